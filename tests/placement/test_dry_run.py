"""The config-only dry run: the size report equals what the converter writes (byte for byte, tensor for tensor,
cost for cost) on tiny models of every kind; dry-run plans on the bundled real-size configs stay within their
budgets and equal the plan of the converted file; bad input is a one-line error."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from cli_helpers import assert_one_line_error, run_cli
from convert_helpers import write_predictors
from placement_fixtures import power_law_counts, write_profile
from tiny_models import FAMILY_KINDS, HIDDEN, KINDS, N_FF, N_LAYER, QWEN_KINDS

from powerinfer_tools.stages.conversion import dry_run
from powerinfer_tools.stages import options
from powerinfer_tools.stages.placement import placement
from powerinfer_tools.stages.conversion.conversion import convert_model, encoded_nbytes
from powerinfer_tools.core.errors import UserError
from powerinfer_tools.formats.gguf_io import open_reader

RANK = 16
REAL_SIZES = ("relullama-70b", "relufalcon-40b", "opt-30b", "bamboo-7b")


@pytest.fixture(scope="module")
def converted(tiny_model_dir, tmp_path_factory):
    """kind -> (model dir, {outtype: converted file with rank-RANK predictors})."""
    cache = {}

    def get(kind):
        if kind not in cache:
            work = tmp_path_factory.mktemp(f"dry_{kind.replace('-', '_')}")
            source = tiny_model_dir(kind)
            predictors = write_predictors(work / "pred", N_LAYER, HIDDEN, N_FF, rank=RANK)
            files = {}
            for outtype in dry_run.DEFAULT_OUTTYPES:
                files[outtype] = work / f"{outtype}.powerinfer.gguf"
                convert_model(str(source), files[outtype], outtype=outtype, predictors_dir=predictors, progress=False)
            cache[kind] = (source, files)
        return cache[kind]

    return get


@pytest.mark.parametrize("kind", KINDS + QWEN_KINDS + FAMILY_KINDS)
def test_size_report_is_the_converted_file(converted, kind):
    """File size exact (the tokenizer is in the directory), the same tensors with the same shapes and types, and
    the same VRAM costs as placement reads from the written file."""
    source, files = converted(kind)
    model = dry_run.load(str(source))
    assert model.tokenizer_dir is not None
    for outtype, path in files.items():
        report = dry_run.size_report(model, outtype, predictor_rank=RANK)
        assert not report.vocab_estimated
        assert report.file_bytes == path.stat().st_size, (kind, outtype)
        assert sum(report.parts().values()) == report.file_bytes
        written = [(t.name, tuple(int(n) for n in reversed(t.shape)), t.tensor_type.name)
                   for t in open_reader(path).tensors]
        assert [(t.name, t.shape, t.qtype.name) for t in report.tensors] == written
        from_file = placement.model_costs(path)
        for part in ("n_ff", "neuron_bytes", "attention_bytes", "predictor_bytes"):
            assert np.array_equal(getattr(report.costs, part), getattr(from_file, part)), part
        assert (report.costs.output_bytes, report.costs.n_embd_gqa) == (from_file.output_bytes, from_file.n_embd_gqa)
        assert report.parts()["predictors"] == sum(encoded_nbytes(t.shape, t.qtype) for t in report.tensors
                                                   if t.name.endswith((".fc1.weight", ".fc2.weight")))


def test_config_json_alone_estimates_only_the_vocabulary(converted, tmp_path):
    source, files = converted("opt")
    alone = tmp_path / "opt-config-only"
    alone.mkdir()
    shutil.copy(source / "config.json", alone / "config.json")
    for spec in (alone, alone / "config.json"):
        model = dry_run.load(str(spec))
        report = dry_run.size_report(model, "q8_0", predictor_rank=RANK)
        exact = dry_run.size_report(dry_run.load(str(source)), "q8_0", predictor_rank=RANK)
        assert report.vocab_estimated and model.tokenizer_dir is None
        n_vocab = report.tensors[0].shape[0]
        assert abs(report.file_bytes - files["q8_0"].stat().st_size) <= n_vocab * dry_run.VOCAB_BYTES_PER_TOKEN
        assert report.parts()["ffn"] == exact.parts()["ffn"] and report.costs.path == str(spec)


def test_default_predictor_rank_is_the_trainers_cap():
    """10% of the FFN parameters: rank * (n_embd + n_ff) <= 0.1 * (3 or 2) * n_embd * n_ff, the largest such."""
    for name, params_per_neuron in (("relullama-70b", 3), ("relufalcon-40b", 2), ("opt-30b", 2), ("bamboo-7b", 3)):
        model = dry_run.load(name)
        d = model.adapter.dims()
        rank = dry_run.predictor_rank_cap(model.adapter)
        budget = 0.1 * params_per_neuron * d.n_embd * d.n_ff
        assert rank * (d.n_embd + d.n_ff) <= budget < (rank + 1) * (d.n_embd + d.n_ff)


def test_quantized_files_store_the_cap_rank_in_whole_blocks():
    """The cap (1911 for ReluLLaMA-70B) is padded to 1920 in q8_0/q4_0 files, where the predictor's fc2 then
    quantizes; the sizes and the note say so, the f16 file keeps 1911."""
    model = dry_run.load("relullama-70b")
    reports = [dry_run.size_report(model, t) for t in ("f16", "q4_0")]
    fc1 = [{t.name: t.shape for t in r.tensors}["blk.0.fc1.weight"] for r in reports]
    assert fc1 == [(1911, 8192), (1920, 8192)]
    assert [{t.name: t.qtype.name for t in r.tensors}["blk.0.fc2.weight"] for r in reports] == ["F16", "Q4_0"]
    note = dry_run.predictor_note(model, reports)
    assert note.startswith("rank 1911 in every layer") and "stored at rank 1920 in q4_0" in note


def test_bundled_configs_have_the_published_shapes():
    """Spot values of the public configs (hidden, n_ff, layers, heads, KV heads, vocab) and the converted tables."""
    expect = {"relullama-70b": ("llama-relu", 8192, 28672, 80, 64, 8, 32000),
              "relufalcon-40b": ("falcon", 8192, 32768, 60, 128, 8, 65024),
              "opt-30b": ("opt", 7168, 28672, 48, 56, 56, 50272),
              "bamboo-7b": ("bamboo", 4096, 14336, 32, 32, 8, 32000),
              "prosparse-llama-2-13b": ("prosparse", 5120, 13824, 40, 40, 40, 32000)}
    for name, (adapter, n_embd, n_ff, n_layer, n_head, n_kv, n_vocab) in expect.items():
        report = dry_run.size_report(dry_run.load(name), "q4_0", predictor_rank=0)
        a = report.costs.arch
        assert report.hparams[f"{a}.attention.head_count"] == n_head
        assert report.hparams.get(f"{a}.attention.head_count_kv", n_head) == n_kv
        assert dry_run.load(name).adapter.name == adapter
        assert report.costs.n_ff.tolist() == [n_ff] * n_layer and report.costs.n_embd == n_embd
        assert report.tensors[0].name == "token_embd.weight" and report.tensors[0].shape == (n_vocab, n_embd)
        # q4_0: 18 bytes per 32 weights; a neuron is 3 (gated) or 2 rows of n_embd
        assert report.costs.neuron_bytes[0] == (3 if adapter in ("llama-relu", "prosparse", "bamboo") else 2) * n_embd // 32 * 18
    assert dry_run.load("prosparse-llama-2-7b").adapter.rule_thresholds() == [0.01] * 32  # FATReLU's own threshold


@pytest.mark.parametrize("name", REAL_SIZES)
def test_dry_run_plans_on_real_sizes_respect_the_budget(name):
    model = dry_run.load(name)
    report = dry_run.size_report(model, "q4_0", predictor_rank=256)
    parts = report.parts()
    # the KV cache at the default context: the config's, at most 4096
    ctx = options.default_ctx_size(report.costs.context_length)
    kv = report.costs.kv_bytes_per_layer(ctx) * report.costs.n_layer
    fixed = placement.DEFAULT_RESERVE_BYTES + parts["attention"] + parts["predictors"] + parts["output"] + kv + 2**30
    for share in (0.2, 0.6):  # budgets that hold a fifth / three fifths of the FFN beside the fixed costs
        budget = fixed + share * parts["ffn"]
        result = dry_run.plan_from_config(model, "q4_0", budget, predictor_rank=256)
        plan, costs = result.plan, result.report.costs
        assert "ASSUMED" in result.assumption
        assert 0 < sum(v for k, v in plan.breakdown.items() if k != "free") <= budget
        assert plan.breakdown["ffn"] >= share * parts["ffn"]
        assert plan.breakdown["free"] >= 0
        assert plan.breakdown["attention"] == costs.attention_bytes.sum()
        assert plan.breakdown["kv_cache"] == kv and plan.ctx_size == ctx
        assert plan.breakdown["ffn"] == int(np.sum(plan.gpu_neurons * costs.neuron_bytes))
        opened = plan.gpu_neurons > 0
        assert np.all(plan.gpu_neurons[opened] >= plan.min_neurons[opened]) and opened.any()
        served = plan.summary()["served_fraction"]
        assert 0 < served < 1 and served > plan.gpu_neurons.sum() / costs.n_ff.sum()  # hottest first pays off


def test_dry_run_plan_with_a_profile_equals_the_plan_of_the_converted_file(converted, tmp_path):
    source, files = converted("llama-relu")
    profile = write_profile(tmp_path / "prof", power_law_counts(N_LAYER, N_FF), tokens=4096)
    costs = placement.model_costs(files["q8_0"])
    budget = int(placement.DEFAULT_RESERVE_BYTES + costs.output_bytes + costs.attention_bytes.sum()
                 + costs.predictor_bytes.sum() + costs.kv_bytes_per_layer(512) * N_LAYER
                 + 0.4 * np.sum(costs.n_ff * costs.neuron_bytes))
    dry = dry_run.plan_from_config(dry_run.load(str(source)), "q8_0", budget, profile, predictor_rank=RANK,
                                   min_layer_neurons=8).plan  # the automatic minimum is a whole tiny layer
    real = placement.plan_for_model(profile, files["q8_0"], budget, min_layer_neurons=8)
    assert dry.breakdown == real.breakdown and np.array_equal(dry.gpu_neurons, real.gpu_neurons)
    assert all(np.array_equal(a, b) for a, b in zip(dry.gpu_index, real.gpu_index))
    assert 0 < real.gpu_neurons.sum() < N_LAYER * N_FF


def test_cli_convert_dry_run_prints_sizes_and_writes_nothing(converted, tmp_path, capsys, monkeypatch):
    source, files = converted("falcon")
    monkeypatch.chdir(tmp_path)
    code, out, _ = run_cli(capsys, "convert", "--dry-run", "-m", source, "--predictor-rank", RANK)
    assert code == 0 and list(tmp_path.iterdir()) == []
    header, file_row = out.splitlines()[2].split(), next(line for line in out.splitlines() if "  file " in line)
    assert header == list(dry_run.DEFAULT_OUTTYPES)
    sizes = [placement.human_bytes(files[t].stat().st_size) for t in dry_run.DEFAULT_OUTTYPES]
    assert file_row.split()[1:] == [part for s in sizes for part in s.split()]
    assert "nothing written" in out
    # the KV cache as the engine holds it: f32 by default, f16 with --kv-type f16
    import powerinfer_engine as engine

    kv = next(line for line in out.splitlines() if line.startswith("KV cache"))
    for kv_type in ("f32", "f16"):
        with engine.Model(files[dry_run.DEFAULT_OUTTYPES[0]], ctx_size=512, kv_type=kv_type) as m:
            assert f"ctx 512: {placement.human_bytes(m.info['kv_cache_bytes'])}" in kv.replace(" / ", ", ctx 512: ")


def test_cli_plan_dry_run_labels_the_assumption_and_writes_only_out(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, out, _ = run_cli(capsys, "plan", "--dry-run", "-m", "bamboo-7b", "--outtype", "q4_0", "--vram-budget", 8)
    assert code == 0 and list(tmp_path.iterdir()) == []
    assert "ASSUMED activation counts" in out and "VRAM budget breakdown" in out and "layer" in out
    summary = tmp_path / "bamboo.plan.json"
    code, out, _ = run_cli(capsys, "plan", "--dry-run", "-m", "bamboo-7b", "--vram-budget", 8, "-o", summary)
    assert code == 0 and sorted(p.name for p in tmp_path.iterdir()) == ["bamboo.plan.json"]
    data = json.loads(summary.read_text())
    assert data["vram_budget"] == 8 * placement.GIB and data["dry_run"]["outtype"] == "q4_0"
    assert "ASSUMED" in data["dry_run"]["activation_counts"] and len(data["layers"]) == 32


def test_profile_counts_are_checked_against_the_configs_shapes(converted, tmp_path, capsys):
    source, _ = converted("llama-relu")
    counts = [torch.as_tensor(c) for c in power_law_counts(N_LAYER, N_FF)]
    counts[1] = counts[1][:N_FF - 1]
    profile = write_profile(tmp_path / "short", counts)
    code, _, err = run_cli(capsys, "plan", "--dry-run", "-m", source, "--profile", profile, "--vram-budget", 1)
    assert_one_line_error(code, err, f"layer 1 of the model has {N_FF} neurons")
    counts = [torch.as_tensor(c).double() for c in power_law_counts(N_LAYER, N_FF)]
    counts[0][3] = float("nan")
    code, _, err = run_cli(capsys, "plan", "--dry-run", "-m", source, "--profile",
                           write_profile(tmp_path / "nan", counts), "--vram-budget", 1)
    assert_one_line_error(code, err, "NaN")


@pytest.mark.parametrize("case, needles", [
    ("unknown", ("unknown model 'relullama-700b'", "relufalcon-40b")),
    ("gpt2", ("unsupported architecture 'gpt2'",)),
    ("not-transformers", ("cannot read the config", "retnet")),
    ("bad-json", ("cannot read the config",)),
    ("budget", ("below the fixed costs", "attention", "predictors")),
    ("rank", ("--predictor-rank must be 0",)),
    ("convert-out", ("--dry-run sizes the file from the config alone",)),
    ("plan-no-profile", ("--profile is required",)),
])
def test_bad_input_is_one_line(tmp_path, capsys, case, needles):
    model = "relullama-70b"
    if case == "unknown":
        model = "relullama-700b"
    elif case in ("gpt2", "not-transformers", "bad-json"):
        model = tmp_path / "config.json"
        raw = {"gpt2": {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4},
               "not-transformers": {"model_type": "retnet", "hidden_act": "swish"}}.get(case)
        model.write_text(json.dumps(raw) if raw else "{not json")
    args = {"budget": ("plan", "--dry-run", "-m", model, "--vram-budget", 4),
            "rank": ("convert", "--dry-run", "-m", model, "--predictor-rank", -1),
            "convert-out": ("convert", "--dry-run", "-m", model, "-o", tmp_path / "x.gguf"),
            "plan-no-profile": ("plan", "-m", tmp_path / "x.gguf", "--vram-budget", 4)}.get(
        case, ("convert", "--dry-run", "-m", model))
    code, _, err = run_cli(capsys, *args)
    assert_one_line_error(code, err, *needles)
    assert sorted(p.name for p in tmp_path.iterdir()) in ([], ["config.json"])


def test_library_rejects_a_bad_outtype():
    with pytest.raises(UserError, match="unknown outtype"):
        dry_run.size_report(dry_run.load("bamboo-7b"), "q9_0")
    with pytest.raises(UserError, match="outtype 'q5_1' is not written"):
        dry_run.size_report(dry_run.load("bamboo-7b"), "q5_1")
