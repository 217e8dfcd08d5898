"""`pi-tools sparsify` on the tiny SiLU Qwen2, Qwen3 and Phi-3 and the GELU Gemma 3 (a few steps of each phase): the
model it writes is the same family with ReLU, which transformers loads as it is and the toolkit reads as the family's
ReLU variant; the pipeline (profile, train-predictor, convert with the profile's neuron order and the predictors,
plan) takes it to a file the engine runs as transformers computes it, gate mode exact, predictor mode with a hot tier
as plan placed it; what stays refused, in one line."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import powerinfer_engine as engine
from cli_helpers import assert_one_line_error, run_cli
from engine_helpers import hf_logits, max_rel_err, random_tokens
from test_sparsify import SMALL
from powerinfer_tools import models
from powerinfer_tools.formats import names
from powerinfer_tools.formats.gguf_io import open_reader

FAMILIES = ("qwen2", "qwen3", "phi3", "gemma3")


@pytest.mark.parametrize("kind", FAMILIES)
def test_writes_the_family_with_relu_that_the_pipeline_runs(kind, tiny_model_dir, calib, tmp_path, capsys):
    src, out = tiny_model_dir(kind), tmp_path / "relu"
    code, stdout, err = run_cli(capsys, "sparsify", "-m", src, "--calib", calib, "-o", out, *SMALL,
                                "--local-epochs", "1", "--tokens", "256")
    assert code == 0, err
    assert f"no threshold shift ({kind}: the FATReLU form (ProSparse's) is a Llama's" in stdout
    config, source = (json.loads((d / "config.json").read_text()) for d in (out, src))
    act_key = "hidden_activation" if kind == "gemma3" else "hidden_act"
    assert config[act_key] == "relu" and config["model_type"] == source["model_type"]
    assert {k: v for k, v in config.items() if k not in (act_key, "dtype")} == \
        {k: v for k, v in source.items() if k not in (act_key, "dtype")}  # nothing else changed (no rope_theta added)
    shift = json.loads((out / "sparsify.json").read_text())["threshold_shift"]
    assert shift["threshold"] == 0.0 and shift["tried"] == [] and shift["budget"] == 0.0
    trained, original = load_file(out / "model.safetensors"), load_file(src / "model.safetensors")
    down = "model.layers.0.mlp.down_proj.weight"
    assert not torch.equal(trained[down], original[down])  # trained

    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(out)  # transformers' own class, no adapter
    _, adapter = models.load_model(models.resolve(str(out)))
    assert adapter.name == f"{kind}-relu" and type(adapter.activation_module(adapter.layers(plain)[0])) is torch.nn.ReLU

    prof, pred, path = tmp_path / "prof", tmp_path / "pred", tmp_path / "relu.gguf"
    steps = [["profile", "-m", out, "-o", prof, "--calib", calib, "--tokens", "1024", "--seq-len", "64"],
             ["train-predictor", prof, "--out", pred, "--threads", "1", "--epochs", "2", "--rank", "8"],
             ["convert", "-m", out, "--predictors", pred, "--profile", prof, "--outtype", "f32", "-o", path, "-q"],
             ["plan", "--profile", prof, "-m", path, "--vram-budget", "0.0005", "--reserve-mib", "0",
              "--min-layer-neurons", "32"]]
    for args in steps:
        code, _, err = run_cli(capsys, *args)
        assert code == 0, (args[0], err)
    reader = open_reader(path)
    assert reader.fields[names.KEY_ARCHITECTURE].contents() == kind
    # PowerInfer does not know the architecture: its f16 down projection is not kept, the file holds the model's f32
    assert {t.tensor_type.name for t in reader.tensors if names.FFN_DOWN_T in t.name} == {"F32"}
    tokens = random_tokens(24, config["vocab_size"])
    with engine.Model(path, threads=2, sparse_mode="dense") as m:
        dense = m.eval(tokens)
        assert m.info["activation"] == "relu"
    with engine.Model(path, threads=2, sparse_mode="gate") as m:
        assert np.array_equal(m.eval(tokens), dense)  # ReLU: skipping exact zeros is exact
    assert max_rel_err(dense, hf_logits(out, tokens)) <= 1e-4
    gpuidx = path.with_name(path.name + ".generated.gpuidx")
    with engine.Model(path, threads=2, sparse_mode="predictor", gpuidx=gpuidx, cpu_hot_tier=True) as m:
        assert m.info["has_predictor"] and 0 < m.info["hot_neurons"]
        assert np.isfinite(m.eval(tokens)).all()


def test_what_stays_refused(tiny_model_dir, calib, tmp_path, capsys):
    """dReLU's form is Bamboo's, a Llama's layout: refused for the other families; a ReLU variant is sparse already."""
    out = tmp_path / "out"
    code, _, err = run_cli(capsys, "sparsify", "-m", tiny_model_dir("qwen3"), "--calib", calib, "-o", out,
                           "--activation", "drelu")
    assert_one_line_error(code, err, "--activation drelu writes a Bamboo model", "Qwen3 with SiLU", "--activation relu")
    code, _, err = run_cli(capsys, "sparsify", "-m", tiny_model_dir("gemma3-relu"), "--calib", calib, "-o", out)
    assert_one_line_error(code, err, "already a relu model", "Gemma 3 (text) with ReLU")
    assert not out.exists()
