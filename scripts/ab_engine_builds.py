"""Decode (or, with --phase prefill, prompt) speed of two builds of the engine library on one file, each run in fresh
processes, alternated per
round (A then B, then B then A): the median of the per-round ratios B/A with its quartiles, per FFN mode.

Two builds loaded into one process mislead: the one loaded second ran up to ~10 % faster here, in either order
(docs/log/perf-notes.md §35, "Tried and dropped"). A process per measurement costs a second of loading and no bias.

    python scripts/ab_engine_builds.py A.so B.so model.powerinfer.gguf gate predictor [--rounds 6] [--threads 2]
    python scripts/ab_engine_builds.py A.so B.so model.powerinfer.gguf dense --phase prefill --prompt 128
    python scripts/ab_engine_builds.py A.so B.so model.powerinfer.gguf dense --model-b model.llamacpp.gguf

--model-b: B runs another file of the same weights and tokenizer (our file's ffn_down_t against llama.cpp's ffn_down,
docs/engine.md "The down projection as stored").

Build a library from another tree (a commit to compare with) with `python setup.py build_ext --inplace` there;
each process loads its build through PI_ENGINE_LIB. Tokens: the start of --text (default: the README) through
the file's own tokenizer, the same for both builds (real text, so that the sparse modes see real activations).
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys

import numpy as np

from powerinfer_tools.core.errors import UserError
from powerinfer_tools.formats.tokenizer import tokenizer_from_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

DECODE = """
import sys, time
import powerinfer_engine as engine
path, mode, threads, n_prompt, runs = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
tokens = [int(t) for t in sys.argv[6].split(",")]
n_gen = len(tokens) - n_prompt
with engine.Model(path, threads=threads, ctx_size=len(tokens) + 8, sparse_mode=mode) as m:
    best = 0.0
    for run in range(runs + 1):  # the first run warms the caches and arranges the layers
        m.reset()
        m.eval(tokens[:n_prompt], all_logits=False)
        t0 = time.perf_counter()
        for t in tokens[n_prompt:]:
            m.eval([t], all_logits=False)
        if run:
            best = max(best, n_gen / (time.perf_counter() - t0))
print(best)
"""

# --phase prefill: the prompt as one batch (the runs' best), its tokens per second
PREFILL = """
import sys, time
import powerinfer_engine as engine
path, mode, threads, n_prompt, runs = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
tokens = [int(t) for t in sys.argv[6].split(",")][:n_prompt]
with engine.Model(path, threads=threads, ctx_size=n_prompt + 8, sparse_mode=mode, batch_size=n_prompt) as m:
    best = 0.0
    for run in range(runs + 1):  # the first run warms the caches and arranges the layers
        m.reset()
        t0 = time.perf_counter()
        m.eval(tokens, all_logits=False)
        if run:
            best = max(best, n_prompt / (time.perf_counter() - t0))
print(best)
"""


def tokens_per_second(lib: str, model: str, args: argparse.Namespace, mode: str, tokens: list[int]) -> float:
    env = dict(os.environ, PI_ENGINE_LIB=lib)
    code = PREFILL if args.phase == "prefill" else DECODE
    out = subprocess.run([sys.executable, "-c", code, model, mode, str(args.threads), str(args.prompt),
                          str(args.runs), ",".join(map(str, tokens))], env=env, capture_output=True, text=True)
    if out.returncode != 0:  # the child's own last line: the engine's message (a bad library, file or mode)
        sys.exit(f"{lib}: {(out.stderr.strip().splitlines() or ['exit status %d' % out.returncode])[-1]}")
    return float(out.stdout.split()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("a", help="engine library A (the baseline)")
    ap.add_argument("b", help="engine library B")
    ap.add_argument("model", help="PowerInfer GGUF file")
    ap.add_argument("modes", nargs="+", help="FFN modes: dense gate predictor auto")
    ap.add_argument("--model-b", default=None, help="the file B runs (default: model, the file A runs)")
    ap.add_argument("--rounds", type=int, default=6, help="rounds per mode (default 6)")
    ap.add_argument("--runs", type=int, default=2, help="timed runs per process, the best kept (default 2)")
    ap.add_argument("--threads", type=int, default=2, help="engine threads (default 2)")
    ap.add_argument("--prompt", type=int, default=32, help="prompt tokens before each timed run (default 32)")
    ap.add_argument("--gen", type=int, default=128, help="decode steps timed per run (default 128)")
    ap.add_argument("--phase", choices=("decode", "prefill"), default="decode",
                    help="what is timed: decode steps, or the prompt as one batch (default decode)")
    ap.add_argument("--text", default=os.path.join(ROOT, "README.md"), help="text the tokens come from (default: README)")
    args = ap.parse_args()
    try:
        with open(args.text, encoding="utf-8") as f:
            tokens = tokenizer_from_file(args.model)(f.read())["input_ids"][: args.prompt + args.gen]
    except (OSError, UserError) as exc:
        sys.exit(f"ab_engine_builds.py: {exc}")
    if args.prompt < 1 or args.gen < 0:
        sys.exit("ab_engine_builds.py: --prompt must be at least 1 and --gen at least 0")
    if len(tokens) < args.prompt + args.gen:
        sys.exit(f"{args.text} gives {len(tokens)} tokens, fewer than --prompt + --gen")
    for mode in args.modes:
        a, b = [], []
        for r in range(args.rounds):
            runs = ((args.a, args.model, a), (args.b, args.model_b or args.model, b))
            for lib, model, out in runs if r % 2 == 0 else runs[::-1]:
                out.append(tokens_per_second(lib, model, args, mode, tokens))
        q1, med, q3 = np.percentile([y / x for x, y in zip(a, b)], [25, 50, 75])
        print(f"{mode:10s} A {statistics.median(a):7.1f} t/s  B {statistics.median(b):7.1f} t/s  "
              f"B/A {med:.3f} ({q1:.3f}-{q3:.3f})", flush=True)


if __name__ == "__main__":
    main()
