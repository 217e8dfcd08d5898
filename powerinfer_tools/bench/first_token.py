"""`pi-tools bench --first-token`: what a user waits for the first token, each engine in a fresh process.

Ours is `pi-tools run -m FILE -p PROMPT -n 1 --temp 0` as a user types it (Python's start, the CLI's imports,
resolving the file, the tokenizer, opening the engine, the prompt batch, the first sample), timed from the
process's start to the first byte of generated text on its stdout (`run` echoes the prompt first: the bytes past
it). The peer is llama-cpp-python in a process of its own (its import, `Llama(...)` on the llama.cpp file, one
streamed token), timed the same way. Rounds alternate which engine goes first; both read their files from the
page cache after the first round (a warm-up round of each is not counted).
"""
from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from powerinfer_tools.core.errors import UserError
from powerinfer_tools.core.progress import progress_bar

PROMPT = "The capital of France is"
N_CTX = 512  # llama-cpp-python's default n_ctx; ours gets the same -c
TIMEOUT_S = 600

# The peer as a user writes it: the import, the model, one streamed token (greedy), written as it arrives.
_PEER_SCRIPT = """
import sys
import llama_cpp
path, prompt, threads, n_ctx = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
llm = llama_cpp.Llama(model_path=path, n_threads=threads, n_ctx=n_ctx, verbose=False)
for chunk in llm(prompt, max_tokens=1, temperature=0.0, stream=True):
    sys.stdout.write(chunk["choices"][0]["text"])
    sys.stdout.flush()
sys.stdout.write("\\n")  # as run ends its text: a token whose text is empty is still seen
"""


@dataclass(frozen=True)
class Contestant:
    """A command whose first output byte past `skip` bytes is its first token."""

    label: str
    command: list[str]
    env: dict[str, str]
    skip: int


def contestants(ours_file: Path, peer_file: Path, threads: int, peer_python: str | None,
                llamacpp_wait: str | None, prompt: str = PROMPT, n_ctx: int = N_CTX) -> list[Contestant]:
    """`pi-tools run` from this installation, and llama-cpp-python under `peer_python` (default: this Python), at
    its default OpenMP wait policy unless `llamacpp_wait` names one."""
    root = Path(__file__).resolve().parents[2]
    ours_env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root)] + [p for p in [os.environ.get("PYTHONPATH")]
                                                                          if p]))
    ours = Contestant("ours", [sys.executable, "-m", "powerinfer_tools", "run", "-m", str(ours_file), "-p", prompt,
                               "-n", "1", "--temp", "0", "-t", str(threads), "-c", str(n_ctx)],
                      ours_env, len(prompt.encode("utf-8")))
    peer_env = dict(os.environ)
    if llamacpp_wait is not None:
        peer_env["OMP_WAIT_POLICY"] = llamacpp_wait.upper()
    peer = Contestant("llama.cpp", [peer_python or sys.executable, "-I", "-c", _PEER_SCRIPT, str(peer_file), prompt,
                                    str(threads), str(n_ctx)], peer_env, 0)
    return [ours, peer]


def first_token(c: Contestant) -> tuple[float, str]:
    """(seconds from the start to the first byte past c.skip on stdout, the output past c.skip). The process
    runs to its end (it writes its one token and exits), so that the next round starts on an idle machine."""
    with tempfile.TemporaryFile() as err:
        started = time.perf_counter()
        proc = subprocess.Popen(c.command, stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL, env=c.env)
        out, seconds = b"", None
        try:
            while True:
                chunk = os.read(proc.stdout.fileno(), 65536)
                if not chunk:
                    break
                out += chunk
                if seconds is None and len(out) > c.skip:
                    seconds = time.perf_counter() - started
            proc.wait(timeout=TIMEOUT_S)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            proc.stdout.close()
        if proc.returncode != 0 or seconds is None:
            err.seek(0)
            tail = err.read().decode("utf-8", "replace").strip().splitlines()[-3:]
            raise UserError(f"bench --first-token: {c.label} wrote no token (exit status {proc.returncode}): "
                            + " / ".join(tail))
    return seconds, out[c.skip:].decode("utf-8", "replace").strip()


def measure(rows: list[Contestant], rounds: int, progress: bool = True) -> dict:
    """Each contestant once untimed (the files into the page cache, the caches `run` keeps filled), then `rounds`
    rounds, the order alternating. Medians, and the median over rounds of ours / the peer's."""
    for c in rows:
        first_token(c)
    seconds = {c.label: [] for c in rows}
    texts = {c.label: set() for c in rows}
    with progress_bar(total=rounds * len(rows), desc="first token", unit="run", disable=not progress) as bar:
        for r in range(rounds):
            for c in (rows if r % 2 == 0 else rows[::-1]):
                s, text = first_token(c)
                seconds[c.label].append(s)
                texts[c.label].add(text)
                bar.update()
    ours, peer = rows[0].label, rows[1].label
    ratios = [a / b for a, b in zip(seconds[ours], seconds[peer])]
    return {"prompt": PROMPT, "n_ctx": N_CTX, "rounds": rounds, "seconds": seconds, "median": {k: statistics.median(v) for k, v in seconds.items()},
            "ratio": statistics.median(ratios), "texts": {k: sorted(v) for k, v in texts.items()}}


def render(record: dict) -> list[str]:
    """The table: each engine's median time to its first token, and ours against the peer's."""
    ft = record["first_token"]
    lines = [f"time to the first token from a fresh process, prompt {ft['prompt']!r}, -n 1, ctx {ft['n_ctx']}; "
             f"medians of {ft['rounds']} alternated rounds", "",
             "| engine | first token, ms | min ms | max ms | text |", "|---|---:|---:|---:|---|"]
    for label, s in ft["seconds"].items():
        lines.append(f"| {label} | {ft['median'][label] * 1e3:.0f} | {min(s) * 1e3:.0f} | {max(s) * 1e3:.0f} | "
                     f"{' / '.join(repr(t) for t in ft['texts'][label])} |")
    lines += ["", f"ours / llama.cpp (median of per-round ratios): {ft['ratio']:.2f}x (below 1: ours is first)"]
    return lines
