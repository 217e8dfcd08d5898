#!/usr/bin/env python
"""Scale benchmark for the placement solver: synthetic power-law activation counts shaped like Llama-2-70B
(80 layers x 28672 neurons) and Falcon-40B (60 x 32768), q4_0 byte costs from their bundled configs (the dry run's
shapes, without predictors), against PowerInfer's formulation and greedy.

PowerInfer's formulation (powerinfer-py/solver.py) is re-implemented here from its description, with scipy's
HiGHS in place of cvxopt/GLPK (cvxopt is not installed here): each layer's sorted counts summed in groups of
256, one binary per group and one per layer, a capacity in neurons (the FFN byte capacity divided by the bytes
of one neuron: every layer costs the same per neuron in these models), the per-layer threshold as
ceil(min/256) groups, and GLPK's 30 s time limit. Its plans are scored at neuron granularity like ours.

    python scripts/bench_placement.py [--fractions 0.1,0.25,0.5] [--seed 0] [--with-ffn] [--models Llama-2-70B]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
from scipy import sparse
from scipy.optimize import Bounds, LinearConstraint, milp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from powerinfer_tools.stages.conversion import dry_run  # noqa: E402
from powerinfer_tools.stages.placement import placement  # noqa: E402
from powerinfer_tools.stages.placement import placement_solver  # noqa: E402

MODELS = {"Llama-2-70B": "relullama-70b", "Falcon-40B": "relufalcon-40b"}  # bundled configs (dry_run)
TOKENS = placement.SYNTHETIC_TOKENS
GROUP = 256


def synthetic_counts(n_layer: int, n_ff: int, rng) -> list[np.ndarray]:
    """Per layer: placement's power-law rate with an exponent a in [0.75, 1.05] (mean rate 4-20%, the hottest few
    percent always active), as binomial counts over TOKENS tokens in random neuron order."""
    out = []
    for _ in range(n_layer):
        rate = placement.power_law_rates(n_ff, rng.uniform(0.75, 1.05))
        out.append(rng.permutation(rng.binomial(TOKENS, rate)).astype(np.int64))
    return out


def powerinfer_formulation(inst: placement_solver.Instance, time_limit: float = 30.0):
    """PowerInfer's ILP: binary groups of 256 sorted neurons, binary layer switches, neuron-count capacity."""
    start = time.perf_counter()
    L = inst.n_layer
    groups = [np.sort(c)[::-1].reshape(-1, GROUP).sum(1) for c in inst.counts]  # n_ff is a multiple of 256
    G = np.array([len(g) for g in groups])
    offsets = np.concatenate(([0], np.cumsum(G)))
    n_x = int(offsets[-1])
    capacity_groups = (inst.capacity // int(inst.neuron_bytes[0])) // GROUP
    thresholds = np.ceil(inst.min_neurons / GROUP).astype(int)
    rows, cols, vals = [], [], []
    rows += [0] * n_x
    cols += list(range(n_x))
    vals += [1.0] * n_x
    for i in range(L):
        members = range(offsets[i], offsets[i + 1])
        rows += [1 + 2 * i] * (len(members) + 1) + [2 + 2 * i] * (len(members) + 1)
        cols += [*members, n_x + i, *members, n_x + i]
        vals += [-1.0] * len(members) + [float(thresholds[i])] + [1.0] * len(members) + [-1e6]
    A = sparse.csr_array((vals, (rows, cols)), shape=(1 + 2 * L, n_x + L))
    ub = np.concatenate(([capacity_groups], np.zeros(2 * L)))
    scale = max(float(sum(g.sum() for g in groups)), 1.0)
    c = -np.concatenate([*groups, np.zeros(L)]) / scale
    res = milp(c, integrality=np.ones(n_x + L), bounds=Bounds(0, 1),
               constraints=LinearConstraint(A, -np.inf, ub), options={"time_limit": time_limit})
    x = np.round(res.x[:n_x]) if res.x is not None else np.zeros(n_x)
    k = np.array([int(x[offsets[i]:offsets[i + 1]].sum()) * GROUP for i in range(L)])
    return placement_solver._solution(inst, k, f"powerinfer-256 ({'time limit' if res.status == 1 else 'optimal'})",
                                      start)


def q4_0_costs(name: str) -> placement.ModelCosts:
    """Byte costs of the model converted to q4_0 without predictors, from its bundled config's shapes."""
    return dry_run.size_report(dry_run.load(MODELS[name]), "q4_0", predictor_rank=0).costs


def instance(costs: placement.ModelCosts, fraction: float, rng, with_ffn: bool) -> placement_solver.Instance:
    n_layer, n_ff = costs.n_layer, int(costs.n_ff[0])
    counts = synthetic_counts(n_layer, n_ff, rng)
    mins = placement.auto_min_neurons(counts, costs, TOKENS)
    dense = costs.attention_bytes + costs.kv_bytes_per_layer(512)
    layer_bytes = dense if with_ffn else np.zeros(n_layer, np.int64)
    capacity = int(fraction * (np.sum(costs.n_ff * costs.neuron_bytes) + np.sum(layer_bytes)))
    return placement_solver.Instance(counts, costs.neuron_bytes, layer_bytes, mins, capacity)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fractions", default="0.1,0.25,0.5", help="FFN capacity as a fraction of all FFN bytes")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--with-ffn", action="store_true",
                    help="charge each layer's attention + KV cache when it places neurons (PowerInfer's "
                    "formulation cannot express this; it is then compared with greedy only)")
    ap.add_argument("--time-limit", type=float, default=20.0)
    ap.add_argument("--models", default=",".join(MODELS), help=f"of {', '.join(MODELS)} (default: both)")
    args = ap.parse_args()
    unknown = set(args.models.split(",")) - set(MODELS)
    if unknown:
        ap.error(f"--models: unknown {', '.join(sorted(unknown))} (known: {', '.join(MODELS)})")
    print("| model | FFN capacity | method | seconds | served | vs ours | ours' proved bound gap |")
    print("|---|---|---|---|---|---|---|")
    for name in args.models.split(","):
        costs = q4_0_costs(name)
        for fraction in map(float, args.fractions.split(",")):
            inst = instance(costs, fraction, np.random.default_rng(args.seed), args.with_ffn)
            total = float(sum(p[-1] for p in inst.prefix))
            ours = placement_solver.solve(inst, time_limit=args.time_limit)
            bound = ours.details.get("upper_bound", ours.value)
            results = [ours, placement_solver.greedy(inst)]
            if not args.with_ffn:
                results.append(powerinfer_formulation(inst))
            for r in results:
                assert inst.feasible(r.k), f"{r.method} plan is infeasible"
                label = r.method + (" (time limit)" if r.details.get("timed_out") else "")
                gap = f"{(bound - ours.value) / bound:.1e}" if r is ours else ""
                print(f"| {name} | {fraction:.0%} ({inst.capacity / 2**30:.1f} GiB, min {int(np.median(inst.min_neurons))}) "
                      f"| {label} | {r.seconds:.2f} | {r.value / total:.4%} | {r.value - ours.value:+,.0f} | {gap} |",
                      flush=True)


if __name__ == "__main__":
    main()
