"""engine.Model: one loaded PowerInfer/GGUF file with its KV cache, driven from Python."""
from __future__ import annotations

import ctypes
import json
import operator
import os
import threading
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np

from ._lib import (FFN_MODES, GPU_MODES, KV_TYPES, UINT64_MAX, EngineError, Options, Sampling, c_float,
                         c_int, check, device_library_path, lib)


class Model:
    """A model file opened by the C++ engine.

    threads: worker threads (default: all cores); sparse_mode: dense | gate | predictor | auto | oracle;
    ctx_size: KV cache length (default: min(training context, 4096)); gpuidx: optional PowerInfer
    .gpuidx file whose neurons form the hot tier on a device (without one it is checked and ignored: every neuron
    is computed by sparse_mode, info["gpu"]["gpuidx_ignored"]); cpu_hot_tier: True keeps it a tier of its own on
    the CPU where no device takes it (its neurons computed whole: for testing the tiers); recall_check: also
    compute the true activation mask in predictor mode to report recall; batch_size: tokens per forward batch of
    a prompt;
    isa: force a kernel set ("scalar", "avx2", "avx512") instead of the best available one; kv_type: the KV
    cache's element type, "f32" (logits within float rounding of the reference) or "f16" (half the cache's
    memory and of what a decode step reads of it, llama.cpp's default); hot_backend: what computes the hot tier,
    "cpu" or, to test the tier boundary, "reference" (csrc/include/pi_engine_testing.h); gpu: where the hot
    tier runs, "auto" (on the GPU when a CUDA device, the CUDA library and a gpuidx are there; info["gpu"] says
    why not), "on" (the same, or EngineError) or "off"; vram_budget: GiB of device memory the device may take:
    the attention blocks and KV caches of as many layers as fit, then their hot rows, layer after layer (the
    rest stay on the CPU; default: what is free, less a reserve); gpu_attention: False keeps every layer's
    attention on the CPU (only the hot tier on the device); gpu_device: the device's ordinal; gpu_library: the
    device library, "cuda" (the default), "emulated" (the host emulation the tests use) or a path;
    input_sparsity: the share of every matrix's inputs zeroed at the thresholds the file holds (0: off;
    docs/engine.md, "Input sparsity"); decode_cache: a file for the weights decoded at load (a llama.cpp file's
    K-quants, q4_1, q5_x, bf16 and ffn_down), read instead of decoding when whole and made from this model file,
    else written for the next load (info["decoded"]["cache"]: read, written, not written or off); memory_budget:
    GiB the engine may hold: the cold FFN neurons past it are read on demand from the neuron bundles beside the
    file (`convert --neuron-bundles`; docs/engine.md, "Models larger than memory"), a mixture's experts from the
    file into a cache of whole experts ("The expert tier"); None: the same under the
    machine's memory or its cgroup's limit where the bundles are there and the FFN would not fit it; n_seq: the
    sequences the engine holds, each its own KV cache (select() picks the one eval, reset, sample and seed act on;
    decode_step computes a token of several at once); expert_lookahead: a mixture of experts under a memory budget
    reads the next layer's likely experts ahead (its router on this layer's input; off by default: docs/bench.md,
    "Experts from disk"), the same logits either way.

    One Model may be shared by threads: ctypes lets go of the GIL inside the engine, so a lock held across
    every engine call serializes them, and close() waits for a call in flight instead of freeing the model
    under it. (Each call is atomic; a sequence such as reset + eval is not.)
    """

    def __init__(self, path: str | os.PathLike, threads: int | None = None, sparse_mode: str = "dense",
                 ctx_size: int | None = None, gpuidx: str | os.PathLike | None = None, recall_check: bool = False,
                 batch_size: int | None = None, isa: str | None = None, kv_type: str = "f32",
                 hot_backend: str = "cpu", gpu: str = "auto", vram_budget: float | None = None, gpu_device: int = 0,
                 gpu_library: str | os.PathLike = "cuda", gpu_attention: bool = True,
                 input_sparsity: float = 0.0, cpu_hot_tier: bool = False,
                 decode_cache: str | os.PathLike | None = None, memory_budget: float | None = None, n_seq: int = 1,
                 expert_lookahead: bool = False):
        self._handle = None
        self._lock = threading.RLock()
        opts = Options()
        lib().pi_options_default(ctypes.byref(opts))
        opts.threads = c_int("threads", threads or os.cpu_count() or 1, 0)
        opts.ctx_size = c_int("ctx_size", ctx_size or 0, 0)
        opts.batch_size = c_int("batch_size", batch_size or 0, 0)
        opts.ffn_mode = _mode_id(sparse_mode)
        opts.recall_check = int(recall_check)
        opts.gpuidx_path = os.fsencode(gpuidx) if gpuidx is not None else None
        opts.decode_cache = os.fsencode(decode_cache) if decode_cache is not None else None
        if not isinstance(cpu_hot_tier, bool):
            raise EngineError(f"cpu_hot_tier must be True or False, not {cpu_hot_tier!r}")
        opts.cpu_hot_tier = int(cpu_hot_tier)
        opts.isa = isa.encode() if isa else None
        if kv_type not in KV_TYPES:
            raise EngineError(f"unknown KV cache type {kv_type!r} (choose from {', '.join(KV_TYPES)})")
        opts.kv_type = KV_TYPES[kv_type]
        if gpu not in GPU_MODES:
            raise EngineError(f"unknown gpu mode {gpu!r} (choose from {', '.join(GPU_MODES)})")
        opts.gpu = GPU_MODES[gpu]
        opts.gpu_device = c_int("gpu_device", gpu_device, 0)
        if vram_budget is not None:
            budget = c_float("vram_budget", vram_budget)
            if not 0 < budget < 2**33:  # 2**33 GiB: the int64 byte count the engine takes
                raise EngineError(f"vram_budget must be a positive number of GiB below 2**33, not {vram_budget!r}")
            opts.vram_budget = c_int("vram_budget", int(budget * 2**30), 1, 2**63 - 1)
        if memory_budget is not None:
            budget = c_float("memory_budget", memory_budget)
            if not 0 < budget < 2**33:
                raise EngineError(f"memory_budget must be a positive number of GiB below 2**33, not {memory_budget!r}")
            opts.memory_budget = c_int("memory_budget", int(budget * 2**30), 1, 2**63 - 1)
        library = device_library_path(str(gpu_library)) if str(gpu_library) in ("cuda", "emulated") else Path(gpu_library)
        opts.gpu_library = os.fsencode(library) if library is not None else None
        if not isinstance(gpu_attention, bool):
            raise EngineError(f"gpu_attention must be True or False, not {gpu_attention!r}")
        opts.gpu_ffn_only = int(not gpu_attention)
        opts.input_sparsity = c_float("input_sparsity", input_sparsity)
        opts.n_seq = c_int("n_seq", n_seq, 1)
        if not isinstance(expert_lookahead, bool):
            raise EngineError(f"expert_lookahead must be True or False, not {expert_lookahead!r}")
        opts.expert_lookahead = int(expert_lookahead)
        handle = ctypes.c_void_p()
        if hot_backend == "cpu":
            check(lib().pi_open(os.fsencode(path), ctypes.byref(opts), ctypes.byref(handle)))
        else:
            check(lib().pi_open_with_hot_backend(os.fsencode(path), ctypes.byref(opts), str(hot_backend).encode(),
                                                 ctypes.byref(handle)))
        self._handle = handle
        self.path = str(path)
        self.info = self._json(lib().pi_info_json)
        self.n_vocab: int = self.info["n_vocab"]
        self.n_embd: int = self.info["n_embd"]
        self.n_ctx: int = self.info["n_ctx"]
        self.n_seq: int = self.info["n_seq"]
        self._last = np.zeros(self.n_vocab, dtype=np.float32)

    # ---- lifetime ---------------------------------------------------------------------------------
    def close(self) -> None:
        """Free the model. The handle is let go of before the call: a Ctrl-C raised as the call returns must not
        leave it there for __del__ to free a second time."""
        with self._lock:
            handle, self._handle = self._handle, None
            if handle is not None:
                lib().pi_close(handle)

    def __enter__(self) -> "Model":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        if not hasattr(self, "_lock"):  # __init__ failed before the lock existed: nothing to close
            return
        try:
            self.close()
        except Exception:  # interpreter shutdown: the library may already be gone
            pass

    def _call(self, fn, *args):
        """fn(handle, *args) under the lock: its raw result (a status is checked by the caller, in the same
        thread, since the engine's error text is per thread)."""
        with self._lock:
            if self._handle is None:
                raise EngineError("the model is closed")
            return fn(self._handle, *args)

    def _checked(self, fn, *args) -> None:
        check(self._call(fn, *args))

    def _json(self, fn) -> dict:
        out = ctypes.c_char_p()
        with self._lock:  # the text lives in the engine until its next JSON call
            self._checked(fn, ctypes.byref(out))
            return json.loads(out.value.decode())

    # ---- settings ---------------------------------------------------------------------------------
    @property
    def sparse_mode(self) -> str:
        return self._json(lib().pi_info_json)["ffn_mode"]

    @sparse_mode.setter
    def sparse_mode(self, mode: str) -> None:
        self._checked(lib().pi_set_ffn_mode, _mode_id(mode))

    @property
    def input_sparsity(self) -> float:
        """Input sparsity's share (0: off); set it to run the next calls at another share (docs/engine.md)."""
        return self.stats()["input_sparsity"]["share"]

    @input_sparsity.setter
    def input_sparsity(self, share: float) -> None:
        self._checked(lib().pi_set_input_sparsity, c_float("input_sparsity", share))

    def set_recall_check(self, enabled: bool) -> None:
        self._checked(lib().pi_set_recall_check, int(enabled))

    def set_expert_trace(self, enabled: bool) -> None:
        """A mixture of experts: record every later eval's routing (expert_choices); refused for a dense model."""
        self._checked(lib().pi_set_expert_trace, int(enabled))

    def expert_choices(self, n: int) -> np.ndarray:
        """The experts the last eval's routers chose, [n (its token count), n_layer, n_expert_used], each layer's
        most probable first; -1 in a layer without experts."""
        out = np.empty((n, self.info["n_layer"], self.info["n_expert_used"]), dtype=np.int32)
        self._checked(lib().pi_expert_choices, out.ctypes.data_as(ctypes.c_void_p), c_int("n", n, 0))
        return out

    # ---- evaluation -------------------------------------------------------------------------------
    @property
    def n_past(self) -> int:
        return int(self._call(lib().pi_n_past))

    def reset(self, n_keep: int = 0) -> None:
        """Forget cached tokens after the first n_keep."""
        self._checked(lib().pi_truncate, c_int("n_keep", n_keep, 0))

    def eval(self, tokens: Iterable[int], all_logits: bool = True) -> np.ndarray:
        """Run tokens after the cached ones; logits [len(tokens), n_vocab] (or [n_vocab] of the last)."""
        toks = _token_ids(tokens, self.n_vocab)
        out = np.empty((toks.size, self.n_vocab) if all_logits else self.n_vocab, dtype=np.float32)
        self._checked(lib().pi_eval, toks.ctypes.data_as(ctypes.c_void_p), toks.size,
                      out.ctypes.data_as(ctypes.c_void_p), int(all_logits))
        return out

    def select(self, seq: int) -> None:
        """Make sequence `seq` (0 <= seq < n_seq) the one that n_past, reset, eval, eval_hidden, sample and seed act
        on (0 at open)."""
        self._checked(lib().pi_set_sequence, c_int("seq", seq, 0))

    def decode_step(self, seqs: Iterable[int], tokens: Iterable[int]) -> np.ndarray:
        """One decode step of several distinct sequences: tokens[t] evaluated as the next token of seqs[t], the
        weights read once for all. Logits [len(seqs), n_vocab], row t the bits seqs[t]'s own eval([tokens[t]])
        would give; sample() on a selected sequence draws from its row."""
        ids = np.array([c_int("seq", s, 0) for s in seqs], dtype=np.int32)
        toks = _token_ids(tokens, self.n_vocab)
        if ids.size != toks.size:
            raise EngineError(f"decode_step takes one token per sequence: {ids.size} sequences, {toks.size} tokens")
        out = np.empty((toks.size, self.n_vocab), dtype=np.float32)
        self._checked(lib().pi_decode_step, ids.ctypes.data_as(ctypes.c_void_p), toks.ctypes.data_as(ctypes.c_void_p),
                      toks.size, out.ctypes.data_as(ctypes.c_void_p))
        return out

    def eval_hidden(self, tokens: Iterable[int]) -> np.ndarray:
        """Run tokens after the cached ones; their last hidden states through the output norm [len(tokens), n_embd]
        (what the head reads; embeddings pool them). No logits: sample() is refused until the next eval()."""
        toks = _token_ids(tokens, self.n_vocab)
        out = np.empty((toks.size, self.n_embd), dtype=np.float32)
        self._checked(lib().pi_eval_hidden, toks.ctypes.data_as(ctypes.c_void_p), toks.size,
                      out.ctypes.data_as(ctypes.c_void_p))
        return out

    def sample(self, temperature: float = 0.0, top_k: int = 40, top_p: float = 0.95,
               repeat_penalty: float = 1.0, repeat_last_n: int = 64, frequency_penalty: float = 0.0,
               presence_penalty: float = 0.0, allowed: np.ndarray | None = None) -> int:
        """Next token from the last evaluated logits (greedy when temperature <= 0). The penalties look at the
        last repeat_last_n tokens of the cache: repeat_penalty scales their logits (llama.cpp's rule),
        frequency_penalty subtracts per occurrence and presence_penalty once (OpenAI's rule). allowed: None, or
        a bitmask of the tokens that may be drawn (32-bit words, bit i % 32 of word i // 32: llguidance's layout),
        applied before everything else, so a grammar keeps every sampling setting."""
        params = Sampling(c_float("temperature", temperature), c_int("top_k", top_k), c_float("top_p", top_p),
                          c_float("repeat_penalty", repeat_penalty), c_int("repeat_last_n", repeat_last_n),
                          c_float("frequency_penalty", frequency_penalty), c_float("presence_penalty", presence_penalty))
        token = ctypes.c_int32()
        if allowed is None:
            self._checked(lib().pi_sample, ctypes.byref(params), ctypes.byref(token))
        else:
            if not (isinstance(allowed, np.ndarray) and allowed.dtype.kind in "iu" and allowed.itemsize == 4
                    and allowed.ndim == 1 and allowed.flags["C_CONTIGUOUS"]):
                raise EngineError("allowed must be a contiguous 1-D array of 32-bit words")
            self._checked(lib().pi_sample_masked, ctypes.byref(params), allowed.ctypes.data_as(ctypes.c_void_p),
                          c_int("allowed words", allowed.size, 0), ctypes.byref(token))
        return int(token.value)

    def seed(self, seed: int) -> None:
        self._checked(lib().pi_set_seed, c_int("seed", seed, 0, UINT64_MAX))

    def generate(self, prompt: Iterable[int], max_tokens: int, temperature: float = 0.0, top_k: int = 40,
                 top_p: float = 0.95, repeat_penalty: float = 1.0, repeat_last_n: int = 64,
                 seed: int | None = None, stop: Iterable[int] = ()) -> Iterator[int]:
        """Yield up to max_tokens sampled token ids after `prompt` (appended to the cache), stopping
        after a token in `stop` or when the context is full."""
        prompt = list(prompt)
        if seed is not None:
            self.seed(seed)
        stop = set(stop)
        if prompt:
            self.eval(prompt, all_logits=False)
        for _ in range(max_tokens):
            token = self.sample(temperature, top_k, top_p, repeat_penalty, repeat_last_n)
            yield token
            if token in stop or self.n_past >= self.n_ctx:
                return
            self.eval([token], all_logits=False)

    # ---- statistics -------------------------------------------------------------------------------
    def stats(self) -> dict:
        """Per-layer FFN density, predictor recall, time per phase and tokens/s since the last reset."""
        s = self._json(lib().pi_stats_json)
        s["prompt_tokens_per_second"] = s["batch_tokens"] / s["batch_seconds"] if s["batch_seconds"] else None
        s["decode_tokens_per_second"] = s["decode_tokens"] / s["decode_seconds"] if s["decode_seconds"] else None
        layers = [l for l in s["layers"] if l["tokens"]]
        s["density"] = float(np.mean([l["density"] for l in layers])) if layers else None
        recalls = [l["recall"] for l in layers if l["recall"] is not None]
        s["recall"] = float(np.mean(recalls)) if recalls else None
        return s

    def reset_stats(self) -> None:
        self._checked(lib().pi_stats_reset)


def _token_ids(tokens: Iterable[int], n_vocab: int) -> np.ndarray:
    """Token ids as int32, each an integer in the vocabulary: np.fromiter would truncate 3.7 to 3 and parse "5"."""
    if isinstance(tokens, np.ndarray) and tokens.dtype.kind in "iu":
        ids = tokens.ravel().tolist()
    else:
        ids = []
        for t in tokens:
            try:
                ids.append(operator.index(t))
            except TypeError:
                raise EngineError(f"token ids must be integers, not {type(t).__name__} {t!r}") from None
    if not ids:
        raise EngineError("eval needs at least one token")
    if min(ids) < 0 or max(ids) >= n_vocab:
        raise EngineError(f"token id outside the vocabulary (0..{n_vocab - 1})")
    return np.array(ids, dtype=np.int32)


def _mode_id(mode: str) -> int:
    if mode not in FFN_MODES:
        raise EngineError(f"unknown sparse mode {mode!r} (choose from {', '.join(FFN_MODES)})")
    return FFN_MODES[mode]
