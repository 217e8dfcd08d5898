"""scripts/synthetic_llama.py, the maker of the 7B/13B-shaped benchmark models, at a tiny shape: a multi-shard
checkpoint, its profile and predictors go through convert, plan, run, perplexity and inspect, and the
predictors select the share of neurons they were built for (in our engine, at threshold 0)."""
from __future__ import annotations

import json

import pytest
from cli_helpers import run_cli
from script_helpers import TINY as SHAPE
from script_helpers import synthetic_llama
from tiny_models import DATA, training_text

import powerinfer_engine as engine


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
    assert run_cli(capsys, "convert", "-m", model, "--predictors", pred, "--outtype", "f32", "-o", out, "-q")[0] == 0
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
    code, _, err = run_cli(capsys, "convert", "-m", model, "--predictors", pred, "--profile", profile, "--outtype", outtype,
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


def test_silu_variant_is_what_sparsify_starts_from(tmp_path, capsys):
    """--act silu (scripts/gpu_check.sh sparsify times sparsify on it): sparsify takes it, and its report times
    both phases."""
    model = tmp_path / "silu"
    synthetic_llama.build_model(model, SHAPE, progress=False, act="silu")
    assert json.loads((model / "config.json").read_text())["hidden_act"] == "silu"
    calib = tmp_path / "calib.txt"
    calib.write_text(training_text()[:40_000])
    code, _, err = run_cli(capsys, "sparsify", "-m", model, "--calib", calib, "-o", tmp_path / "relu", "--seq-len",
                           "64", "--batch", "2", "--local-tokens", "1024", "--local-epochs", "1", "--tokens", "512",
                           "--eval-tokens", "256", "--shift-budget", "0")
    assert code == 0, err
    report = json.loads((tmp_path / "relu" / "sparsify.json").read_text())
    seconds = [h["seconds"] for h in report["history"]]
    assert [h["phase"] for h in report["history"]] == [1] * SHAPE.n_layer + [2] * 4
    assert all(0 < a <= b for a, b in zip(seconds, seconds[1:])) and seconds[-1] <= report["train_seconds"]


def test_the_model_has_hot_and_cold_neurons_that_profile_finds(synthetic, tmp_path, capsys):
    """`pi-tools profile` (layer by layer) of the power-law model finds a trained ReLU model's skew (the hottest
    20 % of neurons serve most activations) at about the sparsity it was built for, in every layer; the same
    shape with iid weights has none."""
    model, _, _ = synthetic
    iid = tmp_path / "iid"
    synthetic_llama.build_model(iid, SHAPE, progress=False, sparsity=None)
    calib = tmp_path / "calib.txt"
    calib.write_text(training_text()[:60_000])
    layers = {}
    for name, path in (("power-law", model), ("iid", iid)):
        code, _, err = run_cli(capsys, "profile", "-m", path, "--calib", calib, "--tokens", "2048", "--seq-len", "128",
                               "--load", "layer", "-o", tmp_path / f"prof-{name}")
        assert code == 0, err
        layers[name] = json.loads((tmp_path / f"prof-{name}" / "profile.json").read_text())["layers"]
    assert len(layers["power-law"]) == SHAPE.n_layer
    for layer in layers["power-law"]:
        assert layer["hot20"] > 0.7 and abs(layer["sparsity"] - 0.9) < 0.05, layer
    for layer in layers["iid"]:
        assert layer["hot20"] < 0.4 and abs(layer["sparsity"] - 0.5) < 0.05, layer


def test_moe_shape_is_qwen3_moe_that_the_engine_computes(tmp_path, capsys):
    """--shape qwen3-30b-a3b's layout at a tiny size (tiny-moe): a Qwen3-MoE checkpoint (its config fields, an expert
    module per expert, q/k norms, heads head_dim wide) that converts and runs in the engine with transformers' logits,
    and whose random router spreads a profile's selections over every expert, none by much more than its share (text's
    frequent tokens route alike, so counts over text are not exactly uniform)."""
    from engine_helpers import engine_prompt_then_decode, hf_logits, max_rel_err, random_tokens

    from powerinfer_tools.stages.profiling import expert_profile

    shape = synthetic_llama.shape_of("tiny-moe")
    big = synthetic_llama.shape_of("qwen3-30b-a3b")
    assert (big.n_embd, big.n_ff, big.n_expert, big.top_k, big.n_head, big.n_kv, big.head_dim, big.vocab) == \
        (2048, 768, 128, 8, 32, 4, 128, 151936)
    model = tmp_path / "moe"
    synthetic_llama.build_model(model, shape, progress=False, act="silu")
    config = json.loads((model / "config.json").read_text())
    assert config["model_type"] == "qwen3_moe" and config["num_experts"] == shape.n_expert
    out = tmp_path / "moe.f32.gguf"
    code, _, err = run_cli(capsys, "convert", "-m", model, "--outtype", "f32", "-o", out, "-q")
    assert code == 0, err
    tokens = random_tokens(96, shape.vocab, seed=3)
    with engine.Model(out, threads=2, ctx_size=256) as m:
        assert m.info["n_expert"] == shape.n_expert and m.info["n_expert_used"] == shape.top_k
        assert max_rel_err(engine_prompt_then_decode(m, tokens, 64), hf_logits(model, tokens)) <= 1e-4
    calib = tmp_path / "calib.txt"
    calib.write_text(training_text()[:60_000])
    code, _, err = run_cli(capsys, "profile", "-m", out, "--calib", calib, "--tokens", "2048", "--seq-len", "128",
                           "-o", tmp_path / "prof")
    assert code == 0, err
    p = expert_profile.load(tmp_path / "prof", json.loads((tmp_path / "prof" / "profile.json").read_text()))
    share = p.counts / p.counts.sum(axis=1, keepdims=True) * shape.n_expert  # 1: a uniform router's share
    assert ((share > 0.25) & (share < 2.5)).all(), share  # every expert chosen, none preferred by much


@pytest.mark.parametrize("name", ["llama3-8b", "qwen3-8b"])
def test_the_8b_shapes_at_a_tiny_size_are_their_families(name, tmp_path):
    """--shape llama3-8b / qwen3-8b at the tiny shape's width (qwen3's heads 32 wide, not width / heads): the config
    of the real model's family (llama3 RoPE scaling, q/k norms, a vocabulary past the tokenizer's pieces, padded),
    converted at f32 the engine computes transformers' model; at q4_0 bench's llama.cpp copy keeps the family's
    architecture, which llama.cpp reads under its own name."""
    from dataclasses import replace

    from engine_helpers import hf_logits, max_rel_err, random_tokens

    from powerinfer_tools.bench.files import bench_files
    from powerinfer_tools.formats.gguf_io import open_reader
    from powerinfer_tools.stages.conversion.conversion import convert_model

    big = synthetic_llama.SHAPES[name]
    shape = replace(SHAPE, family=big.family, act=big.act, head_dim=32 if big.head_dim else None, n_kv=2, vocab=700)
    model = tmp_path / name
    synthetic_llama.build_model(model, shape, progress=False)
    config = json.loads((model / "config.json").read_text())
    assert config["hidden_act"] == "silu" and config["vocab_size"] == 700
    if name == "llama3-8b":
        assert config["rope_theta"] == 500000.0 and config["rope_scaling"]["rope_type"] == "llama3"
    else:
        assert config["model_type"] == "qwen3" and config["head_dim"] == 32
    out = tmp_path / "m.f32.gguf"
    convert_model(str(model), out, outtype="f32", progress=False, powerinfer_compatible=False)
    tokens = random_tokens(80, 600, seed=2)
    with engine.Model(out, threads=2) as m:
        assert max_rel_err(m.eval(tokens), hf_logits(model, tokens)) <= 1e-4
    files = bench_files(str(model), "q4_0", tmp_path / "work", progress=False)
    arch = open_reader(files.llamacpp).fields["general.architecture"].contents()
    assert arch == ("llama" if name == "llama3-8b" else "qwen3")
    assert len(open_reader(files.llamacpp).fields["tokenizer.ggml.tokens"].contents()) == 700
