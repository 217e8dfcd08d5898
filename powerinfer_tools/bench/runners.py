"""The contestants of `pi-tools bench`, each driving a worker process (worker.py).

Every contestant times the same two things on the same token ids: `pp(tokens)`, the prompt evaluated as
one batch from an empty cache, and `tg(tokens)`, the tokens fed one at a time from an empty cache (the
generation loop without sampling, as llama-bench's tg). Only the last token's logits are computed
where the API allows (llama.cpp and ours always; transformers with logits_to_keep=1). Each measurement
is (wall seconds, CPU seconds of the worker process).
"""
from __future__ import annotations

import ctypes
import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

from powerinfer_tools.core.errors import UserError

WORKER = Path(__file__).with_name("worker.py")
OMP_WAIT_POLICIES = ("active", "passive")
_INSTALL_HINT = {"llama.cpp": " (install the 'bench' extra: pip install 'powerinfer-tools[bench]', or point "
                              "--peer-python at a Python that has llama-cpp-python)"}


def _die_with_parent() -> None:
    """Runs in the child before exec: the kernel kills it when the coordinator dies, even while it is stopped."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class WorkerDied(UserError):
    """The worker process ended: `signal` names what killed it (SIGKILL: the OOM killer, under a memory limit)."""

    def __init__(self, message: str, signal: str | None):
        super().__init__(message)
        self.signal = signal


def _preexec(cgroup):
    """The child's steps before exec: die with the parent, and join `cgroup` where there is one."""
    if cgroup is None:
        return _die_with_parent

    def steps():
        _die_with_parent()
        cgroup.preexec()
    return steps


class Worker:
    """One backend in a child process. llama.cpp runs the worker file in isolation (-I) under `python`;
    ours and torch run it as a module of this installation.

    Between requests a worker is stopped (SIGSTOP), so an idle contestant takes no CPU from the one being
    timed: llama.cpp's OpenMP threads under OMP_WAIT_POLICY=active otherwise keep spinning on a core for
    as long as their process lives.

    With a `cgroup` (cgroup.MemoryCgroup), the worker joins it before exec: it runs under that memory limit."""

    def __init__(self, backend: str, path: Path | str, threads: int, n_ctx: int, batch: int = 0, kv_type: str = "f32",
                 python: str | None = None, env: dict | None = None, engine_options: dict | None = None,
                 cgroup=None):
        self.backend = backend
        python = python or sys.executable
        if backend == "llama.cpp":
            cmd = [python, "-I", str(WORKER)]
        else:
            cmd = [python, "-m", "powerinfer_tools.bench.worker"]
        cmd += [backend, str(path), str(threads), str(n_ctx), str(batch), kv_type]
        if engine_options:  # ours: engine.Model's other keywords (the GPU's); llama.cpp: repack; as JSON
            cmd.append(json.dumps(engine_options))
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), OPENBLAS_NUM_THREADS="1", **(env or {}))
        root = Path(__file__).resolve().parents[2]
        env["PYTHONPATH"] = os.pathsep.join([str(root)] + [p for p in [env.get("PYTHONPATH")] if p])
        try:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                         text=True, env=env, preexec_fn=_preexec(cgroup))
        except (OSError, subprocess.SubprocessError) as exc:  # SubprocessError: a preexec step failed
            raise UserError(f"cannot start the {backend} worker with {python}: "
                            f"{getattr(exc, 'strerror', None) or exc}") from None
        first = self._read()
        if "error" in first:
            self.close()
            raise UserError(f"{backend}: {first['error']}{_INSTALL_HINT.get(backend, '')}")
        self._signal(signal.SIGSTOP)

    def _signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            err = self.proc.stderr.read().strip().splitlines()
            code = self.proc.wait()
            # a native crash leaves no message: the signal is what names it (SIGILL: a build for another CPU)
            killed = signal.Signals(-code).name if code < 0 else None
            how = f"killed by {killed}" if killed else f"status {code}"
            raise WorkerDied(f"the {self.backend} worker exited ({how}): {err[-1] if err else 'no message'}", killed)
        return json.loads(line)

    def ask(self, **request) -> dict:
        self._signal(signal.SIGCONT)
        try:
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            reply = self._read()
        finally:
            self._signal(signal.SIGSTOP)
        if "error" in reply:
            raise UserError(f"{self.backend} worker: {reply['error']}")
        return reply

    def close(self) -> None:
        if self.proc.poll() is None:
            self._signal(signal.SIGCONT)
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()


class Runner:
    """A contestant: a worker and, for our engine, the FFN mode it runs in (several share one worker)."""

    def __init__(self, worker: Worker, label: str, mode: str = "dense"):
        self.worker, self.label, self.mode = worker, label, mode
        self.backend = worker.backend
        self.last_stats: dict | None = None

    def _run(self, op: str, tokens: list[int], **extra) -> tuple[float, float]:
        if self.backend == "ours":
            self.worker.ask(op="mode", mode=self.mode)
        reply = self.worker.ask(op=op, tokens=tokens, **extra)
        if self.backend == "ours":
            self.last_stats = self.worker.ask(op="stats")
        return reply["wall"], reply["cpu"]

    def pp(self, tokens: list[int]) -> tuple[float, float]:
        return self._run("pp", tokens)

    def tg(self, tokens: list[int], context: list[int] = ()) -> tuple[float, float]:
        """Generation of `tokens` one at a time after `context` (not timed) went into the cache."""
        return self._run("tg", tokens, context=list(context))

    def argmax(self, tokens: list[int]) -> list[int]:
        if self.backend == "ours":
            self.worker.ask(op="mode", mode=self.mode)
        return self.worker.ask(op="argmax", tokens=tokens)["result"]

    def perplexity(self, windows: list[list[int]]) -> float:
        """exp(mean NLL) of every token but each window's first, each window from an empty cache."""
        if self.backend == "ours":
            self.worker.ask(op="mode", mode=self.mode)
        reply = self.worker.ask(op="nll", windows=windows)
        return math.exp(reply["nll"] / reply["tokens"])


class FasterOf:
    """llama.cpp under each OpenMP wait policy, timed one after the other in every measurement; the
    faster counts. llama.cpp's CPU backend synchronises its threads through OpenMP: spinning waits win
    on an idle machine and collapse on an oversubscribed one, and a shared machine changes between the
    two within minutes, so no single policy chosen up front stays fair."""

    backend = "llama.cpp"
    mode = "dense"

    def __init__(self, runners: dict[str, Runner], label: str = "llama.cpp"):
        self.runners, self.label = runners, label
        self.wins = {policy: 0 for policy in runners}

    def _best(self, op: str, tokens: list[int], **extra) -> tuple[float, float]:
        results = {policy: getattr(r, op)(tokens, **extra) for policy, r in self.runners.items()}
        policy = min(results, key=lambda p: results[p][0])
        self.wins[policy] += 1
        return results[policy]

    def pp(self, tokens: list[int]) -> tuple[float, float]:
        return self._best("pp", tokens)

    def tg(self, tokens: list[int], context: list[int] = ()) -> tuple[float, float]:
        return self._best("tg", tokens, context=context)

    def argmax(self, tokens: list[int]) -> list[int]:
        return next(iter(self.runners.values())).argmax(tokens)

    def perplexity(self, windows: list[list[int]]) -> float:
        return next(iter(self.runners.values())).perplexity(windows)  # the wait policy times, it does not round


def llamacpp_runner(path: Path, threads: int, n_ctx: int, python: str | None,
                    omp_wait: str | None = None) -> tuple[FasterOf, list[Worker]]:
    """The llama.cpp contestant: one worker per OpenMP wait policy (only the given one, or the
    environment's, when fixed) and its workers (for closing)."""
    if omp_wait is not None or "OMP_WAIT_POLICY" in os.environ:
        policy = omp_wait or os.environ["OMP_WAIT_POLICY"].lower()
        policies = {policy: {"OMP_WAIT_POLICY": policy.upper()}}
    else:
        policies = {p: {"OMP_WAIT_POLICY": p.upper()} for p in OMP_WAIT_POLICIES}
    workers = {p: Worker("llama.cpp", path, threads, n_ctx, python=python, env=env) for p, env in policies.items()}
    return FasterOf({p: Runner(w, f"llama.cpp {p}") for p, w in workers.items()}), list(workers.values())
