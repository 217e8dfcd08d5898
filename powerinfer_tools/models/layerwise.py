"""A causal LM run one decoder layer at a time, for models larger than memory (docs/profile.md, "Large models: layer
by layer").

The network is built on torch's meta device (accelerate's `init_empty_weights`: no memory, buffers such as rotary
tables stay real), as GPTQ-style quantizers and llama.cpp's imatrix calibrate large models. The embeddings are loaded
to capture what the model hands its first layer (the hidden states and the keyword arguments: masks, positions,
rotary tables); then each layer's tensors are read from the files (`source_weights`: safetensors shards opened per
tensor, `.bin` shards memory-mapped, a GGUF through gguf-py's map), placed with accelerate's
`set_module_tensor_to_device`, run over every batch and put back on the meta device. The model's own layer code
computes each step, so the result is the whole-model forward's, bit for bit on the same device and dtype.
"""
from __future__ import annotations

import ctypes
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from powerinfer_tools import models
from powerinfer_tools.core.errors import UserError
from powerinfer_tools.models.source_weights import WeightSource, open_weights

class _Caught(Exception):
    """Raised by the stand-in for the first layer: carries what the model passed it."""

    def __init__(self, args: tuple, kwargs: dict):
        super().__init__("first layer reached")
        self.args, self.kwargs = args, kwargs


class _FirstLayerCatcher(torch.nn.Module):
    def forward(self, *args, **kwargs):
        raise _Caught(args, kwargs)


@dataclass
class LayerInputs:
    """What the model passes a decoder layer for one batch: the hidden states and the other arguments
    (the same for every layer of one forward)."""

    hidden: torch.Tensor
    args: tuple
    kwargs: dict


class LayerwiseModel:
    """The model's skeleton (meta tensors), its weight files, and one layer at a time made real."""

    def __init__(self, source: models.ModelSource, adapter, device: str = "cpu", dtype: str = "float32"):
        from accelerate import init_empty_weights
        from transformers import AutoModelForCausalLM

        self.source, self.adapter, self.device, self.dtype = source, adapter, torch.device(device), getattr(torch, dtype)
        self.weights: WeightSource = open_weights(source, adapter.config)
        model_class = adapter.model_class() or AutoModelForCausalLM
        build = adapter.build_config()
        with init_empty_weights():
            self.model = (model_class._from_config(build, dtype=self.dtype) if model_class is not AutoModelForCausalLM
                          else model_class.from_config(build, dtype=self.dtype))
        adapter.prepare(self.model)
        self.model.eval()
        self.layers = adapter.layers(self.model)
        names = {id(module): name for name, module in self.model.named_modules()}
        self.layer_prefix = [names[id(layer)] + "." for layer in self.layers]
        self._check_shapes()

    # ---- the files against the network ---------------------------------------------------------------------
    def _stored_name(self, name: str) -> str:
        stored = self.weights.find(name)
        if stored is None:
            raise UserError(f"{self.source.spec}: the model needs tensor {name}, which is in none of its weight files"
                            f"{_missing_shard_hint(self.source.directory, name)}")
        return stored

    def _check_shapes(self) -> None:
        """Every tensor the profile reads (the layers' and those outside them but the head) is in the files with the
        config's shape: a damaged or foreign checkpoint is refused before the first layer runs, not hours into it."""
        needed = [(prefix + name, param) for prefix, layer in zip(self.layer_prefix, self.layers)
                  for name, param in layer.named_parameters()]
        needed += [(f"{where}.{name}", param) for where, module in self._outside_modules()
                   for name, param in module.named_parameters(recurse=False)]
        for full_name, param in needed:
            stored = self._stored_name(full_name)
            shape = tuple(self.weights.shapes[stored])
            if shape != tuple(param.shape):
                raise UserError(f"{self.source.spec}: tensor {stored} is {list(shape)} in "
                                f"{_file_of(self.weights, stored)}, but the config needs {list(param.shape)}")

    def _load(self, module: torch.nn.Module, prefix: str, recurse: bool = True) -> None:
        from accelerate.utils import set_module_tensor_to_device

        for name, _ in list(module.named_parameters(recurse=recurse)):
            stored = self._stored_name(prefix + name)
            try:
                data = self.weights.load_as(stored, self.dtype)
            except UserError:
                raise
            except Exception as exc:  # a shard cut short or unreadable after its header was read
                raise UserError(f"{self.source.spec}: cannot read tensor {stored} from "
                                f"{_file_of(self.weights, stored)}: {str(exc).splitlines()[0]}") from None
            set_module_tensor_to_device(module, name, self.device, value=data, dtype=self.dtype)

    # ---- the first layer's inputs ----------------------------------------------------------------------------
    def _outside_modules(self) -> list[tuple[str, torch.nn.Module]]:
        """The modules with weights outside the layers (embeddings, OPT's positions, the final norm), less the output
        head, which a profile never runs and which is as large as the embeddings."""
        inside = tuple(self.layer_prefix)
        head = self.model.get_output_embeddings()
        return [(name, module) for name, module in self.model.named_modules()
                if module is not head and not (name + ".").startswith(inside)
                and any(True for _ in module.named_parameters(recurse=False))]

    @torch.no_grad()
    def capture(self, batches: Iterable[torch.Tensor]) -> Iterator[LayerInputs]:
        """Run each batch of token ids up to the first layer: yields LayerInputs per batch (on the device). The
        weights outside the layers are loaded for this and freed after."""
        outside = self._outside_modules()
        for name, module in outside:
            self._load(module, name + ".", recurse=False)
        first = self.layers[0]
        container, index = _parent_of(self.model, self.layer_prefix[0])
        container[index] = _FirstLayerCatcher()
        try:
            for ids in batches:
                try:
                    self.model(input_ids=ids.to(self.device), use_cache=False)
                except _Caught as caught:
                    args = caught.args
                    hidden = args[0] if args else caught.kwargs.pop("hidden_states")
                    yield LayerInputs(hidden, tuple(args[1:]), caught.kwargs)
                else:
                    raise RuntimeError("the model's forward never reached its first layer")
        finally:
            container[index] = first
            for _, module in outside:
                for name, _ in list(module.named_parameters(recurse=False)):
                    module._parameters[name] = torch.nn.Parameter(module._parameters[name].to("meta"),
                                                                  requires_grad=False)

    # ---- one layer ---------------------------------------------------------------------------------------
    def load_layer(self, i: int) -> torch.nn.Module:
        self._load(self.layers[i], self.layer_prefix[i])
        return self.layers[i]

    def free_layer(self, i: int) -> None:
        self.layers[i].to("meta")
        _return_free_heap()

    @torch.no_grad()
    def run_layer(self, i: int, inputs: LayerInputs) -> torch.Tensor:
        out = self.layers[i](inputs.hidden, *inputs.args, **inputs.kwargs)
        return out[0] if isinstance(out, tuple) else out


def _return_free_heap() -> None:
    """Give the C heap's free memory back to the system (glibc's malloc_trim). A layer's temporaries of many sizes
    below glibc's mmap threshold (32 MiB) leave its heap fragmented, and without this the process grows by tens
    of MiB a layer: at a 7B's 32 layers, the difference between 1.9 and 3.3 GiB of peak RSS."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):   # not glibc: nothing to trim this way
        pass


def _parent_of(model: torch.nn.Module, prefix: str):
    """The ModuleList holding the layer at `prefix` ('model.layers.0.') and its index there."""
    parts = prefix.rstrip(".").split(".")
    parent = model.get_submodule(".".join(parts[:-1]))
    return parent, int(parts[-1])


def _file_of(weights: WeightSource, stored: str) -> str:
    files = getattr(weights, "files", None)
    if files and stored in files:
        return Path(files[stored]).name
    return "the model file"


def _missing_shard_hint(directory: Path, name: str) -> str:
    """', which ... names model-00002-of-00003.safetensors (missing)' when the shard index places the tensor in a
    file that is not there."""
    import json

    index = directory / "model.safetensors.index.json"
    if not index.is_file():
        return ""
    try:
        weight_map = json.loads(index.read_text()).get("weight_map") or {}
    except (OSError, ValueError, AttributeError):
        return ""
    for key in (name, name.removeprefix("model."), "model." + name):
        shard = weight_map.get(key)
        if shard and not (directory / shard).is_file():
            return f" ({index.name} puts it in {shard}, which is missing)"
    return ""
