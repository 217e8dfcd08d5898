"""The contestants of `pi-tools bench`: our engine in one FFN mode, llama.cpp, transformers on PyTorch.

Each runner times the same two things on the same token ids: `pp(tokens)`, the prompt evaluated as one
batch from an empty cache, and `tg(tokens)`, the tokens fed one at a time from an empty cache (the
generation loop without sampling, as llama-bench's tg). Only the last token's logits are computed
where the API allows (llama.cpp and ours always; transformers with logits_to_keep=1).
"""
from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from powerinfer_tools.errors import UserError

WORKER = Path(__file__).with_name("llamacpp_worker.py")


class EngineRunner:
    """Our engine; several runners (one per mode) share one loaded model and switch its mode."""

    backend = "ours"

    def __init__(self, model, mode: str):
        self.model, self.mode = model, mode
        self.last_stats: dict | None = None

    @property
    def label(self) -> str:
        return f"ours {self.mode}"

    def pp(self, tokens: list[int]) -> float:
        self.model.sparse_mode = self.mode
        self.model.reset()
        start = time.perf_counter()
        self.model.eval(tokens, all_logits=False)
        return time.perf_counter() - start

    def tg(self, tokens: list[int]) -> float:
        self.model.sparse_mode = self.mode
        self.model.reset()
        self.model.reset_stats()
        start = time.perf_counter()
        for token in tokens:
            self.model.eval([token], all_logits=False)
        elapsed = time.perf_counter() - start
        self.last_stats = self.model.stats()
        return elapsed

    def argmax(self, tokens: list[int]) -> list[int]:
        self.model.sparse_mode = self.mode
        self.model.reset()
        return [int(i) for i in self.model.eval(tokens, all_logits=True).argmax(axis=1)]


def open_engine(path: Path, threads: int, n_ctx: int, batch: int):
    import engine

    try:
        return engine.Model(path, threads=threads, sparse_mode="dense", ctx_size=n_ctx, batch_size=batch)
    except engine.EngineError as exc:
        raise UserError(f"our engine cannot open {path}: {exc}") from None


OMP_WAIT_POLICIES = ("active", "passive")


class LlamaCppRunner:
    """llama.cpp through llama-cpp-python, in a worker process of `python` (which must have it installed).

    llama.cpp's CPU backend synchronises its threads with OpenMP; `omp_wait` sets OMP_WAIT_POLICY (None:
    the environment's, else OpenMP's default). Spinning waits win on an idle machine and lose badly on an
    oversubscribed one, so `best_llamacpp` tries both and keeps the faster.
    """

    backend = "llama.cpp"
    mode = "dense"
    label = "llama.cpp"

    def __init__(self, path: Path, threads: int, n_ctx: int, python: str | None = None, omp_wait: str | None = None):
        python = python or sys.executable
        env = dict(os.environ, OMP_NUM_THREADS=str(threads))
        if omp_wait is not None:
            env["OMP_WAIT_POLICY"] = omp_wait.upper()
        try:
            self.proc = subprocess.Popen([python, "-I", str(WORKER), str(path), str(threads), str(n_ctx)],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                         text=True, env=env)
        except OSError as exc:
            raise UserError(f"cannot start the llama.cpp peer with {python}: {exc.strerror or exc}") from None
        first = self._read()
        if "error" in first:
            self.close()
            raise UserError(f"llama.cpp peer: {first['error']} (install the 'bench' extra: "
                            "pip install 'powerinfer-tools[bench]', or point --peer-python at a Python that has "
                            "llama-cpp-python)")

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            err = self.proc.stderr.read().strip().splitlines()
            raise UserError(f"the llama.cpp peer exited: {err[-1] if err else 'no message'}")
        return json.loads(line)

    def _ask(self, **request) -> dict:
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        reply = self._read()
        if "error" in reply:
            raise UserError(f"llama.cpp peer: {reply['error']}")
        return reply

    def pp(self, tokens: list[int]) -> float:
        return self._ask(op="pp", tokens=tokens)["seconds"]

    def tg(self, tokens: list[int]) -> float:
        return self._ask(op="tg", tokens=tokens)["seconds"]

    def argmax(self, tokens: list[int]) -> list[int]:
        return self._ask(op="argmax", tokens=tokens)["argmax"]

    def info(self) -> dict:
        return self._ask(op="info")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def best_llamacpp(path: Path, threads: int, n_ctx: int, python: str | None, probe: list[int],
                  omp_wait: str | None = None) -> tuple[LlamaCppRunner, dict]:
    """The llama.cpp peer with the OpenMP wait policy (given, or the faster on `probe` tg) and the probe times."""
    if omp_wait is not None or "OMP_WAIT_POLICY" in os.environ:
        return LlamaCppRunner(path, threads, n_ctx, python, omp_wait), {}
    seconds, best = {}, None
    for policy in OMP_WAIT_POLICIES:
        runner = LlamaCppRunner(path, threads, n_ctx, python, policy)
        runner.tg(probe[:4])  # warm-up
        seconds[policy] = runner.tg(probe)
        if best is None or seconds[policy] < seconds[best[0]]:
            if best is not None:
                best[1].close()
            best = (policy, runner)
        else:
            runner.close()
    return best[1], seconds


class TorchRunner:
    """transformers on PyTorch (CPU), the source model in float32: the same weights before quantization."""

    backend = "torch"
    mode = "dense"

    def __init__(self, model_spec: str, threads: int, hf_model=None):
        import torch

        from powerinfer_tools import models

        torch.set_num_threads(threads)
        self.torch = torch
        self.model = hf_model if hf_model is not None else models.load_model(models.resolve(model_spec))[0]
        self.label = f"torch {torch.__version__} f32"
        # transformers 5 renamed past_key_values to cache; the cache object is updated in place
        params = inspect.signature(self.model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"

    def _step(self, ids, cache) -> None:
        self.model(input_ids=ids, use_cache=True, logits_to_keep=1, **{self._cache_kw: cache})

    def pp(self, tokens: list[int]) -> float:
        from transformers import DynamicCache

        with self.torch.inference_mode():
            ids = self.torch.tensor([tokens])
            start = time.perf_counter()
            self._step(ids, DynamicCache())
            return time.perf_counter() - start

    def tg(self, tokens: list[int]) -> float:
        from transformers import DynamicCache

        with self.torch.inference_mode():
            cache = DynamicCache()
            start = time.perf_counter()
            for token in tokens:
                self._step(self.torch.tensor([[token]]), cache)
            return time.perf_counter() - start

    def close(self) -> None:
        self.model = None
