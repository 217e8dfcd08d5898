"""The expert tier (model/expert_tier.h, docs/engine.md "The expert tier", issue 67 item 4): a mixture of experts under a
memory budget reads its experts from the model file into a cache of whole experts. Tiny random Qwen3-MoE and Mixtral
files at f32, q8_0 and q4_0, under budgets whose caches hold one token's experts of a layer, half the experts, and all
of them: a prompt's batch and decode steps give the in-memory run's bits; the lookahead changes no bit; the counters
say what was read; what the tier cannot hold or read is refused in one line."""
from __future__ import annotations

import numpy as np
import pytest
from cli_helpers import assert_one_line_error, run_cli
from engine_helpers import engine_prompt_then_decode
from test_moe import family, profiled_copy, tokens_for  # noqa: F401 (family: the module's fixture)
from tiny_models import N_EXPERT

import powerinfer_engine as engine

N_PROMPT, N_DECODE = 40, 24
HUGE_GIB = 4.0  # a budget past every tiny model's experts: the tier holds them all


def tier_shape(path, **kwargs) -> tuple[int, int, int]:
    """(fixed bytes, bytes of a slot, layers) of the tier at `path`, from its stats under a budget holding all."""
    with engine.Model(path, threads=2, ctx_size=256, memory_budget=HUGE_GIB, **kwargs) as m:
        d = m.stats()["disk"]
        n_layer = m.info["n_layer"]
    assert d["kind"] == "experts" and d["slots"] == n_layer * N_EXPERT
    return d["fixed_bytes"], d["slot_bytes"], n_layer


def run_tier(path, tokens, slots: int | None, **kwargs):
    """Logits of every position (a batch, then decode steps) and the stats, with a cache of `slots` experts (None: no
    budget, everything in memory)."""
    budget = {}
    if slots is not None:
        fixed, slot, _ = tier_shape(path)
        budget = {"memory_budget": (fixed + slots * slot + slot // 2) / 2**30}
    with engine.Model(path, threads=2, ctx_size=256, **budget, **kwargs) as m:
        logits = engine_prompt_then_decode(m, tokens, N_PROMPT)
        return logits, m.stats()


@pytest.mark.parametrize("outtype", ["f32", "q8_0", "q4_0"])
@pytest.mark.parametrize("kind", ["qwen3-moe", "mixtral"])
def test_experts_from_disk_give_the_in_memory_bits(kind, outtype, family):
    """Each expert read from the file is packed into its slot as the load packs it in memory, and computed by the same
    kernels as it arrives: the same bits as everything in memory, for a cache of one token's experts of a layer (a
    batch's layer wants more than it holds: read in waves), half the experts and all of them."""
    src, path, _ = family(kind, outtype)
    tokens = tokens_for(src, N_PROMPT + N_DECODE)
    ref, ref_stats = run_tier(path, tokens, None)
    assert ref_stats["disk"] is None
    _, _, n_layer = tier_shape(path)
    k = {"qwen3-moe": 4, "mixtral": 2}[kind]
    for slots in (k, n_layer * N_EXPERT // 2, n_layer * N_EXPERT):
        logits, stats = run_tier(path, tokens, slots)
        np.testing.assert_array_equal(logits, ref, err_msg=f"{slots} slots")
        d = stats["disk"]
        assert d["slots"] == slots and d["tokens"] == N_DECODE
        assert d["cache_hits"] + d["cache_misses"] == N_DECODE * n_layer * k  # a step's experts, each once
        if slots == k:  # a layer's experts evict the last layer's: every step reads
            assert d["cache_misses"] >= N_DECODE * (n_layer - 1) and d["bytes"] > 0 and d["reads"] > 0
        if slots == n_layer * N_EXPERT:  # the prompt read every expert its tokens chose; decode reads what is left
            assert d["cache_hits"] > d["cache_misses"]


@pytest.mark.parametrize("kind", ["qwen3-moe", "mixtral"])
def test_the_lookahead_reads_ahead_and_changes_no_bit(kind, family):
    """The next layer's router on this layer's input names the experts to read ahead: with and without it the same bits;
    with it, experts are read ahead and some of those are then used; without it none is read ahead."""
    src, path, _ = family(kind, "q8_0")
    tokens = tokens_for(src, N_PROMPT + N_DECODE)
    k = {"qwen3-moe": 4, "mixtral": 2}[kind]
    on, on_stats = run_tier(path, tokens, 2 * k, expert_lookahead=True)
    off, off_stats = run_tier(path, tokens, 2 * k)  # the default
    np.testing.assert_array_equal(on, off)
    assert off_stats["disk"]["prefetched"] == 0 and off_stats["disk"]["prefetch_used"] == 0
    d = on_stats["disk"]
    assert d["prefetched"] > 0 and 0 < d["prefetch_used"] <= d["prefetched"]
    assert d["cache_hits"] + d["cache_misses"] == off_stats["disk"]["cache_hits"] + off_stats["disk"]["cache_misses"]


def test_what_the_tier_cannot_hold_or_read_is_refused_in_one_line(family, capsys):
    """A budget below what the engine must hold and one token's experts of a layer; ReLU experts (their down is
    transposed at load, a copy): each refused in one line, no crash; the CLI's --memory-budget runs a mixture."""
    src, path, _ = family("qwen3-moe", "q8_0")
    fixed, slot, _ = tier_shape(path)
    with pytest.raises(engine.EngineError) as exc:
        engine.Model(path, threads=2, ctx_size=256, memory_budget=(fixed + 3 * slot) / 2**30)
    msg = str(exc.value)
    assert len(msg.splitlines()) == 1 and "a token's 4 experts of a layer" in msg, msg
    _, relu, _ = family("mixtral-relu", "q8_0")
    with pytest.raises(engine.EngineError) as exc:
        engine.Model(relu, threads=2, ctx_size=256, memory_budget=HUGE_GIB)
    assert len(str(exc.value).splitlines()) == 1 and "ReLU experts' down projection is transposed" in str(exc.value)
    code, out, err = run_cli(capsys, "run", "-m", path, "-p", "To be", "-n", "4", "--memory-budget", str(HUGE_GIB))
    assert code == 0, err
    code, _, err = run_cli(capsys, "run", "-m", relu, "-p", "To be", "-n", "2", "--memory-budget", "1")
    assert_one_line_error(code, err, "ReLU experts' down projection is transposed")


def planned_copy(path, tmp_path, pinned: list[list[int]], cached: list[int]):
    """The model copied beside a plan of its own (the family's file is shared), pinning pinned[layer] and caching
    cached[layer] experts; the budget that holds them."""
    import shutil

    from powerinfer_tools.formats import tier_plan

    fixed, slot, n_layer = tier_shape(path)
    model = tmp_path / path.name
    shutil.copy(path, model)
    with engine.Model(model, threads=2, ctx_size=256) as m:
        n_ff = m.info["n_ff"]
    experts = tier_plan.ExpertCounts(N_EXPERT, cached, tuple(pinned))
    tier_plan.write(tier_plan.TierCounts(n_ff, np.zeros(n_layer), np.zeros(n_layer), experts=experts),
                    tier_plan.path_for(model))
    return model, (fixed + (sum(map(len, pinned)) + sum(cached)) * slot + slot // 2) / 2**30


def decode_with_trace(model, tokens, budget, **kwargs):
    """Logits (a batch, then decode steps), the stats, and the experts each decode step chose [steps, layer, k]."""
    with engine.Model(model, threads=2, ctx_size=256, memory_budget=budget, **kwargs) as m:
        m.set_expert_trace(True)
        rows, chosen = [m.eval(tokens[:N_PROMPT])], []
        for t in tokens[N_PROMPT:]:
            rows.append(m.eval([t])[None, 0])
            chosen.append(m.expert_choices(1)[0])
        return np.concatenate(rows), m.stats(), np.stack(chosen)


@pytest.mark.parametrize("kind", ["qwen3-moe", "mixtral"])
def test_a_plan_pins_its_experts_for_good_and_sizes_each_layers_cache(kind, family, tmp_path):
    """MODEL.tiers' expert section (pi-tools plan --memory-budget writes it): each layer's pinned experts are read at
    open and never again (every decode choice of one is a pinned hit, no byte read for it), the others share the
    layer's own cache of the planned size; the in-memory bits. With every expert pinned nothing is read at all."""
    src, path, _ = family(kind, "q8_0")
    tokens = tokens_for(src, N_PROMPT + N_DECODE)
    ref, _ = run_tier(path, tokens, None)
    _, _, n_layer = tier_shape(path)
    k = {"qwen3-moe": 4, "mixtral": 2}[kind]
    rng = np.random.default_rng(3)
    pinned = [sorted(rng.choice(N_EXPERT, 2, replace=False).tolist()) for _ in range(n_layer)]
    model, budget = planned_copy(path, tmp_path, pinned, [k] * n_layer)
    logits, stats, chosen = decode_with_trace(model, tokens, budget)
    np.testing.assert_array_equal(logits, ref)
    d = stats["disk"]
    assert d["tier_plan"] and d["pinned"] == 2 * n_layer and d["slots"] == (2 + k) * n_layer
    hits_on_pinned = sum(int(np.isin(chosen[:, il], pinned[il]).sum()) for il in range(n_layer))
    assert hits_on_pinned > 0 and d["pinned_hits"] == hits_on_pinned
    assert d["cache_hits"] + d["cache_misses"] == N_DECODE * n_layer * k
    assert d["cache_misses"] <= N_DECODE * n_layer * k - hits_on_pinned
    assert d["reads"] == 3 * d["cache_misses"]  # each miss its three runs, no read of a pinned expert

    everything = [list(range(N_EXPERT))] * n_layer
    model, budget = planned_copy(path, tmp_path, everything, [0] * n_layer)
    logits, stats, _ = decode_with_trace(model, tokens, budget)
    np.testing.assert_array_equal(logits, ref)
    d = stats["disk"]
    assert d["pinned_hits"] == d["cache_hits"] == N_DECODE * n_layer * k
    assert d["cache_misses"] == d["reads"] == d["bytes"] == 0


def test_a_plan_the_tier_cannot_follow_is_refused_in_one_line(family, tmp_path):
    """A plan beyond the budget, a layer's cache below a token's experts, an expert id past the layer's, another
    model's expert count: each refused in one line. A version 1 plan (no expert section) is still read: one cache."""
    import struct

    from powerinfer_tools.formats import neuron_bundles, tier_plan

    _, path, _ = family("qwen3-moe", "q8_0")
    _, _, n_layer = tier_shape(path)
    model, budget = planned_copy(path, tmp_path, [[0, 1]] * n_layer, [4] * n_layer)
    fixed, slot, _ = tier_shape(path)
    with pytest.raises(engine.EngineError, match="plan again at this budget") as exc:
        engine.Model(model, threads=2, ctx_size=256, memory_budget=(fixed + 5 * slot) / 2**30)
    assert "\n" not in str(exc.value)
    plan_path = tier_plan.path_for(model)
    good = plan_path.read_bytes()
    with engine.Model(model, threads=2, ctx_size=256) as m:
        n_ff = m.info["n_ff"]

    def raw(n_expert, table, ids, version=2):
        body = tier_plan.HEADER.pack(b"PITP", version, n_layer, n_ff, 0, 0) + bytes(8 * n_layer)
        if version == 2:
            body += struct.pack("<I", n_expert) + b"".join(struct.pack("<2I", c, p) for c, p in table)
            body += b"".join(struct.pack("<I", e) for e in ids)
        return body + struct.pack("<Q", neuron_bundles.checksum(body))

    cases = {"fewer than a token's 4": raw(N_EXPERT, [(3, 1)] * n_layer, [0] * n_layer),
             f"pins expert {N_EXPERT}, past its": raw(N_EXPERT, [(4, 1)] * n_layer, [N_EXPERT] * n_layer),
             "pins expert 1 twice": raw(N_EXPERT, [(4, 2)] * n_layer, [1, 1] * n_layer),
             f"made for {N_EXPERT + 1} experts": raw(N_EXPERT + 1, [(4, 0)] * n_layer, []),
             "its size": good[:-12] + good[-8:],
             "damaged": good[:-9] + bytes([good[-9] ^ 1]) + good[-8:]}
    for words, data in cases.items():
        plan_path.write_bytes(data)
        with pytest.raises(engine.EngineError, match=words) as exc:
            engine.Model(model, threads=2, ctx_size=256, memory_budget=budget)
        assert "\n" not in str(exc.value)
        if words != "fewer than a token's 4":  # the format's own checks; the cache's floor is the tier's
            with pytest.raises(Exception, match=words.split(",")[0]):
                tier_plan.read(plan_path, n_layer, n_ff, N_EXPERT)
    plan_path.write_bytes(raw(0, [], [], version=1))
    with engine.Model(model, threads=2, ctx_size=256, memory_budget=budget) as m:
        d = m.stats()["disk"]
    assert not d["tier_plan"] and d["pinned"] == 0


def test_plan_places_a_mixtures_experts_and_the_engine_follows(family, tmp_path, capsys):
    """`pi-tools profile` then `pi-tools plan --memory-budget` on a mixture: MODEL.tiers holds per layer the pinned
    experts and cache slots the program chose within the engine's room at that budget (no more slots than it), the
    engine opened at the budget follows it with the in-memory bits; the dense plan's options are refused (a device's
    experts: tests/arch/test_moe_device.py)."""
    from powerinfer_tools.formats import tier_plan
    from powerinfer_tools.stages.options import DEFAULT_KV_TYPE

    src, path, model = profiled_copy(family, "qwen3-moe", "q8_0", tmp_path, capsys)
    kv = {"kv_type": DEFAULT_KV_TYPE}  # as plan opens the engine (and run)
    fixed, slot, n_layer = tier_shape(model, **kv)
    room = n_layer * N_EXPERT // 2
    budget = (fixed + room * slot + slot // 2) / 2**30
    code, out, err = run_cli(capsys, "plan", "--profile", tmp_path / "prof", "-m", model, "--vram-budget", 0,
                             "--memory-budget", budget, "-c", 256)
    assert code == 0, err
    assert f"room for {room} experts" in out and "expected expert reads a token" in out
    with engine.Model(model, threads=2, ctx_size=256) as m:
        n_ff = m.info["n_ff"]
    plan = tier_plan.read(tier_plan.path_for(model), n_layer, n_ff, N_EXPERT)
    x = plan.experts
    used = int(x.slots.sum()) + sum(len(p) for p in x.pinned)
    assert 4 * n_layer <= used <= room and np.all(x.slots + [len(p) for p in x.pinned] >= 4)
    tokens = tokens_for(src, N_PROMPT + N_DECODE)
    ref, _ = run_tier(path, tokens, None, **kv)
    logits, stats, _ = decode_with_trace(model, tokens, budget, **kv)
    np.testing.assert_array_equal(logits, ref)
    assert stats["disk"]["tier_plan"] and stats["disk"]["slots"] == used
    assert stats["disk"]["pinned"] == sum(len(p) for p in x.pinned)
    # planned again at a smaller budget, with a plan beside the model that pins every expert (which that budget cannot
    # hold): the room is the engine's without the old plan, and the new plan fits
    everything = tier_plan.ExpertCounts(N_EXPERT, [0] * n_layer, tuple([list(range(N_EXPERT))] * n_layer))
    tier_plan.write(tier_plan.TierCounts(n_ff, np.zeros(n_layer), np.zeros(n_layer), experts=everything),
                    tier_plan.path_for(model))
    smaller = (fixed + 5 * n_layer * slot + slot // 2) / 2**30
    code, out, err = run_cli(capsys, "plan", "--profile", tmp_path / "prof", "-m", model, "--vram-budget", 0,
                             "--memory-budget", smaller, "-c", 256)
    assert code == 0, err
    assert f"room for {5 * n_layer} experts" in out
    logits, stats, _ = decode_with_trace(model, tokens, smaller, **kv)
    np.testing.assert_array_equal(logits, ref)
    assert stats["disk"]["tier_plan"] and stats["disk"]["slots"] <= 5 * n_layer
    code, out, err = run_cli(capsys, "run", "-m", model, "-p", "To be", "-n", "4", "--memory-budget", smaller,
                             "-c", 256, "-v")
    assert code == 0, err
    assert "expert tier: " in out + err and "on the plan's pinned experts" in out + err
    for extra, words in ((["--vram-budget", 0], "give --memory-budget"),
                         (["--vram-budget", 0, "--memory-budget", budget, "--granularity", 4],
                          "--granularity applies")):
        code, _, err = run_cli(capsys, "plan", "--profile", tmp_path / "prof", "-m", model, *extra)
        assert_one_line_error(code, err, words)


def test_a_plan_a_little_past_the_budget_is_trimmed_from_its_largest_caches(family, tmp_path):
    """A plan made where the engine held a little less (another thread count, batch or context) loses cache slots one
    at a time from its largest caches, none below a token's experts; its pinned experts stay; the in-memory bits."""
    src, path, _ = family("qwen3-moe", "q8_0")
    tokens = tokens_for(src, N_PROMPT + N_DECODE)
    ref, _ = run_tier(path, tokens, None)
    fixed, slot, n_layer = tier_shape(path)
    cached = [6, 4] + [4] * (n_layer - 2)  # layer 0's cache is the largest
    model, _ = planned_copy(path, tmp_path, [[5]] * n_layer, cached)
    fits = n_layer + sum(cached) - 2
    logits, stats, chosen = decode_with_trace(model, tokens, (fixed + fits * slot + slot // 2) / 2**30)
    np.testing.assert_array_equal(logits, ref)
    d = stats["disk"]
    assert d["slots"] == fits and d["pinned"] == n_layer
    assert d["pinned_hits"] == int((chosen == 5).sum())
