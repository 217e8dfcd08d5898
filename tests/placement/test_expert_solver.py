"""Experts across memory and disk (stages/placement/expert_solver.py): the misses of every (pinned, cache) split
against a plain LRU simulated split by split, the multiple-choice knapsack against exhaustive search, and what the
plan makes of near-uniform and of skewed routing."""
import itertools
from collections import OrderedDict

import numpy as np
import pytest

from powerinfer_tools.stages.placement import expert_solver as es


def simulated_misses(trace, pinned: set, slots: int, warm: int) -> int:
    """One layer's trace ([T, k]) through an LRU of `slots` experts beside the `pinned` ones, one selection at a
    time; the misses after `warm` tokens."""
    cache, misses = OrderedDict(), 0
    for t, token in enumerate(trace):
        for e in token.tolist():
            if e in pinned:
                continue
            if e in cache:
                cache.move_to_end(e)
            else:
                misses += t >= warm
                if slots:
                    cache[e] = True
                    if len(cache) > slots:
                        cache.popitem(last=False)
    return misses


def routed(rng, tokens, n_layer, n_expert, top_k, weights):
    """[tokens, n_layer, top_k] distinct experts per token and layer, drawn by `weights` ([n_layer, n_expert])."""
    return np.stack([np.stack([rng.choice(n_expert, top_k, replace=False, p=w / w.sum()) for w in weights])
                     for _ in range(tokens)]).astype(np.int16)


def test_misses_of_every_split_equal_an_lru_simulated_split_by_split():
    rng = np.random.default_rng(67)
    for _ in range(6):
        E, k, L, T = int(rng.integers(3, 9)), int(rng.integers(1, 3)), 2, int(rng.integers(5, 40))
        trace = routed(rng, T, L, E, k, rng.uniform(0.05, 1.0, (L, E)) ** 3)
        order = np.stack([rng.permutation(E) for _ in range(L)])
        warm = int(rng.integers(0, T))
        misses = es.lru_misses(trace, order, E, warm)
        for il in range(L):
            for p in range(E + 1):
                for c in range(E + 1):
                    want = simulated_misses(trace[:, il], set(order[il, :p].tolist()), c, warm)
                    assert misses[il, p, c] == want, (il, p, c)


def exhaustive(options, capacity):
    best = None
    for choice in itertools.product(*(range(len(o.slots)) for o in options)):
        if sum(int(o.slots[c]) for o, c in zip(options, choice)) <= capacity:
            m = sum(float(o.misses[c]) for o, c in zip(options, choice))
            best = m if best is None else min(best, m)
    return best


def random_options(rng, n_expert, top_k):
    """A layer's options from a made-up misses table, decreasing in slots as real ones are."""
    m = np.sort(rng.uniform(0, 100, (n_expert + 1, n_expert + 1)), axis=1)[:, ::-1].copy()
    return es.layer_options(m, top_k, sigmas=float(rng.choice([0.0, 2.0])))


def test_the_knapsack_equals_exhaustive_search_on_small_random_instances():
    rng = np.random.default_rng(5)
    for _ in range(80):
        L, E, k = int(rng.integers(1, 4)), int(rng.integers(2, 7)), int(rng.integers(1, 3))
        options = [random_options(rng, E, k) for _ in range(L)]
        capacity = int(rng.integers(0, L * E + 2))
        sol, want = es.solve(options, capacity), exhaustive(options, capacity)
        if want is None:
            assert sol is None
            continue
        assert sol.slots.sum() <= capacity
        assert sol.misses == pytest.approx(want, abs=1e-9)


def plan_for(trace, n_expert, top_k, capacity):
    """The solution and each layer's pinned experts, hottest first on the trace's first half."""
    half = len(trace) // 2
    order = es.hottest_first(trace[:half], n_expert)
    sol = es.solve([es.layer_options(m, top_k) for m in es.lru_misses(trace, order, n_expert, half)], capacity)
    return sol, [set(o[:p].tolist()) for o, p in zip(order, sol.pinned)]


def test_uniform_routing_pins_nothing_and_skewed_routing_pins_its_hot_experts():
    """Near-uniform routing: an LRU holds as much as any fixed set, and a set picked on the first half is no better
    on the second: no pins. Routing where three experts each come every few tokens, with cold ones between enough
    to push them out of a small LRU: those three are pinned."""
    rng = np.random.default_rng(8)
    E, k, L, T = 32, 2, 3, 800
    for capacity in (L * 6, L * 10, L * E):
        uniform, _ = plan_for(routed(rng, T, L, E, k, np.ones((L, E))), E, k, capacity)
        assert np.all(uniform.pinned == 0) and uniform.slots.sum() <= capacity
    hot = np.ones((L, E))
    hot[:, [3, 17, 29]] = 6.0  # each layer's three hot experts
    _, pinned = plan_for(routed(rng, T, L, E, k, hot), E, k, L * 6)
    assert all(p >= {3, 17, 29} for p in pinned)


def test_the_device_choice_equals_exhaustive_search_on_small_random_instances():
    """Each layer's count of its most selected experts on the device: the program's counts serve as many selections
    as the best of every count vector whose bytes fit, layers of different expert bytes included, and leave no room
    for one more expert; nothing fits a capacity below every expert, and everything where all fit."""
    rng = np.random.default_rng(5)
    for _ in range(40):
        n_layer, n_expert = int(rng.integers(1, 4)), int(rng.integers(1, 5))
        sel = -np.sort(-rng.integers(0, 50, (n_layer, n_expert)), axis=1)  # each layer's, most selected first
        cost = rng.integers(1, 6, n_layer).astype(float)
        capacity = float(rng.integers(0, int(cost.sum() * n_expert) + 2))
        best = max(sum(int(sel[il, :d].sum()) for il, d in enumerate(ds))
                   for ds in itertools.product(range(n_expert + 1), repeat=n_layer)
                   if sum(d * c for d, c in zip(ds, cost)) <= capacity)
        sol = es.device_choice(sel, cost, capacity)
        left = capacity - float(np.dot(sol.counts, cost))
        assert left >= 0 and all(d == n_expert or c > left for d, c in zip(sol.counts, cost))  # nothing more fits
        assert sol.served == best == sum(int(sel[il, :d].sum()) for il, d in enumerate(sol.counts))
    sel = np.array([[5, 3, 1], [4, 4, 0]])
    assert es.device_choice(sel, np.array([2.0, 2.0]), 1.9).counts.tolist() == [0, 0]
    assert es.device_choice(sel, np.array([2.0, 2.0]), 12.0).counts.tolist() == [3, 3]
    # two experts' room: the two most selected of all layers (5 and one 4), not a layer's top two (5 and 3)
    assert sorted(es.device_choice(sel, np.array([2.0, 2.0]), 4.0).counts.tolist()) == [1, 1]
