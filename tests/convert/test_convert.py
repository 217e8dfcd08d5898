"""pi-tools convert on tiny random models of every architecture: every tensor read back with gguf-py
equals the source weight after the documented transform (written out independently here, index
by index), within the format's error bound when quantized; metadata as docs/formats.md says."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from convert_helpers import read_fields, read_tensors, write_predictors
from safetensors.numpy import load_file
from tiny_models import HIDDEN, KINDS, N_FF, N_HEAD, N_KV, N_LAYER, PROSPARSE_THRESHOLD

from powerinfer_tools.stages.conversion.conversion import POWERINFER_DOWN_T_OUTTYPE, convert_model, summary_lines
from powerinfer_tools.formats.gguf_io import read_magic

D_HEAD = HIDDEN // N_HEAD


def rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's q/k row order: in each head, row 2i <- HF row i, row 2i+1 <- HF row i + d/2."""
    d = w.shape[0] // n_heads
    return w[[h * d + r // 2 + (r % 2) * (d // 2) for h in range(n_heads) for r in range(d)]]


def falcon_qkv(w: np.ndarray, n_head: int, n_kv: int) -> np.ndarray:
    """Falcon's fused QKV (n_kv groups of [queries..., k, v] heads) -> all q heads, all k, all v."""
    d = w.shape[0] // (n_head + 2 * n_kv)
    per = n_head // n_kv + 2
    head = [w[j * d:(j + 1) * d] for j in range(n_head + 2 * n_kv)]
    q = [head[g * per + j] for g in range(n_kv) for j in range(per - 2)]
    return np.concatenate(q + [head[g * per + per - 2] for g in range(n_kv)]
                          + [head[g * per + per - 1] for g in range(n_kv)])


def expected_tensors(kind: str, hf: dict[str, np.ndarray], head_once: bool = False) -> dict[str, np.ndarray]:
    """The file's tensors as docs/formats.md defines them, from the HF state dict; head_once: a tied head is stored
    once, as token_embd (a file PowerInfer does not read: conversion.tie_head)."""
    exp = {}
    if kind in ("llama-relu", "llama-silu", "prosparse", "bamboo"):
        exp["token_embd.weight"] = hf["model.embed_tokens.weight"]
        exp["output_norm.weight"] = hf["model.norm.weight"]
        exp["output.weight"] = hf.get("lm_head.weight", hf["model.embed_tokens.weight"])
        for i in range(N_LAYER):
            p = f"model.layers.{i}."
            exp.update({
                f"blk.{i}.attn_norm.weight": hf[p + "input_layernorm.weight"],
                f"blk.{i}.attn_q.weight": rope_rows(hf[p + "self_attn.q_proj.weight"], N_HEAD),
                f"blk.{i}.attn_k.weight": rope_rows(hf[p + "self_attn.k_proj.weight"], N_KV),
                f"blk.{i}.attn_v.weight": hf[p + "self_attn.v_proj.weight"],
                f"blk.{i}.attn_output.weight": hf[p + "self_attn.o_proj.weight"],
                f"blk.{i}.ffn_norm.weight": hf[p + "post_attention_layernorm.weight"],
                f"blk.{i}.ffn_gate.weight": hf[p + "mlp.gate_proj.weight"],
                f"blk.{i}.ffn_up.weight": hf[p + "mlp.up_proj.weight"],
                f"blk.{i}.ffn_down_t.weight": hf[p + "mlp.down_proj.weight"].T,
            })
    elif kind in ("falcon", "falcon7b"):
        n_kv = N_KV if kind == "falcon" else 1
        exp["token_embd.weight"] = hf["transformer.word_embeddings.weight"]
        exp["output.weight"] = hf.get("lm_head.weight", hf["transformer.word_embeddings.weight"])
        exp["output_norm.weight"] = hf["transformer.ln_f.weight"]
        exp["output_norm.bias"] = hf["transformer.ln_f.bias"]
        for i in range(N_LAYER):
            p = f"transformer.h.{i}."
            norms = {"attn_norm": "ln_mlp", "attn_norm_2": "ln_attn"} if kind == "falcon" \
                else {"attn_norm": "input_layernorm"}
            for ours, theirs in norms.items():
                exp[f"blk.{i}.{ours}.weight"] = hf[f"{p}{theirs}.weight"]
                exp[f"blk.{i}.{ours}.bias"] = hf[f"{p}{theirs}.bias"]
            exp.update({
                f"blk.{i}.attn_qkv.weight": falcon_qkv(hf[p + "self_attention.query_key_value.weight"], N_HEAD, n_kv),
                f"blk.{i}.attn_output.weight": hf[p + "self_attention.dense.weight"],
                f"blk.{i}.ffn_up.weight": hf[p + "mlp.dense_h_to_4h.weight"],
                f"blk.{i}.ffn_down_t.weight": hf[p + "mlp.dense_4h_to_h.weight"].T,
            })
    elif kind == "opt":
        d = "model.decoder."
        exp["token_embd.weight"] = hf[d + "embed_tokens.weight"]
        exp["position_embd.weight"] = hf[d + "embed_positions.weight"]
        exp["output_norm.weight"] = hf[d + "final_layer_norm.weight"]
        exp["output_norm.bias"] = hf[d + "final_layer_norm.bias"]
        names = {"attn_norm": "self_attn_layer_norm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
                 "attn_v": "self_attn.v_proj", "attn_output": "self_attn.out_proj", "ffn_norm": "final_layer_norm",
                 "ffn_up": "fc1", "ffn_down_t": "fc2"}
        for i in range(N_LAYER):
            for ours, theirs in names.items():
                w = hf[f"{d}layers.{i}.{theirs}.weight"]
                exp[f"blk.{i}.{ours}.weight"] = w.T if ours == "ffn_down_t" else w
                exp[f"blk.{i}.{ours}.bias"] = hf[f"{d}layers.{i}.{theirs}.bias"]
    if head_once and "output.weight" in exp and exp["output.weight"] is exp["token_embd.weight"]:
        del exp["output.weight"]
    return exp


def head_name(expected: dict) -> str:
    """The tensor that is the output head: output.weight, or the embedding where the file has none."""
    return "output.weight" if "output.weight" in expected else "token_embd.weight"


def predictor_tensors(pred_dir) -> dict[str, np.ndarray]:
    out = {}
    for i in range(N_LAYER):
        state = torch.load(pred_dir / f"model_{i}.pt", weights_only=True)
        out[f"blk.{i}.fc1.weight"] = state["fc1.weight"].numpy()
        out[f"blk.{i}.fc2.weight"] = state["fc2.weight"].numpy()
    return out


def block_bound(expected: np.ndarray, qtype: str) -> np.ndarray:
    """Per-element error bound of q8_0 / q4_0: half a step (q4_0: one step at the clamped end) of the
    block's scale amax/127 or amax/8, with slack for the f16-rounded scale."""
    blocks = np.abs(expected.reshape(-1, 32)).max(axis=1, keepdims=True)
    step = blocks / 127.0 * 0.6 if qtype == "Q8_0" else blocks / 8.0 * 1.1
    return np.broadcast_to(step, (blocks.shape[0], 32)).reshape(expected.shape) + 1e-7


@pytest.mark.parametrize("kind", KINDS)
def test_f32_every_tensor_equals_transformed_source(kind, tiny_model_dir, tmp_path):
    model = tiny_model_dir(kind)
    pred = write_predictors(tmp_path / "pred", N_LAYER, HIDDEN, N_FF)
    out = tmp_path / "m.powerinfer.gguf"
    summary = convert_model(str(model), out, "f32", predictors_dir=pred, progress=False, powerinfer_compatible=False)
    assert read_magic(out) == b"PWRI"
    got = read_tensors(out)
    expected = expected_tensors(kind, load_file(model / "model.safetensors"), head_once=True)
    expected.update(predictor_tensors(pred))
    assert set(got) == set(expected)
    for name, want in expected.items():
        qtype, data = got[name]
        assert qtype == "F32", name
        np.testing.assert_array_equal(data, want, err_msg=name)
    assert summary["tensors"] == len(expected) and summary["bytes_out"] == out.stat().st_size


@pytest.mark.parametrize("kind,outtype", [("llama-relu", "f16"), ("llama-silu", "q8_0"), ("bamboo", "q4_0"),
                                          ("falcon", "q8_0"), ("falcon7b", "q4_0"), ("opt", "q4_0")])
def test_reduced_types_within_format_error(kind, outtype, tiny_model_dir, tmp_path):
    model = tiny_model_dir(kind)
    pred = write_predictors(tmp_path / "pred", N_LAYER, HIDDEN, N_FF)
    out = tmp_path / "m.gguf"
    convert_model(str(model), out, outtype, predictors_dir=pred, progress=False)
    got = read_tensors(out)
    # a SiLU file is one PowerInfer refuses: a tied head in it is stored once
    expected = expected_tensors(kind, load_file(model / "model.safetensors"), head_once=kind == "llama-silu")
    assert set(got) == set(expected) | set(predictor_tensors(pred))
    preds = predictor_tensors(pred)
    if kind != "llama-silu":  # fc2 carries the per-layer thresholds folded into one (test_threshold_fold.py)
        common = read_fields(out)["powerinfer.sparse_threshold"]
        for entry in json.loads((pred / "config.json").read_text())["layers"]:
            preds[f"blk.{entry['layer']}.fc2.weight"] = preds[f"blk.{entry['layer']}.fc2.weight"] * (
                common / entry["threshold"])
    for name, want in {**expected, **preds}.items():
        qtype, data = got[name]
        if name in preds and outtype == "q4_0":  # rank 16 stored at 32 (stored_rank): zero rows / columns
            real, pad = (data[:16], data[16:]) if name.endswith("fc1.weight") else (data[:, :16], data[:, 16:])
            assert data.shape[name.endswith("fc2.weight")] == 32 and not pad.any(), name
            data = real
        if want.ndim == 1:
            assert qtype == "F32", name  # norms and biases stay f32
            np.testing.assert_array_equal(data, want, err_msg=name)
        elif (outtype == "f16" or want.shape[-1] % 32 and not (name in preds and outtype == "q4_0")
              or name.endswith("ffn_down_t.weight") and outtype in POWERINFER_DOWN_T_OUTTYPE and kind != "llama-silu"):
            # rows that do not split into 32-value blocks stay f16 (a rank-16 fc2 in a q8_0 file), and so does
            # a q8_0 file's down projection of a model PowerInfer runs (it reads it as f16; a SiLU file it refuses)
            assert qtype == "F16", name
            np.testing.assert_allclose(data, want, rtol=1e-3, atol=1e-6, err_msg=name)
        else:
            # a predictor's fc1 and the output head are q8_0 in a q4_0 file (FC1_OUTTYPE, HEAD_OUTTYPE)
            eight = name.endswith("fc1.weight") or name == head_name(expected)
            assert qtype == ("Q8_0" if eight and outtype == "q4_0" else outtype.upper()), name
            err = np.abs(data - want)
            assert np.all(err <= block_bound(want, qtype)), (name, float(err.max()))
            assert err.max() > 0  # really quantized


@pytest.mark.parametrize("kind, head", [("llama-relu", "output"), ("falcon", "token_embd")])
def test_summary_names_every_kind_of_tensor_with_its_type(kind, head, tiny_model_dir, tmp_path):
    """convert's first line says what each kind of tensor was written as: the q4_0 file's head (the separate
    output.weight, or the tied embedding stored once) at q8_0, every other matrix at q4_0, vectors f32."""
    summary = convert_model(str(tiny_model_dir(kind)), tmp_path / "m.gguf", "q4_0", progress=False,
                            powerinfer_compatible=False)
    types = summary["types"]
    assert types["q8_0"] == [head]
    assert {"attn_norm", "output_norm"} <= set(types["f32"])
    assert "ffn_down_t" in types["q4_0"] and head not in types["q4_0"]
    assert sum(map(len, types.values())) == len({k for kinds in types.values() for k in kinds})  # each kind once
    groups = summary_lines(summary)[0].split(" (", 1)[1].split(")")[0].split("; ")
    assert f"q8_0 {head}" in groups


def test_rope_permutation_keeps_attention_scores(tiny_model_dir, tmp_path):
    """Adjacent-pair RoPE on the file's q/k gives the same q.k scores as HF's rotate-half RoPE on
    the source q/k (the property the engine relies on), at every position pair and head."""
    model = tiny_model_dir("llama-silu")
    out = tmp_path / "m.gguf"
    convert_model(str(model), out, "f32", progress=False)
    got = read_tensors(out)
    hf = load_file(model / "model.safetensors")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, HIDDEN)).astype(np.float64)
    pos = np.arange(5)
    inv = 10000.0 ** (-np.arange(0, D_HEAD, 2) / D_HEAD)
    ang = pos[:, None] * inv[None, :]
    cos, sin = np.cos(ang), np.sin(ang)

    def rotate_half(v):  # v: [pos, heads, d]
        a, b = v[..., : D_HEAD // 2], v[..., D_HEAD // 2:]
        c, s = cos[:, None, :], sin[:, None, :]
        return np.concatenate([a * c - b * s, b * c + a * s], axis=-1)

    def adjacent(v):
        a, b = v[..., 0::2], v[..., 1::2]
        c, s = cos[:, None, :], sin[:, None, :]
        out = np.empty_like(v)
        out[..., 0::2], out[..., 1::2] = a * c - b * s, a * s + b * c
        return out

    def scores(q, k, rope):
        q = rope((x @ q.T).reshape(5, N_HEAD, D_HEAD))
        k = rope((x @ k.T).reshape(5, N_KV, D_HEAD)).repeat(N_HEAD // N_KV, axis=1)
        return np.einsum("ihd,jhd->hij", q, k)

    want = scores(hf["model.layers.0.self_attn.q_proj.weight"], hf["model.layers.0.self_attn.k_proj.weight"],
                  rotate_half)
    have = scores(got["blk.0.attn_q.weight"][1], got["blk.0.attn_k.weight"][1], adjacent)
    np.testing.assert_allclose(have, want, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("kind", ["llama-relu", "llama-silu", "prosparse", "falcon", "opt"])
def test_metadata(kind, tiny_model_dir, tmp_path):
    model = tiny_model_dir(kind)
    pred = write_predictors(tmp_path / "pred", N_LAYER, HIDDEN, N_FF, thresholds=[0.25, -0.5])
    prof = tmp_path / "prof"
    prof.mkdir()
    (prof / "profile.json").write_text(json.dumps({"rule": "threshold", "thresholds": [0.03, 0.07]}))
    out = tmp_path / "m.gguf"
    convert_model(str(model), out, "f16", predictors_dir=pred, profile_dir=prof, progress=False)
    f = read_fields(out)
    cfg = json.loads((model / "config.json").read_text())
    arch = {"llama-relu": "llama", "llama-silu": "llama-silu", "prosparse": "llama", "falcon": "falcon", "opt": "opt"}[kind]
    assert f["general.architecture"] == arch
    assert f[f"{arch}.block_count"] == N_LAYER and f[f"{arch}.embedding_length"] == HIDDEN
    assert f[f"{arch}.feed_forward_length"] == N_FF
    assert f[f"{arch}.context_length"] == cfg["max_position_embeddings"]
    assert f[f"{arch}.attention.head_count"] == N_HEAD
    assert f["powerinfer.sparse_threshold"] == 0.0
    assert f["powerinfer.predictor_thresholds"] == [0.25, -0.5]
    assert f["powerinfer.ffn_activation"] == {"llama-silu": "silu", "prosparse": "fatrelu"}.get(kind, "relu")
    thresholds = f["powerinfer.activation_thresholds"]
    if kind == "llama-silu":
        np.testing.assert_allclose(thresholds, [0.03, 0.07], rtol=1e-6)
    elif kind == "prosparse":  # the model's own FATReLU threshold, whatever the profile says
        np.testing.assert_allclose(thresholds, [PROSPARSE_THRESHOLD] * N_LAYER, rtol=1e-6)
    else:
        assert thresholds == [0.0, 0.0]  # ReLU-family: active means a != 0
    if arch.startswith("llama"):
        assert f[f"{arch}.attention.head_count_kv"] == N_KV
        assert f[f"{arch}.rope.dimension_count"] == D_HEAD
        assert f[f"{arch}.rope.freq_base"] == cfg.get("rope_theta", cfg.get("rope_parameters", {}).get("rope_theta"))
        assert abs(f[f"{arch}.attention.layer_norm_rms_epsilon"] - cfg["rms_norm_eps"]) < 1e-12
    if arch == "falcon":
        assert f["falcon.tensor_data_layout"] == "jploski" and f["falcon.attention.head_count_kv"] == N_KV


def test_without_predictors_is_dense_file(tiny_model_dir, tmp_path):
    out = tmp_path / "dense.gguf"
    convert_model(str(tiny_model_dir("llama-relu")), out, "f32", progress=False)
    names = set(read_tensors(out))
    assert not any(".fc1." in n or ".fc2." in n for n in names) and "blk.1.ffn_down_t.weight" in names
    assert "powerinfer.predictor_thresholds" not in read_fields(out)


def test_pytorch_bin_checkpoint_converts_like_safetensors(tiny_model_dir, tmp_path):
    import shutil

    from safetensors.torch import load_file as load_torch

    src = tiny_model_dir("opt")
    bin_dir = tmp_path / "bin"
    shutil.copytree(src, bin_dir, ignore=shutil.ignore_patterns("*.safetensors"))
    # OPT's own checkpoints name tensors without the `model.` prefix of the causal-LM class
    state = {k.removeprefix("model."): v for k, v in load_torch(src / "model.safetensors").items()}
    torch.save(state, bin_dir / "pytorch_model.bin")
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    convert_model(str(src), a, "q8_0", progress=False)
    convert_model(str(bin_dir), b, "q8_0", progress=False)
    got_a, got_b = read_tensors(a), read_tensors(b)
    assert set(got_a) == set(got_b)
    for name in got_a:
        np.testing.assert_array_equal(got_a[name][1], got_b[name][1], err_msg=name)


def test_predictor_ranks_padded_where_quantizing_pays():
    """A rank that does not fill whole 32-value blocks is padded in q4_0/q8_0 files when the whole predictor
    (fc1 at q8_0 in a q4_0 file, fc2 quantized) is then smaller than unpadded with an f16 fc2; never past
    n_ff, never in f32/f16 files. SmolLM2's shapes (576, 1536) and ReluLLaMA-70B's cap."""
    from powerinfer_tools.stages.conversion.conversion import stored_rank

    assert [stored_rank(r, "q4_0", 576, 1536) for r in (4, 12, 13, 16, 32, 48, 125)] == [4, 12, 32, 32, 32, 64, 128]
    assert [stored_rank(r, "q8_0", 576, 1536) for r in (16, 19, 20, 24, 250)] == [16, 19, 32, 32, 256]
    assert stored_rank(1911, "q4_0", 8192, 28672) == 1920
    assert stored_rank(24, "q4_0", 576, 24) == 24 and stored_rank(24, "f16", 576, 1536) == 24
    assert stored_rank(24, "f32", 576, 1536) == 24


@pytest.mark.parametrize("stem, name", [("SmolLM2-135M-Instruct.Q4_1", "SmolLM2-135M-Instruct"),
                                        ("llama-2-7b.Q4_K_M", "llama-2-7b"), ("model-f16", "model"),
                                        ("tiny.IQ2_XS", "tiny"), ("Mistral-7B-v0.1", "Mistral-7B-v0.1"),
                                        ("Q8_0", "Q8_0")])
def test_the_converted_name_drops_the_sources_weight_type(stem, name):
    """A llama.cpp GGUF's file name carries its weight type, which a conversion to another type replaces."""
    from powerinfer_tools.stages.conversion.conversion import model_name

    assert model_name(Path(f"/models/{stem}.gguf")) == name
