"""Experts across memory and disk: per layer, how many of its hottest experts are pinned in memory and how many cache
slots its other experts share, by one integer program over the misses measured on the profile's own trace
(docs/placement.md, "Three tiers").

The misses. A layer's pinned experts never miss; the others go through its cache. The engine's cache is a CLOCK,
which approximates LRU, and an LRU's misses for every cache size at once follow from stack distances (Mattson et
al. 1970, as the expert profile's LRU hit rate): a selection hits an LRU of C experts exactly where fewer than C
distinct other experts were chosen since the layer last chose it. With the P hottest pinned, only the unpinned
others count towards that distance, so one pass over the trace gives misses[P, C] for every P and C: for each
selection, the distinct experts chosen since, counted by rank. The trace is used, not the profile's reuse-distance
histogram, because pinning changes every distance and the histogram cannot say by how much.

Which experts are hottest is learned on the trace's first half and the misses counted on its second (the cache
warm from the first): a hot set chosen on the very tokens it is scored on looks better than it is (near-uniform
routing would pin its luckiest experts). And a layer pins only where that beats its all-cache option at the same
number of slots by more than chance: two standard deviations of the difference of the two counts of misses (each
taken as Poisson). Near-uniform routing thus keeps "no pins, all cache"; a skewed layer pins its hot experts.

The program. Every slot costs the same bytes, so a layer's options are its slot totals n (pinned + cached), each
at its best split; the plan picks one option per layer within the room's slots, minimising the misses: a
multiple-choice knapsack, solved exactly by HiGHS (scipy.optimize.milp). A layer's cache holds at least one
token's experts of those it does not pin (the engine reads a step's experts into its cache).

A device (--vram-budget) is chosen first, by the same kind of program: each layer's option is how many of its most
selected experts (by the trace's first half, as the pins) go to the device, worth the selections they serve and
costing their device bytes, one option per layer within the bytes the engine's placement leaves for experts
(device_choice). The device's experts then never reach the cache, as pinned ones: the memory program above runs on
each layer's other experts (its misses[d + P, C], d the layer's device experts).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from powerinfer_tools.stages.placement.placement_solver import Rows, stopped_in_time

CHANCE_SIGMAS = 2.0  # a pinned split must beat the all-cache one by this many standard deviations


def selection_counts(trace: np.ndarray, n_expert: int) -> np.ndarray:
    """[L, E] how often each layer's experts are selected in `trace` ([T, L, k])."""
    return np.stack([np.bincount(trace[:, il].ravel(), minlength=n_expert) for il in range(trace.shape[1])])


def hottest_first(trace: np.ndarray, n_expert: int) -> np.ndarray:
    """[L, E] each layer's experts by selections in `trace` ([T, L, k]), most selected first (ties: lower id)."""
    return np.argsort(-selection_counts(trace, n_expert), axis=1, kind="stable")


def lru_misses(trace: np.ndarray, order: np.ndarray, n_expert: int, warm: int = 0,
               progress: bool = False) -> np.ndarray:
    """misses[L, P, C] (P, C from 0 to n_expert): the selections of trace[warm:] ([T, L, k], in order) that miss an
    LRU of C experts when each layer's P first experts of `order` ([L, E]) are pinned; trace[:warm] warms the cache."""
    from powerinfer_tools.core.progress import progress_bar

    T, L, k = trace.shape
    E = n_expert
    rank = np.empty_like(order)
    np.put_along_axis(rank, order, np.arange(E)[None, :], axis=1)
    hist = np.zeros((L, E + 1, E + 1), np.int64)  # [layer, P, distance among the unpinned]: E for a first selection
    last = np.full((L, E), -1, np.int64)
    layers, P = np.arange(L), np.arange(E + 1)
    use = 0
    for t in progress_bar(range(T), desc="expert misses", unit="tok", disable=not progress):
        for i in range(k):
            e = trace[t, :, i].astype(np.int64)
            used = last[layers, e]
            since = np.take_along_axis(last > used[:, None], order, axis=1)  # [L, E] by rank: chosen since
            below = np.concatenate([np.zeros((L, 1), np.int64), np.cumsum(since, axis=1)], axis=1)  # [L, P]
            dist = np.where(used[:, None] >= 0, below[:, -1:] - below, E)
            last[layers, e] = use
            use += 1
            if t < warm:
                continue
            r = rank[layers, e]
            li, pi = np.nonzero(P[None, :] <= r[:, None])  # unpinned where P <= its rank
            hist[li, pi, dist[li, pi]] += 1
    return np.cumsum(hist[:, :, ::-1], axis=2)[:, :, ::-1]  # misses at C: distances >= C


@dataclass
class ExpertOptions:
    """One layer's options: slot totals n, each with its pinned count and the misses it leaves."""

    slots: np.ndarray   # int64 [m]: pinned + cached
    pinned: np.ndarray  # int64 [m]
    misses: np.ndarray  # float [m]


def layer_options(misses: np.ndarray, top_k: int, sigmas: float = CHANCE_SIGMAS) -> ExpertOptions:
    """A layer's best split at each slot total (misses[P, C] of lru_misses): the all-cache split unless a pinned
    one has fewer misses by more than `sigmas` standard deviations; a cache below min(top_k, E - P) is not an
    option."""
    E = misses.shape[0] - 1
    totals, pins, miss = [], [], []
    for n in range(E + 1):
        splits = [(p, float(misses[p, n - p])) for p in range(n + 1) if n - p >= min(top_k, E - p)]
        if not splits:
            continue
        cache = dict(splits).get(0)
        p, m = min(splits, key=lambda s: (s[1], s[0]))
        if cache is not None and cache - m <= sigmas * np.sqrt(cache + m):
            p, m = 0, cache
        totals.append(n)
        pins.append(p)
        miss.append(m)
    return ExpertOptions(np.array(totals, np.int64), np.array(pins, np.int64), np.array(miss, np.float64))


@dataclass
class ExpertSolution:
    choice: np.ndarray  # int64 [L]: the option each layer takes
    slots: np.ndarray   # int64 [L]: its slots, pinned + cached
    pinned: np.ndarray  # int64 [L]
    misses: float
    seconds: float
    timed_out: bool


def solve(options: list[ExpertOptions], capacity: int, time_limit: float = 20.0) -> ExpertSolution:
    """The options (one per layer) with the fewest misses whose slots fit `capacity`; None where even the smallest
    do not fit."""
    import time

    from scipy.optimize import Bounds, milp

    start = time.perf_counter()
    offsets = np.concatenate([[0], np.cumsum([len(o.slots) for o in options])]).astype(np.int64)
    n = int(offsets[-1])
    if sum(int(o.slots.min()) for o in options) > capacity:
        return None
    rows = Rows()
    rows.add([(j, float(s)) for o, at in zip(options, offsets) for j, s in enumerate(o.slots, start=at)], -np.inf,
             float(capacity))
    for at, end in zip(offsets[:-1], offsets[1:]):
        rows.add([(j, 1.0) for j in range(at, end)], 1.0, 1.0)  # one option per layer
    cost = np.concatenate([o.misses for o in options])
    scale = max(float(cost.max(initial=0.0)), 1.0)
    res = milp(cost / scale, integrality=np.ones(n), bounds=Bounds(np.zeros(n), np.ones(n)),
               constraints=rows.constraint(n),
               options={"mip_rel_gap": 0.0, "time_limit": max(time_limit, 0.5), "disp": False})
    timed_out = stopped_in_time(res, "expert")
    x = np.round(res.x).astype(np.int64)
    choice = np.array([int(np.argmax(x[at:end])) for at, end in zip(offsets[:-1], offsets[1:])], np.int64)
    return ExpertSolution(choice, np.array([o.slots[c] for o, c in zip(options, choice)], np.int64),
                          np.array([o.pinned[c] for o, c in zip(options, choice)], np.int64),
                          float(sum(o.misses[c] for o, c in zip(options, choice))), time.perf_counter() - start,
                          timed_out)


@dataclass
class DeviceSolution:
    counts: np.ndarray  # int64 [L]: each layer's experts on the device, its most selected first
    served: float       # the selections they serve
    seconds: float
    timed_out: bool


def device_choice(selections: np.ndarray, expert_bytes: np.ndarray, capacity: float,
                  time_limit: float = 20.0) -> DeviceSolution:
    """How many of each layer's most selected experts go to the device: the counts serving the most selections
    (selections: [L, E], each layer's sorted most first) whose bytes (expert_bytes: [L], one of the layer's experts)
    fit `capacity`; a multiple-choice knapsack (one count per layer), solved exactly by HiGHS, then the room it
    leaves filled with the next most selected experts while one fits."""
    import time

    from scipy.optimize import Bounds, milp

    start = time.perf_counter()
    L, E = selections.shape
    served = np.concatenate([np.zeros((L, 1)), np.cumsum(selections, axis=1, dtype=np.float64)], axis=1)
    most = [int(min(E, max(capacity, 0.0) // max(float(b), 1.0))) for b in expert_bytes]  # per layer, alone
    offsets = np.concatenate([[0], np.cumsum([m + 1 for m in most])]).astype(np.int64)
    n = int(offsets[-1])
    rows = Rows()
    rows.add([(int(at) + d, float(d * expert_bytes[il])) for il, at in enumerate(offsets[:-1])
              for d in range(most[il] + 1)], -np.inf, float(max(capacity, 0.0)))
    for at, end in zip(offsets[:-1], offsets[1:]):
        rows.add([(j, 1.0) for j in range(at, end)], 1.0, 1.0)  # one count per layer
    value = np.concatenate([served[il, :most[il] + 1] for il in range(L)])
    scale = max(float(value.max(initial=0.0)), 1.0)
    res = milp(-value / scale, integrality=np.ones(n), bounds=Bounds(np.zeros(n), np.ones(n)),
               constraints=rows.constraint(n),
               options={"mip_rel_gap": 0.0, "time_limit": max(time_limit, 0.5), "disp": False})
    timed_out = stopped_in_time(res, "device expert")
    x = np.round(res.x).astype(np.int64)
    counts = np.array([int(np.argmax(x[at:end])) for at, end in zip(offsets[:-1], offsets[1:])], np.int64)
    # what the optimum leaves (its experts of no selections are worth nothing to it): the next most selected of all
    # layers while one fits, so that a room holding every expert gets every expert
    left = float(max(capacity, 0.0)) - float(np.dot(counts, expert_bytes))
    while True:
        fits = [il for il in range(L) if counts[il] < E and expert_bytes[il] <= left]
        if not fits:
            break
        il = max(fits, key=lambda i: (selections[i, counts[i]], -i))
        left -= float(expert_bytes[il])
        counts[il] += 1
    return DeviceSolution(counts, float(sum(served[il, d] for il, d in enumerate(counts))),
                          time.perf_counter() - start, timed_out)
