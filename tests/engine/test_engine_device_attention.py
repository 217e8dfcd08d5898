"""The layers' attention blocks and KV caches on the device (docs/engine.md, "The GPU tier"): the whole split
(attention and hot rows on the device, the cold tier on the CPU) against the CPU-only engine, through the host
emulation here and the CUDA library where a device is (`gpu`): a context whose decode steps cross the CPU cache's
key tiles, an f16 cache, truncate and reset (the device's cache overwritten where the context grows again), the
budget's placement (attention and KV cache first, in layer order, then hot rows) and what the engine reports of it."""
from __future__ import annotations

import numpy as np
import pytest
from device_fixtures import KINDS, TOKENS, comparable_batch, device, emulated, gpuidx_30, gpuidx_all, run  # noqa: F401
from engine_helpers import converted, max_rel_err, random_tokens  # noqa: F401
from tiny_models import N_LAYER

import powerinfer_engine as engine

LONG = random_tokens(230, 384, seed=9)


def long_context(path, **kw):
    """A prompt of 100 tokens in batches of 16, then 130 decode steps: positions up to 229 of a 256-position cache,
    past the CPU cache's key tiles of 64 positions (csrc/engine/run_state.h)."""
    with engine.Model(path, threads=2, sparse_mode="gate", batch_size=16, ctx_size=256, **kw) as m:
        rows = [m.eval(LONG[:100])] + [m.eval([t])[None, 0] for t in LONG[100:]]
        return np.concatenate(rows), m.stats()


@pytest.mark.parametrize("kv_type", ["f32", "f16"])
@pytest.mark.parametrize("kind", KINDS)
def test_a_long_context_on_the_device_gives_the_cpu_logits(kind, kv_type, converted, gpuidx_30, device):
    path = converted(kind, "f32", predictors=True)
    cpu, _ = long_context(path, gpuidx=gpuidx_30, gpu="off", cpu_hot_tier=True, kv_type=kv_type)
    dev, stats = long_context(path, gpuidx=gpuidx_30, gpu="on", gpu_library=device, kv_type=kv_type)
    # split layers (llama family: attention, hot rows there, a cold tier here) or attention jobs (falcon, opt)
    assert stats["gpu"]["attention_jobs"] + stats["gpu"]["split_jobs"] == N_LAYER * (100 // 16 + 1 + 130)
    assert max_rel_err(dev, cpu) <= 1e-4, max_rel_err(dev, cpu)


@pytest.mark.parametrize("outtype", ["f32", "q8_0"])
@pytest.mark.parametrize("kind", ["llama-silu", "falcon", "opt"])
def test_truncate_and_reset_overwrite_the_device_cache(kind, outtype, converted, gpuidx_30, device):
    path = converted(kind, outtype, predictors=True)
    a, b = TOKENS, random_tokens(40, 384, seed=11)

    def session(batch_size=16, **kw):
        with engine.Model(path, threads=2, sparse_mode="dense", batch_size=batch_size, gpuidx=gpuidx_30, **kw) as m:
            m.eval(a)
            m.reset(12)  # keep 12 positions; the next tokens overwrite the rest
            kept = [m.eval(b[:20])] + [m.eval([t])[None, 0] for t in b[20:30]]
            m.reset()
            fresh = m.eval(a[:16])
            return np.concatenate(kept), fresh

    bs = comparable_batch(outtype)
    cpu_kept, cpu_fresh = session(batch_size=bs, gpu="off", cpu_hot_tier=True)
    dev_kept, dev_fresh = session(batch_size=bs, gpu="on", gpu_library=device)
    tol = 1e-4 if outtype == "f32" else 2e-3
    assert max_rel_err(dev_kept, cpu_kept) <= tol and max_rel_err(dev_fresh, cpu_fresh) <= tol
    # the truncated positions matter: a session that kept all of them computes other logits
    with engine.Model(path, threads=2, batch_size=16, gpuidx=gpuidx_30, gpu="on", gpu_library=device) as m:
        m.eval(a)
        assert max_rel_err(m.eval(b[:20]), dev_kept[:20]) > 1e-2


def test_the_budget_places_attention_first_then_hot_rows(converted, gpuidx_all, device):
    """A budget for the scratch, the output head and one layer's attention and KV cache: those on the device, every
    hot row on the CPU; one for all that, every layer's attention and one layer's hot rows: those; one for the
    scratch and the head alone: the head; the logits the CPU's."""
    path = converted("llama-relu", "f32", predictors=True)
    with engine.Model(path, gpuidx=gpuidx_all, gpu="on", gpu_library=device, ctx_size=128, batch_size=16) as m:
        placed = m.info["gpu"]["device"]["placed_bytes"]
        # what the library allocated: the weights and caches placed, and as much of the scratch as it keeps
        assert sum(placed.values()) - placed["scratch"] <= m.info["gpu"]["device"]["device_bytes"] <= sum(placed.values())
    attention = (placed["attention"] + placed["kv_cache"]) / N_LAYER
    hot = placed["hot"] / N_LAYER
    cpu = run(path, "gate", gpuidx=gpuidx_all, gpu="off", cpu_hot_tier=True, ctx_size=128)[0]
    first = placed["scratch"] + placed["head"]
    cases = [(first + 1.5 * attention, [1] + [0] * (N_LAYER - 1), [0] * N_LAYER),
             (first + N_LAYER * attention + 1.5 * hot, [1] * N_LAYER, [1] + [0] * (N_LAYER - 1)),
             (first + 0.5 * attention, [0] * N_LAYER, [0] * N_LAYER)]
    for budget, attention_on, hot_on in cases:
        dev, info, stats = run(path, "gate", gpuidx=gpuidx_all, gpu="on", gpu_library=device, ctx_size=128,
                               vram_budget=budget / 2**30)
        used = info["gpu"]["device"]
        assert [layer["attention"] == "device" for layer in used["layers"]] == [bool(x) for x in attention_on]
        assert [layer["hot_rows"] == "device" for layer in used["layers"]] == [bool(x) for x in hot_on]
        assert used["attention_layers"] == sum(attention_on) and used["layers_on_device"] == sum(hot_on)
        assert used["output_head"] == "device" and stats["gpu"]["head_jobs"] == 2 + len(TOKENS) - 24
        assert used["device_bytes"] <= used["budget_bytes"]
        # a layer with its attention and all its neurons (every one hot) on the device runs there whole
        whole = sum(a and h for a, h in zip(attention_on, hot_on))
        assert stats["gpu"]["layer_jobs"] == whole * (2 + len(TOKENS) - 24)
        assert stats["gpu"]["attention_jobs"] == (sum(attention_on) - whole) * (2 + len(TOKENS) - 24)
        assert max_rel_err(dev, cpu) <= 1e-4


def test_what_keeps_attention_on_the_cpu_is_said(converted, gpuidx_30, emulated):
    path = converted("llama-relu", "f32")
    with engine.Model(path, gpuidx=gpuidx_30, gpu="on", gpu_library=emulated, gpu_attention=False) as m:
        assert m.info["gpu"]["device"]["attention_layers"] == 0
        assert "attention and the output head kept on the CPU" in m.info["gpu"]["device"]["attention_reason"]
        assert m.info["gpu"]["device"]["output_head"] == "cpu"
    with engine.Model(path, gpuidx=gpuidx_30, gpu="on", gpu_library=emulated, vram_budget=2**-20) as m:
        assert m.info["gpu"]["device"]["attention_reason"] == "the budget holds no layer's attention and KV cache"
    with pytest.raises(engine.EngineError, match="gpu_attention must be True or False"):
        engine.Model(path, gpuidx=gpuidx_30, gpu_attention="yes")
