"""The placement MILP against an exhaustive search over neuron subsets, and against greedy."""
import numpy as np
import pytest

from powerinfer_tools.stages.placement.placement_solver import Instance, greedy, solve


def exhaustive_optimum(inst: Instance, min_neurons=None, granularity: int = 1) -> float:
    """Best value over every subset of every layer's neurons (not only hottest-first prefixes) whose size is 0,
    or at least the layer's minimum and a multiple of `granularity` or the whole layer."""
    best_by_bytes = {0: 0.0}  # total bytes -> best value, merged layer by layer
    mins = inst.min_neurons if min_neurons is None else min_neurons
    for i, c in enumerate(inst.counts):
        n = len(c)
        masks = np.arange(2**n)
        bits = (masks[:, None] >> np.arange(n)) & 1
        size = bits.sum(1)
        ok = (size == 0) | ((size >= mins[i]) & ((size % granularity == 0) | (size == n)))
        value = bits @ c
        cost = size * inst.neuron_bytes[i] + np.where(size > 0, inst.layer_bytes[i], 0)
        options = {}
        for v, b in zip(value[ok], cost[ok]):
            options[int(b)] = max(options.get(int(b), -1.0), float(v))
        merged = {}
        for b0, v0 in best_by_bytes.items():
            for b1, v1 in options.items():
                if b0 + b1 <= inst.capacity:
                    merged[b0 + b1] = max(merged.get(b0 + b1, -1.0), v0 + v1)
        best_by_bytes = merged
    return max(best_by_bytes.values())


def random_instance(rng, max_layers=3, max_neurons=6, max_count=30):
    L = int(rng.integers(1, max_layers + 1))
    n = rng.integers(1, max_neurons + 1, size=L)
    counts = [rng.integers(0, max_count, size=k) for k in n]
    neuron_bytes = rng.integers(1, 9, size=L)
    layer_bytes = rng.integers(0, 12, size=L)
    min_neurons = rng.integers(0, 5, size=L)
    total = int(np.sum(neuron_bytes * n + layer_bytes))
    return Instance(counts, neuron_bytes, layer_bytes, min_neurons, int(rng.integers(0, total + 4)))


def test_milp_equals_exhaustive_search_on_small_random_instances():
    rng = np.random.default_rng(1234)
    solved_by_milp = 0
    for _ in range(150):
        inst = random_instance(rng)
        sol = solve(inst)
        assert inst.feasible(sol.k)
        assert sol.value == pytest.approx(exhaustive_optimum(inst), abs=1e-9)
        solved_by_milp += sol.method == "milp"
    assert solved_by_milp > 50  # the trivial shortcuts (all fits / nothing fits) do not carry the test


def test_granularity_equals_exhaustive_search_on_small_random_instances():
    """Counts in multiples of g or the whole layer (PowerInfer's CUDA kernels: 32, or 256 for q4_0), scaled down."""
    rng = np.random.default_rng(99)
    solved_by_milp = 0
    for _ in range(120):
        g = int(rng.integers(2, 5))
        base = random_instance(rng, max_neurons=10)
        asked = rng.integers(0, 5, size=base.n_layer)
        inst = Instance(base.counts, base.neuron_bytes, base.layer_bytes, asked, base.capacity, granularity=g)
        mins = np.minimum(np.maximum(asked, 1), inst.n)  # a minimum above the width: all or nothing
        sol = solve(inst)
        k = sol.k
        assert inst.bytes_used(k) <= inst.capacity
        assert np.all((k == 0) | ((k >= mins) & ((k % g == 0) | (k == inst.n)))), (k, g, mins, inst.n)
        assert sol.value == pytest.approx(exhaustive_optimum(inst, mins, g), abs=1e-9)
        base_k = greedy(inst).k
        assert inst.feasible(base_k) and inst.bytes_used(base_k) <= inst.capacity
        solved_by_milp += sol.method == "milp"
    assert solved_by_milp > 40


def test_never_below_greedy_and_always_within_budget_and_minimum():
    rng = np.random.default_rng(7)
    strictly_better = 0
    for _ in range(12):
        L = int(rng.integers(3, 9))
        n = rng.integers(50, 400, size=L)
        counts = [np.floor(rng.pareto(1.2, size=k) * 50) for k in n]
        inst = Instance(counts, rng.integers(100, 3000, size=L), rng.integers(0, 200_000, size=L),
                        rng.integers(0, 60, size=L), int(rng.integers(1, int(np.sum(n) * 1500))))
        sol, base = solve(inst), greedy(inst)
        for k in (sol.k, base.k):
            assert inst.bytes_used(k) <= inst.capacity
            assert np.all((k == 0) | ((k >= inst.min_neurons) & (k <= inst.n)))
        assert sol.value >= base.value
        assert sol.value <= sol.details.get("upper_bound", sol.value) + 1e-6
        strictly_better += sol.value > base.value
    assert strictly_better > 0  # instances where the fixed charges and minimums defeat greedy


def test_edge_budgets():
    counts = [np.array([5, 1, 3]), np.array([2, 2])]
    everything = Instance(counts, [2, 3], [1, 1], [0, 0], 2 * 3 + 3 * 2 + 2)
    assert solve(everything).k.tolist() == [3, 2]
    nothing = Instance(counts, [2, 3], [1, 1], [0, 0], 0)
    assert solve(nothing).k.tolist() == [0, 0]
    # a minimum of 2: one byte buys a single neuron of layer 0, which is not allowed; two bytes buy its pair
    assert solve(Instance(counts, [1, 2], [0, 0], [2, 2], 1)).k.tolist() == [0, 0]
    assert solve(Instance(counts, [1, 2], [0, 0], [2, 2], 2)).k.tolist() == [2, 0]


def test_minimum_above_width_means_whole_layer_or_nothing():
    inst = Instance([np.array([4, 4, 4])], [1], [0], [10], 2)
    assert inst.min_neurons.tolist() == [3]
    assert solve(inst).k.tolist() == [0]
    assert solve(Instance([np.array([4, 4, 4])], [1], [0], [10], 3)).k.tolist() == [3]
