"""The GPU tier (csrc/backend/device_backend.h, csrc/include/pi_device.h): through the host emulation of a device
library, which computes with the CUDA kernels' arithmetic (csrc/device/tier_math.h, attention_math.h), the engine's
side of the boundary is checked on any machine: the same logits as the CPU backend in every mode, architecture and
type, with the layers' attention and KV cache on the device and without, the VRAM budget taken layer by layer, what
is refused, the traffic counted, no device memory kept after close (tests/engine/test_engine_device_attention.py:
attention's own checks). The tests marked `gpu` run the same checks against the CUDA library on a CUDA device (scripts/gpu_check.sh)."""
from __future__ import annotations

import numpy as np
import pytest
from device_fixtures import KINDS, N_PROMPT, TOKENS, comparable_batch, device, emulated, gpuidx_30, gpuidx_all, run  # noqa: F401
from engine_helpers import converted, engine_prompt_then_decode, hf_logits, max_rel_err, write_gpuidx  # noqa: F401
from tiny_models import N_FF, N_LAYER

import powerinfer_engine as engine
from powerinfer_engine import EngineError


TOLERANCE = {"f32": 1e-4, "f16": 1e-4, "q8_0": 2e-3, "q4_0": 6e-2}
# the kinds whose layers run split where attention and part of the FFN are on the device (a sequential block
# without a down bias: not falcon's parallel one, not opt's biased fc2)
SPLIT_KINDS = ("llama-relu", "llama-silu", "prosparse", "bamboo")
# predictor mode (and auto, which may run it) selects neurons from the hidden state: at q4_0 the tiers' rounding
# moves a near-threshold neuron of a tiny model across, one down row of 256 worth several percent of a logit
PREDICTED_Q4_0_TOLERANCE = 1e-1
# a split layer's predictor-mode hot rows against the CPU alone: the two predictors' scores of a hot neuron (the
# device's and the CPU's, each on its own tier's rounding of the same stream) put a near-threshold one on either
# side now and then; at q4_0 one such neuron of a tiny model moves its token's logits by up to a third. So: every
# token's logits within q4_0's tolerance but for at most SPLIT_FLIPS of them, none beyond SPLIT_FLIP_TOLERANCE
SPLIT_FLIPS, SPLIT_FLIP_TOLERANCE = 2, 0.5


@pytest.mark.parametrize("attention", [True, False], ids=["attention", "ffn-only"])
@pytest.mark.parametrize("outtype", ["f32", "f16", "q8_0", "q4_0"])
@pytest.mark.parametrize("kind", KINDS)
def test_the_device_tier_gives_the_cpu_logits(kind, outtype, attention, converted, gpuidx_30, gpuidx_all, device):
    path = converted(kind, outtype, predictors=True)
    bs = comparable_batch(outtype)
    for index in (gpuidx_30, gpuidx_all):
        # a split layer (attention and hot rows on the device, a cold tier here) computes in predictor mode the
        # hot rows its predictor selects, as the CPU alone computes every neuron the predictor selects; the other
        # device paths compute the hot rows by the rule, as the CPU's own hot tier does
        split = attention and index == gpuidx_30 and kind in SPLIT_KINDS
        for mode in ("dense", "gate", "predictor", "auto"):
            alone = split and mode == "predictor"
            cpu, _, cpu_stats = run(path, mode, gpuidx=index, batch_size=bs, gpu="off", cpu_hot_tier=not alone)
            dev, info, dev_stats = run(path, mode, gpuidx=index, batch_size=bs, gpu="on", gpu_library=device,
                                       gpu_attention=attention)
            assert info["hot_backend"] in ("emulated", "cuda") and info["gpu"]["used"]
            assert info["gpu"]["device"]["layers_on_device"] == N_LAYER
            assert info["gpu"]["device"]["attention_layers"] == (N_LAYER if attention else 0)
            assert info["gpu"]["device"]["output_head"] == ("device" if attention else "cpu")
            gpu = dev_stats["gpu"]
            # a layer without a cold tier runs whole on the device (a sequential block without a down bias)
            whole = attention and index == gpuidx_all and kind not in ("falcon", "falcon7b", "opt")
            batches = N_LAYER * (-(-N_PROMPT // bs) + len(TOKENS) - N_PROMPT)
            assert gpu["layer_jobs"] == (batches if whole else 0)
            assert gpu["split_jobs"] == (batches if split else 0)
            assert gpu["attention_jobs"] == (batches if attention and not whole and not split else 0)
            # the same rule on the same operands (q8_0 blocks for quantized weights), each tier summing in its own
            # arithmetic: the CPU's q4_0 decode step adds its down rows in integers (coefficients rounded against
            # their group's largest), the device in f32; either is as close to float64 as the other
            # (test_each_tier_is_as_close_to_float64), and the tiny models' layers carry a difference on through
            # the q8_0 operands' steps
            predicted = outtype == "q4_0" and mode in ("predictor", "auto")
            tolerance = PREDICTED_Q4_0_TOLERANCE if predicted else TOLERANCE[outtype]
            if alone and outtype == "q4_0":
                rows = np.abs(dev - cpu).max(axis=1) / np.abs(cpu).max()
                assert (rows > TOLERANCE[outtype]).sum() <= SPLIT_FLIPS and rows.max() <= SPLIT_FLIP_TOLERANCE, rows
            else:
                assert max_rel_err(dev, cpu) <= tolerance, (mode, max_rel_err(dev, cpu))
            for a, b in zip(dev_stats["layers"], cpu_stats["layers"]):
                if alone:  # the predictor's selection over all neurons, the hot rows' share of it on the device
                    assert abs(a["density"] - b["density"]) <= 0.01, (mode, a, b)
                    assert abs(a["computed_density"] - b["computed_density"]) <= 0.01, (mode, a, b)
                else:
                    assert abs(a["hot_density"] - b["hot_density"]) <= 0.01, (mode, a, b)


@pytest.mark.parametrize("outtype", ["f32", "q8_0", "q4_0"])
@pytest.mark.parametrize("kind", ["llama-relu", "llama-silu", "prosparse", "bamboo"])
def test_each_tier_is_as_close_to_float64(kind, outtype, converted, gpuidx_all, device, tiny_model_dir):
    """Dense logits of everything on the device and of the CPU alone against transformers in float64 on the file's
    weights (and, for quantized weights, the q8_0 operands both tiers multiply): neither tier's arithmetic costs
    accuracy against the other's."""
    path = converted(kind, outtype, predictors=True)
    quantized = outtype != "f32"
    ref = hf_logits(tiny_model_dir(kind), TOKENS, weights_from=path, q8_inputs=quantized, float64=True)
    cpu = run(path, "dense", gpuidx=gpuidx_all, batch_size=comparable_batch(outtype), gpu="off", cpu_hot_tier=True)[0]
    dev = run(path, "dense", gpuidx=gpuidx_all, gpu="on", gpu_library=device, gpu_attention=True)[0]
    cpu_err, dev_err = max_rel_err(cpu, ref), max_rel_err(dev, ref)
    # quantized: either within 1.5x of the other, either way round (which tier's rounding of the same sums lands
    # closer varies from file to file)
    assert dev_err <= (1e-4 if not quantized else 1.5 * cpu_err + 1e-6), (cpu_err, dev_err)
    assert cpu_err <= (1e-4 if not quantized else 1.5 * dev_err + 1e-6), (cpu_err, dev_err)
    # the CPU's batches: a quantized down projection in integers (q8_0 input and transposed weights, which the
    # reference above leaves in floats), against float64 without any rounding, about as close as the device
    batch = run(path, "dense", gpuidx=gpuidx_all, gpu="off", cpu_hot_tier=True)[0]
    exact = ref if not quantized else hf_logits(tiny_model_dir(kind), TOKENS, weights_from=path, float64=True)
    batch_err, dev_exact_err = max_rel_err(batch, exact), max_rel_err(dev, exact)
    assert batch_err <= (1e-4 if not quantized else 1.5 * dev_exact_err + 1e-6), (batch_err, dev_exact_err)


@pytest.mark.parametrize("mode", ["gate", "predictor"])
@pytest.mark.parametrize("outtype", ["q8_0", "q4_0"])
@pytest.mark.parametrize("kind", KINDS)
def test_greedy_tokens_agree_over_64_steps(kind, outtype, mode, converted, gpuidx_30, device):
    """The device's 64 greedy tokens, each the CPU's choice on the same context, or one the CPU scores within its
    tolerance of its choice (a random tiny model's near-ties: the two tiers sum in their own arithmetic). The split
    layers' in predictor mode against the CPU alone (every neuron through the predictor)."""
    path = converted(kind, outtype, predictors=True)
    prompt = TOKENS[:N_PROMPT]
    bs = comparable_batch(outtype)
    alone = mode == "predictor" and kind in SPLIT_KINDS
    with engine.Model(path, threads=2, sparse_mode=mode, gpuidx=gpuidx_30, gpu="on", gpu_library=device,
                      batch_size=bs) as m:
        assert m.info["gpu"]["used"]
        tokens = list(m.generate(prompt, 64))
        assert (m.stats()["gpu"]["split_jobs"] > 0) == (kind in SPLIT_KINDS)
    with engine.Model(path, threads=2, sparse_mode=mode, gpuidx=gpuidx_30, gpu="off", cpu_hot_tier=not alone,
                      batch_size=bs) as m:
        cpu = engine_prompt_then_decode(m, prompt + tokens[:-1], N_PROMPT)[N_PROMPT - 1:]
    predicted = outtype == "q4_0" and mode == "predictor"
    margin = (PREDICTED_Q4_0_TOLERANCE if predicted else TOLERANCE[outtype]) * np.abs(cpu).max()
    for step, (token, logits) in enumerate(zip(tokens, cpu)):
        assert logits[token] >= logits.max() - margin, (step, token, int(logits.argmax()))
    exact = sum(int(t == int(row.argmax())) for t, row in zip(tokens, cpu))
    assert exact >= 60, exact


def test_without_a_hot_tier_auto_stays_on_the_cpu_and_on_is_refused(converted, emulated):
    path = converted("llama-relu", "q8_0", predictors=True)
    cpu, info, _ = run(path, "gate", gpu="auto", gpu_library=emulated)
    assert not info["gpu"]["used"] and "no hot tier" in info["gpu"]["reason"] and info["hot_backend"] == "cpu"
    np.testing.assert_array_equal(cpu, run(path, "gate", gpu="off")[0])
    with pytest.raises(EngineError, match="gpu on: no hot tier"):
        engine.Model(path, gpu="on", gpu_library=emulated)


def test_what_is_missing_for_a_device_is_named(converted, gpuidx_30, emulated, monkeypatch, tmp_path):
    path = converted("llama-relu", "q8_0")
    monkeypatch.setenv("PI_EMULATED_DEVICES", "0")
    with engine.Model(path, gpuidx=gpuidx_30, gpu="auto", gpu_library=emulated) as m:
        assert not m.info["gpu"]["used"] and "no device" in m.info["gpu"]["reason"]
    with pytest.raises(EngineError, match="gpu on: .*no device"):
        engine.Model(path, gpuidx=gpuidx_30, gpu="on", gpu_library=emulated)
    monkeypatch.delenv("PI_EMULATED_DEVICES")
    with pytest.raises(EngineError, match="no device 3 \\(1 found\\)"):
        engine.Model(path, gpuidx=gpuidx_30, gpu="on", gpu_device=3, gpu_library=emulated)
    not_a_library = tmp_path / "x.so"
    not_a_library.write_bytes(b"\x7fELF garbage")
    with pytest.raises(EngineError, match="cannot load the device library"):
        engine.Model(path, gpuidx=gpuidx_30, gpu="on", gpu_library=not_a_library)
    with pytest.raises(EngineError, match="lacks pi_device_api_get"):
        engine.Model(path, gpuidx=gpuidx_30, gpu="on", gpu_library=engine.library_path())
    for bad in (dict(gpu="yes"), dict(vram_budget=-1), dict(vram_budget="4"), dict(vram_budget=float("inf")),
                dict(vram_budget=float("nan")), dict(vram_budget=1e30), dict(gpu="on", gpu_library="metal")):
        with pytest.raises(EngineError):
            engine.Model(path, gpuidx=gpuidx_30, **bad)


def test_without_a_device_a_gpuidx_is_ignored_unless_asked_to_keep_a_cpu_tier(converted, gpuidx_30, emulated,
                                                                              monkeypatch, tmp_path):
    """A gpuidx places neurons on a device (issue 56): where none takes them (gpu off, or auto finding no device),
    the engine checks the index and computes every neuron by the FFN mode, so predictor mode is the predictor's in
    every layer, not gate mode's for the marked ones; cpu_hot_tier keeps the marked ones a CPU tier of their own."""
    path = converted("llama-relu", "q8_0", predictors=True)
    plain = run(path, "predictor")[0]
    monkeypatch.setenv("PI_EMULATED_DEVICES", "0")
    for kw in (dict(gpu="off"), dict(gpu="auto", gpu_library=emulated)):
        logits, info, stats = run(path, "predictor", gpuidx=gpuidx_30, **kw)
        assert info["gpu"]["gpuidx_ignored"] and info["hot_neurons"] == 0, kw
        assert [layer["hot_neurons"] for layer in stats["layers"]] == [0] * N_LAYER, kw
        np.testing.assert_array_equal(logits, plain, err_msg=str(kw))
    kept, info, _ = run(path, "predictor", gpuidx=gpuidx_30, gpu="off", cpu_hot_tier=True)
    assert not info["gpu"]["gpuidx_ignored"] and info["hot_neurons"] > 0
    assert not np.array_equal(kept, plain)  # the hot neurons computed whole
    other = write_gpuidx(tmp_path / "other.gpuidx", [np.ones(N_FF, bool)] * (N_LAYER + 1))
    with pytest.raises(EngineError, match=f"for a model with {N_LAYER + 1} layers"):
        engine.Model(path, gpuidx=other, gpu="off")  # ignored, but checked
    monkeypatch.delenv("PI_EMULATED_DEVICES")
    _, info, _ = run(path, "predictor", gpuidx=gpuidx_30, gpu="auto", gpu_library=emulated)
    assert info["gpu"]["used"] and not info["gpu"]["gpuidx_ignored"] and info["hot_neurons"] > 0


def test_a_budget_above_the_free_memory_is_refused(converted, gpuidx_30, emulated):
    with pytest.raises(EngineError, match="VRAM budget of 1.00 GiB is more than the 0.50 GiB free on device 0"):
        engine.Model(converted("llama-relu", "q8_0"), gpuidx=gpuidx_30, gpu="auto", vram_budget=1, gpu_library=emulated)


def test_the_budget_takes_layers_in_order_and_the_rest_stay_on_the_cpu(converted, gpuidx_all, device):
    """The hot rows alone (attention kept on the CPU); test_engine_device_attention.py: with attention first."""
    path = converted("llama-relu", "f32", predictors=True)
    with engine.Model(path, gpuidx=gpuidx_all, gpu="on", gpu_library=device, gpu_attention=False) as m:
        whole = m.info["gpu"]["device"]["device_bytes"]
    per_layer = whole / N_LAYER  # every layer's hot tier is the same size here (all neurons), scratch aside
    cpu = run(path, "gate", gpuidx=gpuidx_all, gpu="off", cpu_hot_tier=True)[0]
    for budget_layers in (1, N_LAYER - 1):
        budget = (per_layer * budget_layers + per_layer / 2) / 2**30
        dev, info, stats = run(path, "gate", gpuidx=gpuidx_all, gpu="on", vram_budget=budget, gpu_library=device,
                               gpu_attention=False)
        used = info["gpu"]["device"]
        assert 1 <= used["layers_on_device"] <= budget_layers and used["hot_layers"] == N_LAYER
        assert used["device_bytes"] <= used["budget_bytes"]
        assert stats["weight_copies"]["hot"] > 0  # the layers past the budget: their hot rows copied on the host
        assert max_rel_err(dev, cpu) <= 1e-4


def test_traffic_and_time_are_counted(converted, gpuidx_30, device):
    path = converted("llama-relu", "q8_0", predictors=True)
    n_tok, E = len(TOKENS), None
    batches = 2 + (len(TOKENS) - N_PROMPT)  # the prompt in two batches of 16 and 8, then one token a step
    for attention in (False, True):
        _, info, stats = run(path, "gate", gpuidx=gpuidx_30, gpu="on", gpu_library=device, gpu_attention=attention)
        gpu, E = stats["gpu"], info["n_embd"]
        assert gpu["tokens"] == N_LAYER * n_tok and gpu["attention_jobs"] == 0
        x = n_tok * E * 4  # every token's row, once
        if not attention:
            # the hot tier, up: each token's f32 row (the device makes its q8_0 form); down: its f32 output row and
            # the job's counts (24 bytes)
            assert gpu["jobs"] == N_LAYER * batches and gpu["split_jobs"] == 0 and gpu["head_jobs"] == 0
            assert gpu["h2d_bytes"] == N_LAYER * x
            assert gpu["d2h_bytes"] == N_LAYER * (x + batches * 24)
            assert gpu["device_seconds"] > 0 and gpu["wait_seconds"] > 0
        else:
            # split layers: up, the first layer's input and each layer's cold output; down, each layer's stream and
            # its FFN norm in one copy, and its counts; the head reads the stream on the device, its logits down
            assert gpu["jobs"] == 0 and gpu["split_jobs"] == N_LAYER * batches and gpu["head_jobs"] == batches
            assert gpu["h2d_bytes"] == (N_LAYER + 1) * x
            assert gpu["d2h_bytes"] == N_LAYER * (2 * x + batches * 24) + n_tok * info["n_vocab"] * 4
            assert gpu["split_seconds"] > 0 and gpu["head_seconds"] > 0


def test_close_gives_the_device_memory_back(converted, gpuidx_30, device):
    path = converted("llama-relu", "q4_0", predictors=True)
    free = []
    for _ in range(1000 if "cuda" in str(device) else 50):
        with engine.Model(path, gpuidx=gpuidx_30, gpu="on", gpu_library=device) as m:
            free.append(m.info["gpu"]["device"]["free_bytes"])
    # the emulated device's free memory is exact; a real one's moves with other processes' use, by pages
    assert max(free) - min(free) <= (0 if "emulated" in str(device) else 64 << 20), (min(free), max(free))


def test_a_budget_above_the_device_is_refused_on_cuda_too(converted, gpuidx_30, device):
    with pytest.raises(EngineError, match="VRAM budget of .* is more than the .* free on device 0"):
        engine.Model(converted("llama-relu", "q8_0"), gpuidx=gpuidx_30, gpu="on", vram_budget=1 << 20, gpu_library=device)


def test_the_cuda_library_loads_and_says_there_is_no_device(converted, gpuidx_30):
    """On a machine without a CUDA device the library still loads (static cudart needs no driver to load) and
    says why there is no device; `auto` then runs on the CPU. This is what CI checks of the CUDA build."""
    path = engine.device_library_path("cuda")
    if path is None:
        pytest.skip("built without nvcc: no CUDA library")
    with engine.Model(converted("llama-relu", "q8_0"), gpuidx=gpuidx_30, gpu="auto", gpu_library=path) as m:
        if m.info["gpu"]["used"]:
            pytest.skip("a CUDA device is present: the `gpu` tests check it")
        assert "no CUDA device" in m.info["gpu"]["reason"], m.info["gpu"]


def test_launches_and_device_bytes_follow_the_kernels(converted, gpuidx_30, gpuidx_all, device):
    """The stats' kernels launched and bytes read on the device, per job kind, from the file's own tensor sizes
    (gguf-py's reader) and the kernels' plan (tier_math.h: 8 tokens a pass over a matrix; the down projection's 32
    splits summed by a second kernel where a batch leaves room for them, always for a whole layer, which adds into
    its stream; attention_math.h's launches): the floor the bench measures the device against is made of these.
    With every neuron hot each layer runs whole on the device, and the stream crosses the bus once a batch; with a
    cold tier each layer runs split, its cold output coming up once."""
    from powerinfer_tools.formats.gguf_io import open_reader

    path = converted("llama-relu", "q8_0", predictors=True)
    size = {t.name: int(t.n_bytes) for t in open_reader(path).tensors}
    for index, whole in ((gpuidx_30, False), (gpuidx_all, True)):
        _, info, stats = run(path, "dense", gpuidx=index, gpu="on", gpu_library=device, gpu_attention=True)
        E, n_batch = info["n_embd"], info["n_batch"]
        D = E // 4  # d_head of the tiny llama: 4 heads
        batches = [16, 8] + [1] * (len(TOKENS) - N_PROMPT)
        launches = reads = h2d = 0.0
        n_past = 0
        for n in batches:
            p = (n + 7) // 8
            for il in range(N_LAYER):
                attn = sum(size[f"blk.{il}.attn_{m}.weight"] for m in ("q", "k", "v", "output"))
                seen = n * n_past + n * (n + 1) / 2
                split = max(1, min(32, n_batch // n)) > 1
                launches += 6 + 4  # attention's (o quantized), the FFN's norm, gate_up, down, the splits' sum
                reads += attn * p + seen * 4 * D * 4 * 2  # every head's keys and values, f32 cache
                # dense: every hot neuron's gate and up rows once a pass, its down row each token
                share = stats["layers"][il]["hot_neurons"] / info["n_ff"]
                gate_up = size[f"blk.{il}.ffn_gate.weight"] + size[f"blk.{il}.ffn_up.weight"]
                reads += share * (gate_up * p + n * size[f"blk.{il}.ffn_down_t.weight"])
                h2d += n * E * 4 if il == 0 else 0  # the stream's start
                h2d += 0 if whole else n * E * 4  # a split layer's cold output
            launches += 2
            reads += size["output.weight" if "output.weight" in size else "token_embd.weight"] * p
            n_past += n
        gpu = stats["gpu"]
        assert gpu["launches"] == launches, whole
        assert gpu["h2d_bytes"] == h2d, whole
        assert gpu["device_read_bytes"] == pytest.approx(reads, rel=1e-12)
        assert gpu["copy_rate"] > 0
