"""`pi-tools sparsify` on a tiny random SiLU Llama: the ReLU model it writes loads in transformers and runs
through the rest of the pipeline, L1 raises its sparsity, an interrupted run resumes bit for bit, bad input
gets one line."""
from __future__ import annotations

import json
import os
import signal
import warnings

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import powerinfer_engine as engine
from cli_helpers import assert_one_line_error, run_cli
from engine_helpers import hf_logits, max_rel_err, random_tokens
from tiny_models import training_text
from powerinfer_tools.models import arch
from powerinfer_tools import models
from powerinfer_tools.runtime import default_build as pipeline
from powerinfer_tools.stages.profiling import calibration
from powerinfer_tools.stages import sparsification as sparsify
from powerinfer_tools.stages.sparsification import end_to_end, layer_local

# a few seconds a run: 32-token sequences, 2 of them a step
SMALL = ("--seq-len", "32", "--batch", "2", "--local-tokens", "1024", "--local-epochs", "2", "--tokens", "1536",
         "--eval-tokens", "256")


@pytest.fixture(scope="module")
def sparsified(tiny_model_dir, calib, tmp_path_factory):
    """The tiny SiLU model sparsified at target 0.9, plain ReLU (no threshold shift), and its report."""
    out = tmp_path_factory.mktemp("sparsified") / "relu"
    from powerinfer_tools.cli import main
    try:
        main(["sparsify", "-m", str(tiny_model_dir("llama-silu")), "--calib", str(calib), "-o", str(out),
              "--target-sparsity", "0.9", *SMALL, "--local-epochs", "8", "--shift-budget", "0"])
    except SystemExit as exc:
        assert exc.code in (0, None)
    return out, json.loads((out / "sparsify.json").read_text())


def test_writes_a_relu_llama_that_transformers_and_the_pipeline_load(sparsified, tmp_path, monkeypatch):
    out, report = sparsified
    config = json.loads((out / "config.json").read_text())
    assert config["hidden_act"] == "relu" and config["model_type"] == "llama"
    # PowerInfer's converters read a top-level rope_theta (its convert.py: config.get("rope_theta"))
    assert config["rope_theta"] == config["rope_parameters"]["rope_theta"]
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out)  # plain transformers, no adapter
    assert model.config.hidden_act == "relu"
    adapter = arch.for_config(models.load_config(models.resolve(str(out))))
    assert adapter.name == "llama-relu"

    monkeypatch.setenv("POWERINFER_TOOLS_CACHE", str(tmp_path / "cache"))
    path = pipeline.build(str(out), outtype="f32", tokens=1024, rank=8)  # profile -> train-predictor -> convert
    tokens = random_tokens(12, config["vocab_size"])
    ref = hf_logits(out, tokens, weights_from=path)  # the file's weights (its down projection is f16)
    with engine.Model(path, sparse_mode="dense") as llm:
        dense = llm.eval(tokens)
    with engine.Model(path, sparse_mode="gate") as llm:
        gate = llm.eval(tokens)
    assert max_rel_err(dense, ref) < 1e-4
    np.testing.assert_allclose(gate, dense, rtol=1e-5, atol=1e-5)  # ReLU: skipping exact zeros is exact


def test_threshold_shift_writes_a_fatrelu_model_that_the_pipeline_runs(tiny_model_dir, calib, tmp_path, capsys,
                                                                       monkeypatch):
    out = tmp_path / "fatrelu"
    code, stdout, err = run_cli(capsys, "sparsify", "-m", tiny_model_dir("llama-silu"), "--calib", calib, "-o", out,
                                "--target-sparsity", "0.6", *SMALL, "--shift-budget", "0.05")
    assert code == 0, err
    shift = json.loads((out / "sparsify.json").read_text())["threshold_shift"]
    t = shift["threshold"]
    assert t > 0 and "FATReLU threshold" in stdout
    assert shift["sparsity_shifted"] > shift["sparsity_relu"]
    assert shift["perplexity_shifted"] <= 1.05 * shift["perplexity_relu"]
    limit = 1.05 * shift["perplexity_relu"]
    assert t == max(c["threshold"] for c in shift["tried"] if c["perplexity"] <= limit)  # the largest accepted
    assert all(c["threshold"] > t for c in shift["tried"] if c["perplexity"] > limit)
    config = json.loads((out / "config.json").read_text())
    assert config["hidden_act"] == "fatrelu" and config["hidden_act_param"] == t
    model, adapter = models.load_model(models.resolve(str(out)))
    assert adapter.name == "prosparse" and adapter.rule_thresholds() == [t] * 2

    monkeypatch.setenv("POWERINFER_TOOLS_CACHE", str(tmp_path / "cache"))
    path = pipeline.build(str(out), outtype="f32", tokens=1024, rank=8)
    tokens = random_tokens(12, config["vocab_size"])
    ref = hf_logits(out, tokens, weights_from=path)
    with engine.Model(path, sparse_mode="dense") as llm:
        dense = llm.eval(tokens)
    with engine.Model(path, sparse_mode="gate") as llm:
        gate = llm.eval(tokens)
    assert max_rel_err(dense, ref) < 1e-4    # the engine cuts at t as transformers' Threshold does
    np.testing.assert_allclose(gate, dense, rtol=1e-5, atol=1e-5)


def test_threshold_search_keeps_the_largest_t_within_the_budget(monkeypatch):
    """Against an exhaustive reference on a known perplexity curve: ppl(t) = 10 (1 + t^2)."""
    from powerinfer_tools.stages.sparsification import threshold_shift as ts

    curve = lambda t: 10.0 * (1.0 + t * t)
    monkeypatch.setattr(ts, "_measure", lambda model, adapter, seqs, batch, t: (curve(t), 0.5 + t))
    monkeypatch.setattr(ts, "_top_activation", lambda model, adapter, seqs: 1.0)
    monkeypatch.setattr(ts, "set_threshold", lambda adapter, model, t: None)
    shift = ts.calibrate(None, None, None, budget=0.04, batch=1)   # exact answer: t = 0.2
    grid = [1.0 / 2 ** k for k in range(ts.GRID_OCTAVES, -1, -1)]
    assert max(t for t in grid if curve(t) <= 10.4) < shift.threshold <= 0.2
    assert shift.threshold > 0.9 * 0.2       # the refinement closes most of the last octave
    assert shift.perplexity_shifted == curve(shift.threshold) <= 10.4
    assert ts.calibrate(None, None, None, budget=0.0, batch=1).threshold == 0.0


def test_l1_raises_sparsity_to_the_target(sparsified):
    _, report = sparsified
    before = [h["relu_sparsity_before"] for h in report["history"] if h["phase"] == 1 and "error" in h]
    assert len(before) == len(report["layer_sparsity"]) == 2
    assert report["sparsity"] > max(before) + 0.15       # a plain ReLU swap leaves about half the gates on
    assert report["sparsity"] > 0.8                      # steered to 0.9
    layers = [h for h in report["history"] if h["phase"] == 1 and "error" in h]
    assert all(h["error"] <= h["error_trained"] for h in layers)   # the least-squares down projection
    assert any(h["error"] < 0.9 * h["error_trained"] for h in layers)
    held = report["held_out"]
    assert held["perplexity_sparsified"] > 0 and held["perplexity_ratio"] == pytest.approx(
        held["perplexity_sparsified"] / held["perplexity_original"])
    assert report["tokens_seen"]["end_to_end"] == 1536


def _interrupt_at(monkeypatch, module, name: str, n: int, sig=signal.SIGINT):
    """Sends this process SIGINT (a real Ctrl-C), or `sig`, during the n-th call of module.<name>."""
    real = getattr(module, name)
    calls = {"n": 0}

    def wrapped(*a, **kw):
        calls["n"] += 1
        if calls["n"] == n:
            os.kill(os.getpid(), sig)
        return real(*a, **kw)

    monkeypatch.setattr(module, name, wrapped)


@pytest.mark.parametrize("activation", ["relu", "drelu"])
def test_interrupted_run_resumes_bit_for_bit(tiny_model_dir, calib, tmp_path, capsys, monkeypatch, activation):
    model = str(tiny_model_dir("llama-silu"))
    args = ("sparsify", "-m", model, "--calib", calib, *SMALL, "--activation", activation)
    code, _, _ = run_cli(capsys, *args, "-o", tmp_path / "straight")
    assert code == 0

    with monkeypatch.context() as m:       # Ctrl-C in the layer-local phase (second layer) ...
        _interrupt_at(m, layer_local, "local_step", 40)
        code, _, err = run_cli(capsys, *args, "-o", tmp_path / "resumed")
    assert code == 130 and "--resume" in err and not (tmp_path / "resumed").exists()
    with monkeypatch.context() as m:       # ... then in the end-to-end phase, by SIGTERM (as a job scheduler stops it)
        _interrupt_at(m, end_to_end, "e2e_step", 5, signal.SIGTERM)
        code, out, err = run_cli(capsys, *args, "-o", tmp_path / "resumed", "--resume")
    assert code == 130 and "phase 1, layer 1" in out and not (tmp_path / "resumed").exists()
    code, out, _ = run_cli(capsys, *args, "-o", tmp_path / "resumed", "--resume")
    assert code == 0 and "phase 2" in out

    straight = load_file(tmp_path / "straight" / "model.safetensors")
    resumed = load_file(tmp_path / "resumed" / "model.safetensors")
    assert straight.keys() == resumed.keys()
    for name in straight:
        assert torch.equal(straight[name], resumed[name]), name
    assert not sparsify.partial_dir(tmp_path / "resumed").exists()


def test_gradient_checkpointing_recomputes_the_same_training(tiny_model_dir, calib, tmp_path, capsys):
    args = ("sparsify", "-m", tiny_model_dir("llama-silu"), "--calib", calib, *SMALL, "--local-epochs", "0",
            "--tokens", "256", "--shift-budget", "0")
    code, _, err = run_cli(capsys, *args, "-o", tmp_path / "stored")
    assert code == 0, err
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)     # transformers' deprecated name is not the one called
        code, _, err = run_cli(capsys, *args, "-o", tmp_path / "recomputed", "--grad-checkpointing")
    assert code == 0, err
    stored = load_file(tmp_path / "stored" / "model.safetensors")
    recomputed = load_file(tmp_path / "recomputed" / "model.safetensors")
    source = load_file(tiny_model_dir("llama-silu") / "model.safetensors")
    assert not torch.equal(stored["model.layers.0.mlp.gate_proj.weight"], source["model.layers.0.mlp.gate_proj.weight"])
    for name in stored:
        torch.testing.assert_close(recomputed[name], stored[name], rtol=1e-6, atol=1e-7)


def test_bad_input_one_line(tiny_model_dir, calib, tmp_path, capsys):
    silu = str(tiny_model_dir("llama-silu"))
    out = tmp_path / "out"
    code, _, err = run_cli(capsys, "sparsify", "-m", str(tiny_model_dir("llama-relu")), "--calib", calib, "-o", out)
    assert_one_line_error(code, err, "already a relu model")
    code, _, err = run_cli(capsys, "sparsify", "-m", str(tiny_model_dir("opt")), "--calib", calib, "-o", out)
    assert_one_line_error(code, err, "already a relu model")
    for bad in ("0", "1", "1.5", "-0.2"):
        code, _, err = run_cli(capsys, "sparsify", "-m", silu, "--calib", calib, "-o", out, "--target-sparsity", bad)
        assert_one_line_error(code, err, "--target-sparsity must be a number in (0, 1)")
    for bad in ("1", "-0.01"):
        code, _, err = run_cli(capsys, "sparsify", "-m", silu, "--calib", calib, "-o", out, "--shift-budget", bad)
        assert_one_line_error(code, err, "--shift-budget must be a number in [0, 1)")
    for bad in ("gelu", "ReLU", ""):
        code, _, err = run_cli(capsys, "sparsify", "-m", silu, "--calib", calib, "-o", out, "--activation", bad)
        assert_one_line_error(code, err, f"--activation must be relu or drelu, got {bad!r}")
    code, _, err = run_cli(capsys, "sparsify", "-m", silu, "--calib", calib, "-o", out, "--self-tokens", "-1")
    assert_one_line_error(code, err, "--self-tokens must be >= 0")
    code, _, err = run_cli(capsys, "sparsify", "-m", silu, "-o", out, "--self-tokens", "64")
    assert_one_line_error(code, err, "--self-tokens adds the model's own text to --calib files")
    small = tmp_path / "small.txt"
    small.write_text("To be, or not to be, that is the question.")
    code, _, err = run_cli(capsys, "sparsify", "-m", silu, "--calib", small, "-o", out)
    assert_one_line_error(code, err, "shorter than one sequence")
    code, _, err = run_cli(capsys, "sparsify", "-m", silu, "--calib", calib, "-o", out, "--seq-len", "32",
                           "--batch", "100000")
    assert_one_line_error(code, err, "sparsify needs at least 100001")
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    code, _, err = run_cli(capsys, "sparsify", "-m", silu, "--calib", calib, "-o", blocker / "out")
    assert_one_line_error(code, err, "not a writable directory")
    code, _, err = run_cli(capsys, "sparsify", "-m", silu, "--calib", calib, "-o", out, "--resume")
    assert_one_line_error(code, err, "no interrupted sparsify run")
    code, _, err = run_cli(capsys, "sparsify", "-m", silu, "--calib", tmp_path / "missing.txt", "-o", out)
    assert_one_line_error(code, err, "calibration file not found")
    for not_a_file in ("/dev/null", tmp_path):   # there, but no text file: not "not found"
        code, _, err = run_cli(capsys, "sparsify", "-m", silu, "--calib", not_a_file, "-o", out)
        assert_one_line_error(code, err, f"calibration file {not_a_file} is not a regular file")
    assert not out.exists() and not sparsify.partial_dir(out).exists()


def test_self_tokens_join_the_training_rows_not_the_held_out(tiny_model_dir, calib, tmp_path, capsys, monkeypatch):
    """--self-tokens: the model's own text is generated once and appended to the training rows; the held-out
    rows, which measure the result, stay the calibration file's tail."""
    generated, trained = [], []
    real_generate, real_phase2 = calibration.self_generated, end_to_end.train

    def generate(*args, **kw):
        generated.append(real_generate(*args, **kw))
        return generated[-1]

    def phase2(teacher, student, adapter, train, *args):
        trained.append(train)
        return real_phase2(teacher, student, adapter, train, *args)

    monkeypatch.setattr(calibration, "self_generated", generate)
    monkeypatch.setattr(end_to_end, "train", phase2)
    out = tmp_path / "relu"
    common = ("sparsify", "-m", str(tiny_model_dir("llama-silu")), "--calib", calib, *SMALL, "--local-epochs", "1",
              "--shift-budget", "0")
    code, _, err = run_cli(capsys, *common, "-o", out, "--self-tokens", "64")
    assert code == 0, err
    code, _, err = run_cli(capsys, *common, "-o", tmp_path / "files-only")
    assert code == 0, err
    (own,) = generated
    with_own, files_only = trained
    assert own.shape == (2, 32)
    assert torch.equal(with_own[:-2], files_only) and torch.equal(with_own[-2:], own)
    # the same held-out rows: the original model's perplexity on them is the same number
    held = [json.loads((d / "sparsify.json").read_text())["held_out"] for d in (out, tmp_path / "files-only")]
    assert held[0]["sequences"] == held[1]["sequences"]
    assert held[0]["perplexity_original"] == pytest.approx(held[1]["perplexity_original"], rel=1e-6)


def test_resume_with_other_options_is_refused(tiny_model_dir, calib, tmp_path, capsys, monkeypatch):
    args = ("sparsify", "-m", str(tiny_model_dir("llama-silu")), "--calib", calib, "-o", tmp_path / "out", *SMALL)
    with monkeypatch.context() as m:
        _interrupt_at(m, layer_local, "local_step", 3)
        code, _, _ = run_cli(capsys, *args)
    assert code == 130
    code, _, err = run_cli(capsys, *args, "--resume", "--target-sparsity", "0.7")
    assert_one_line_error(code, err, "other options", "target_sparsity")
    code, _, err = run_cli(capsys, *args, "--resume", "--activation", "drelu")
    assert_one_line_error(code, err, "other options", "activation")


@pytest.mark.slow
def test_gguf_source_is_written_as_a_float_checkpoint(tmp_path, capsys):
    """The default model is a GGUF file, which transformers marks as quantized when it loads one (its weights
    dequantized): the output must still be a plain float checkpoint. --local-epochs 0 --tokens 0 is the bare
    ReLU swap, which leaves about half the gates on."""
    calib = tmp_path / "calib.txt"
    calib.write_text(training_text()[:40_000])
    out = tmp_path / "relu"
    code, _, err = run_cli(capsys, "sparsify", "-m", "smollm2", "--calib", calib, "-o", out, "--local-epochs", "0",
                           "--tokens", "0", "--seq-len", "64", "--eval-tokens", "256", "--shift-budget", "0")
    assert code == 0, err
    config = json.loads((out / "config.json").read_text())
    assert config["hidden_act"] == "relu" and "quantization_config" not in config
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(out).config.hidden_act == "relu"
    report = json.loads((out / "sparsify.json").read_text())
    assert report["tokens_seen"] == {"layer_local": 0, "end_to_end": 0}
    assert 0.3 < report["sparsity"] < 0.8
    assert report["held_out"]["perplexity_ratio"] > 1.5   # the swap alone is far from the original


def test_the_output_files_are_readable_by_all(sparsified):
    """As every other output (atomic_file, atomic_dir): safetensors' own temporary file left model.safetensors 0600."""
    out, _ = sparsified
    mask = os.umask(0)
    os.umask(mask)
    for path in out.iterdir():
        assert path.stat().st_mode & 0o777 == 0o666 & ~mask, path
