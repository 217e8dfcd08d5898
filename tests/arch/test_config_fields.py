"""Every config field that changes the computation is computed or refused (models/arch/config_fields.py, issue 66):
RoPE scaling (linear, llama3) against transformers over 300 positions, five times llama3's original context;
Mistral's sliding window as a capped context; attention and MLP biases; each refused field one line from
`pi-tools convert`, its dry run and profile; a llama.cpp file with a key or tensor the engine does not compute
refused at open, and one with llama3's rope_freqs as llama.cpp writes it run right."""
from __future__ import annotations

import json
import shutil

import gguf
import numpy as np
import pytest
import torch
from cli_helpers import assert_one_line_error, run_cli
from family_checks import refused_fields
from engine_helpers import (converted, engine_prompt_then_decode, finish_gguf, hf_logits, hf_model,  # noqa: F401
                            max_rel_err, random_tokens)
from tiny_models import make_tiny

import powerinfer_engine as engine
from powerinfer_tools.formats.gguf_io import open_reader
from powerinfer_tools.stages.conversion import convert_model

VOCAB, N_TOKENS, N_PROMPT, N_GREEDY = 384, 300, 200, 32
TOKENS = random_tokens(N_TOKENS, VOCAB, seed=7)
# a small original context, so that most of the 300 positions lie past it; head_dim 16: pairs 0 (wavelength 6),
# 1-2 (20, 63: smoothed) and 3-7 (divided by the factor) cover llama3's three cases
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64, "rope_theta": 10000.0}
LINEAR = {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}
VARIANTS = {
    "llama3": ("llama-silu", dict(rope_parameters=LLAMA3, max_position_embeddings=512)),
    "linear": ("llama-silu", dict(rope_parameters=LINEAR, max_position_embeddings=512)),
    "biases": ("llama-relu", dict(attention_bias=True, mlp_bias=True)),
    "window": ("bamboo", dict(sliding_window=64)),
}


@pytest.fixture(scope="module")
def variant(tmp_path_factory):
    """variant(name) -> (model directory, its f32 file): the tiny model of VARIANTS[name], biases random."""
    cache = {}

    def get(name):
        if name not in cache:
            kind, overrides = VARIANTS[name]
            root = tmp_path_factory.mktemp(name)
            src = make_tiny(kind, root / "hf", **overrides)
            if overrides.get("attention_bias"):  # transformers starts biases at 0: give them values that count
                model, _ = hf_model(src)
                with torch.no_grad():
                    for pname, p in model.named_parameters():
                        if pname.endswith(".bias"):
                            p.normal_(0.0, 0.1)
                model.save_pretrained(src, safe_serialization=True)
            out = root / f"{name}.gguf"
            convert_model(str(src), out, outtype="f32", progress=False, powerinfer_compatible=False)
            cache[name] = src, out
        return cache[name]

    return get


def hf_greedy(model_dir, prompt: list[int], n: int) -> list[int]:
    model, _ = hf_model(model_dir)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("name", ["llama3", "linear"])
def test_rope_scaling_matches_transformers(name, variant):
    src, path = variant(name)
    ref = hf_logits(src, TOKENS)
    with engine.Model(path, threads=2, ctx_size=512) as m:
        logits = engine_prompt_then_decode(m, TOKENS, N_PROMPT)
    err = max_rel_err(logits, ref)
    assert err <= 1e-4, f"{name} RoPE drifts from transformers: {err:.2e} relative"
    prompt = TOKENS[:N_TOKENS - N_GREEDY]
    with engine.Model(path, threads=2, ctx_size=512) as m:
        got = list(m.generate(prompt, N_GREEDY))
    assert got == hf_greedy(src, prompt, N_GREEDY)


def test_llama3_file_holds_rope_freqs_and_no_scaling_key(variant):
    reader = open_reader(variant("llama3")[1])
    freqs = next(t for t in reader.tensors if t.name == "rope_freqs.weight")
    factors = np.array(freqs.data)
    assert factors.shape == (8,) and factors[0] == 1.0 and np.all(factors[3:] == 8.0) and 1 < factors[1] < 8
    assert not any(".rope.scaling" in k for k in reader.fields)


def test_linear_scaling_is_written_and_counts(variant, tmp_path):
    """The factor is in the file, and the engine applies it: without it the logits are another model's."""
    src, path = variant("linear")
    reader = open_reader(path)
    assert reader.fields["llama-silu.rope.scaling.factor"].contents() == 4.0
    unscaled = llama_cpp_file(path, tmp_path / "unscaled.gguf", drop_keys=("rope.scaling.type", "rope.scaling.factor"))
    with engine.Model(unscaled, threads=2, ctx_size=512) as m:
        assert max_rel_err(m.eval(TOKENS), hf_logits(src, TOKENS)) > 1e-2


def test_biases_match_transformers(variant):
    src, path = variant("biases")
    names = {t.name for t in open_reader(path).tensors}
    assert {"blk.0.attn_q.bias", "blk.0.attn_output.bias", "blk.0.ffn_gate.bias", "blk.0.ffn_down_t.bias"} <= names
    with engine.Model(path, threads=2) as m:
        assert max_rel_err(engine_prompt_then_decode(m, TOKENS[:96], 64), hf_logits(src, TOKENS[:96])) <= 1e-4


def test_sliding_window_caps_the_context(variant):
    """Within its window a windowed model is a causal one: the engine runs at most the window, and says so when
    asked for more."""
    src, path = variant("window")
    assert open_reader(path).fields["bamboo.attention.sliding_window"].contents() == 64
    with engine.Model(path, threads=2) as m:
        assert m.n_ctx == 64
        assert max_rel_err(engine_prompt_then_decode(m, TOKENS[:64], 48), hf_logits(src, TOKENS[:64])) <= 1e-4
    with pytest.raises(engine.EngineError) as exc:
        engine.Model(path, threads=2, ctx_size=128)
    assert len(str(exc.value).splitlines()) == 1
    assert "ctx_size 128" in str(exc.value) and "sliding_window = 64" in str(exc.value)


# ---- refusals at convert ---------------------------------------------------------------------------------------
REFUSED = [  # (kind, config.json fields, what the line names)
    ("llama-silu", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}},
     "rope_parameters.rope_type = 'yarn'"),
    ("llama-silu", {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope_parameters.rope_type = 'dynamic'"),
    ("llama-silu", {"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
                                     "original_max_position_embeddings": 64}},
     "rope_parameters.rope_type = 'longrope'"),
    ("llama-silu", {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}},
     "rope_parameters.partial_rotary_factor = 0.5"),
    ("llama-silu", {"head_dim": 32}, "head_dim = 32"),
    ("falcon", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_parameters.rope_type = 'linear'"),
    ("falcon", {"alibi": True}, "alibi = True"),
    ("falcon7b", {"parallel_attn": False}, "parallel_attn = False"),
    ("falcon", {"activation": "silu"}, "activation = 'silu'"),
    ("opt", {"do_layer_norm_before": False}, "do_layer_norm_before = False"),
    ("opt", {"word_embed_proj_dim": 32}, "word_embed_proj_dim = 32"),
    ("opt", {"_remove_final_layer_norm": True}, "_remove_final_layer_norm = True"),
    ("opt", {"layer_norm_elementwise_affine": False}, "layer_norm_elementwise_affine = False"),
    ("opt", {"enable_bias": False}, "enable_bias = False"),
    ("opt", {"tie_word_embeddings": False}, "tie_word_embeddings = False"),
    ("opt", {"activation_function": "silu"}, "activation_function = 'silu'"),
]


def edited_copy(src, dst, fields: dict):
    """A copy of a model directory whose config.json has `fields` set (rope_scaling replaces rope_parameters)."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    if "rope_scaling" in fields:
        cfg.pop("rope_parameters", None)
    cfg.update(fields)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@refused_fields(REFUSED)
def test_unsupported_field_is_refused_by_convert_and_its_dry_run(kind, fields, needle, tiny_model_dir, tmp_path,
                                                                 capsys):
    model = edited_copy(tiny_model_dir(kind), tmp_path / "model", fields)
    out = tmp_path / "m.gguf"
    code, _, err = run_cli(capsys, "convert", "-m", model, "-o", out)
    assert_one_line_error(code, err, needle, "not supported")
    assert not out.exists()
    code, _, err = run_cli(capsys, "convert", "--dry-run", "-m", model / "config.json")
    assert_one_line_error(code, err, needle)


def test_unsupported_field_is_refused_by_profile(tiny_model_dir, tmp_path, capsys):
    kind, fields, needle = REFUSED[0]
    model = edited_copy(tiny_model_dir(kind), tmp_path / "model", fields)
    (tmp_path / "calib.txt").write_text("To be, or not to be, that is the question. " * 40)
    code, _, err = run_cli(capsys, "profile", "-m", model, "--calib", tmp_path / "calib.txt", "--tokens", "64",
                           "--seq-len", "32", "-o", tmp_path / "profile")
    assert_one_line_error(code, err, needle)


# ---- a user's llama.cpp file ---------------------------------------------------------------------------------
def llama_cpp_file(src, dst, fields: dict | None = None, tensors: dict | None = None, drop_keys: tuple = ()):
    """`src` (a converted llama-family file) as llama.cpp names it: architecture llama, its keys under `llama.`,
    ffn_down a row per output, no powerinfer keys; plus `fields` (suffix -> (value, type)) and `tensors` (name ->
    f32 array, in place of the file's own)."""
    tensors = tensors or {}
    reader = open_reader(src)
    prefix = reader.fields["general.architecture"].contents() + "."
    writer = gguf.GGUFWriter(str(dst), arch="llama")
    for name, f in reader.fields.items():
        if name.startswith(("GGUF.", "general.architecture", "powerinfer")) or name[len(prefix):] in drop_keys:
            continue
        sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        key = "llama." + name[len(prefix):] if name.startswith(prefix) else name
        writer.add_key_value(key, f.contents(), f.types[0], sub_type=sub)
    for suffix, (value, vtype) in (fields or {}).items():
        writer.add_key_value(f"llama.{suffix}", value, vtype)
    for t in reader.tensors:
        if t.name in tensors:
            continue
        data = np.array(t.data)
        name = t.name.replace("ffn_down_t", "ffn_down")
        writer.add_tensor(name, data.T.copy() if name != t.name and name.endswith(".weight") else data)
    finish_gguf(writer, tensors)
    return dst


def test_llama_cpp_llama3_file_runs_right(variant, tmp_path):
    """llama.cpp's converter writes llama3 scaling as rope_freqs.weight alone, by its own formula (here with the
    config's original context): the engine computes transformers' model from it."""
    import math

    src, path = variant("llama3")
    dim, base, p = 16, LLAMA3["rope_theta"], LLAMA3
    low, high = p["original_max_position_embeddings"] / p["low_freq_factor"], \
        p["original_max_position_embeddings"] / p["high_freq_factor"]
    factors = []
    for i in range(0, dim, 2):  # llama.cpp's LlamaModel.generate_extra_tensors
        wavelen = 2 * math.pi * base ** (i / dim)
        if wavelen < high:
            factors.append(1.0)
        elif wavelen > low:
            factors.append(p["factor"])
        else:
            smooth = (p["original_max_position_embeddings"] / wavelen - p["low_freq_factor"]) / \
                (p["high_freq_factor"] - p["low_freq_factor"])
            factors.append(1 / ((1 - smooth) / p["factor"] + smooth))
    theirs = llama_cpp_file(path, tmp_path / "theirs.gguf",
                            tensors={"rope_freqs.weight": np.array(factors, dtype=np.float32)})
    with engine.Model(theirs, threads=2, ctx_size=512) as m:
        assert m.info["magic"] == "GGUF"
        assert max_rel_err(engine_prompt_then_decode(m, TOKENS, N_PROMPT), hf_logits(src, TOKENS)) <= 1e-4


UNCOMPUTED_KEYS = [
    ("rope.scaling.type", ("yarn", gguf.GGUFValueType.STRING), "rope scaling 'yarn' is not supported"),
    ("rope.scaling.attn_factor", (1.5, gguf.GGUFValueType.FLOAT32), "key llama.rope.scaling.attn_factor"),
    ("attn_logit_softcapping", (50.0, gguf.GGUFValueType.FLOAT32), "key llama.attn_logit_softcapping"),
    ("final_logit_softcapping", (30.0, gguf.GGUFValueType.FLOAT32), "key llama.final_logit_softcapping"),
    ("expert_shared_count", (1, gguf.GGUFValueType.UINT32), "key llama.expert_shared_count"),  # experts: test_moe
    ("attention.key_length", (32, gguf.GGUFValueType.UINT32), "llama.attention.key_length 32"),
]


@pytest.mark.parametrize("suffix,value,needle", UNCOMPUTED_KEYS, ids=[k for k, _, _ in UNCOMPUTED_KEYS])
def test_llama_cpp_file_with_a_key_the_engine_does_not_compute_is_refused(suffix, value, needle, tiny_model_dir,
                                                                         converted, tmp_path, capsys):
    path = llama_cpp_file(converted("llama-silu"), tmp_path / "m.gguf", fields={suffix: value})
    with pytest.raises(engine.EngineError) as exc:
        engine.Model(path, threads=1)
    assert len(str(exc.value).splitlines()) == 1 and needle in str(exc.value), str(exc.value)
    code, _, err = run_cli(capsys, "run", "-m", path, "-p", "hi", "-n", "1")
    assert_one_line_error(code, err, needle)


def test_llama_cpp_file_with_rope_freqs_is_not_converted(variant, tmp_path, capsys):
    """transformers' GGUF loader drops rope_freqs and RoPE scaling keys: convert refuses rather than lose them."""
    path = llama_cpp_file(variant("llama3")[1], tmp_path / "m.gguf")
    code, _, err = run_cli(capsys, "convert", "-m", path, "-o", tmp_path / "out.gguf")
    assert_one_line_error(code, err, "rope_freqs.weight", "pi-tools run -m")
