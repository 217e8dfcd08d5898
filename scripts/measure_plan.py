#!/usr/bin/env python3
"""Wall time of `pi-tools plan` on a file with ReluLLaMA-7B's tensor table and a 32000-token vocabulary.

The file is what a q4_0 conversion with a profile writes, less the weights: the same metadata (a
SentencePiece vocabulary, the neuron order key) and tensor table (7B shapes, q4_0, f16 predictors), its
3.6 GiB of tensor data zeros in a sparse file (no disk used). `plan` reads no tensor data, so its time is
what it takes on the real file. The profile is the placement benchmark's power law, 32 count files.

Each round runs `pi-tools plan` as a user does (a fresh interpreter), and prints its wall time; with
`--in-process`, it also times reading the byte costs in-process by this reader and by gguf-py's
GGUFReader (the reader plan used before).

  python scripts/measure_plan.py --work /tmp/plan7b --rounds 5
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

N_LAYER, N_EMBD, N_FF, N_HEAD, N_VOCAB = 32, 4096, 11008, 32, 32000


def build(work: Path) -> tuple[Path, Path]:
    from placement_fixtures import power_law_counts, write_model, write_profile

    work.mkdir(parents=True, exist_ok=True)
    model, profile = work / "relu7b-table.q4_0.powerinfer.gguf", work / "prof"
    if not model.is_file():
        write_model(model, N_LAYER, N_FF, "Q4_0", n_vocab=N_VOCAB, n_embd=N_EMBD, n_head=N_HEAD, n_kv=N_HEAD,
                    vocabulary=True, data=False, neuron_order=True)
    if not (profile / "activation" / f"activation_{N_LAYER - 1}.pt").is_file():
        write_profile(profile, power_law_counts(N_LAYER, N_FF, tokens=1 << 16), tokens=1 << 16)
    return model, profile


def header_times(model: Path) -> dict:
    from powerinfer_tools.formats.gguf_io import field, open_reader
    from powerinfer_tools.stages import placement

    started = time.perf_counter()
    placement.model_costs(model)
    ours = time.perf_counter() - started
    started = time.perf_counter()
    reader = open_reader(model)
    placement.costs_from_tensors(str(model), lambda key, default=None: field(reader, key, default),
                                 ((t.name, tuple(int(n) for n in reversed(t.shape)), int(t.n_bytes))
                                  for t in reader.tensors))
    return {"header_s": round(ours, 4), "gguf_py_s": round(time.perf_counter() - started, 4)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, required=True, help="where the file and the profile go (kept)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--vram-budget", default="4")
    ap.add_argument("--source", type=Path, default=ROOT, help="the toolkit checkout whose `plan` runs")
    ap.add_argument("--in-process", action="store_true", help="also time reading the costs in-process")
    args = ap.parse_args()
    model, profile = build(args.work)
    env = dict(os.environ, PYTHONPATH=str(args.source))
    cmd = [sys.executable, "-m", "powerinfer_tools", "plan", "--profile", str(profile), "-m", str(model),
           "--vram-budget", args.vram_budget, "-o", str(args.work / "plan.gpuidx")]
    walls = []
    for _ in range(args.rounds):
        started = time.perf_counter()
        subprocess.run(cmd, check=True, env=env, cwd=args.work, stdout=subprocess.DEVNULL)
        walls.append(time.perf_counter() - started)
    out = {"file_bytes": os.path.getsize(model), "rounds_s": [round(w, 3) for w in walls],
           "median_s": round(statistics.median(walls), 3), "load_average": os.getloadavg()[0],
           "command": " ".join(cmd[1:])}
    if args.in_process:
        out |= header_times(model)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
