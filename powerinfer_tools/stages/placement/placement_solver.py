"""Exact hot/cold neuron placement under a byte budget: a small MILP that HiGHS solves at neuron granularity.

The problem. Layer i has n_i neurons with activation counts. Putting one of its neurons on the GPU costs
b_i bytes (its rows of gate/up/down at the file's quantization) and serves its count from the GPU. A layer
that places anything also pays c_i bytes once (its dense parts, when those follow the layer) and places at
least m_i neurons (below that, the launch/sync overhead of a split layer costs more than it saves).
Maximise the served count within a capacity of R bytes. With a granularity g > 1, a layer places 0, a multiple of
g, or all of its neurons (PowerInfer's CUDA kernels take GPU rows in multiples of 32, or of 256 for q4_0).

The structure that keeps the model small. Every neuron of a layer costs the same, so for a given count k_i the
hottest k_i neurons are best: the layer's value is F_i(k) = the sum of its k largest counts, a concave function
of the integer k. The MILP therefore has three variables per layer, whatever n_i is: the count k_i (integer),
y_i (binary: the layer places anything) and t_i (its value), with t_i bounded by lines through consecutive
points (j, F_i(j)), (j+1, F_i(j+1)). By concavity each such line lies on or above F_i at every integer k, so any
set of them gives a relaxation. We start with a few lines per layer, solve, and wherever t_i overstates
F_i(k_i) add the two lines through k_i and solve again. When no t_i overstates, the relaxation's optimum is a
feasible placement with the same true value, hence optimal for the full neuron-level problem. A granularity
only narrows k_i's domain (k_i = g u_i + r_i f_i, u_i integer, f_i binary taking the remainder r_i = n_i mod g
when u_i is at its top); the lines bound F_i at every integer, so the argument stands.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np


@dataclass
class Instance:
    """A placement problem. `counts[i]` are layer i's activation counts in neuron order."""

    counts: list[np.ndarray]
    neuron_bytes: np.ndarray  # int64 [L]: bytes one neuron of layer i occupies on the GPU
    layer_bytes: np.ndarray  # int64 [L]: bytes a layer pays once when it places any neuron
    min_neurons: np.ndarray  # int64 [L]: a layer places 0 or at least this many neurons
    capacity: int  # bytes available to neurons and per-layer charges
    granularity: int = 1  # a layer places 0, a multiple of this, or all of its neurons

    def __post_init__(self):
        self.counts = [np.asarray(c, dtype=np.float64) for c in self.counts]
        self.n = np.array([len(c) for c in self.counts], dtype=np.int64)
        self.neuron_bytes = np.asarray(self.neuron_bytes, dtype=np.int64)
        self.layer_bytes = np.asarray(self.layer_bytes, dtype=np.int64)
        if self.granularity < 1:
            raise ValueError("granularity must be at least 1")
        g = self.granularity
        # the smallest count a layer may place that is >= its minimum: the next multiple of g, or all
        mins = np.maximum(np.asarray(self.min_neurons, dtype=np.int64), 1)
        self.min_neurons = np.minimum(-(-mins // g) * g, self.n)
        self.capacity = int(self.capacity)
        # prefix[i][k] = F_i(k): the value of layer i's k hottest neurons
        self.prefix = [np.concatenate(([0.0], np.cumsum(np.sort(c)[::-1]))) for c in self.counts]

    @property
    def n_layer(self) -> int:
        return len(self.counts)

    def value(self, k: np.ndarray) -> float:
        return float(sum(p[int(j)] for p, j in zip(self.prefix, k)))

    def bytes_used(self, k: np.ndarray) -> int:
        k = np.asarray(k, dtype=np.int64)
        return int(np.sum(k * self.neuron_bytes) + np.sum(self.layer_bytes[k > 0]))

    def allowed(self, k: np.ndarray) -> np.ndarray:
        """Per layer: k is a count the layer may place (0, or from its minimum up, at the granularity)."""
        k = np.asarray(k, dtype=np.int64)
        in_range = (k >= self.min_neurons) & (k <= self.n) & ((k % self.granularity == 0) | (k == self.n))
        return (k == 0) | in_range

    def round_down(self, k: np.ndarray) -> np.ndarray:
        """Each layer's k lowered to the nearest count it may place."""
        k = np.asarray(k, dtype=np.int64)
        k = np.where(k >= self.n, self.n, k // self.granularity * self.granularity)
        return np.where(k >= self.min_neurons, k, 0)

    def feasible(self, k: np.ndarray) -> bool:
        return bool(np.all(self.allowed(k)) and self.bytes_used(k) <= self.capacity)


@dataclass
class Solution:
    """How many of each layer's hottest neurons go to the GPU, and what that serves."""

    k: np.ndarray
    value: float
    bytes_used: int
    method: str
    seconds: float
    iterations: int = 0
    details: dict = field(default_factory=dict)


def _solution(inst: Instance, k, method: str, start: float, **extra) -> Solution:
    k = np.asarray(k, dtype=np.int64)
    return Solution(k=k, value=inst.value(k), bytes_used=inst.bytes_used(k), method=method,
                    seconds=time.perf_counter() - start, **extra)


def greedy(inst: Instance) -> Solution:
    """The no-solver baseline: neurons by count per byte, then repair the per-layer minimum, then top up.

    1. Sort all neurons by count / b_i and take the longest prefix that fits, charging c_i when a layer's first
       neuron enters. 2. Layers below their minimum are raised to it where the bytes allow (best value per byte
       first), otherwise emptied. 3. Leftover bytes go to the next-densest neurons of the open layers.
    """
    start = time.perf_counter()
    layer_of = np.concatenate([np.full(n, i, dtype=np.int64) for i, n in enumerate(inst.n)])
    rank_in_layer = np.concatenate([np.arange(n, dtype=np.int64) for n in inst.n])
    density = np.concatenate([np.sort(c)[::-1] / inst.neuron_bytes[i] for i, c in enumerate(inst.counts)])
    order = np.argsort(-density, kind="stable")
    layer_sorted = layer_of[order]
    first = rank_in_layer[order] == 0
    cost = inst.neuron_bytes[layer_sorted] + np.where(first, inst.layer_bytes[layer_sorted], 0)
    taken = int(np.searchsorted(np.cumsum(cost), inst.capacity, side="right"))
    k = np.bincount(layer_sorted[:taken], minlength=inst.n_layer).astype(np.int64)

    short = np.flatnonzero((k > 0) & (k < inst.min_neurons))
    k[short] = 0
    gain = np.array([(inst.prefix[i][inst.min_neurons[i]]) / (inst.layer_bytes[i] + inst.min_neurons[i]
                     * inst.neuron_bytes[i]) for i in short])
    for i in short[np.argsort(-gain, kind="stable")]:
        trial = k.copy()
        trial[i] = inst.min_neurons[i]
        if inst.bytes_used(trial) <= inst.capacity:
            k = trial

    left = inst.capacity - inst.bytes_used(k)
    is_open = k > 0
    rest = is_open[layer_sorted] & (rank_in_layer[order] >= k[layer_sorted])
    extra = int(np.searchsorted(np.cumsum(inst.neuron_bytes[layer_sorted[rest]]), left, side="right"))
    k += np.bincount(layer_sorted[rest][:extra], minlength=inst.n_layer).astype(np.int64)
    return _solution(inst, inst.round_down(k), "greedy", start)


def _trivial(inst: Instance) -> np.ndarray | None:
    """All neurons when everything fits; None otherwise."""
    if inst.bytes_used(inst.n) <= inst.capacity:
        return inst.n.copy()
    return None


class _Lines:
    """The lines that bound one layer's value curve F: one per run of equal counts among its sorted counts.

    The line through (j, F(j)) and (j+1, F(j+1)) has the slope of the (j+1)-th largest count, so all j inside a
    run of equal counts give the same line; lines are named by run index r, anchored at the run's first j.
    """

    def __init__(self, sorted_counts: np.ndarray, prefix: np.ndarray):
        self.prefix = prefix
        change = np.flatnonzero(np.diff(sorted_counts)) + 1 if len(sorted_counts) else np.array([], np.int64)
        self.starts = np.concatenate(([0], change)).astype(np.int64) if len(sorted_counts) else change
        self.slopes = sorted_counts[self.starts] if len(sorted_counts) else np.array([])
        self.chosen: set[int] = {0} if len(sorted_counts) else set()

    def run_of(self, j: int) -> int:
        return int(np.searchsorted(self.starts, j, side="right")) - 1

    def near(self, k: int, reach: int = 6) -> set[int]:
        """The runs of the two lines through k, and runs 2^p further on either side (where k is headed)."""
        n_runs = len(self.starts)
        if not n_runs:
            return set()
        mid = {self.run_of(j) for j in (k - 1, k) if 0 <= j < self.prefix.size - 1}
        spread = {r + s * 2**p for r in mid for p in range(reach) for s in (-1, 1)}
        return {r for r in mid | spread if 0 <= r < n_runs}

    def add(self, runs: set[int]) -> int:
        new = runs - self.chosen
        self.chosen |= new
        return len(new)

    def rows(self):
        """(slope, intercept) of the chosen lines: t <= slope k + intercept y."""
        for r in sorted(self.chosen):
            j, slope = int(self.starts[r]), float(self.slopes[r])
            yield slope, float(self.prefix[j]) - slope * j


def _initial_lines(inst: Instance, sorted_counts, hint: np.ndarray, grid: int = 24) -> list[_Lines]:
    """Where to start: a geometric grid of runs (F bends most among the hottest neurons), each layer's
    minimum, and the neighbourhoods of the greedy plan and of where each layer's count/byte crosses the
    greedy plan's marginal count/byte."""
    taken = [sc[hint[i] - 1] / inst.neuron_bytes[i] for i, sc in enumerate(sorted_counts) if hint[i] > 0]
    marginal = min(taken, default=0.0)
    layers = []
    for i, sc in enumerate(sorted_counts):
        lines = _Lines(sc, inst.prefix[i])
        if len(lines.starts):
            lines.add({int(r) for r in np.round(np.geomspace(1, len(lines.starts), grid)) - 1})
            crossing = int(np.sum(sc / inst.neuron_bytes[i] >= marginal))
            for k in (int(hint[i]), crossing, int(inst.min_neurons[i])):
                lines.add(lines.near(k))
        layers.append(lines)
    return layers


def solve(inst: Instance, time_limit: float = 20.0, gap: float = 1e-6) -> Solution:
    """The optimal placement, proved to within `gap` (relative); details["upper_bound"] bounds every plan.

    See the module doc for the model. The loop stops when the lines overstate the plan's true value by at most
    `gap` of it, so the plan is within about 2 x `gap` of the bound (exact for integer counts when that slack is
    under one count). Past `time_limit` seconds it returns the best plan found (never below greedy) with
    details["timed_out"] set; details["upper_bound"] still bounds the optimum.
    """
    start = time.perf_counter()
    if inst.capacity < 0:
        raise ValueError("negative capacity")
    everything = _trivial(inst)
    if everything is not None:
        return _solution(inst, everything, "all-fit", start)
    base = greedy(inst)
    L = inst.n_layer
    if L == 0 or not np.any(inst.layer_bytes + inst.min_neurons * inst.neuron_bytes <= inst.capacity):
        return _solution(inst, np.zeros(L, dtype=np.int64), "nothing-fits", start)

    # t in units of 1e-5 of all activations: HiGHS' absolute row tolerance (1e-7) then stays far below one count
    scale = max(float(sum(p[-1] for p in inst.prefix)) / 1e5, 1.0)
    lines = _initial_lines(inst, [np.sort(c)[::-1] for c in inst.counts], base.k)
    capacity = inst.capacity
    iterations = 0
    nodes = 0
    best = base.k
    timed_out = False
    while True:
        iterations += 1
        res = _solve_relaxation(inst, lines, capacity, scale, gap, time_limit - (time.perf_counter() - start))
        nodes += int(getattr(res, "mip_node_count", 0) or 0)
        timed_out = stopped_in_time(res, "placement")
        if res.x is None:
            break
        k = np.round(res.x[:L]).astype(np.int64)
        t = res.x[2 * L:3 * L] * scale
        overused = inst.bytes_used(k) - inst.capacity
        if overused > 0:  # a float tolerance let the budget row slip: tighten it by the excess and re-solve
            capacity -= overused
            continue
        if inst.value(k) > inst.value(best):
            best = k
        true = np.array([inst.prefix[i][k[i]] for i in range(L)])
        overstated = np.maximum(t - true, 0.0)
        if timed_out or overstated.sum() <= gap * max(true.sum(), 1.0):
            break
        if not sum(lines[i].add(lines[i].near(int(k[i]))) for i in np.flatnonzero(overstated > 0)):
            break  # every t_i already sits on its own lines: the excess is HiGHS' feasibility tolerance
    bound = -float(res.mip_dual_bound) * scale if res.x is not None else float("inf")
    return _solution(inst, best, "milp", start, iterations=iterations,
                     details={"lines": sum(len(x.chosen) for x in lines), "nodes": nodes, "mip_rel_gap": gap,
                              "upper_bound": max(bound, inst.value(best)), "timed_out": timed_out})


def stopped_in_time(res, what: str) -> bool:
    """Whether HiGHS stopped at its time limit (with or without a plan); a failure without one raises."""
    timed_out = res.status == 1
    if res.x is None and not timed_out:
        raise RuntimeError(f"{what} MILP failed: {res.message}")
    return timed_out


class Rows:
    """A sparse constraint matrix built a row at a time: lo <= sum of v x_c over (c, v) in entries <= hi."""

    def __init__(self):
        self.rows, self.cols, self.vals, self.lb, self.ub = [], [], [], [], []

    def add(self, entries, lo: float, hi: float) -> None:
        r = len(self.lb)
        for c, v in entries:
            self.rows.append(r)
            self.cols.append(c)
            self.vals.append(float(v))
        self.lb.append(lo)
        self.ub.append(hi)

    def constraint(self, n_vars: int):
        from scipy import sparse
        from scipy.optimize import LinearConstraint

        A = sparse.csr_array((self.vals, (self.rows, self.cols)), shape=(len(self.lb), n_vars))
        return LinearConstraint(A, self.lb, self.ub)


def _solve_relaxation(inst: Instance, lines: list[_Lines], capacity: int, scale: float, gap: float,
                      time_limit: float):
    """One HiGHS solve over variables [k (int), y (binary), t (value / scale)], each of length L, and with a
    granularity g > 1 also [u (int), f (binary)]: k = g u + (n mod g) f, f only with u at n // g."""
    # imported here: `pi-tools run` reaches this module through placement, and scipy would be its largest import
    from scipy.optimize import Bounds, milp

    L = inst.n_layer
    g = inst.granularity
    n_vars = 5 * L if g > 1 else 3 * L
    rows = Rows()
    row = rows.add

    cap = max(float(capacity), 1.0)
    row([(i, inst.neuron_bytes[i] / cap) for i in range(L)]
        + [(L + i, inst.layer_bytes[i] / cap) for i in range(L)], -np.inf, capacity / cap)
    for i in range(L):
        row([(i, 1.0), (L + i, -float(inst.n[i]))], -np.inf, 0.0)  # k_i <= n_i y_i
        row([(i, -1.0), (L + i, float(inst.min_neurons[i]))], -np.inf, 0.0)  # k_i >= m_i y_i
        for slope, intercept in lines[i].rows():  # t_i <= slope k_i + intercept y_i: off when y_i = 0
            row([(2 * L + i, 1.0), (i, -slope / scale), (L + i, -intercept / scale)], -np.inf, 0.0)
        if g > 1:
            chunks, rest = divmod(int(inst.n[i]), g)
            row([(i, 1.0), (3 * L + i, -float(g)), (4 * L + i, -float(rest))], 0.0, 0.0)  # k_i = g u_i + r_i f_i
            row([(4 * L + i, float(chunks)), (3 * L + i, -1.0)], -np.inf, 0.0)  # f_i only when u_i = n_i // g
    top = np.array([p[-1] for p in inst.prefix]) / scale
    upper = [inst.n.astype(float), np.ones(L), top]
    if g > 1:
        upper += [(inst.n // g).astype(float), (inst.n % g > 0).astype(float)]
    bounds = Bounds(np.zeros(n_vars), np.concatenate(upper))
    c = np.concatenate([np.zeros(2 * L), -np.ones(L), np.zeros(n_vars - 3 * L)])
    integrality = np.concatenate([np.ones(2 * L), np.zeros(L), np.ones(n_vars - 3 * L)])
    return milp(c, integrality=integrality, bounds=bounds, constraints=rows.constraint(n_vars),
                options={"mip_rel_gap": gap, "time_limit": max(time_limit, 0.5), "disp": False})
