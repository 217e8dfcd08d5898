"""Architecture adapters: pick the one a transformers config belongs to."""
from __future__ import annotations

from powerinfer_tools.models.arch.bamboo import Bamboo
from powerinfer_tools.models.arch.base import Arch, Dims, install_taps, is_active
from powerinfer_tools.models.arch.config_fields import check as check_config_fields
from powerinfer_tools.models.arch.falcon import Falcon
from powerinfer_tools.models.arch.gemma3 import Gemma3, Gemma3Relu
from powerinfer_tools.models.arch.llama_family import is_bamboo
from powerinfer_tools.models.arch.llama_relu import LlamaRelu
from powerinfer_tools.models.arch.llama_silu import LlamaSilu
from powerinfer_tools.models.arch.moe import Mixtral, MixtralRelu, Olmoe, Qwen3Moe, no_neurons
from powerinfer_tools.models.arch.opt import Opt
from powerinfer_tools.models.arch.phi3 import Phi3, Phi3Relu
from powerinfer_tools.models.arch.prosparse import MODEL_TYPE as PROSPARSE_MODEL_TYPE, ProSparse
from powerinfer_tools.models.arch.qwen import Qwen2, Qwen2Relu, Qwen3, Qwen3Relu
from powerinfer_tools.core.errors import UserError

ADAPTERS: tuple[type[Arch], ...] = (LlamaRelu, LlamaSilu, ProSparse, Bamboo, Qwen2, Qwen3, Phi3, Gemma3, Qwen2Relu,
                                     Qwen3Relu, Phi3Relu, Gemma3Relu, Falcon, Opt, Qwen3Moe, Mixtral, MixtralRelu, Olmoe)

__all__ = ["ADAPTERS", "Arch", "Dims", "for_config", "for_neurons", "config_class_for", "install_taps", "is_active",
           "no_neurons"]


def supported() -> str:
    return "; ".join(f"{a.name}: {a.description}" for a in ADAPTERS)


def for_config(config) -> Arch:
    """The adapter for a config, or a UserError naming the supported architectures or the first config field
    whose value the converted file would not compute (config_fields.py)."""
    for adapter in ADAPTERS:
        if adapter.matches(config):
            check_config_fields(config, adapter.config_fields)
            return adapter(config)
    act = getattr(config, "hidden_act", None) or getattr(config, "activation", None) or "?"
    raise UserError(f"unsupported architecture '{config.model_type}' (activation {act}); supported: {supported()}")


def for_neurons(config) -> Arch:
    """for_config's adapter for a stage that works on the FFN's neurons (profile, sparsify): a mixture of experts is
    refused in one line before its weights load."""
    adapter = for_config(config)
    if adapter.experts:
        raise no_neurons(adapter.name)
    return adapter


def config_class_for(raw: dict):
    """A transformers config class for raw config.json contents that transformers cannot map itself."""
    from types import SimpleNamespace

    if is_bamboo(SimpleNamespace(model_type=raw.get("model_type"), architectures=raw.get("architectures"))):
        from transformers import MistralConfig
        return MistralConfig
    if raw.get("model_type") == PROSPARSE_MODEL_TYPE:
        from transformers import LlamaConfig
        return LlamaConfig
    return None
