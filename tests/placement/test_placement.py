"""pi-tools plan: byte costs from a model file, plans within the budget, the gpu-index file, bad input."""
import itertools
import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from placement_fixtures import N_EMBD, N_HEAD, N_KV, N_VOCAB, power_law_counts, write_model, write_profile

from powerinfer_tools.stages.placement import placement
from powerinfer_tools.core.errors import UserError
from powerinfer_tools.formats.gguf_io import open_reader, read_magic

N_LAYER, N_FF = 3, 128


def row_bytes(qtype: str, cols: int) -> int:
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]]
    return cols // block * size


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("model") / "tiny.powerinfer.gguf", N_LAYER, N_FF, "Q8_0")


@pytest.fixture(scope="module")
def counts():
    return power_law_counts(N_LAYER, N_FF, tokens=4096)


@pytest.fixture(scope="module")
def profile(tmp_path_factory, counts):
    return write_profile(tmp_path_factory.mktemp("profile"), counts, tokens=4096)


def run_cli(*args):
    from powerinfer_tools.cli import main

    with pytest.raises(SystemExit) as exc:
        main(list(map(str, args)))
        raise SystemExit(0)
    return exc.value.code


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "F16"])
def test_costs_follow_the_file_quantization(tmp_path, qtype):
    costs = placement.model_costs(write_model(tmp_path / "m.gguf", 2, 96, qtype))
    d_head = N_EMBD // N_HEAD
    assert costs.n_ff.tolist() == [96, 96]
    assert costs.neuron_bytes.tolist() == [3 * row_bytes(qtype, N_EMBD)] * 2
    attention = (2 * N_HEAD + 2 * N_KV) * d_head * row_bytes(qtype, N_EMBD) + 2 * 4 * N_EMBD
    assert costs.attention_bytes.tolist() == [attention] * 2
    assert costs.predictor_bytes.tolist() == [2 * (16 * N_EMBD + 96 * 16)] * 2
    assert costs.output_bytes == N_VOCAB * row_bytes(qtype, N_EMBD) + 4 * N_EMBD
    assert costs.kv_bytes_per_layer(100) == 2 * 100 * N_KV * d_head * 2


@pytest.mark.parametrize("budget_kib", [100, 120, 140, 165])
def test_plans_respect_budget_and_minimum_and_take_hottest(model, profile, counts, budget_kib):
    plan = placement.plan_for_model(profile, model, budget_kib * 1024, ctx_size=64, reserve_bytes=4096,
                                    min_layer_neurons="20")
    assert sum(v for k, v in plan.breakdown.items() if k != "free") + plan.breakdown["free"] == budget_kib * 1024
    assert plan.breakdown["free"] >= 0
    costs = placement.model_costs(model)
    assert plan.breakdown["ffn"] == int(np.sum(plan.gpu_neurons * costs.neuron_bytes))
    for c, k, idx in zip(counts, plan.gpu_neurons, plan.gpu_index):
        assert k == 0 or k >= 20
        assert len(idx) == k and np.all(np.diff(idx) > 0)
        if 0 < k < N_FF:  # every GPU neuron is at least as hot as every CPU neuron
            assert c[idx].min() >= np.delete(c, idx).max()
    inst = placement.placement_solver.Instance(counts, costs.neuron_bytes, np.zeros(N_LAYER), plan.min_neurons,
                                               budget_kib * 1024 - sum(v for k, v in plan.breakdown.items()
                                                                       if k not in ("ffn", "free")))
    assert plan.served.sum() >= placement.placement_solver.greedy(inst).value


def test_budget_zero_is_all_cpu_and_a_large_budget_is_all_gpu(model, profile):
    cpu = placement.plan_for_model(profile, model, 0)
    assert cpu.gpu_neurons.tolist() == [0] * N_LAYER and cpu.breakdown["free"] == 0
    gpu = placement.plan_for_model(profile, model, placement.GIB)  # default 256 MiB reserve, ctx 512
    assert gpu.gpu_neurons.tolist() == [N_FF] * N_LAYER
    assert gpu.summary()["served_fraction"] == 1.0


def test_with_ffn_policy_charges_dense_parts_only_for_offloading_layers(model, profile):
    costs = placement.model_costs(model)
    one_layer = costs.attention_bytes[0] + costs.predictor_bytes[0] + costs.kv_bytes_per_layer(64)
    budget = int(costs.output_bytes + one_layer + N_FF * costs.neuron_bytes[0] + 100)
    plan = placement.plan_for_model(profile, model, budget, ctx_size=64, reserve_bytes=0, dense="with-ffn",
                                    min_layer_neurons="0")
    assert (plan.gpu_neurons > 0).sum() >= 1
    opened = int((plan.gpu_neurons > 0).sum())
    assert plan.breakdown["attention"] == opened * costs.attention_bytes[0]
    assert plan.breakdown["kv_cache"] == opened * costs.kv_bytes_per_layer(64)
    assert plan.breakdown["free"] >= 0


def test_auto_minimum_follows_the_cost_model(model, profile, counts):
    costs = placement.model_costs(model)
    mins = placement.auto_min_neurons(counts, costs, 4096.0)
    overhead = placement.SPLIT_LAYER_OVERHEAD_S + 2 * N_EMBD * 4 / placement.PCIE_BYTES_PER_S
    for c, m, b in zip(counts, mins, costs.neuron_bytes):
        saved = np.cumsum(np.sort(c)[::-1]) / 4096 * b / placement.CPU_BYTES_PER_S
        if saved[-1] >= overhead:
            assert saved[m - 1] >= overhead and (m == 1 or saved[m - 2] < overhead)
        else:
            assert m == len(c)  # a tiny layer never pays for a split: all or nothing


def test_gpuidx_reads_back_with_gguf_py(model, profile, counts, tmp_path):
    plan = placement.plan_for_model(profile, model, 100 * 1024, ctx_size=64, reserve_bytes=0,
                                    min_layer_neurons="8")
    out = tmp_path / "x.generated.gpuidx"
    placement.write_gpuidx(plan, out)
    placement.write_summary(plan, tmp_path / "x.json")
    assert read_magic(out) == b"PWRI"
    reader = open_reader(out)
    assert reader.fields["general.architecture"].contents() == "generic.gpu_index"
    assert reader.fields["generic.gpu_index.block_count"].contents() == N_LAYER
    assert reader.fields["split.vram_capacity"].contents() == plan.breakdown["ffn"]
    names = [t.name for t in reader.tensors]
    assert names == [f"blk.{i}.{kind}" for i in range(N_LAYER) for kind in ("gpu_idx", "gpu_bucket")]
    tensors = {t.name: t for t in reader.tensors}
    for i in range(N_LAYER):
        mask, bucket = tensors[f"blk.{i}.gpu_idx"], tensors[f"blk.{i}.gpu_bucket"]
        assert mask.tensor_type == bucket.tensor_type == gguf.GGMLQuantizationType.I32
        assert mask.data.shape == (N_FF,) and set(np.unique(mask.data)) <= {0, 1}
        assert np.array_equal(np.flatnonzero(mask.data), np.asarray(bucket.data))
        assert len(bucket.data) == plan.gpu_neurons[i]
    summary = json.loads((tmp_path / "x.json").read_text())
    assert summary["gpu_neurons"] == int(plan.gpu_neurons.sum())
    assert sum(summary["breakdown_bytes"].values()) == plan.vram_budget


def test_cli_writes_gpuidx_beside_the_model_and_prints_breakdown(model, profile, tmp_path, capsys):
    import shutil

    local = tmp_path / "m.powerinfer.gguf"
    shutil.copy(model, local)
    assert run_cli("plan", "--profile", profile, "--model", local, "--vram-budget", 0.0001, "--ctx-size", 64,
                   "--reserve-mib", 0, "--min-layer-neurons", 4) == 0
    captured = capsys.readouterr()
    text = captured.out
    assert "VRAM budget breakdown" in text and "KV cache (ctx 64)" in text and "served" in text
    from powerinfer_tools.cli import plan as plan_cli  # a machine without a GPU is told the budget is a guess
    assert ("no NVIDIA GPU is visible here" in captured.err) == (not plan_cli._nvidia_gpu_visible())
    out = tmp_path / "m.powerinfer.gguf.generated.gpuidx"
    assert open_reader(out).fields["generic.gpu_index.block_count"].contents() == N_LAYER
    assert json.loads((tmp_path / "m.powerinfer.gguf.generated.gpuidx.json").read_text())["ctx_size"] == 64


@pytest.mark.parametrize("visible", [False, True])
def test_plan_without_a_gpu_says_the_plan_is_for_another_machine(visible, model, profile, tmp_path, capsys,
                                                                 monkeypatch):
    """Issue 56: on a machine without a GPU a plan only serves another one (run and perplexity ignore a .gpuidx
    there), and plan says so once; with a GPU it says nothing of the kind."""
    from powerinfer_tools.cli import plan as plan_cli

    monkeypatch.setattr(plan_cli, "_nvidia_gpu_visible", lambda: visible)
    assert run_cli("plan", "--profile", profile, "-m", model, "--vram-budget", 0.001, "-o", tmp_path / "p.gpuidx",
                   "--reserve-mib", 0) == 0
    err = capsys.readouterr().err
    assert err.count("no NVIDIA GPU is visible here: this plan is for another machine, one with 0.001 GiB of GPU "
                     "memory to give (--vram-budget); here run, perplexity, chat and serve ignore it") == (not visible)


def expect_one_line_error(capsys, code, *needles):
    assert code == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("pi-tools: error:") and "\n" not in err and "Traceback" not in err
    for needle in needles:
        assert needle in err
    return err


def test_budget_below_fixed_costs_is_one_line_with_breakdown(model, profile, tmp_path, capsys):
    out = tmp_path / "never.gpuidx"
    from powerinfer_tools.formats.gguf_header import read_header

    code = run_cli("plan", "--profile", profile, "-m", model, "--vram-budget", 0.00001, "-o", out)
    ctx = placement.model_ctx_size(read_header(model))  # the model's default context, which run opens it with
    assert ctx == 2048  # the file names no context_length: the engine's assumption
    expect_one_line_error(capsys, code, "below the fixed costs", "reserve", "output", f"KV cache (ctx {ctx})",
                          "attention", "predictors")
    assert not out.exists()


def bad_profile(tmp_path, counts):
    return write_profile(tmp_path / "bad", counts)


@pytest.mark.parametrize("case, needle", [
    ("short", "layer 1 of the model has 128 neurons"),
    ("layers", "the model has 3 layers"),
    ("negative", "negative"),
    ("nan", "NaN"),
    ("2d", "must have 1 dimension, not 2"),
])
def test_bad_activation_files_are_one_line_errors(model, counts, tmp_path, capsys, case, needle):
    bad = [torch.as_tensor(c) for c in counts]
    if case == "short":
        bad[1] = bad[1][:100]
    elif case == "layers":
        bad = bad[:2]
    elif case == "negative":
        bad[2] = bad[2].clone()
        bad[2][5] = -3
    elif case == "nan":
        bad[0] = bad[0].double()
        bad[0][7] = float("nan")
    elif case == "2d":
        bad[0] = bad[0].reshape(2, -1)
    profile = bad_profile(tmp_path, bad)
    out = tmp_path / "never.gpuidx"
    code = run_cli("plan", "--profile", profile, "-m", model, "--vram-budget", 1, "-o", out)
    expect_one_line_error(capsys, code, needle)
    assert not out.exists()


def test_library_errors_are_user_errors(model, profile, tmp_path):
    with pytest.raises(UserError, match="min-layer-neurons"):
        placement.plan_for_model(profile, model, 10**9, min_layer_neurons="many")
    with pytest.raises(UserError, match="no activation"):
        placement.plan_for_model(tmp_path, model, 10**9)
    with pytest.raises(UserError, match=r"--vram-budget must be a number in \[0, 1048576\] GiB"):
        placement.plan_for_model(profile, model, -1)
    not_a_model = tmp_path / "x.gguf"
    not_a_model.write_bytes(b"nope" * 10)
    with pytest.raises(UserError, match="magic"):
        placement.plan_for_model(profile, not_a_model, 10**9)


def test_convert_with_vram_budget_writes_gpuidx_beside_the_model(tiny_model_dir, tmp_path, capsys):
    from convert_helpers import write_predictors
    from tiny_models import HIDDEN, N_FF as TINY_FF, N_LAYER as TINY_LAYERS

    predictors = write_predictors(tmp_path / "pred", TINY_LAYERS, HIDDEN, TINY_FF)
    prof = write_profile(tmp_path / "prof", power_law_counts(TINY_LAYERS, TINY_FF), tokens=4096)
    out = tmp_path / "tiny.powerinfer.gguf"
    assert run_cli("convert", "-m", tiny_model_dir("llama-relu"), "--predictors", predictors, "--profile", prof, "--outtype", "q8_0",
                   "-o", out, "-q", "--vram-budget", 0.5) == 0
    assert "VRAM budget breakdown" in capsys.readouterr().out
    direct = placement.plan_for_model(prof, out, 0.5 * placement.GIB, granularity="powerinfer")
    saved = json.loads(Path(f"{out}.generated.gpuidx.json").read_text())
    assert saved["granularity"] == placement.POWERINFER_GRANULARITY  # a q8_0 file: f16 down projection
    reader = open_reader(f"{out}.generated.gpuidx")
    assert reader.fields["split.vram_capacity"].contents() == direct.breakdown["ffn"] > 0
    for i, idx in enumerate(direct.gpu_index):
        bucket = next(t for t in reader.tensors if t.name == f"blk.{i}.gpu_bucket")
        assert np.array_equal(np.asarray(bucket.data), idx)


def test_convert_vram_budget_without_profile_fails_before_converting(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "never.powerinfer.gguf"
    code = run_cli("convert", "-m", tiny_model_dir("llama-relu"), "--outtype", "q8_0", "-o", out, "-q", "--vram-budget", 1)
    expect_one_line_error(capsys, code, "--vram-budget needs --profile")
    assert not out.exists()


@pytest.mark.parametrize("qtype, step", [("F16", placement.POWERINFER_GRANULARITY),
                                         ("Q4_0", placement.POWERINFER_GRANULARITY_Q4_0)])
def test_powerinfer_granularity_equals_enumerating_the_counts(tmp_path, qtype, step):
    """Each layer's GPU count is 0, a multiple of what PowerInfer's CUDA build takes for the file's down projection
    (256 for q4_0, else 32), or the whole layer; and the plan serves as much as the best such counts do
    (enumerated: for a given count the hottest neurons are best)."""
    n_ff = 640  # 2.5 x 256: the whole layer is a count of its own
    model = write_model(tmp_path / "m.gguf", N_LAYER, n_ff, qtype)
    counts = power_law_counts(N_LAYER, n_ff, tokens=4096, seed=5)
    prof = write_profile(tmp_path / "prof", counts, tokens=4096)
    free = placement.plan_for_model(prof, model, 10**9, reserve_bytes=0, min_layer_neurons="0")
    fixed = sum(v for k, v in free.breakdown.items() if k not in ("ffn", "free"))
    neuron = placement.model_costs(model).neuron_bytes
    for share in (0.3, 0.55, 0.8):
        capacity = int(share * n_ff * neuron.sum())
        plan = placement.plan_for_model(prof, model, fixed + capacity, reserve_bytes=0, min_layer_neurons="0",
                                        granularity="powerinfer")
        assert plan.granularity == step
        k = plan.gpu_neurons
        assert np.all((k % step == 0) | (k == n_ff)), k
        assert int(np.sum(k * neuron)) <= capacity
        prefix = [np.concatenate(([0], np.cumsum(np.sort(c)[::-1]))) for c in counts]
        allowed = sorted(set(range(0, n_ff + 1, step)) | {n_ff})
        best = max(sum(p[j] for p, j in zip(prefix, ks)) for ks in itertools.product(allowed, repeat=N_LAYER)
                   if int(np.sum(np.array(ks) * neuron)) <= capacity)
        assert plan.served.sum() == pytest.approx(best)
        fine = placement.plan_for_model(prof, model, fixed + capacity, reserve_bytes=0, min_layer_neurons="0")
        assert fine.served.sum() >= plan.served.sum()
    with pytest.raises(UserError, match="--granularity"):
        placement.plan_for_model(prof, model, 10**9, granularity="0")
    out = tmp_path / "m.gpuidx"
    assert run_cli("plan", "--profile", prof, "-m", model, "--vram-budget", 0.5, "--granularity", "powerinfer",
                   "-o", out) == 0
    assert json.loads(Path(f"{out}.json").read_text())["granularity"] == step


def test_a_missing_activation_file_is_named(model, counts, tmp_path, capsys):
    profile = bad_profile(tmp_path, [torch.as_tensor(c) for c in counts])
    (profile / "activation" / "activation_1.pt").unlink()
    code = run_cli("plan", "--profile", profile, "-m", model, "--vram-budget", 1, "-o", tmp_path / "never.gpuidx")
    expect_one_line_error(capsys, code, "activation_1.pt is missing, but the model has 3 layers (0-2)")


def test_a_negative_budget_is_named_in_gib(model, profile, tmp_path, capsys):
    code = run_cli("plan", "--profile", profile, "-m", model, "--vram-budget", -1, "-o", tmp_path / "never.gpuidx")
    expect_one_line_error(capsys, code, "--vram-budget must be a number in [0, 1048576] GiB, not -1")
