"""Every config field that changes the computation is computed or refused (models/arch/config_fields.py, issue 66):
RoPE scaling (linear, llama3, yarn) against transformers over 300 positions, about five times the original context,
and 32 greedy steps; dynamic NTK as the default frequencies in a context capped at max_position_embeddings;
Mistral's sliding window as a capped context; attention and MLP biases; each refused field one line from
`pi-tools convert`, its dry run and profile; a llama.cpp file with a key or tensor the engine does not compute
refused at open, and ones with llama3's rope_freqs or yarn's keys as llama.cpp writes them run right."""
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
from family_checks import assert_computes_transformers_model, assert_context_capped
from tiny_models import make_tiny

import powerinfer_engine as engine
from powerinfer_tools.formats.gguf_io import open_reader
from powerinfer_tools.stages.conversion.conversion import convert_model

VOCAB, N_TOKENS, N_PROMPT, N_GREEDY = 384, 300, 200, 32
TOKENS = random_tokens(N_TOKENS, VOCAB, seed=7)
# a small original context, so that most of the 300 positions lie past it; head_dim 16: pairs 0 (wavelength 6),
# 1-2 (20, 63: smoothed) and 3-7 (divided by the factor) cover llama3's three cases
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64, "rope_theta": 10000.0}
LINEAR = {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}
# YaRN's defaults (beta_fast 32, beta_slow 1) over 64 original positions: pair 0 keeps its frequency, 1-2 are blended,
# 3-7 divided by the factor; cos and sin times 0.1 ln 8 + 1
YARN = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64, "rope_theta": 10000.0}
DYNAMIC = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
VARIANTS = {
    "llama3": ("llama-silu", dict(rope_parameters=LLAMA3, max_position_embeddings=512)),
    "linear": ("llama-silu", dict(rope_parameters=LINEAR, max_position_embeddings=512)),
    "yarn": ("llama-silu", dict(rope_parameters=YARN, max_position_embeddings=512)),
    "dynamic": ("llama-silu", dict(rope_parameters=DYNAMIC, max_position_embeddings=128)),
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


@pytest.mark.parametrize("name", ["llama3", "linear", "yarn"])
def test_rope_scaling_matches_transformers(name, variant):
    src, path = variant(name)
    assert_computes_transformers_model(src, [path], TOKENS, N_PROMPT, N_GREEDY, ctx_size=512)


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


def test_yarn_is_written_as_llama_cpp_keys_and_its_attention_factor_counts(variant, tmp_path):
    """YaRN as llama.cpp's converter writes it (type, factor, original context; no tensor), which the engine computes
    it from: a llama.cpp file of them runs as transformers; with cos and sin left unscaled (yarn_attn_factor 1) the
    logits are another model's."""
    src, path = variant("yarn")
    reader = open_reader(path)
    assert {k: reader.fields[k].contents() for k in reader.fields if ".rope.scaling." in k} == {
        "llama-silu.rope.scaling.type": "yarn", "llama-silu.rope.scaling.factor": 8.0,
        "llama-silu.rope.scaling.original_context_length": 64}
    assert not any(t.name.startswith("rope_") for t in reader.tensors)
    ref = hf_logits(src, TOKENS)
    with engine.Model(llama_cpp_file(path, tmp_path / "theirs.gguf"), threads=2, ctx_size=512) as m:
        assert max_rel_err(engine_prompt_then_decode(m, TOKENS, N_PROMPT), ref) <= 1e-4
    unscaled = llama_cpp_file(path, tmp_path / "unscaled.gguf",
                              fields={"rope.scaling.yarn_attn_factor": (1.0, gguf.GGUFValueType.FLOAT32)})
    with engine.Model(unscaled, threads=2, ctx_size=512) as m:
        assert max_rel_err(m.eval(TOKENS), ref) > 1e-2


def test_dynamic_ntk_runs_within_max_position_embeddings(variant, tmp_path):
    """Dynamic NTK is transformers' default RoPE until a sequence passes max_position_embeddings (dynamic_rope_update):
    the file carries that length as the window, so the engine runs no longer context, and within it the logits and
    greedy tokens are transformers', as are those of a llama.cpp file (whose converter writes nothing for dynamic)."""
    src, path = variant("dynamic")
    reader = open_reader(path)
    assert reader.fields["llama-silu.attention.sliding_window"].contents() == 128
    assert not any(".rope.scaling." in k for k in reader.fields)
    assert_context_capped(path, 128, "llama-silu.attention.sliding_window = 128")
    theirs = llama_cpp_file(path, tmp_path / "theirs.gguf", drop_keys=("attention.sliding_window",))
    assert_computes_transformers_model(src, [path, theirs], TOKENS[:128], 96, N_GREEDY)


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
        assert max_rel_err(engine_prompt_then_decode(m, TOKENS[:64], 48), hf_logits(src, TOKENS[:64])) <= 1e-4
    assert_context_capped(path, 64, "sliding_window = 64")


# ---- refusals at convert ---------------------------------------------------------------------------------------
REFUSED = [  # (kind, config.json fields, what the line names)
    ("llama-silu", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                                     "truncate": False}},  # llama.cpp's keys have no untruncated ramp
     "rope_parameters.truncate = False"),
    ("llama-silu", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                                     "beta_fast": 1.0, "beta_slow": 2.0}}, "rope_parameters.beta_fast = 1.0"),
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
    ("rope.scaling.type", ("dynamic", gguf.GGUFValueType.STRING), "rope scaling 'dynamic' is not supported"),
    ("rope.scaling.yarn_log_multiplier", (0.1, gguf.GGUFValueType.FLOAT32),
     "key llama.rope.scaling.yarn_log_multiplier"),
    ("rope.scaling.yarn_beta_fast", (16.0, gguf.GGUFValueType.FLOAT32),
     "key llama.rope.scaling.yarn_beta_fast with rope scaling 'linear'"),
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
