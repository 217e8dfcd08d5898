"""scripts/synthetic_llama.py, the maker of the 7B/13B-shaped benchmark models, at a tiny shape: a multi-shard
checkpoint, its profile and predictors go through convert, plan, run, perplexity and inspect, and the
predictors select the share of neurons they were built for (in our engine, at threshold 0)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from cli_helpers import run_cli
from tiny_models import DATA

import engine

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import synthetic_llama  # noqa: E402

SHAPE = synthetic_llama.shape_of("tiny")


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    root = tmp_path_factory.mktemp("synthetic")
    model = root / "model"
    synthetic_llama.build_model(model, SHAPE, progress=False)
    return model, synthetic_llama.build_profile(root / "prof", SHAPE), root


def test_checkpoint_is_sharded_with_its_index_and_tokenizer(synthetic):
    model, _, _ = synthetic
    shards = sorted(model.glob("*.safetensors"))
    assert len(shards) == SHAPE.n_layer + 2
    index = json.loads((model / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(index.values()) == {s.name for s in shards}
    assert index["model.layers.2.mlp.down_proj.weight"] != index["model.layers.1.mlp.down_proj.weight"]
    assert json.loads((model / "config.json").read_text())["hidden_act"] == "relu"
    assert (model / "tokenizer.model").is_file()


@pytest.mark.parametrize("sparsity", [0.5, 0.9])
def test_predictors_select_the_share_they_were_built_for(synthetic, sparsity, tmp_path, capsys):
    model, _, _ = synthetic
    pred = synthetic_llama.build_predictors(tmp_path / "pred", SHAPE, sparsity, rank=64)
    out = tmp_path / "m.gguf"
    assert run_cli(capsys, "convert", "-m", model, "-p", pred, "-t", "f32", "-o", out, "-q")[0] == 0
    with engine.Model(out, threads=1, sparse_mode="predictor") as m:
        m.eval(list(range(3, 67)))
        layers = m.stats()["layers"]
    predicted = [layer["predicted_density"] for layer in layers]
    assert all(abs(p - (1 - sparsity)) < 0.06 for p in predicted), predicted


@pytest.mark.parametrize("outtype", ["q4_0", "q8_0"])
def test_pipeline_on_the_synthetic_model(synthetic, outtype, capsys):
    model, profile, root = synthetic
    pred = synthetic_llama.build_predictors(root / f"pred-{outtype}", SHAPE, 0.8, rank=32)
    out = root / f"model.{outtype}.powerinfer.gguf"
    code, _, err = run_cli(capsys, "convert", "-m", model, "-p", pred, "--profile", profile, "-t", outtype,
                           "-o", out, "-q")
    assert code == 0, err
    gpuidx = root / f"model.{outtype}.gpuidx"
    code, _, err = run_cli(capsys, "plan", "--profile", profile, "-m", out, "--vram-budget", "0.0015", "--reserve-mib", "0", "-o", gpuidx)
    assert code == 0 and gpuidx.is_file(), err
    code, text, err = run_cli(capsys, "run", "-m", out, "-p", "The king", "-n", "8", "--temp", "0",
                              "--sparse-mode", "predictor", "--gpuidx", gpuidx, "-t", "1")
    assert code == 0 and text.strip(), err
    code, text, err = run_cli(capsys, "perplexity", "-m", out, "-f", DATA / "wikitext-2-valid.txt", "-c", "64",
                              "--chunks", "2", "--sparse-mode", "predictor", "-t", "1", "--json", "-q")
    assert code == 0, err
    ppl = json.loads(text)["perplexity"]
    assert 1.0 < ppl < 10 * SHAPE.vocab  # random weights: near the vocabulary's size, never inf or nan
    code, text, err = run_cli(capsys, "inspect", out, "--json")
    assert code == 0, err
    assert "blk.2.fc2.weight" in text
