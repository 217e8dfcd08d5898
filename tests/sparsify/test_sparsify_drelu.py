"""`pi-tools sparsify --activation drelu` on a tiny random SiLU Llama: the dReLU student (relu(gate x) *
relu(up x)) is written in the Bamboo form, which the pipeline converts and our engine runs as the student
computed it (gate mode exact); its penalty reaches both projections; the threshold shift does not apply."""
from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch

import powerinfer_engine as engine
from engine_helpers import load_file_weights, max_rel_err, random_tokens
from test_sparsify import SMALL
from powerinfer_tools import models
from powerinfer_tools.cli import main
from powerinfer_tools.models.arch.llama_silu import LlamaSilu
from powerinfer_tools.runtime import default_build as pipeline
from powerinfer_tools.stages.sparsification import student as student_mod
from powerinfer_tools.stages.sparsification.student import StudentForm


@pytest.fixture(scope="module")
def drelu(tiny_model_dir, calib, tmp_path_factory):
    """The tiny SiLU model sparsified with dReLU at target 0.9: (output, report, the student as trained)."""
    out = tmp_path_factory.mktemp("sparsified") / "drelu"
    made = []
    real = StudentForm.make

    def keep(self, teacher):
        made.append(real(self, teacher))
        return made[-1]

    with pytest.MonkeyPatch.context() as m:
        m.setattr(student_mod.StudentForm, "make", keep)
        try:
            main(["sparsify", "-m", str(tiny_model_dir("llama-silu")), "--calib", str(calib), "-o", str(out),
                  "--activation", "drelu", "--target-sparsity", "0.9", *SMALL, "--local-epochs", "8"])
        except SystemExit as exc:
            assert exc.code in (0, None)
    (student, _), = made
    return out, json.loads((out / "sparsify.json").read_text()), student


def _logits(model, tokens: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(input_ids=torch.tensor([tokens]), use_cache=False).logits[0].float().numpy()


def test_the_drelu_student_runs_in_the_engine_as_it_was_trained(drelu, tmp_path, monkeypatch):
    out, report, student = drelu
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "bamboo" and config["architectures"] == ["BambooForCausalLM"]
    assert config["hidden_act"] == "relu" and config["sliding_window"] is None and "hidden_act_param" not in config
    loaded, adapter = models.load_model(models.resolve(str(out)))
    assert adapter.name == "bamboo" and adapter.activation == "drelu"
    x = torch.randn(8, config["hidden_size"])
    for layer in loaded.model.layers:   # the layer-local phase trains the function the model computes
        with torch.no_grad():
            torch.testing.assert_close(layer.mlp.down_proj(StudentForm("drelu", adapter).ffn(layer.mlp, x)[1]),
                                       layer.mlp(x))
    tokens = random_tokens(12, config["vocab_size"])
    ref = _logits(student, tokens)
    assert max_rel_err(_logits(loaded, tokens), ref) < 1e-5   # the written form reads back as the student

    monkeypatch.setenv("POWERINFER_TOOLS_CACHE", str(tmp_path / "cache"))
    path = pipeline.build(str(out), outtype="f32", tokens=1024, rank=8)  # profile -> train-predictor -> convert
    with engine.Model(path, sparse_mode="dense") as llm:
        dense = llm.eval(tokens)
    with engine.Model(path, sparse_mode="gate") as llm:
        gate = llm.eval(tokens)
        assert llm.info["arch"] == "bamboo" and llm.info["activation"] == "drelu"
    on_file = copy.deepcopy(student)   # the student's forward on the file's weights (its down projection is f16)
    load_file_weights(on_file, path, config["num_attention_heads"], config["num_key_value_heads"])
    assert max_rel_err(dense, _logits(on_file, tokens)) < 1e-4
    np.testing.assert_allclose(gate, dense, rtol=1e-5, atol=1e-5)   # dReLU: skipping exact zeros is exact
    assert max_rel_err(dense, ref) < 1e-2


def test_drelu_sparsity_and_report(drelu):
    _, report, _ = drelu
    assert report["activation"] == "drelu"
    before = [h["relu_sparsity_before"] for h in report["history"] if h["phase"] == 1 and "error" in h]
    assert len(before) == 2 and min(before) > 0.6   # a dReLU swap leaves about a quarter of the neurons on
    assert report["sparsity"] > max(before) + 0.05 and report["sparsity"] > 0.8
    layers = [h for h in report["history"] if h["phase"] == 1 and "error" in h]
    assert all(h["error"] <= h["error_trained"] for h in layers)   # the least-squares down projection
    assert any(h["error"] < h["error_trained"] for h in layers)
    shift = report["threshold_shift"]   # Bamboo's form has no threshold: not shifted, measured as it is
    assert shift["threshold"] == 0.0 and shift["tried"] == [] and shift["budget"] == 0.0
    assert shift["sparsity_relu"] > 0.8


@pytest.mark.parametrize("activation", ["relu", "drelu"])
def test_the_penalty_reaches_what_makes_a_neuron_active(activation):
    """The L1 term's gradient: for ReLU on the gate alone; for dReLU on gate and up, and only on neurons both
    switch on (a neuron one of them already switches off is left to the fit)."""
    torch.manual_seed(0)
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    mlp = LlamaMLP(LlamaConfig(hidden_size=16, intermediate_size=64, num_attention_heads=2, hidden_act="silu"))
    x = torch.randn(32, 16)
    outputs = {}

    def keep(name):
        def hook(_module, _args, output):
            output.retain_grad()
            outputs[name] = output
        return hook

    mlp.gate_proj.register_forward_hook(keep("gate"))
    mlp.up_proj.register_forward_hook(keep("up"))
    a, h = StudentForm(activation, LlamaSilu(mlp.config)).ffn(mlp, x)
    a.sum().backward()
    gate, up = outputs["gate"], outputs["up"]
    if activation == "relu":
        assert torch.equal(a, torch.relu(gate)) and torch.allclose(h, a * up)
        assert up.grad is None and torch.all(gate.grad == (gate > 0).float())
        return
    assert torch.equal(h, a) and torch.allclose(a, torch.relu(gate) * torch.relu(up))
    both = (gate > 0) & (up > 0)
    assert both.any() and (~both).any()
    assert torch.equal(gate.grad, torch.where(both, up, torch.zeros_like(up)).detach())
    assert torch.equal(up.grad, torch.where(both, gate, torch.zeros_like(gate)).detach())
