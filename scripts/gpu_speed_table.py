#!/usr/bin/env python3
"""The table of scripts/gpu_check.sh speed, from the bench records it has written so far (OUT/bench-NAME.json):
per placement and mode, prompt and decode tokens/s, decode against the CPU-only predictor mode, where the
layers' parts were, and the device per generated token: its time, launches, bytes read there and the floor those
bytes imply at its own copy rate (powerinfer_tools.bench.report.device_per_token); then the peers' rows
(OUT/peers.jsonl, scripts/gpu_peers.py: PowerInfer's CUDA build at the same budgets, its -ngl layer offload),
medians over rounds, ours at each budget against them.

Usage: scripts/gpu_speed_table.py OUT LAYERS [SHAPE]   (SHAPE: synthetic_llama.py's, default 7b)
"""
from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from powerinfer_tools.bench.report import device_per_token

RUNS = ("cpu", "hybrid", "hybrid02", "gpu4", "gpu8", "gpu8-ffn-only")


def placement(gpu: dict) -> str:
    if not gpu["used"]:
        return f"all on the CPU ({gpu['reason'] or '--gpu ' + gpu['mode']})"
    d = gpu["device"]
    return (f"hot rows of {d['layers_on_device']}/{d['hot_layers']} layers, attention + KV cache of "
            f"{d['attention_layers']}/{len(d['layers'])} on the device")


def step_times(path: Path) -> list[str]:
    """The device's decode steps (PI_CUDA_STEP_TIMES: step, times, total µs a line, summed over the bench's
    engines): per generated token (one `head` step each) and per occurrence. A split layer's `h2d_cold` runs from
    its hot rows' end to its cold output's arrival: the host's cold tier is in it, and the device idle there."""
    totals: dict[str, list[float]] = {}
    for line in path.read_text().splitlines():
        name, times, micros = line.split("\t")
        entry = totals.setdefault(name, [0, 0.0])
        entry[0] += int(times)
        entry[1] += float(micros)
    tokens = totals.get("head", [0])[0]
    if not tokens:
        return []
    steps = [(n, t, us) for n, (t, us) in totals.items() if not n.startswith("batch ")]
    total = sum(us for _, _, us in steps)
    return [f"{'':14s} device steps per decode token (CUDA events, {tokens} tokens): {total / tokens:.0f} µs: "
            + ", ".join(f"{n} {us / tokens:.0f} ({us / t:.1f} x {t // tokens})" for n, t, us in steps)]


def peer_rows(path: Path) -> list[str]:
    """The peers' rows (gpu_peers.py), medians over rounds, and at each budget ours against PowerInfer's and
    against its -ngl layer offload of the dense file."""
    rows: dict[str, dict[str, list[float]]] = {}
    errors: dict[str, str] = {}
    for line in path.read_text().splitlines():
        r = json.loads(line)
        if "error" in r:
            errors[r["row"]] = r["error"].strip().splitlines()[-1] if r["error"].strip() else "failed"
            continue
        entry = rows.setdefault(r["row"], {"pp": [], "tg": []})
        entry["tg"].append(r["tg"])
        if r.get("pp"):
            entry["pp"].append(r["pp"])
    med = {name: {k: statistics.median(v) if v else 0.0 for k, v in e.items()} for name, e in rows.items()}
    lines = ["peers on the same card, file, prompt and threads (pi-tools run / PowerInfer main, medians of "
             f"{max((len(e['tg']) for e in rows.values()), default=0)} rounds):"]
    for name, m in med.items():
        lines.append(f"  {name:34s} pp {m['pp']:8.2f} t/s  tg {m['tg']:7.2f} t/s")
    for name, why in errors.items():
        lines.append(f"  {name:34s} FAILED: {why[:150]}")
    for name in med:
        if not name.startswith("ours hybrid "):
            continue
        budget = name.split()[-1]
        ours = med[name]
        for peer in med:
            if peer == f"powerinfer {budget}" or (peer.startswith("powerinfer -ngl") and peer.endswith(f" {budget}")) \
                    or peer == "ours cpu predictor":
                p = med[peer]
                pp = f"{ours['pp'] / p['pp']:.2f}x" if p["pp"] else "-"
                lines.append(f"  {name} / {peer}: decode {ours['tg'] / p['tg']:.2f}x, prompt {pp}")
    return lines


def main(out: Path, layers: int, shape: str) -> None:
    print(f"{shape} shape, {layers} layers, q4_0, 90 % predicted sparsity (budgets: the 7B's, the rest scaled to "
          f"{layers} of its 32 layers)")
    base = None
    for name in RUNS:
        path = out / f"bench-{name}.json"
        if not path.exists():
            continue
        rec = json.loads(path.read_text())
        where = placement(rec["engine"]["gpu"])
        for run in rec["runs"]:
            if not run["label"].startswith("ours"):
                continue
            pp, tg = (run.get("pp") or {}).get("median") or 0.0, run["tg"]["median"]
            if name == "cpu" and run["label"] == "ours predictor":
                base = tg
            ratio = f"{tg / base:5.2f}x" if base else "  -  "
            print(f"{name:14s} {run['label']:16s} pp {pp:8.2f} t/s  tg {tg:7.2f} t/s  {ratio} CPU predictor  {where}")
            d = device_per_token(run.get("stats") or {})
            if d:
                print(f"{'':14s} device per token: {d['device_us']:.0f} µs, {d['launches']:.0f} launches, "
                      f"{d['device_mb']:.1f} MB read, bus {d['h2d_kib']:.1f} KiB up / {d['d2h_kib']:.1f} down; floor "
                      f"{d['floor_us']:.0f} µs at {d['copy_gbs']:.0f} GB/s + 5 µs a launch ({d['of_floor']:.0%} of it)")
        if (out / f"steps-{name}.tsv").exists():
            print("\n".join(step_times(out / f"steps-{name}.tsv")))
    if (out / "peers.jsonl").exists():
        print("\n".join(peer_rows(out / "peers.jsonl")))


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else "7b")
