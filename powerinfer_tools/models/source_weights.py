"""A model's weights, one tensor at a time, in the Hugging Face layout and float32.

The converter never holds more than one tensor: safetensors shards are opened per tensor (so no
mapping of the whole shard stays resident), `.bin` shards are memory-mapped by torch, and a GGUF
source (the default SmolLM2) is read through gguf-py's memory map and dequantized tensor by tensor.
"""
from __future__ import annotations

import importlib.metadata
from pathlib import Path

import numpy as np

from powerinfer_tools.core.errors import UserError
from powerinfer_tools.core.safe_load import load_pt
from powerinfer_tools.models import ModelSource

# Checkpoints saved from the base model class lack the causal-LM prefix, e.g. OPT's `decoder.layers...`.
_PREFIXES = ("model.", "transformer.")


class WeightSource:
    """Base: `shapes` maps each stored HF tensor name to its shape; `load` returns float32 data."""

    shapes: dict[str, tuple[int, ...]]
    stored_bytes: dict[str, int]

    def find(self, name: str) -> str | None:
        """The stored name of an HF tensor, allowing for a missing or extra model prefix."""
        if name in self.shapes:
            return name
        for prefix in _PREFIXES:
            if name.startswith(prefix) and name[len(prefix):] in self.shapes:
                return name[len(prefix):]
            if prefix + name in self.shapes:
                return prefix + name
        return None

    def names_with_prefixes(self) -> set[str]:
        """Stored names plus their prefixed spellings: what adapters test optional tensors against."""
        return set(self.shapes) | {prefix + name for name in self.shapes for prefix in _PREFIXES}

    def load(self, name: str) -> np.ndarray:
        raise NotImplementedError

    def load_as(self, name: str, dtype):
        """The tensor as a torch tensor of `dtype` (through float32 here; a source that stores torch dtypes
        converts once)."""
        import torch

        return torch.from_numpy(self.load(name)).to(dtype)


class SafetensorsSource(WeightSource):
    def __init__(self, directory: Path):
        from safetensors import safe_open

        self.files: dict[str, Path] = {}
        self.shapes, self.stored_bytes = {}, {}
        for path in sorted(directory.glob("*.safetensors")):
            try:
                with safe_open(path, framework="pt") as f:
                    for name in f.keys():
                        sl = f.get_slice(name)
                        shape = tuple(sl.get_shape())
                        self.files[name], self.shapes[name] = path, shape
                        self.stored_bytes[name] = int(np.prod(shape, dtype=np.int64)) * _DTYPE_BYTES.get(
                            sl.get_dtype(), 4)
            except Exception as exc:  # safetensors raises its own error types for damaged files
                raise UserError(f"cannot read {path}: {str(exc).splitlines()[0]}") from None

    def load(self, name: str) -> np.ndarray:
        from safetensors import safe_open

        with safe_open(self.files[name], framework="pt") as f:
            return f.get_tensor(name).float().numpy()

    def load_as(self, name: str, dtype):
        from safetensors import safe_open

        with safe_open(self.files[name], framework="pt") as f:
            return f.get_tensor(name).to(dtype)


_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


class TorchBinSource(WeightSource):
    """PyTorch `.bin` shards, memory-mapped (torch.load(mmap=True)) so only touched tensors are read."""

    def __init__(self, directory: Path):
        self.files, self.shapes, self.stored_bytes = {}, {}, {}
        for path in sorted(directory.glob("*.bin")):
            state = load_pt(path, "checkpoint shard", mmap=True)
            for name, tensor in state.items():
                self.files[name], self.shapes[name] = path, tuple(tensor.shape)
                self.stored_bytes[name] = tensor.numel() * tensor.element_size()
            del state

    def load(self, name: str) -> np.ndarray:
        state = load_pt(self.files[name], "checkpoint shard", mmap=True)
        return state[name].float().numpy().copy()


class LlamaCppGgufSource(WeightSource):
    """A llama.cpp GGUF of a Llama-family model, presented under HF names and in HF layout
    (q/k rows put back in rotate-half order), dequantized to float32 one tensor at a time.

    The config is what transformers' GGUF loader reads of the file: a `llama.*` key outside its mapping (RoPE
    scaling, a sliding window) or a tensor with no HF name (llama3's rope_freqs) would be lost, so either is
    refused (the engine runs such a file directly)."""

    def __init__(self, path: Path, config):
        from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

        from powerinfer_tools.models.arch.llama_family import llamacpp_to_hf
        from powerinfer_tools.formats.gguf_io import field, open_reader

        self.reader = open_reader(path)
        if field(self.reader, "general.architecture") != "llama":
            raise UserError(f"{path}: only llama-architecture GGUF files can be converted "
                            f"(this one is '{field(self.reader, 'general.architecture')}')")
        read = {f"llama.{key}" for key in GGUF_CONFIG_MAPPING["llama"]}
        lost = [k for k in self.reader.fields if k.startswith("llama.") and k not in read]
        if lost:
            raise UserError(f"{path}: its key {lost[0]} = {field(self.reader, lost[0])!r} is not carried into "
                            "a converted file; run the file itself (pi-tools run -m)")
        self.tensors, self.reorders, self.shapes, self.stored_bytes = {}, {}, {}, {}
        for tensor in self.reader.tensors:
            hf, reorder = llamacpp_to_hf(tensor.name, config)
            if not hf:
                raise UserError(f"{path}: its tensor {tensor.name} is not carried into a converted file; run the "
                                "file itself (pi-tools run -m)")
            self.tensors[hf], self.reorders[hf] = tensor, reorder
            self.shapes[hf] = tuple(int(n) for n in reversed(tensor.shape))
            self.stored_bytes[hf] = int(tensor.n_bytes)

    def load(self, name: str) -> np.ndarray:
        import gguf

        tensor = self.tensors[name]
        shape = self.shapes[name]
        raw = tensor.data.reshape(-1, tensor.data.shape[-1]) if tensor.data.ndim > 1 else tensor.data[None]
        data = np.empty((raw.shape[0], shape[-1]), np.float32)
        for r in range(0, raw.shape[0], _DEQUANT_ROWS):  # bounded temporaries, not a whole-tensor copy
            try:
                data[r:r + _DEQUANT_ROWS] = gguf.quants.dequantize(raw[r:r + _DEQUANT_ROWS], tensor.tensor_type)
            except NotImplementedError:
                raise UserError(f"tensor {tensor.name} has type {tensor.tensor_type.name}, which gguf-py "
                                f"{importlib.metadata.version('gguf')} cannot dequantize") from None
        data = data.reshape(shape)
        reorder = self.reorders[name]
        return reorder(data) if reorder is not None else data


_DEQUANT_ROWS = 4096


class MetaShapes(WeightSource):
    """The tensors a checkpoint of the adapter's config holds, names and shapes only: the model is built on torch's meta
    device (no memory, no weights), so transformers itself says what the checkpoint would contain. A tied
    output head is listed once, under the embedding's name, as save_pretrained stores it."""

    def __init__(self, adapter):
        import torch
        from transformers import AutoModelForCausalLM

        model_class = adapter.model_class() or AutoModelForCausalLM
        build = adapter.build_config()
        with torch.device("meta"):
            model = model_class._from_config(build) if model_class is not AutoModelForCausalLM \
                else model_class.from_config(build)
        dtype = getattr(build, "dtype", None) or torch.float32
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype)
        element = torch.empty((), dtype=dtype).element_size()
        self.shapes, self.stored_bytes, seen = {}, {}, set()
        for name, tensor in model.state_dict(keep_vars=True).items():
            if id(tensor) in seen:
                continue
            seen.add(id(tensor))
            self.shapes[name] = tuple(tensor.shape)
            self.stored_bytes[name] = tensor.numel() * element

    def load(self, name: str) -> np.ndarray:
        raise RuntimeError(f"{name}: a shapes-only source has no data (dry run)")


def open_weights(source: ModelSource, config) -> WeightSource:
    """The weight reader for a resolved model source."""
    if source.gguf_file is not None:
        return LlamaCppGgufSource(source.path, config)
    if list(source.directory.glob("*.safetensors")):
        return SafetensorsSource(source.directory)
    return TorchBinSource(source.directory)
