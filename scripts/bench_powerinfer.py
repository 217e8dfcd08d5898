#!/usr/bin/env python3
"""Our engine against PowerInfer's own (its CPU build's `main`) on the same PowerInfer file, interleaved.

`pi-tools bench` drives llama.cpp through llama-cpp-python; PowerInfer has no such binding, so this
script runs both command-line programs the same way: `main -m FILE -p TEXT -n N -t T --temp 0 --ignore-eos`
and `pi-tools run -m FILE -p TEXT -n N -t T --temp 0 --sparse-mode MODE -v`, one after the other in every
round (load drifts on a shared machine: ratios are taken within a round, medians over rounds). Both print
llama.cpp's `llama_print_timings` lines; the prompt and generation rates are read from them. PowerInfer
compares predictor logits with one threshold for every layer (LLAMA_SPARSE_PRED_THRESHOLD, default 0),
so the file's predictors should select at threshold 0 (scripts/synthetic_llama.py builds them so).
PowerInfer is a peer, never a dependency: build it from its source in a directory of your own.

Usage: python scripts/bench_powerinfer.py --file model.powerinfer.gguf --powerinfer ../PowerInfer/build/bin/main
         [--rounds 3] [--n-gen 32] [--threads 2] [--mode predictor] [--peer-file plain.gguf] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

PROMPT = ("The history of the city begins in the early years of the century , when the first settlers arrived "
          "from the coast and built a small church on the hill above the river .")
TIMING = re.compile(r"(prompt eval|\beval) time =\s*([\d.]+) ms /\s*(\d+) (?:tokens|runs)")


def rates(output: str) -> dict[str, float]:
    """tokens/s of the prompt and of generation from llama_print_timings lines."""
    found = {}
    for what, ms, n in TIMING.findall(output):
        found["pp" if what == "prompt eval" else "tg"] = int(n) / (float(ms) / 1000.0)
    if "tg" not in found:
        raise RuntimeError(f"no timings in the output:\n{output[-2000:]}")
    return found


def run(cmd: list[str], env: dict | None = None) -> dict[str, float]:
    result = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, **(env or {})))
    if result.returncode != 0:
        raise RuntimeError(f"{cmd[0]} exited {result.returncode}: {result.stderr[-2000:]}")
    return rates(result.stdout + result.stderr)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--file", type=Path, required=True, help="PowerInfer GGUF both engines load")
    ap.add_argument("--powerinfer", type=Path, required=True, help="PowerInfer's main binary (CPU build)")
    ap.add_argument("--peer-file", type=Path, default=None,
                    help="the file PowerInfer's main runs instead (default: --file); e.g. bench's plain llama.cpp "
                         "copy of the same weights, which its llama.cpp code runs dense")
    ap.add_argument("--rounds", type=int, default=3, help="default 3")
    ap.add_argument("--n-gen", type=int, default=32, help="tokens generated per run (default 32)")
    ap.add_argument("--threads", type=int, default=2, help="default 2")
    ap.add_argument("--mode", default="predictor", help="our FFN mode (default predictor)")
    ap.add_argument("--json", type=Path, default=None, help="write the per-round rates here")
    args = ap.parse_args()
    common = ["-p", PROMPT, "-n", str(args.n_gen), "-t", str(args.threads), "--temp", "0", "--repeat-penalty", "1.0"]
    contestants = {
        "powerinfer": ([str(args.powerinfer), "-m", str(args.peer_file or args.file), *common, "--ignore-eos",
                        "--log-disable"],
                       {"LLAMA_SPARSE_PRED_THRESHOLD": "0"}),
        f"ours {args.mode}": ([sys.executable, "-m", "powerinfer_tools", "run", "-m", str(args.file), *common,
                               "--sparse-mode", args.mode, "-v"], {}),
    }
    rounds = []
    for r in range(args.rounds):
        rounds.append({name: run(cmd, env) for name, (cmd, env) in contestants.items()})
        print(f"round {r + 1}: " + ", ".join(f"{n} pp {v.get('pp', 0):.1f} tg {v['tg']:.2f} t/s"
                                             for n, v in rounds[-1].items()), flush=True)
    ours = f"ours {args.mode}"
    summary = {name: {t: statistics.median(x[name][t] for x in rounds) for t in ("pp", "tg")}
               for name in contestants}
    ratio = {t: statistics.median(x[ours][t] / x["powerinfer"][t] for x in rounds) for t in ("pp", "tg")}
    for name, v in summary.items():
        print(f"{name}: pp {v['pp']:.1f} t/s, tg {v['tg']:.2f} t/s (medians of {args.rounds})")
    print(f"ours / powerinfer (median of per-round ratios): pp {ratio['pp']:.2f}x, tg {ratio['tg']:.2f}x")
    if args.json:
        args.json.write_text(json.dumps({"file": str(args.file), "peer_file": str(args.peer_file or args.file),
                                         "n_gen": args.n_gen, "threads": args.threads,
                                         "mode": args.mode, "rounds": rounds, "median": summary,
                                         "ratio": ratio, "load": os.getloadavg()}, indent=1))


if __name__ == "__main__":
    main()
