"""A decode token's time by phase on the 7B q4_0 PWRI file, with each phase's bytes / time against the read probe.

    python scripts/decode_phases.py FILE [--modes dense,predictor] [--threads 2] [--tokens 16] [--rounds 2]

Per mode: open, eval a 16-token prompt, reset stats, decode --tokens tokens one at a time, read stats' phases.
Bytes per phase from the byte model (byte_model.model_bytes / layer_reads with the run's layer stats).
The probe (numpy streaming read, the bench's 'of limit' divisor, and engine.read_rows_rate in order) is
sampled before every mode's run.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

import powerinfer_engine as engine
from powerinfer_tools.bench import byte_model, machine


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("file")
    ap.add_argument("--modes", default="dense,predictor")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json")
    args = ap.parse_args()
    mb = byte_model.model_bytes(args.file)
    probe = machine.BandwidthProbe(args.threads, 256 << 20)
    rng = np.random.default_rng(0)
    prompt = rng.integers(10, 30000, 16).tolist()
    gen = rng.integers(10, 30000, args.tokens).tolist()
    out = []
    print(f"load {os.getloadavg()}")
    for rnd in range(args.rounds):
        for mode in args.modes.split(","):
            bw = probe.measure(3)
            seq = engine.read_rows_rate(mb.layers[0].gate_row, 1.0, args.threads)
            with engine.Model(args.file, threads=args.threads, sparse_mode=mode, ctx_size=256, gpu="off") as m:
                m.eval(prompt, all_logits=False)
                m.eval(gen[:2], all_logits=False)  # warm: every page touched once in this mode
                m.reset_stats()
                t0 = time.perf_counter()
                c0 = time.process_time()
                for t in gen:
                    m.eval([t], all_logits=False)
                wall = (time.perf_counter() - t0) / len(gen)
                cpu = (time.process_time() - c0) / len(gen)
                s = m.stats()
            n = s["decode_tokens"]
            ph = {k: v / n for k, v in s["phases"].items()}
            layers = s["layers"] if mode != "dense" else None
            att = pred = gu = dn = 0.0
            for i, lb in enumerate(mb.layers):
                r = byte_model.layer_reads(lb, layers[i] if layers else None)
                att += r.attention
                pred += r.predictor
                gu += r.ffn[0][0] * r.ffn[0][1] + r.ffn[1][0] * r.ffn[1][1]
                dn += r.ffn[2][0] * r.ffn[2][1]
            head = mb.head + mb.embedding_row
            nbytes = {"attention": att, "predictor": pred, "gate_up": gu, "down": dn, "output": head}
            total_b = sum(nbytes.values())
            rec = {"round": rnd, "mode": mode, "threads": args.threads, "wall_per_token": wall, "cpu_per_token": cpu,
                   "probe_numpy": bw, "probe_read_rows_in_order": seq, "phases": ph, "bytes": nbytes,
                   "density": s.get("density"), "load": os.getloadavg()}
            out.append(rec)
            print(f"round {rnd} {mode:9s} thr {args.threads}: {wall * 1e3:7.1f} ms/token wall, {cpu * 1e3:7.1f} ms CPU; "
                  f"probe numpy {bw / 1e9:.1f} GB/s, read_rows in order {seq / 1e9:.1f} GB/s; "
                  f"token {total_b / 2**20:.0f} MiB -> {total_b / wall / 1e9:.1f} GB/s ({total_b / wall / bw:.0%} of numpy probe)")
            for k in ("attention", "predictor", "gate_up", "down", "output"):
                t = ph.get(k, 0.0)
                b = nbytes[k]
                rate = b / t / 1e9 if t > 0 else float("nan")
                print(f"    {k:10s} {t * 1e3:8.1f} ms  {b / 2**20:7.0f} MiB  {rate:6.1f} GB/s  ({rate * 1e9 / bw:.0%} of probe)")
            other = wall - sum(ph.values())
            print(f"    {'other':10s} {other * 1e3:8.1f} ms (wall less the phases)   load {os.getloadavg()[0]:.1f}", flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
