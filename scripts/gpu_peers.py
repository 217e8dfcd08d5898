#!/usr/bin/env python3
"""Ours against PowerInfer's CUDA build on the same card, file, prompt and threads (scripts/gpu_check.sh speed):
per VRAM budget, `pi-tools run` with the hot tier on the device and PowerInfer's `main --vram-budget` on the same
PowerInfer GGUF with the same gpu index beside it (`pi-tools plan --reserve-mib 0` writes FILE.generated.gpuidx,
where both look for it), and PowerInfer's `main -ngl N` on the dense llama.cpp GGUF of the same weights, N the most layers whose
weights and KV cache fit the same budget (llama.cpp's layer offload); ours on the CPU alone as the base. Both
programs print llama.cpp's timings (scripts/bench_powerinfer.py reads them). Each row is appended to
OUT/peers.jsonl as it finishes, so that a run cut short keeps what it measured; gpu_speed_table.py prints them.

Usage: scripts/gpu_peers.py --file PI.gguf --dense PLAIN.gguf --powerinfer BIN --profile PROF --out OUT
         [--budgets 0.4,0.2] [--threads 8] [--n-gen 32] [--rounds 1] [--ctx 512]
       scripts/gpu_peers.py --layers-that-fit PLAIN.gguf --budgets 0.4 [--ctx 512]   (prints N per budget)
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_powerinfer import PROMPT, run  # noqa: E402


def layers_that_fit(dense: Path, budget_gib: float, ctx: int) -> int:
    """The most layers of the dense file whose tensors and f16 KV cache (ctx positions) fit the budget: what `-ngl`
    offloads (the output head and llama.cpp's CUDA scratch are not counted: the layers alone are a bound above)."""
    from powerinfer_tools.formats.gguf_io import field, open_reader

    reader = open_reader(dense)
    arch = field(reader, "general.architecture")
    n_layer = int(field(reader, f"{arch}.block_count"))
    n_embd = int(field(reader, f"{arch}.embedding_length"))
    n_head = int(field(reader, f"{arch}.attention.head_count"))
    n_kv = int(field(reader, f"{arch}.attention.head_count_kv") or n_head)
    per_layer = [0] * n_layer
    for t in reader.tensors:
        if t.name.startswith("blk."):
            per_layer[int(t.name.split(".")[1])] += int(t.n_bytes)
    kv = 2 * ctx * n_embd // n_head * n_kv * 2
    room, n = budget_gib * 2**30, 0
    while n < n_layer and per_layer[n] + kv <= room:
        room -= per_layer[n] + kv
        n += 1
    return n


def record(out: Path, row: dict) -> None:
    with open(out / "peers.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")
    print(json.dumps(row), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--file", type=Path, help="the PowerInfer GGUF both engines load")
    ap.add_argument("--dense", type=Path, help="the llama.cpp GGUF of the same weights (PowerInfer's -ngl row)")
    ap.add_argument("--powerinfer", type=Path, help="PowerInfer's main, its CUDA build")
    ap.add_argument("--profile", type=Path, help="the activation profile pi-tools plan solves the index from")
    ap.add_argument("--out", type=Path, default=Path("."), help="where peers.jsonl goes (default .)")
    ap.add_argument("--budgets", default="0.4,0.2", help="GiB, comma-separated (default 0.4,0.2)")
    ap.add_argument("--threads", type=int, default=8, help="default 8")
    ap.add_argument("--n-gen", type=int, default=32, help="tokens generated per run (default 32)")
    ap.add_argument("--rounds", type=int, default=1, help="rounds of every row, interleaved (default 1)")
    ap.add_argument("--ctx", type=int, default=512, help="context of every run (default 512)")
    ap.add_argument("--layers-that-fit", type=Path, default=None, metavar="PLAIN.gguf",
                    help="only print -ngl's layer count per budget for this dense file")
    args = ap.parse_args()
    budgets = [float(b) for b in args.budgets.split(",") if b]
    if args.layers_that_fit:
        for b in budgets:
            print(f"{b} GiB: -ngl {layers_that_fit(args.layers_that_fit, b, args.ctx)}")
        return
    for name in ("file", "dense", "powerinfer", "profile"):
        if getattr(args, name) is None:
            ap.error(f"--{name} is required")
    args.out.mkdir(parents=True, exist_ok=True)
    common = ["-p", PROMPT, "-n", str(args.n_gen), "-t", str(args.threads), "--temp", "0", "-c", str(args.ctx)]
    ours = [sys.executable, "-m", "powerinfer_tools", "run", "-m", str(args.file), *common, "--sparse-mode",
            "predictor", "-v"]
    theirs = [str(args.powerinfer), *common, "--ignore-eos", "--log-disable", "--repeat-penalty", "1.0"]
    # PowerInfer compares every layer's predictor logits with one threshold (the file's predictors select at 0)
    their_env = {"LLAMA_SPARSE_PRED_THRESHOLD": "0"}
    index = Path(str(args.file) + ".generated.gpuidx")
    rows: list[tuple[str, float | None, list[str], dict]] = [("ours cpu predictor", None, ours + ["--gpu", "off"], {})]
    for b in budgets:
        n = layers_that_fit(args.dense, b, args.ctx)
        rows += [(f"ours hybrid {b}", b, ours + ["--gpu", "on", "--gpuidx", str(index), "--vram-budget", str(b)], {}),
                 (f"powerinfer {b}", b, theirs + ["-m", str(args.file), "--vram-budget", str(b)], their_env),
                 (f"powerinfer -ngl {n} dense {b}", None, theirs + ["-m", str(args.dense), "-ngl", str(n)], {})]
    for r in range(args.rounds):
        for name, budget, cmd, env in rows:
            if budget is not None:  # the index for this budget, beside the file for both programs
                # without the plan's default reserve (256 MiB: more than 0.2 GiB), at the runs' context
                subprocess.run([sys.executable, "-m", "powerinfer_tools", "plan", "-m", str(args.file),
                                "--vram-budget", str(budget), "--profile", str(args.profile), "--reserve-mib", "0",
                                "--ctx-size", str(args.ctx), "-o", str(index)], check=True, capture_output=True)
            try:
                rates = run(cmd, env)
                record(args.out, {"row": name, "round": r, "pp": rates.get("pp"), "tg": rates["tg"]})
            except RuntimeError as exc:
                record(args.out, {"row": name, "round": r, "error": str(exc)[-500:]})


if __name__ == "__main__":
    main()
