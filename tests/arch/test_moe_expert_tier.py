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
from test_moe import family, tokens_for  # noqa: F401 (family: the module's fixture)
from tiny_models import N_EXPERT

import powerinfer_engine as engine

N_PROMPT, N_DECODE = 40, 24
HUGE_GIB = 4.0  # a budget past every tiny model's experts: the tier holds them all


def tier_shape(path) -> tuple[int, int, int]:
    """(fixed bytes, bytes of a slot, layers) of the tier at `path`, from its stats under a budget holding all."""
    with engine.Model(path, threads=2, ctx_size=256, memory_budget=HUGE_GIB) as m:
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
