"""Falcon (new decoder architecture and the 7B layout) and OPT in the engine, against transformers on
tiny random models in f32: dense logits, the sparse modes against the rules they define, hot/cold
tiers, bad input for the tensors these architectures add, and the whole pipeline through the CLI.

The tiny models get random norm weights and biases here (transformers initialises them to ones and
zeros), so that a norm or bias read from the wrong tensor, or skipped, changes the logits."""
from __future__ import annotations

import shutil

import gguf
import numpy as np
import pytest
import torch
from convert_helpers import write_predictors
from engine_helpers import (auto_run, engine_prompt_then_decode, hf_logits, max_rel_err, predictor_rule,
                            random_tokens, write_gpuidx)
from test_engine_bad_input import rewrite
from cli_helpers import run_cli
from tiny_models import N_FF, N_LAYER, training_text

import powerinfer_engine as engine
from powerinfer_engine import kernels
from powerinfer_tools.models import arch
from powerinfer_tools import models
from powerinfer_tools.stages.conversion.conversion import convert_model

KINDS = ["falcon", "falcon7b", "opt"]
N_PROMPT, N_DECODE = 24, 6
TOKENS = random_tokens(N_PROMPT + N_DECODE, 300, seed=2)


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir, tmp_path_factory):
    """model_dir(kind) -> the tiny model of `kind` with random 1-D parameters (norms, biases)."""
    cache = {}

    def get(kind):
        if kind not in cache:
            out = tmp_path_factory.mktemp(f"biased_{kind}")
            shutil.copytree(tiny_model_dir(kind), out, dirs_exist_ok=True)
            model, _ = models.load_model(models.resolve(str(out)))
            gen = torch.Generator().manual_seed(5)
            with torch.no_grad():
                for name, p in model.named_parameters():
                    if p.dim() == 1:
                        base = 1.0 if name.endswith("weight") else 0.0
                        p.copy_(base + 0.1 * torch.randn(p.shape, generator=gen))
            model.save_pretrained(out, safe_serialization=True)
            cache[kind] = out
        return cache[kind]

    return get


@pytest.fixture(scope="module")
def converted_fo(model_dir, tmp_path_factory):
    """converted_fo(kind, predictors=False, rank=32) -> f32 PowerInfer file of model_dir(kind); predictors random,
    of that rank."""
    cache = {}
    root = tmp_path_factory.mktemp("fo_models")

    def get(kind, predictors=False, rank=32):
        key = (kind, predictors, rank)
        if key not in cache:
            src = model_dir(kind)
            pred = None
            if predictors:
                dims = arch.for_config(models.load_config(models.resolve(str(src)))).dims()
                pred = write_predictors(root / f"pred_{kind}_{rank}", dims.n_layer, dims.n_embd, dims.n_ff, rank=rank,
                                        thresholds=[0.0] * dims.n_layer)
            out = root / f"{kind}.{predictors}.{rank}.gguf"
            convert_model(str(src), out, outtype="f32", predictors_dir=pred, progress=False, powerinfer_compatible=False)
            cache[key] = out
        return cache[key]

    return get


def run(path, mode="dense", **kw):
    with engine.Model(path, threads=2, sparse_mode=mode, **kw) as m:
        return engine_prompt_then_decode(m, TOKENS, N_PROMPT), m.stats()


@pytest.mark.parametrize("kind", KINDS)
def test_dense_matches_transformers(kind, model_dir, converted_fo, tiny_model_dir):
    ref = hf_logits(model_dir(kind), TOKENS)
    for isa in ["scalar"] + [i for i in ("avx2",) if kernels.available(i)]:
        logits, stats = run(converted_fo(kind), isa=isa)
        assert max_rel_err(logits, ref) <= 1e-4, isa
    assert stats["batch_tokens"] == N_PROMPT and stats["decode_tokens"] == N_DECODE
    # the random norms and biases matter: without them the logits are far off
    assert max_rel_err(hf_logits(tiny_model_dir(kind), TOKENS), ref) > 1e-2


@pytest.mark.parametrize("kind", KINDS)
def test_sparse_modes(kind, model_dir, converted_fo):
    path = converted_fo(kind, predictors=True)
    dense, dense_stats = run(path, "dense")
    for mode in ("oracle", "gate"):  # exact on ReLU models: the skipped neurons contribute zeros
        logits, stats = run(path, mode)
        assert np.array_equal(logits, dense), mode
        assert stats["density"] == pytest.approx(dense_stats["density"])
    assert dense_stats["density"] < 0.9
    ref = hf_logits(model_dir(kind), TOKENS, mask_fn=predictor_rule(path))
    logits, stats = run(path, "predictor", recall_check=True)
    assert max_rel_err(logits, ref) <= 1e-4
    assert all(0.2 < layer["recall"] < 0.8 for layer in stats["layers"])  # random predictors


@pytest.mark.parametrize("kind", KINDS)
def test_auto_computes_what_the_modes_it_picks_define(kind, model_dir, converted_fo):
    """Auto's logits are those of the mode it picked in each layer and step: dense values where the gate rule's
    kernels ran, the predictor's rule where the predictor did. Predictors of rank 32 cost more than the gate
    rule here, those of rank 4 less, so both cases are checked."""
    cases = set()
    for rank in (32, 4):
        path = converted_fo(kind, predictors=True, rank=rank)
        auto, predicted = auto_run(path, TOKENS, N_PROMPT)
        cases.add(any(p.any() for p in predicted))
        if not any(p.any() for p in predicted):  # the gate rule's kernels throughout: the dense values, bit for bit
            assert np.array_equal(auto, run(path, "dense")[0])
        rule = predictor_rule(path)
        mask = [torch.from_numpy(p)[:, None] for p in predicted]
        ref = hf_logits(model_dir(kind), TOKENS, mask_fn=lambda i, x, a: torch.where(mask[i], rule(i, x, a), a))
        assert max_rel_err(auto, ref) <= 1e-4, rank
    assert cases == {False, True}, "auto no longer picks the predictor in one case and not in the other"


@pytest.mark.parametrize("kind", ["falcon", "opt"])
def test_hot_cold_tiers(kind, tmp_path, model_dir, converted_fo):
    path = converted_fo(kind, predictors=True)
    rng = np.random.default_rng(4)
    hot = [rng.random(N_FF) < 0.3 for _ in range(N_LAYER)]
    gpuidx = write_gpuidx(tmp_path / "m.gpuidx", hot)
    dense, _ = run(path, "dense")
    assert max_rel_err(run(path, "oracle", gpuidx=gpuidx, cpu_hot_tier=True)[0], dense) <= 1e-5
    rule, hot_t = predictor_rule(path), [torch.from_numpy(h) for h in hot]
    ref = hf_logits(model_dir(kind), TOKENS, mask_fn=lambda i, x, a: torch.where(hot_t[i], a, rule(i, x, a)))
    logits, stats = run(path, "predictor", gpuidx=gpuidx, cpu_hot_tier=True)
    assert max_rel_err(logits, ref) <= 1e-4
    assert [layer["hot_neurons"] for layer in stats["layers"]] == [int(h.sum()) for h in hot]


def test_opt_context_is_the_learned_position_table(converted_fo):
    with engine.Model(converted_fo("opt"), threads=1, ctx_size=4096) as m:
        assert m.info["n_ctx"] == 256  # max_position_embeddings of the tiny OPT
        m.eval(TOKENS)


def _vector(n):
    return (np.ones(n, np.float32), None)


@pytest.mark.parametrize("kind,change,message", [
    ("opt", {"drop": ("blk.1.ffn_up.bias",)}, "blk.1.ffn_up.bias is missing"),
    ("opt", {"drop": ("blk.0.attn_q.bias",)}, "blk.0.attn_q.bias is missing"),
    ("opt", {"drop": ("position_embd.weight",)}, "position_embd.weight is missing"),
    # (a table of exactly context_length rows is PowerInfer's convention, read as such)
    ("opt", {"tensors": {"position_embd.weight": (np.zeros((255, 64), np.float32), None)}},
     r"position_embd.weight has shape \(255, 64\), the hyperparameters say \(258, 64\)"),
    ("opt", {"tensors": {"blk.0.ffn_down_t.bias": _vector(N_FF)}}, "blk.0.ffn_down_t.bias has shape"),
    ("falcon", {"drop": ("blk.0.attn_norm_2.bias",)}, "blk.0.attn_norm_2.bias is missing"),
    ("falcon", {"drop": ("output_norm.bias",)}, "output_norm.bias is missing"),
    ("falcon", {"tensors": {"blk.0.attn_qkv.weight": (np.zeros((64 * 3, 64), np.float32), None)}},
     r"attn_qkv.weight has shape \(192, 64\), the hyperparameters say \(128, 64\)"),
    ("falcon", {"tensors": {"blk.1.attn_norm_2.weight": _vector(100)}}, "attn_norm_2.weight has shape"),
    ("falcon7b", {"drop": ("blk.1.attn_norm.bias",)}, "blk.1.attn_norm.bias is missing"),
    ("falcon", {"tensors": {"blk.0.attn_norm.bias": (np.ones(64, np.float16), None)}}, "it must be f32"),
    ("falcon", {"fields": {"falcon.tensor_data_layout": ("Meta AI original pth", gguf.GGUFValueType.STRING)}},
     "tensor_data_layout"),
    ("falcon7b", {"fields": {"powerinfer.ffn_activation": ("gelu", gguf.GGUFValueType.STRING)}},
     "activation 'gelu' is not supported"),
])
def test_bad_input(kind, change, message, tmp_path, converted_fo):
    bad = rewrite(converted_fo(kind), tmp_path / "bad.gguf", **change)
    with pytest.raises(engine.EngineError, match=message):
        engine.Model(bad, threads=1)


@pytest.mark.parametrize("kind", ["falcon", "opt"])
def test_pipeline_profile_train_convert_run(kind, tmp_path, model_dir, capsys):
    src, text = str(model_dir(kind)), tmp_path / "calib.txt"
    text.write_text(training_text()[:40_000])
    prof, pred, out = tmp_path / "profile", tmp_path / "pred", tmp_path / f"{kind}.powerinfer.gguf"
    steps = [["profile", "-m", src, "-o", str(prof), "--calib", str(text), "--tokens", "2048", "--seq-len", "64"],
             ["train-predictor", str(prof), "--out", str(pred), "--threads", "1", "--epochs", "3"],
             ["convert", "-m", src, "--predictors", str(pred), "--profile", str(prof), "--outtype", "f32", "-o", str(out),
              "-q"]]
    for args in steps:
        code, _, err = run_cli(capsys, *args)
        assert code == 0, (args[0], err)
    code, text_out, err = run_cli(capsys, *["run", "-m", str(out), "-p", "ROMEO:", "-n", "8", "--temp", "0", "-t", "2",
                                   "--sparse-mode", "predictor", "-v"])
    assert code == 0, err
    assert text_out.startswith("ROMEO:") and "ffn: mode predictor" in err
    with engine.Model(out, threads=2, sparse_mode="predictor", recall_check=True) as m:
        assert m.info["arch"] == kind and m.info["has_predictor"]
        m.eval(TOKENS)
        stats = m.stats()
    # trained predictors on a ReLU model: most active neurons are found
    assert all(layer["recall"] > 0.6 for layer in stats["layers"]), stats["layers"]
