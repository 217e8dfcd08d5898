"""The three-tier MILP (GPU, memory, disk) against an exhaustive search over every neuron's tier."""
import itertools

import numpy as np
import pytest

from powerinfer_tools.stages.placement.placement_solver import Instance
from powerinfer_tools.stages.placement.placement_solver import solve as solve_gpu
from powerinfer_tools.stages.placement.tier_solver import TierInstance, solve


def exhaustive_optimum(inst: TierInstance) -> float:
    """Best saving over every assignment of every neuron to GPU, memory or disk (not only hottest-first runs):
    per layer all 3^n assignments, merged layer by layer over (VRAM bytes, memory bytes)."""
    g = inst.gpu
    best = {(0, 0): 0.0}
    for i, c in enumerate(g.counts):
        options = {}
        for tiers in itertools.product((0, 1, 2), repeat=len(c)):  # 0 GPU, 1 memory, 2 disk
            t = np.array(tiers, dtype=np.int64)
            k, r = int(np.sum(t == 0)), int(np.sum(t == 1))
            if 0 < k < g.min_neurons[i]:
                continue
            vram = k * int(g.neuron_bytes[i]) + (int(g.layer_bytes[i]) if k else 0)
            mem = r * int(inst.memory_bytes[i])
            value = (inst.gpu_gain[i] + inst.disk_gain[i]) * c[t == 0].sum() + inst.disk_gain[i] * c[t == 1].sum()
            options[(vram, mem)] = max(options.get((vram, mem), -1.0), float(value))
        merged = {}
        for (v0, m0), x0 in best.items():
            for (v1, m1), x1 in options.items():
                v, m = v0 + v1, m0 + m1
                if v <= g.capacity and m <= inst.memory_capacity:
                    merged[(v, m)] = max(merged.get((v, m), -1.0), x0 + x1)
        best = merged
    return max(best.values())


def random_instance(rng, max_layers=3, max_neurons=4, vram=None, memory=None):
    L = int(rng.integers(1, max_layers + 1))
    n = rng.integers(1, max_neurons + 1, size=L)
    counts = [rng.integers(0, 30, size=k) for k in n]
    neuron_bytes = rng.integers(1, 6, size=L)
    layer_bytes = rng.integers(0, 8, size=L)
    mins = rng.integers(0, 4, size=L)
    memory_bytes = rng.integers(1, 6, size=L)
    vram_total = int(np.sum(neuron_bytes * n + layer_bytes))
    memory_total = int(np.sum(memory_bytes * n))
    gpu = Instance(counts, neuron_bytes, layer_bytes, mins,
                   int(rng.integers(0, vram_total + 3)) if vram is None else vram)
    return TierInstance(gpu, memory_bytes, int(rng.integers(0, memory_total + 3)) if memory is None else memory,
                        rng.uniform(0.0, 2.0, size=L), rng.uniform(0.0, 5.0, size=L))


def test_milp_equals_exhaustive_search_on_small_random_instances():
    rng = np.random.default_rng(67)
    for _ in range(120):
        inst = random_instance(rng)
        sol = solve(inst)
        assert inst.feasible(sol.k, sol.s)
        assert sol.value == pytest.approx(exhaustive_optimum(inst), rel=1e-6, abs=1e-9)
        assert sol.upper_bound >= sol.value - 1e-9


def test_no_vram_is_the_memory_disk_split_hottest_first():
    """--vram-budget 0: nothing on the GPU; at equal bytes per neuron the memory share is the globally hottest
    neurons (the disk tier's frequency rule), whatever the gains."""
    rng = np.random.default_rng(5)
    for _ in range(40):
        base = random_instance(rng, max_layers=4, max_neurons=8, vram=0)
        L = base.n_layer
        inst = TierInstance(base.gpu, np.full(L, 3), 3 * int(rng.integers(0, 12)), base.gpu_gain, np.full(L, 1.5))
        sol = solve(inst)
        assert np.all(sol.k == 0)
        assert sol.value == pytest.approx(exhaustive_optimum(inst), rel=1e-6, abs=1e-9)
        everything = np.sort(np.concatenate(inst.gpu.counts))[::-1]
        held = int(inst.memory_capacity // 3)
        assert sol.value == pytest.approx(1.5 * everything[:held].sum(), rel=1e-9, abs=1e-9)


def test_unlimited_memory_is_the_gpu_plan():
    """Memory for every neuron: the GPU counts serve as much as placement_solver's plan, nothing is on disk."""
    rng = np.random.default_rng(11)
    for _ in range(40):
        base = random_instance(rng, max_layers=4, max_neurons=10)
        inst = TierInstance(base.gpu, base.memory_bytes, int(np.sum(base.memory_bytes * base.gpu.n)),
                            np.full(base.n_layer, 1.0), base.disk_gain)
        sol = solve(inst)
        assert np.array_equal(sol.s, inst.gpu.n)
        assert inst.gpu.value(sol.k) == pytest.approx(solve_gpu(inst.gpu).value, abs=1e-9)


def test_budgets_respected_on_larger_instances():
    rng = np.random.default_rng(3)
    for _ in range(10):
        L = 12
        counts = [rng.binomial(1000, np.minimum(0.01 * (np.arange(1, 301) / 300.0) ** -0.9, 1.0)) for _ in range(L)]
        gpu = Instance(counts, np.full(L, 7), rng.integers(0, 50, L), rng.integers(0, 40, L), int(rng.integers(0, 12000)))
        inst = TierInstance(gpu, np.full(L, 8), int(rng.integers(0, 20000)), rng.uniform(0.1, 1, L), rng.uniform(1, 9, L))
        sol = solve(inst)
        assert inst.feasible(sol.k, sol.s)
        assert gpu.bytes_used(sol.k) <= gpu.capacity and inst.memory_used(sol.k, sol.s) <= inst.memory_capacity
        assert sol.value >= sol.upper_bound * (1 - 1e-5)


def apart(inst: TierInstance) -> float:
    """The tiers chosen apart: the VRAM-only plan's GPU counts, then memory by the frequency rule (the most frequent
    of the rest, all layers together; optimal for memory alone at equal bytes and gains)."""
    k = solve_gpu(inst.gpu).k
    rest = np.concatenate([np.sort(c)[::-1][j:] for c, j in zip(inst.gpu.counts, k)])
    layer = np.concatenate([np.full(len(c) - j, i) for i, (c, j) in enumerate(zip(inst.gpu.counts, k))])
    held = np.argsort(-rest, kind="stable")[:inst.memory_capacity // int(inst.memory_bytes[0])]
    s = k + np.bincount(layer[held], minlength=inst.n_layer)
    return inst.value(k, s)


def test_one_program_is_never_below_the_tiers_chosen_apart_and_beats_them_somewhere():
    """Per-layer VRAM charges and minimums against a memory shortfall: the GPU plan that serves the most activations
    is not always the one that leaves memory the least costly rest."""
    rng = np.random.default_rng(8)
    wins = 0
    for _ in range(60):
        L = int(rng.integers(2, 6))
        counts = [rng.binomial(500, np.minimum(0.02 * (np.arange(1, 41) / 40.0) ** -rng.uniform(0.3, 1.5), 1.0))
                  for _ in range(L)]
        gpu = Instance(counts, np.full(L, 2), rng.integers(0, 40, L), rng.integers(0, 10, L), int(rng.integers(10, 120)))
        inst = TierInstance(gpu, np.full(L, 3), 3 * int(rng.integers(0, 30 * L)), np.full(L, 1.0), np.full(L, 4.0))
        joint, separate = solve(inst).value, apart(inst)
        assert joint >= separate - 1e-9
        wins += joint > separate + 1e-9
    assert wins > 0
