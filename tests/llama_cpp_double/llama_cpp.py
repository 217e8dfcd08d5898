"""A stand-in for llama-cpp-python in the bench's tests: the calls `worker.LlamaCpp` makes, computed by
transformers from the same GGUF file llama.cpp would load (dequantized to float32). With it CI runs the
benchmark's llama.cpp path (the worker started in isolated mode, both OpenMP policies, the paired rounds,
the agreement probe, the ratios and targets) without building llama.cpp, and the agreement probe checks that
the llama.cpp file is a llama model with our weights. Its timings mean nothing."""
from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM

__version__ = "test-double (transformers)"


def llama_print_system_info() -> bytes:
    return b"llama.cpp test double: transformers on the dequantized file"


class _Context:
    """The one method of llama.cpp's context the worker calls: the last token's logits."""

    def __init__(self):
        self.logits = np.zeros(1, np.float32)

    def get_logits_ith(self, i: int):
        if i != -1:
            raise ValueError("the test double keeps only the last token's logits")
        return self.logits.ctypes.data_as(ctypes.POINTER(ctypes.c_float))


class Llama:
    def __init__(self, model_path: str, n_ctx: int, n_threads: int | None = None, **_):
        path = Path(model_path)
        torch.set_num_threads(n_threads or 1)
        self.model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
        self.n_ctx = n_ctx
        self._ctx = _Context()
        self.reset()

    def n_vocab(self) -> int:
        return self.model.config.vocab_size

    def reset(self) -> None:
        self.cache, self.n_past = None, 0

    def eval(self, tokens) -> None:
        tokens = list(tokens)
        if self.n_past + len(tokens) > self.n_ctx:
            raise ValueError(f"{self.n_past + len(tokens)} tokens exceed n_ctx {self.n_ctx}")
        with torch.no_grad():
            out = self.model(torch.tensor([tokens]), past_key_values=self.cache, use_cache=True)
        self.cache, self.n_past = out.past_key_values, self.n_past + len(tokens)
        self._ctx.logits = out.logits[0, -1].float().numpy().copy()
