"""A split layer (docs/engine.md, "A split layer"): its attention and hot rows on the device, its cold tier here.
A decode token crosses the bus once each way per split layer (the cold tier's output up; the stream and its FFN
norm down in one copy) and launches a fixed number of kernels; in predictor mode the device computes only the hot
rows the layer's predictor selects there. Its logits against the CPU's: test_engine_device.py (every mode, type and
architecture; greedy tokens over 64 steps)."""
from __future__ import annotations

import pytest
from device_fixtures import N_PROMPT, TOKENS, device, emulated, gpuidx_30  # noqa: F401
from engine_helpers import converted  # noqa: F401
from tiny_models import N_LAYER

import powerinfer_engine as engine
from powerinfer_tools.formats.gguf_io import open_reader

QUANTIZED = ("Q8_0", "Q4_0")


@pytest.mark.parametrize("outtype", ["f32", "q8_0", "q4_0"])
def test_a_decode_token_crosses_the_bus_once_each_way_per_split_layer(outtype, converted, gpuidx_30, device):
    path = converted("llama-relu", outtype, predictors=True)
    types = {t.name: t.tensor_type.name for t in open_reader(path).tensors}
    with engine.Model(path, threads=2, sparse_mode="predictor", gpuidx=gpuidx_30, gpu="on", gpu_library=device) as m:
        E, V = m.info["n_embd"], m.info["n_vocab"]
        assert [layer["predictor"] for layer in m.info["gpu"]["device"]["layers"]] == ["device"] * N_LAYER
        m.eval(TOKENS[:N_PROMPT])
        steps = []
        for token in TOKENS[N_PROMPT:N_PROMPT + 8]:
            m.reset_stats()
            m.eval([token])
            gpu = m.stats()["gpu"]
            steps.append({k: gpu[k] for k in ("h2d_bytes", "d2h_bytes", "launches", "split_jobs", "attention_jobs",
                                              "jobs", "layer_jobs", "head_jobs")})
    # up: the embedding's row into layer 0's stream, then each layer's cold output (one copy a layer); down: each
    # layer's stream and its FFN norm in one copy, with the hot rows' counters (24 bytes; they come down with the
    # head's logits, at the stream's end), then the logits
    h2d = E * 4 + N_LAYER * E * 4
    d2h = N_LAYER * (2 * E * 4 + 24) + V * 4
    # a split layer's launches: attention's 5 (norm with its q8_0 form, q/k/v, RoPE and the cache's store, heads,
    # o into the stream) and the heads' q8_0 form where o is quantized; the FFN's norm (with the stream's copy);
    # the predictor's fc1 with its ReLU, the stream's q8_0 form where fc1 is quantized and the hidden layer's where
    # fc2 is; gate_up (fc2 scored in it), down, the sum of the down partials and the cold output into the stream.
    # The head's 2 (its norm, the projection).
    attention = 5 + (types["blk.0.attn_output.weight"] in QUANTIZED)
    predictor = 1 + sum(types[f"blk.0.fc{i}.weight"] in QUANTIZED for i in (1, 2))
    launches = N_LAYER * (attention + 1 + predictor + 3) + 2
    want = {"h2d_bytes": h2d, "d2h_bytes": d2h, "launches": launches, "split_jobs": N_LAYER, "attention_jobs": 0,
            "jobs": 0, "layer_jobs": 0, "head_jobs": 1}
    assert steps == [want] * len(steps)


def test_predictor_mode_reads_only_the_selected_hot_rows(converted, gpuidx_30, emulated):
    """The device's bytes read per decode token: a split layer's gate and up rows only where its predictor selects
    them (fewer than every hot row), in predictor mode; every hot row's in gate mode."""
    path = converted("llama-relu", "q8_0", predictors=True)
    reads = {}
    for mode in ("gate", "predictor"):
        with engine.Model(path, threads=2, sparse_mode=mode, gpuidx=gpuidx_30, gpu="on", gpu_library=emulated) as m:
            m.eval(TOKENS[:N_PROMPT])
            m.reset_stats()
            for token in TOKENS[N_PROMPT:]:
                m.eval([token])
            reads[mode] = m.stats()["gpu"]["device_read_bytes"]
    assert reads["predictor"] < reads["gate"], reads
