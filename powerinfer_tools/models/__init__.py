"""Model resolution shared by every subcommand's --model.

A model is named by a Hugging Face directory (config.json + safetensors/.bin shards), a GGUF file
(read by transformers through `gguf_file=`), or `smollm2`, the embedded default.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from powerinfer_tools.models import default_model
from powerinfer_tools.models.gguf_parse_once import parse_once
from powerinfer_tools.core.errors import UserError

_VOLATILE_CONFIG_KEYS = {"transformers_version", "quantization_config", "dtype", "torch_dtype",
                         "architectures", "use_cache"}


@dataclass(frozen=True)
class ModelSource:
    """Where a model's files are: `directory`, plus `gguf_file` (a name inside it) for GGUF sources."""

    spec: str
    directory: Path
    gguf_file: str | None = None

    @property
    def path(self) -> Path:
        return self.directory / self.gguf_file if self.gguf_file else self.directory

    def hf_kwargs(self) -> dict:
        return {"gguf_file": self.gguf_file} if self.gguf_file else {}


def resolve(spec: str) -> ModelSource:
    """Turn a --model argument into a ModelSource, or raise UserError saying what is wrong."""
    if spec == default_model.NAME:
        path = default_model.default_gguf()
        return ModelSource(spec, path.parent, path.name)
    path = Path(spec).expanduser()
    if not path.exists():
        raise UserError(f"model not found: {spec} (give a Hugging Face model directory, a .gguf file, "
                        f"or '{default_model.NAME}')")
    if path.is_file():
        with open(path, "rb") as f:
            magic = f.read(4)
        if magic not in (b"GGUF",):
            raise UserError(f"{spec} is not a GGUF file (magic {magic!r}); PowerInfer (PWRI) files are "
                            "outputs of 'pi-tools convert', not inputs")
        return ModelSource(spec, path.parent.resolve(), path.name)
    if not (path / "config.json").is_file():
        raise UserError(f"{spec} has no config.json: not a Hugging Face model directory")
    weights = list(path.glob("*.safetensors")) + list(path.glob("*.bin"))
    if not weights:
        raise UserError(f"{spec} has no weights (*.safetensors or *.bin)")
    return ModelSource(spec, path.resolve())


def _quiet_transformers():
    logging.getLogger("transformers").setLevel(logging.ERROR)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def load_config(source: ModelSource):
    """The transformers config of a model (architectures our adapters map to a known class)."""
    if source.gguf_file is None:
        return load_config_file(source.directory / "config.json", source.spec)
    from transformers import AutoConfig

    _quiet_transformers()
    try:
        with parse_once():
            return AutoConfig.from_pretrained(source.directory, **source.hf_kwargs())
    except (ValueError, KeyError, OSError) as exc:
        raise UserError(f"cannot read the config of {source.spec}: {str(exc).splitlines()[0]}") from None


def load_config_file(path: Path, spec: str):
    """The transformers config in a config.json (all a dry run needs of a model)."""
    from transformers import AutoConfig

    from powerinfer_tools.models import arch

    _quiet_transformers()
    try:
        raw = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UserError(f"cannot read the config of {spec}: {path}: {exc}") from None
    if not isinstance(raw, dict):
        raise UserError(f"cannot read the config of {spec}: {path} does not hold a JSON object")
    config_class = arch.config_class_for(raw) or AutoConfig
    try:
        return config_class.from_pretrained(path)
    except (ValueError, KeyError, OSError, TypeError) as exc:
        raise UserError(f"cannot read the config of {spec}: {str(exc).splitlines()[0]}") from None


def load_model(source: ModelSource, device: str = "cpu", dtype: str = "float32"):
    """Load the causal LM for inference; device 'auto' spreads a large model with accelerate."""
    with parse_once():  # the config and the weights from one parse of a GGUF source
        return _load_model(source, device, dtype)


def _load_model(source: ModelSource, device: str, dtype: str):
    import torch
    from transformers import AutoModelForCausalLM

    from powerinfer_tools.core.progress import library_bars
    from powerinfer_tools.models import arch

    config = load_config(source)
    adapter = arch.for_config(config)
    torch_dtype = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]
    kwargs = dict(source.hf_kwargs(), config=adapter.build_config(), dtype=torch_dtype)
    if device == "auto":
        kwargs["device_map"] = "auto"
    model_class = adapter.model_class() or AutoModelForCausalLM
    try:
        with library_bars():  # a GGUF source's de-quantizing bar
            model = model_class.from_pretrained(source.directory, **kwargs)
    except (OSError, ValueError, RuntimeError) as exc:
        raise UserError(f"cannot load {source.spec}: {str(exc).splitlines()[0]}") from None
    if device != "auto":
        model.to(device)
    adapter.prepare(model)
    model.eval()
    return model, adapter


def load_tokenizer(source: ModelSource):
    from transformers import AutoTokenizer

    _quiet_transformers()
    try:
        with parse_once():
            return AutoTokenizer.from_pretrained(source.directory, **source.hf_kwargs())
    except (OSError, ValueError, KeyError) as exc:
        raise UserError(f"cannot load the tokenizer of {source.spec}: {str(exc).splitlines()[0]}") from None


def config_hash(config) -> str:
    """A short stable hash of the parts of a config that define the network."""
    data = {k: v for k, v in config.to_dict().items()
            if not k.startswith("_") and k not in _VOLATILE_CONFIG_KEYS}
    blob = json.dumps(data, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]
