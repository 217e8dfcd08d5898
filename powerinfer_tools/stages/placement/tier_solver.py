"""One plan for three tiers: each layer's neurons across the GPU, memory and disk, by a MILP that HiGHS solves exactly.

The problem. Layer i has n_i neurons with activation counts c. A neuron's expected cost per token is its count (per
token) times the seconds one activation costs where its rows are: g_i on the GPU, m_i in memory, d_i on disk (its
bundle's read). Placing k_i neurons on the GPU costs b_i bytes of VRAM each (plus c_i once for the layer, and at
least the layer's minimum, as placement_solver's GPU problem); keeping r_i in memory costs a_i bytes of memory each.
Minimise the expected time within both budgets.

Why hottest-first per tier, and why two counts per layer suffice. Within a layer every neuron costs the same bytes
in each tier, so swapping a hotter neuron in a slower tier with a colder one in a faster tier keeps both budgets
and, with g_i <= m_i <= d_i, never adds time. So an optimal plan puts the k_i hottest on the GPU and the next r_i in
memory. With s_i = k_i + r_i and F_i(k) the sum of the layer's k largest counts (concave), the time is

    sum_i  d_i F_i(n_i) - (m_i - g_i) F_i(k_i) - (d_i - m_i) F_i(s_i)

so the program maximises sum_i (m_i - g_i) t_i + (d_i - m_i) w_i with t_i <= F_i(k_i) and w_i <= F_i(s_i) bounded
by the same lines through consecutive points as placement_solver (the perspective form y_i for t_i, whose layer may
place nothing on the GPU; w_i needs none since F_i(0) = 0 lies on the first line), subject to

    sum_i b_i k_i + c_i y_i <= VRAM capacity,   sum_i a_i (s_i - k_i) <= memory capacity,
    m_i y_i <= k_i <= n_i y_i,                   k_i <= s_i <= n_i.

Lines are added where a solution's t_i or w_i overstates the true F_i until none does (within `gap`): the
relaxation's optimum is then a feasible plan of the same true value, hence optimal. With unlimited memory every
s_i = n_i and the objective is (m_i - g_i) times placement_solver's served count; with no VRAM every k_i = 0 and
the memory share is the concave knapsack over F_i(s_i), which at equal a_i is the globally hottest neurons (the
disk tier's frequency rule).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from powerinfer_tools.stages.placement.placement_solver import (Instance, Rows, _initial_lines, _Lines, greedy,
                                                                   stopped_in_time)


@dataclass
class TierInstance:
    """A three-tier problem: `gpu` is placement_solver's GPU instance (counts, VRAM bytes, per-layer charges,
    minimums, VRAM capacity; granularity 1); the rest prices memory and the seconds saved per activation."""

    gpu: Instance
    memory_bytes: np.ndarray  # int64 [L]: bytes one memory-resident neuron of layer i takes
    memory_capacity: int  # bytes of memory available to resident neurons
    gpu_gain: np.ndarray  # float [L]: seconds an activation saves on the GPU instead of in memory, m_i - g_i
    disk_gain: np.ndarray  # float [L]: seconds an activation saves in memory instead of on disk, d_i - m_i

    def __post_init__(self):
        if self.gpu.granularity != 1:
            raise ValueError("the three-tier program places neurons one by one (granularity 1)")
        self.memory_bytes = np.asarray(self.memory_bytes, dtype=np.int64)
        self.memory_capacity = int(self.memory_capacity)
        self.gpu_gain = np.maximum(np.asarray(self.gpu_gain, dtype=np.float64), 0.0)
        self.disk_gain = np.maximum(np.asarray(self.disk_gain, dtype=np.float64), 0.0)
        if self.memory_capacity < 0 or self.gpu.capacity < 0:
            raise ValueError("negative capacity")

    @property
    def n_layer(self) -> int:
        return self.gpu.n_layer

    def value(self, k: np.ndarray, s: np.ndarray) -> float:
        """Seconds (x tokens) saved against every neuron on disk."""
        p = self.gpu.prefix
        return float(sum(self.gpu_gain[i] * p[i][int(k[i])] + self.disk_gain[i] * p[i][int(s[i])]
                         for i in range(self.n_layer)))

    def memory_used(self, k: np.ndarray, s: np.ndarray) -> int:
        return int(np.sum((np.asarray(s, np.int64) - np.asarray(k, np.int64)) * self.memory_bytes))

    def feasible(self, k: np.ndarray, s: np.ndarray) -> bool:
        k, s = np.asarray(k, np.int64), np.asarray(s, np.int64)
        return bool(self.gpu.feasible(k) and np.all((k <= s) & (s <= self.gpu.n))
                    and self.memory_used(k, s) <= self.memory_capacity)


@dataclass
class TierSolution:
    """Per layer: the k hottest neurons on the GPU, the next s - k in memory, the rest on disk."""

    k: np.ndarray
    s: np.ndarray
    value: float
    seconds: float
    iterations: int
    upper_bound: float
    timed_out: bool

    @property
    def resident(self) -> np.ndarray:
        return self.s - self.k


def _memory_hint(inst: TierInstance, k: np.ndarray) -> np.ndarray:
    """s from the memory greedy over each layer's neurons past its k GPU ones (a start for the lines)."""
    rest = [np.sort(c)[::-1][int(j):] for c, j in zip(inst.gpu.counts, k)]
    mem = Instance(rest, np.maximum(inst.memory_bytes, 1), np.zeros(inst.n_layer), np.zeros(inst.n_layer),
                   inst.memory_capacity)
    return k + greedy(mem).k


def solve(inst: TierInstance, time_limit: float = 20.0, gap: float = 1e-6) -> TierSolution:
    """The optimal three-tier plan, proved to within `gap` (relative); see the module doc."""
    start = time.perf_counter()
    g, L = inst.gpu, inst.n_layer
    if L == 0:
        empty = np.zeros(0, np.int64)
        return TierSolution(empty, empty, 0.0, 0.0, 0, 0.0, False)
    # scaled so that HiGHS' absolute tolerances stay far below one count's worth
    total = float(sum((inst.gpu_gain[i] + inst.disk_gain[i]) * g.prefix[i][-1] for i in range(L)))
    scale = max(total / 1e5, 1e-300)
    k0 = greedy(g).k if g.capacity > 0 else np.zeros(L, np.int64)
    sorted_counts = [np.sort(c)[::-1] for c in g.counts]
    gpu_lines = _initial_lines(g, sorted_counts, k0)
    mem_inst = Instance(g.counts, np.maximum(inst.memory_bytes, 1), np.zeros(L), np.zeros(L), inst.memory_capacity)
    mem_lines = _initial_lines(mem_inst, sorted_counts, _memory_hint(inst, k0))
    best_k, best_s = np.zeros(L, np.int64), np.zeros(L, np.int64)
    vram, memory = g.capacity, inst.memory_capacity
    iterations, timed_out, res = 0, False, None
    while True:
        iterations += 1
        res = _solve_relaxation(inst, gpu_lines, mem_lines, vram, memory, scale, gap,
                                time_limit - (time.perf_counter() - start))
        timed_out = stopped_in_time(res, "three-tier")
        if res.x is None:
            break
        k = np.round(res.x[:L]).astype(np.int64)
        s = np.round(res.x[3 * L:4 * L]).astype(np.int64)
        over_vram, over_memory = g.bytes_used(k) - g.capacity, inst.memory_used(k, s) - inst.memory_capacity
        if over_vram > 0 or over_memory > 0:  # a float tolerance let a budget row slip: tighten it and re-solve
            vram -= max(over_vram, 0)
            memory -= max(over_memory, 0)
            continue
        if inst.value(k, s) > inst.value(best_k, best_s):
            best_k, best_s = k, s
        true_t = np.array([g.prefix[i][k[i]] for i in range(L)])
        true_w = np.array([g.prefix[i][s[i]] for i in range(L)])
        over_t = np.maximum(res.x[2 * L:3 * L] * scale - true_t * inst.gpu_gain, 0.0)
        over_w = np.maximum(res.x[4 * L:5 * L] * scale - true_w * inst.disk_gain, 0.0)
        if timed_out or over_t.sum() + over_w.sum() <= gap * max(inst.value(k, s), total * 1e-12):
            break
        added = sum(gpu_lines[i].add(gpu_lines[i].near(int(k[i]))) for i in np.flatnonzero(over_t > 0))
        added += sum(mem_lines[i].add(mem_lines[i].near(int(s[i]))) for i in np.flatnonzero(over_w > 0))
        if not added:
            break  # every value already sits on its own lines: the excess is HiGHS' feasibility tolerance
    bound = -float(res.mip_dual_bound) * scale if res is not None and res.x is not None else float("inf")
    value = inst.value(best_k, best_s)
    return TierSolution(best_k, best_s, value, time.perf_counter() - start, iterations, max(bound, value), timed_out)


def _solve_relaxation(inst: TierInstance, gpu_lines: list[_Lines], mem_lines: list[_Lines], vram: int, memory: int,
                      scale: float, gap: float, time_limit: float):
    """One HiGHS solve over [k (int), y (binary), t (GPU value / scale), s (int), w (memory value / scale)]."""
    from scipy.optimize import Bounds, milp

    g, L = inst.gpu, inst.n_layer
    rows = Rows()
    row = rows.add
    K, Y, T, S, W = (j * L for j in range(5))
    v_cap, m_cap = max(float(vram), 1.0), max(float(memory), 1.0)
    row([(K + i, g.neuron_bytes[i] / v_cap) for i in range(L)] + [(Y + i, g.layer_bytes[i] / v_cap) for i in range(L)],
        -np.inf, vram / v_cap)
    row([(S + i, inst.memory_bytes[i] / m_cap) for i in range(L)] + [(K + i, -inst.memory_bytes[i] / m_cap)
                                                                     for i in range(L)], -np.inf, memory / m_cap)
    for i in range(L):
        row([(K + i, 1.0), (Y + i, -float(g.n[i]))], -np.inf, 0.0)  # k_i <= n_i y_i
        row([(K + i, -1.0), (Y + i, float(g.min_neurons[i]))], -np.inf, 0.0)  # k_i >= m_i y_i
        row([(K + i, 1.0), (S + i, -1.0)], -np.inf, 0.0)  # k_i <= s_i
        a, d = inst.gpu_gain[i] / scale, inst.disk_gain[i] / scale
        for slope, intercept in gpu_lines[i].rows():  # t_i <= a (slope k_i + intercept y_i)
            row([(T + i, 1.0), (K + i, -a * slope), (Y + i, -a * intercept)], -np.inf, 0.0)
        for slope, intercept in mem_lines[i].rows():  # w_i <= d (slope s_i + intercept)
            row([(W + i, 1.0), (S + i, -d * slope)], -np.inf, d * intercept)
    top = np.array([p[-1] for p in g.prefix])
    n = g.n.astype(float)
    upper = np.concatenate([n, np.ones(L), top * inst.gpu_gain / scale, n, top * inst.disk_gain / scale])
    c = np.concatenate([np.zeros(2 * L), -np.ones(L), np.zeros(L), -np.ones(L)])
    integrality = np.concatenate([np.ones(2 * L), np.zeros(L), np.ones(L), np.zeros(L)])
    return milp(c, integrality=integrality, bounds=Bounds(np.zeros(5 * L), upper),
                constraints=rows.constraint(5 * L),
                options={"mip_rel_gap": gap, "time_limit": max(time_limit, 0.5), "disp": False})
