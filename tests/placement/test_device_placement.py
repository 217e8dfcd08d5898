"""One placement on the device for the engine and the toolkit: powerinfer_tools.stages.placement.device_placement, from a
converted file's header, places the same layers' attention, KV cache and hot rows, and counts the same bytes, as the
engine does when it opens the file (csrc/backend/device_placement.cpp, through the emulated device library) at the
same budget, context, batch size and KV cache type; on every architecture and several budgets, from all of it down
to nothing; with predictors, the split layers' predictors placed with their hot rows."""
from __future__ import annotations

import numpy as np
import pytest
from engine_helpers import converted, write_gpuidx  # noqa: F401
from tiny_models import FAMILY_KINDS, KINDS, N_FF, N_LAYER, QWEN_KINDS

import powerinfer_engine as engine
from powerinfer_tools.formats.gguf_header import read_header
from powerinfer_tools.stages.placement.device_placement import device_costs, place_on_device


@pytest.fixture(scope="module")
def hot_masks():
    # a different share of hot neurons per layer, so that the layers' hot rows differ in size
    return [np.random.default_rng(3 + i).random(N_FF) < 0.2 + 0.3 * i for i in range(N_LAYER)]


@pytest.fixture(scope="module")
def gpuidx(tmp_path_factory, hot_masks):
    return write_gpuidx(tmp_path_factory.mktemp("hot") / "hot.gpuidx", hot_masks)


def engine_placement(path, gpuidx, budget, with_attention=True, **kw):
    with engine.Model(path, threads=1, gpuidx=gpuidx, gpu="on", gpu_library="emulated", vram_budget=budget / 2**30,
                      gpu_attention=with_attention, **kw) as m:
        used = m.info["gpu"]["device"]
    return ([layer["attention"] == "device" for layer in used["layers"]],
            [layer["hot_rows"] == "device" for layer in used["layers"]], used["output_head"] == "device",
            used["placed_bytes"], [layer["predictor"] == "device" for layer in used["layers"]])


@pytest.mark.parametrize("predictors", [False, True], ids=["", "predictors"])
@pytest.mark.parametrize("outtype", ["f32", "q4_0"])
@pytest.mark.parametrize("kind", KINDS + QWEN_KINDS + FAMILY_KINDS + ("gemma3-relu",))
def test_the_toolkit_places_what_the_engine_places(kind, outtype, predictors, converted, gpuidx, hot_masks,
                                                   monkeypatch):
    if predictors and kind not in ("llama-relu", "falcon", "opt"):
        pytest.skip("the predictors' placement: a llama, a parallel block (none), opt")
    monkeypatch.setenv("PI_EMULATED_DEVICE_MIB", "64")
    path = converted(kind, outtype, predictors=predictors)
    hot = [int(m.sum()) for m in hot_masks]
    for ctx, batch, kv_type in ((128, 16, "f32"), (256, 64, "f16")):
        costs = device_costs(read_header(path), ctx_size=ctx, n_batch=batch, kv_type=kv_type)
        whole = place_on_device(costs, 2**40, hot)
        full = (whole.scratch + whole.head_bytes + whole.attention_bytes + whole.kv_cache_bytes + whole.hot_bytes
                + whole.predictor_bytes)
        # a layer takes its predictor where it is split: attention placed, a cold tier beside, a sequential block
        assert whole.predictor.any() == (predictors and kind != "falcon"), whole.predictor
        hot_scratch = costs.shape.hot_scratch_bytes(max(hot))
        first = whole.scratch + whole.head_bytes  # both scratches and the head
        smallest_hot = min(n * b for n, b in zip(hot, costs.neuron))
        budgets = [1.05 * full, 0.95 * full, first + 1.5 * costs.attention[0],  # the head and one layer's attention
                   first + costs.attention.sum() + 0.5 * smallest_hot,  # every layer's attention, no hot rows
                   hot_scratch + whole.head_bytes + 0.5 * min(smallest_hot, costs.attention[0]),  # the head alone
                   0.6 * full, 0.3 * full, 0.05 * full]
        seen = set()
        for budget in budgets:
            for with_attention in (True, False):
                ours = place_on_device(costs, budget, hot, with_attention)
                attention, hot_on, head, placed, predictor = engine_placement(
                    path, gpuidx, budget, with_attention, ctx_size=ctx, batch_size=batch, kv_type=kv_type)
                assert attention == list(ours.attention) and hot_on == list(ours.hot), (budget, with_attention)
                assert predictor == list(ours.predictor) and head == ours.head
                assert placed == pytest.approx({"scratch": ours.scratch, "head": ours.head_bytes,
                                                "attention": ours.attention_bytes, "kv_cache": ours.kv_cache_bytes,
                                                "hot": ours.hot_bytes, "predictor": ours.predictor_bytes,
                                                "experts": 0.0})  # a mixture's: tests/arch/test_moe_device.py
                seen.add((ours.head, ours.attention.sum(), ours.hot.sum()))
        # the budgets covered all of it, a part of the layers' attention, attention without hot rows, the head alone;
        # qwen3's and gemma3's attention none of them (the device computes no per-head q/k norms), gemma3's neurons
        # neither (nor GELU) but for its ReLU variant's
        if kind in ("qwen3", "gemma3", "gemma3-relu"):
            assert costs.attention_refused and (True, 0, 0) in seen
            assert ((True, 0, N_LAYER) in seen) == (kind != "gemma3")
            assert bool(costs.neurons_refused) == (kind == "gemma3")
            continue
        assert (True, N_LAYER, N_LAYER) in seen and any(head and a == 1 for head, a, _ in seen)
        assert (True, N_LAYER, 0) in seen and (True, 0, 0) in seen


@pytest.mark.parametrize("kind", ["llama-relu", "opt"])
def test_plan_reports_the_engines_placement_for_its_index(kind, converted, tmp_path, monkeypatch):
    """`plan` writes a gpu index for a budget and says where the engine will put each layer's parts with it: the
    engine opened with that index, budget and context puts them there."""
    from placement_fixtures import power_law_counts, write_profile

    from powerinfer_tools.stages.placement import placement
    from powerinfer_tools.stages.options import DEFAULT_KV_TYPE

    monkeypatch.setenv("PI_EMULATED_DEVICE_MIB", "64")
    path = converted(kind, "q8_0")
    profile = write_profile(tmp_path / "prof", power_law_counts(N_LAYER, N_FF), tokens=4096)
    costs = device_costs(read_header(path), ctx_size=128)
    full = place_on_device(costs, 2**40, [N_FF] * N_LAYER)
    for budget in (2.0 * (full.scratch + full.attention_bytes + full.kv_cache_bytes + full.hot_bytes),
                   full.scratch + full.head_bytes + 0.7 * (full.attention_bytes + full.kv_cache_bytes)):
        plan = placement.plan_for_model(profile, path, int(budget), ctx_size=128, reserve_bytes=0, offload_output=False,
                                        dense="with-ffn", min_layer_neurons=0)
        files = placement.write_plan(plan, tmp_path / f"{kind}.gpuidx")
        attention, hot, head, _, _ = engine_placement(path, files.gpuidx, int(budget), ctx_size=128,
                                                   kv_type=DEFAULT_KV_TYPE)  # what run opens it with
        assert head == plan.engine["output_head"]
        assert [i for i, on in enumerate(attention) if on] == plan.engine["attention_layers"]
        assert [i for i, on in enumerate(hot) if on] == plan.engine["hot_layers"]
        assert any(line.startswith("bundled engine at this budget") for line in placement.report_lines(plan))
