"""The KV cache's pages come in as positions are written: opening at a long context costs the process almost
none of the cache's memory (nothing populates it, nothing reads past the positions written), and the logits do
not depend on the context size the cache was laid out for."""
from __future__ import annotations

import numpy as np
import pytest
from engine_helpers import converted, random_tokens  # noqa: F401

import powerinfer_engine as engine

TOKENS = random_tokens(40, 384, seed=3)  # a prompt batch, then decode steps
LONG_CTX = 1 << 19  # 256 MiB of f32 cache for the tiny model, 40 positions of it written


def anon_rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


def run(m) -> np.ndarray:
    rows = [m.eval(TOKENS[:24])] + [m.eval([t])[None, 0] for t in TOKENS[24:]]
    return np.concatenate(rows)


@pytest.mark.parametrize("kv_type", ["f32", "f16"])
def test_a_long_context_costs_only_the_positions_written(converted, kv_type):
    path = converted("llama-relu")
    with engine.Model(path, threads=1, ctx_size=64, kv_type=kv_type) as m:
        short = run(m)
    before = anon_rss()
    with engine.Model(path, threads=1, ctx_size=LONG_CTX, kv_type=kv_type) as m:
        kv, work = m.info["kv_cache_bytes"], m.info["work_buffer_bytes"]
        opened = anon_rss() - before
        long = run(m)
        used = anon_rss() - before
    assert kv >= LONG_CTX * 2 * 2 * 32 * (4 if kv_type == "f32" else 2)  # layers x (K, V) x kv width
    # the work buffers (scores and RoPE tables sized by the context) are written at open; of the cache only the
    # pages of the 40 positions written, a 2 MiB page per layer for keys and for values at most
    assert opened < work + kv / 16, (opened, work, kv)
    assert used < work + kv / 8, (used, work, kv)
    assert np.array_equal(long, short)  # the same fma chains whatever the layout's blocks
