"""The converter's neuron order (neuron_order.py): hottest-first blocks spread over each layer, recorded in the
file, the same model (engine logits in every mode equal the source-order file's), and everything indexed by
source neuron mapped to file positions (the placement's gpu index, the benchmark's llama.cpp file)."""
from __future__ import annotations

import json

import numpy as np
import pytest
from cli_helpers import run_cli
from convert_helpers import write_predictors
from placement_fixtures import power_law_counts, write_profile
from powerinfer_fixtures import write_powerinfer_gpuidx
from tiny_models import HIDDEN, N_FF, N_LAYER

import powerinfer_engine as engine
from powerinfer_tools.formats import neuron_order
from powerinfer_tools.stages.placement import placement
from powerinfer_tools.stages.conversion.conversion import convert_model
from powerinfer_tools.core.errors import UserError
from powerinfer_tools.formats.gguf_io import open_reader


def test_bit_reversed_ranks():
    assert neuron_order.bit_reversed_ranks(8).tolist() == [0, 4, 2, 6, 1, 5, 3, 7]
    for n in (1, 5, 12, 96):
        assert sorted(neuron_order.bit_reversed_ranks(n).tolist()) == list(range(n))


@pytest.mark.parametrize("n", [256, 1536, 1000])
def test_layer_order_is_hottest_first_blocks_spread_over_the_layer(n):
    counts = np.random.default_rng(n).permutation(np.arange(n) ** 2).astype(np.float64)
    order = neuron_order.layer_order(counts)
    assert sorted(order.tolist()) == list(range(n))
    placed = counts[order]
    # neurons that fire about as often sit together: each block of BLOCK_ROWS in the hottest-first ranking
    # is one contiguous stretch of the file, in ranking order
    rank = np.empty(n, np.int64)
    rank[np.argsort(-counts, kind="stable")] = np.arange(n)
    block = rank[order] // neuron_order.BLOCK_ROWS
    starts = np.flatnonzero(np.diff(block, prepend=-1))
    assert len(starts) == -(-n // neuron_order.BLOCK_ROWS)
    for lo, hi in zip(starts, list(starts[1:]) + [n]):
        assert np.all(np.diff(rank[order][lo:hi]) == 1)
    # any half (a thread's share) holds about half of the activations; plain hottest-first would give ~7/8
    for share in (placed[: n // 2], placed[n // 2:]):
        assert abs(share.sum() / placed.sum() - 0.5) < 0.06
    hottest_first = np.sort(counts)[::-1]
    assert hottest_first[: n // 2].sum() / counts.sum() > 0.8


def test_apply_moves_only_neuron_tensors():
    orders = [np.array([2, 0, 1]), np.array([1, 2, 0])]
    rows = np.arange(6.0).reshape(3, 2)
    assert neuron_order.apply("blk.1.ffn_up.weight", rows, orders).tolist() == rows[[1, 2, 0]].tolist()
    assert neuron_order.apply("blk.0.ffn_gate.bias", np.arange(3.0), orders).tolist() == [2.0, 0.0, 1.0]
    for name in ("blk.0.attn_q.weight", "blk.0.ffn_down_t.bias", "blk.0.fc1.weight", "output.weight"):
        assert neuron_order.apply(name, rows, orders) is rows
    assert neuron_order.apply("blk.0.ffn_up.weight", rows, None) is rows


@pytest.fixture(scope="module")
def pair(tiny_model_dir, tmp_path_factory):
    """kind -> (profile counts, ordered file, source-order file), f32 with predictors."""
    cache = {}

    def get(kind):
        if kind not in cache:
            work = tmp_path_factory.mktemp(f"order_{kind.replace('-', '_')}")
            counts = power_law_counts(N_LAYER, N_FF, seed=len(cache))
            prof = write_profile(work / "prof", counts, tokens=4096)
            meta = json.loads((prof / "profile.json").read_text())
            (prof / "profile.json").write_text(json.dumps(meta | {"thresholds": [0.05] * N_LAYER}))
            pred = write_predictors(work / "pred", N_LAYER, HIDDEN, N_FF, rank=16, thresholds=[0.0] * N_LAYER)
            files = []
            for order in (True, False):
                out = work / f"{'ordered' if order else 'source'}.gguf"
                convert_model(str(tiny_model_dir(kind)), out, "f32", predictors_dir=pred, profile_dir=prof,
                              progress=False, order_neurons=order)
                files.append(out)
            cache[kind] = (counts, prof, *files)
        return cache[kind]

    return get


def tensors(path):
    return {t.name: np.array(t.data) for t in open_reader(path).tensors}


@pytest.mark.parametrize("kind", ["llama-silu", "bamboo", "opt"])
def test_file_holds_the_source_rows_in_the_recorded_order(pair, kind):
    counts, _, ordered, source = pair(kind)
    orders = neuron_order.read(ordered, [N_FF] * N_LAYER)
    assert neuron_order.read(source, [N_FF] * N_LAYER) is None
    for i in range(N_LAYER):
        assert np.array_equal(orders[i], neuron_order.layer_order(counts[i]))
    a, b = tensors(ordered), tensors(source)
    assert a.keys() == b.keys()
    moved = 0
    for name in a:
        layer, _, rest = name[4:].partition(".") if name.startswith("blk.") else ("", "", "")
        if rest in neuron_order.NEURON_TENSORS:
            assert np.array_equal(a[name], b[name][orders[int(layer)]]), name
            moved += 1
        else:
            assert np.array_equal(a[name], b[name]), name
    assert moved == N_LAYER * 4, moved  # gate, up, down_t, fc2 (opt: up, its bias, down_t, fc2)


@pytest.mark.parametrize("kind", ["llama-silu", "llama-relu", "bamboo", "falcon", "opt"])
def test_engine_computes_the_same_model_in_every_mode(pair, kind):
    _, _, ordered, source = pair(kind)
    with engine.Model(ordered, threads=2, ctx_size=64) as m, engine.Model(source, threads=2, ctx_size=64) as ref:
        tokens = np.random.default_rng(1).integers(3, m.n_vocab, size=12).tolist()
        for mode in ("dense", "gate", "predictor"):
            got, want = [], []
            for model, out in ((m, got), (ref, want)):
                model.sparse_mode = mode
                model.reset()
                out.append(model.eval(tokens[:8]))  # a prompt (batch path)
                out.extend(model.eval([t], all_logits=False) for t in tokens[8:])  # decode steps
            for g, w in zip(got, want):
                np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4, err_msg=f"{kind} {mode}")
            assert m.stats()["density"] == pytest.approx(ref.stats()["density"]), (kind, mode)


def test_plan_marks_file_positions_of_the_hottest_neurons(pair):
    counts, prof, ordered, source = pair("llama-relu")
    orders = neuron_order.read(ordered, [N_FF] * N_LAYER)
    a = placement.plan_for_model(prof, ordered, placement.GIB, reserve_bytes=0)
    b = placement.plan_for_model(prof, source, placement.GIB, reserve_bytes=0)
    small = placement.plan_for_model(prof, ordered, 0.5 * placement.MIB, reserve_bytes=0, min_layer_neurons=0)
    assert np.array_equal(a.gpu_neurons, b.gpu_neurons)
    for i in range(N_LAYER):  # the same source neurons, at their file positions
        assert np.array_equal(np.sort(orders[i][a.gpu_index[i]]), b.gpu_index[i])
        k = int(small.gpu_neurons[i])
        if 0 < k < N_FF:
            hot = set(orders[i][small.gpu_index[i]].tolist())
            assert hot == set(np.argsort(-counts[i], kind="stable")[:k].tolist())


def test_a_gpu_index_must_number_the_files_neurons(pair, tmp_path):
    """An index PowerInfer's solver builds from a profile's activation files numbers source neurons: on a file
    that stores them hottest first it would mark other neurons, so the engine refuses it; pi-tools plan's index
    carries the file's order and loads; an index for one order is refused on a file in another."""
    counts, prof, ordered, source = pair("llama-relu")
    plan = placement.plan_for_model(prof, ordered, 0.5 * placement.MIB, reserve_bytes=0, min_layer_neurons=0)
    ours = tmp_path / "ordered.gpuidx"
    placement.write_gpuidx(plan, ours)
    with engine.Model(ordered, threads=1, gpuidx=ours, cpu_hot_tier=True) as m:
        assert m.info["hot_neurons"] == int(plan.gpu_neurons.sum())
    hottest = [np.isin(np.arange(N_FF), np.argsort(-c, kind="stable")[:int(k)]) for c, k in zip(counts, plan.gpu_neurons)]
    theirs = write_powerinfer_gpuidx(tmp_path / "theirs.gpuidx", hottest, vram_capacity=1 << 20)
    with pytest.raises(engine.EngineError, match="source order.*make the index with pi-tools plan"):
        engine.Model(ordered, threads=1, gpuidx=theirs)
    with engine.Model(source, threads=1, gpuidx=theirs, cpu_hot_tier=True) as m:  # the order it was made for
        assert m.info["hot_neurons"] == int(plan.gpu_neurons.sum())
    with pytest.raises(engine.EngineError, match="another neuron order"):
        engine.Model(source, threads=1, gpuidx=ours)


def test_a_cached_plan_without_the_order_is_solved_again(pair, tmp_path):
    from powerinfer_tools.runtime.inference import cached_plan

    _, prof, ordered, _ = pair("llama-relu")
    model = tmp_path / ordered.name
    model.write_bytes(ordered.read_bytes())
    path = cached_plan(model, 0.3, prof, 64)
    summary = path.with_name(path.name + ".json")
    saved = json.loads(summary.read_text())
    assert saved["neuron_order"] == "profile"
    del saved["neuron_order"]  # as written before plans recorded it
    summary.write_text(json.dumps(saved))
    before = path.stat().st_mtime_ns
    with engine.Model(model, threads=1, gpuidx=cached_plan(model, 0.3, prof, 64)):
        pass
    assert path.stat().st_mtime_ns != before and "neuron_order" in json.loads(summary.read_text())


def test_source_order_flag_and_cli_line(tiny_model_dir, pair, tmp_path, capsys):
    _, prof, _, _ = pair("llama-relu")
    out = tmp_path / "m.gguf"
    code, stdout, _ = run_cli(capsys, "convert", "-m", tiny_model_dir("llama-relu"), "--profile", prof, "--outtype", "f32",
                              "-o", out, "-q")
    assert code == 0 and "hottest first" in stdout
    assert neuron_order.read(out, [N_FF] * N_LAYER) is not None
    code, stdout, _ = run_cli(capsys, "convert", "-m", tiny_model_dir("llama-relu"), "--profile", prof, "--outtype", "f32",
                              "-o", out, "-q", "--source-order")
    assert code == 0 and "hottest first" not in stdout
    assert neuron_order.read(out, [N_FF] * N_LAYER) is None


def test_a_damaged_order_is_one_line(pair, tmp_path):
    _, _, ordered, _ = pair("llama-relu")
    with pytest.raises(UserError, match="lists"):
        neuron_order.read(ordered, [N_FF] * (N_LAYER + 1))
    import shutil

    for text, message in ((b"AAAAAAAA", "not an order"),  # neurons 0 and 0 in the first two positions
                          (b"!!!!", "not base64")):
        bad = tmp_path / "bad.gguf"
        shutil.copyfile(ordered, bad)
        field = open_reader(bad, writable=True).fields[neuron_order.ORDER_KEY]
        field.parts[field.data[0]][:len(text)] = np.frombuffer(text, np.uint8)
        with pytest.raises(UserError, match=message):
            neuron_order.read(bad, [N_FF] * N_LAYER)


def test_a_large_order_is_one_field_part(tmp_path):
    """ReluLLaMA-70B's 80 x 28672 neurons: one string, which gguf-py parses as one part (an array is parsed
    element by element: 2.3M parts, 20 s on every open of the file)."""
    import gguf

    orders = [np.random.default_rng(i).permutation(28672) for i in range(80)]
    path = tmp_path / "big.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_key_value(neuron_order.ORDER_KEY, neuron_order.encode(orders), gguf.GGUFValueType.STRING)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    assert len(open_reader(path).fields[neuron_order.ORDER_KEY].parts) < 10  # key, type, value: not 2.3M
    back = neuron_order.read(path, [28672] * 80)
    assert all(np.array_equal(a, b) for a, b in zip(back, orders))
