"""A mixture's decode with experts on a device (scripts/gpu_check.sh moe; docs/engine.md, "Experts on a device"): for a
converted mixture and its expert profile, `pi-tools plan --vram-budget --memory-budget` at VRAM budgets whose room
after the device's scratch, output head and attention holds none, a quarter, half and all of the experts, then the
engine on each plan (every expert in memory: no memory budget) timing a prompt batch and decode steps, beside the CPU
alone; one line a row into OUT/moe.jsonl and a table on stdout.

  python scripts/gpu_moe.py --model a3b.q4_0.gguf --profile prof --threads 16 --out build/gpu_check
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

import powerinfer_engine as engine
from powerinfer_tools.stages.options import DEFAULT_KV_TYPE
from powerinfer_tools.stages.placement import expert_tiers

CTX, N_PROMPT, N_GEN = 512, 64, 32
SHARES = (0.25, 0.5, 1.0)  # of all experts' bytes, beside the device's fixed part


def timed(model: Path, threads: int, **kw) -> dict:
    """Prompt and decode tokens/s, and the device's counts, for one engine configuration."""
    with engine.Model(model, threads=threads, ctx_size=CTX, kv_type=DEFAULT_KV_TYPE, **kw) as m:  # as plan sized it
        tokens = np.random.default_rng(0).integers(0, m.info["n_vocab"], N_PROMPT + N_GEN).tolist()
        m.eval(tokens[:8])  # warm: the mapped pages, the device's first launches
        m.reset()
        t0 = time.perf_counter()
        m.eval(tokens[:N_PROMPT])
        prompt = N_PROMPT / (time.perf_counter() - t0)
        m.reset_stats()
        t0 = time.perf_counter()
        for t in tokens[N_PROMPT:]:
            m.eval([t])
        decode = N_GEN / (time.perf_counter() - t0)
        g, info = m.stats()["gpu"], m.info["gpu"]
    row = {"prompt_tps": prompt, "decode_tps": decode, "gpu_used": info["used"], "reason": info["reason"]}
    if g:
        row |= {k: g[k] for k in ("expert_jobs", "expert_pairs", "expert_seconds", "expert_wait_seconds",
                                  "attention_jobs", "head_jobs")}
        row["experts_on_device"] = info["device"]["experts_on_device"]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, required=True, help="a converted mixture of experts")
    ap.add_argument("--profile", type=Path, required=True, help="its expert profile (pi-tools profile)")
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--memory-budget", type=float, default=None,
                    help="GiB for plan's memory side (default: the file's size and 4 GiB)")
    ap.add_argument("--out", type=Path, default=Path("."))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    dev = expert_tiers.device_room(args.model, 64 << 30, CTX)
    fixed = (64 << 30) - dev.room  # the scratch, head and attention the device holds before any expert
    from powerinfer_tools.formats.gguf_header import read_header

    header = read_header(args.model)
    n_expert = int(header.get(f"{header.get('general.architecture')}.expert_count"))
    all_experts = float(dev.expert_bytes.sum()) * n_expert
    memory = args.memory_budget or args.model.stat().st_size / 2**30 + 4
    rows = [("cpu", timed(args.model, args.threads, gpu="off"))]
    for share in SHARES:
        vram = int(fixed + dev.scratch + share * all_experts + 4096)
        plan = subprocess.run([sys.executable, "-m", "powerinfer_tools", "plan", "--profile", str(args.profile), "-m",
                               str(args.model), "--vram-budget", str(vram / 2**30), "--memory-budget", str(memory),
                               "-c", str(CTX)], capture_output=True, text=True)
        if plan.returncode != 0:
            rows.append((f"gpu {share:.0%} experts", {"error": plan.stderr.strip()[-300:]}))
            continue
        try:
            row = timed(args.model, args.threads, gpu="on", vram_budget=vram / 2**30)
        except engine.EngineError as e:
            row = {"error": str(e)}
        rows.append((f"gpu {share:.0%} experts ({vram / 2**30:.3f} GiB)", row))
    with open(args.out / "moe.jsonl", "a") as f:
        for name, row in rows:
            f.write(json.dumps({"row": name, "model": str(args.model), "threads": args.threads} | row) + "\n")
    print(f"{args.model.name}: {N_PROMPT}-token prompt, {N_GEN} decode steps, {args.threads} threads, ctx {CTX}")
    print("| row | pp t/s | tg t/s | experts on device | device pairs/token | expert s/token (device) | wait s/token |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, row in rows:
        if "error" in row:
            print(f"| {name} | failed: {row['error']} | | | | | |")
            continue
        per = lambda k: row.get(k, 0) / N_GEN  # noqa: E731 (the stats were reset before the decode steps)
        print(f"| {name} | {row['prompt_tps']:.1f} | {row['decode_tps']:.1f} | {row.get('experts_on_device', 0)} | "
              f"{per('expert_pairs'):.1f} | {per('expert_seconds') * 1e3:.2f} ms | "
              f"{per('expert_wait_seconds') * 1e3:.2f} ms |")


if __name__ == "__main__":
    main()
