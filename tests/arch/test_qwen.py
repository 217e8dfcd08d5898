"""Qwen2/Qwen2.5 and Qwen3 through every stage (models/arch/qwen.py, issue 66): tiny random models with every feature
on (q/k/v biases, Qwen3's o bias, per-head q/k norms and heads 32 wide beside 64 / 4, a tied head, rope_theta 1e6)
converted at f32 and run by the engine against transformers' own classes over 300 positions and 32 greedy steps; a
GGUF of the same checkpoint written as llama.cpp's convert_hf_to_gguf.py writes one (gguf-py's names, no q/k
permutation, its vocabulary with pre-tokenizer qwen2 and chat template) run with the same logits and tokenizer;
Qwen2.5's YaRN past its original context; a sliding window capping the context; the GPU tier through the host
emulation; what is refused, in one line."""
from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
from cli_helpers import assert_one_line_error, run_cli
from family_checks import (add_bpe_vocab, add_checkpoint_tensors, assert_computes_transformers_model,
                           assert_input_sparsity_runs, assert_relu_sparse_modes,
                           assert_same_tokenizer_and_template, convert_refusal_test, emulated_device_run,
                           llama_cpp_writer)
from engine_helpers import (converted, engine_prompt_then_decode, finish_gguf, hf_logits, hf_model,  # noqa: F401
                            max_rel_err, random_tokens)
from tiny_models import N_FF, N_LAYER, QWEN3_HEAD_DIM, QWEN_KINDS, make_tiny

import powerinfer_engine as engine
from powerinfer_tools.formats import names
from powerinfer_tools.formats.gguf_io import open_reader
from powerinfer_tools.formats.tokenizer import tokenizer_from_file

VOCAB, N_TOKENS, N_PROMPT, N_GREEDY = 400, 300, 200, 32
TOKENS = random_tokens(N_TOKENS, VOCAB, seed=7)
GGUF_ARCH = {"qwen2": gguf.MODEL_ARCH.QWEN2, "qwen3": gguf.MODEL_ARCH.QWEN3}


def llama_cpp_gguf(model_dir, dst, kind: str):
    """The checkpoint at model_dir as llama.cpp's convert_hf_to_gguf.py writes a qwen2/qwen3 GGUF (its Qwen2Model,
    Qwen3Model): gguf-py's tensor names for the architecture, q/k rows as they are (llama.cpp runs both with NeoX
    RoPE), no output.weight for a tied head, key_length/value_length from head_dim, the byte-level vocabulary with
    pre-tokenizer qwen2, its merges, special tokens and chat template (_set_vocab_gpt2)."""
    writer, config = llama_cpp_writer(model_dir, dst, GGUF_ARCH[kind])
    rope = config["rope_parameters"]
    writer.add_rope_freq_base(rope["rope_theta"])
    if rope["rope_type"] == "yarn":  # its TextModel.set_gguf_parameters
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        for field, add in (("attention_factor", writer.add_rope_scaling_yarn_attn_factor),
                           ("beta_fast", writer.add_rope_scaling_yarn_beta_fast),
                           ("beta_slow", writer.add_rope_scaling_yarn_beta_slow)):
            if rope.get(field) is not None:
                add(rope[field])
    add_bpe_vocab(writer, model_dir, config["vocab_size"])
    add_checkpoint_tensors(writer, model_dir, GGUF_ARCH[kind], config["num_hidden_layers"])
    return dst


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    """family(kind, **config) -> (model directory, its f32 file, its llama.cpp GGUF)."""
    from powerinfer_tools.stages.conversion.conversion import convert_model

    cache = {}

    def get(kind, **overrides):
        key = (kind, json.dumps(overrides, sort_keys=True))
        if key not in cache:
            root = tmp_path_factory.mktemp(kind)
            src = make_tiny(kind, root / "hf", **overrides)
            out = root / f"{kind}.gguf"
            convert_model(str(src), out, outtype="f32", progress=False, powerinfer_compatible=False)
            cache[key] = src, out, llama_cpp_gguf(src, root / f"{kind}.llama.cpp.gguf", kind)
        return cache[key]

    return get


@pytest.mark.parametrize("kind", QWEN_KINDS)
def test_converted_file_computes_transformers_model(kind, family):
    src, path, _ = family(kind)
    assert_computes_transformers_model(src, [path], TOKENS, N_PROMPT, N_GREEDY, ctx_size=512)


@pytest.mark.parametrize("kind", QWEN_KINDS)
def test_converted_file_is_named_as_llama_cpp_names_the_family(kind, family):
    """general.architecture <llama.cpp's name>-silu (as llama-silu: PowerInfer refuses it), gguf-py's tensor names,
    q/k rows unpermuted (NeoX RoPE), a tied head stored once, Qwen3's head width as attention.key_length."""
    src, path, theirs = family(kind)
    reader = open_reader(path)
    assert reader.fields[names.KEY_ARCHITECTURE].contents() == f"{kind}-silu"
    ours = {t.name: np.array(t.data) for t in reader.tensors}
    llama_cpp = {t.name: np.array(t.data) for t in open_reader(theirs).tensors}
    assert "output.weight" not in ours and "output.weight" not in llama_cpp
    assert ("blk.0.attn_q_norm.weight" in ours) == (kind == "qwen3") and "blk.0.attn_q.bias" in ours
    assert ("blk.0.attn_output.bias" in ours) == (kind == "qwen3")  # Qwen2's o projection has none
    for name, data in llama_cpp.items():  # the same tensors, the same rows, but for the down projection's transpose
        assert np.array_equal(ours[name], data) if name in ours else np.array_equal(
            ours[name.replace(names.FFN_DOWN, names.FFN_DOWN_T)], data.T), name
    if kind == "qwen3":
        assert reader.fields[f"{kind}-silu.attention.key_length"].contents() == QWEN3_HEAD_DIM
        assert ours["blk.0.attn_q.weight"].shape == (4 * QWEN3_HEAD_DIM, 64)


@pytest.mark.parametrize("kind", QWEN_KINDS)
def test_llama_cpp_file_runs_with_the_same_logits_and_tokenizer(kind, family, capsys):
    src, _, theirs = family(kind)
    with engine.Model(theirs, threads=2, ctx_size=512) as m:
        assert m.info["magic"] == "GGUF"
        err = max_rel_err(engine_prompt_then_decode(m, TOKENS, N_PROMPT), hf_logits(src, TOKENS))
    assert err <= 1e-4, f"llama.cpp's {kind} file drifts from transformers: {err:.2e} relative"
    assert_same_tokenizer_and_template(src, theirs)
    assert tokenizer_from_file(theirs).eos_token == "<|im_end|>"
    code, _, err = run_cli(capsys, "run", "-m", theirs, "-p", "To be", "-n", "4")
    assert code == 0, err


# Qwen2.5's long-context YaRN over a small original context, every sub-field set: beta_fast/beta_slow move the ramp
# (pairs 0-1 kept, 2 blended, 3-7 interpolated here), attention_factor replaces 0.1 ln 4 + 1
QWEN_YARN = {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0, "original_max_position_embeddings": 128,
             "beta_fast": 16.0, "beta_slow": 2.0, "attention_factor": 1.25}


def test_yarn_matches_transformers_past_the_original_context(family):
    """YaRN written as llama.cpp's keys (type, factor, original context, yarn_beta_fast/slow, yarn_attn_factor), ours
    and llama.cpp's converter's alike, computed by the engine as transformers' static YaRN over 300 positions."""
    src, path, theirs = family("qwen2", rope_parameters=QWEN_YARN)
    fields = open_reader(path).fields
    assert fields["qwen2-silu.rope.scaling.type"].contents() == "yarn"
    assert fields["qwen2-silu.rope.scaling.yarn_attn_factor"].contents() == 1.25
    assert fields["qwen2-silu.rope.scaling.yarn_beta_fast"].contents() == 16.0
    assert_computes_transformers_model(src, [path, theirs], TOKENS, N_PROMPT, N_GREEDY, ctx_size=512)


def test_a_sliding_window_caps_the_context(family):
    """use_sliding_window with layers past max_window_layers sliding: within its window such a model is a causal one,
    so the file carries the window and the engine runs no longer context (Mistral's rule); with no layer sliding
    the window is not written."""
    src, path, _ = family("qwen2", use_sliding_window=True, sliding_window=64, max_window_layers=1)
    assert open_reader(path).fields["qwen2-silu.attention.sliding_window"].contents() == 64
    with engine.Model(path, threads=2) as m:
        assert m.n_ctx == 64
        assert max_rel_err(engine_prompt_then_decode(m, TOKENS[:64], 48), hf_logits(src, TOKENS[:64])) <= 1e-4
    _, none_slide, _ = family("qwen2", use_sliding_window=True, sliding_window=64, max_window_layers=N_LAYER)
    assert "qwen2-silu.attention.sliding_window" not in open_reader(none_slide).fields


@pytest.mark.parametrize("kind,config", [("qwen2", {}), ("qwen2", {"head_dim": 32}), ("qwen3", {}),
                                         ("qwen2", {"rope_parameters": QWEN_YARN})],
                         ids=["qwen2", "qwen2-head_dim", "qwen3", "qwen2-yarn"])
def test_the_device_tier_gives_the_cpu_logits(kind, config, family, tmp_path, monkeypatch):
    """Through the host emulation of a device library (tests/engine/test_engine_device.py): Qwen2's attention and KV
    cache on the device (its biases, NeoX RoPE, YaRN's frequencies and attention factor in the tables the host gives
    it, heads of their own width where config.json sets head_dim, which Qwen2's class reads too); Qwen3's stay on the
    CPU (the device computes no per-head norms), its hot rows and output head on the device."""
    _, path, _ = family(kind, **config)
    cpu, dev, info, stats = emulated_device_run(path, TOKENS[:40], 24, N_LAYER, N_FF, tmp_path, monkeypatch)
    placed = info["gpu"]["device"]
    assert placed["layers_on_device"] == N_LAYER and placed["output_head"] == "device"
    assert placed["attention_layers"] == (N_LAYER if kind == "qwen2" else 0)
    gpu = stats["gpu"]  # attention on the device: alone, or in a split or whole layer's job
    assert (gpu["attention_jobs"] + gpu["split_jobs"] + gpu["layer_jobs"] > 0) == (kind == "qwen2")
    assert max_rel_err(dev, cpu) <= 1e-4


@pytest.mark.parametrize("kind", QWEN_KINDS)
def test_input_sparsity_from_a_profile_runs(kind, family, tmp_path, capsys):
    """profile --input-allocation, convert with its thresholds, run --sparse-mode input (the logits against
    transformers with the same inputs zeroed: tests/engine/test_engine_input_sparsity.py)."""
    src, _, _ = family(kind)
    assert_input_sparsity_runs(src, tmp_path, capsys)


@pytest.mark.parametrize("kind", ["qwen2-relu", "qwen3-relu"])
def test_relu_variant_runs_every_sparse_mode(kind, tiny_model_dir, converted, tmp_path, monkeypatch):
    """hidden_act relu (`pi-tools sparsify`'s output): a file named qwen2 / qwen3 (ReLU is not thresholded), exact
    zeros, so the sparse modes are the model's own (family_checks.assert_relu_sparse_modes)."""
    path = converted(kind, predictors=True)
    assert open_reader(path).fields[names.KEY_ARCHITECTURE].contents() == kind.removesuffix("-relu")
    assert_relu_sparse_modes(tiny_model_dir(kind), path, TOKENS[:80], 64, tmp_path, monkeypatch)


# ---- refusals ---------------------------------------------------------------------------------------------------
REFUSED = [  # (kind, config.json fields, what the line names)
    ("qwen2", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
                                "truncate": False}}, "rope_parameters.truncate = False"),
    ("qwen3", {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope_parameters.rope_type = 'dynamic'"),
    ("qwen2", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_parameters.rope_type = 'linear'"),
    ("qwen3", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5}},
     "rope_parameters.partial_rotary_factor = 0.5"),
    ("qwen2", {"hidden_act": "gelu"}, "unsupported architecture 'qwen2'"),
]


test_unsupported_field_is_refused_by_convert_and_its_dry_run = convert_refusal_test(REFUSED)


def rewritten(src, dst, drop: tuple = (), fields: dict | None = None, tensors: dict | None = None, arch=None):
    """A copy of the GGUF at src without the tensors and keys named in drop, with `fields` (key -> (value, type)) and
    `tensors` (name -> f32 array) added, under architecture `arch` (its keys renamed)."""
    reader = open_reader(src)
    old = reader.fields[names.KEY_ARCHITECTURE].contents()
    writer = gguf.GGUFWriter(str(dst), arch or old)
    for name, f in reader.fields.items():
        if name.startswith(("GGUF.", names.KEY_ARCHITECTURE)) or name in drop:
            continue
        sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        key = f"{arch}.{name[len(old) + 1:]}" if arch and name.startswith(old + ".") else name
        writer.add_key_value(key, f.contents(), f.types[0], sub_type=sub)
    for key, (value, vtype) in (fields or {}).items():
        writer.add_key_value(key, value, vtype)
    for t in reader.tensors:
        if t.name not in drop:
            writer.add_tensor(t.name, np.array(t.data))
    finish_gguf(writer, tensors)
    return dst


def test_engine_refuses_what_it_would_not_compute(family, tmp_path, capsys):
    _, _, qwen3 = family("qwen3")
    _, _, qwen2 = family("qwen2")
    norm = np.ones(16, np.float32)
    cases = [  # (file, what the line says)
        (rewritten(qwen2, tmp_path / "a.gguf", tensors={"blk.0.attn_q_norm.weight": norm}),
         "blk.0.attn_q_norm.weight (per-head q/k norms) is not computed for architecture qwen2"),
        (rewritten(qwen3, tmp_path / "b.gguf", drop=("blk.1.attn_k_norm.weight",)),
         "tensor blk.1.attn_k_norm.weight is missing"),
        (rewritten(qwen3, tmp_path / "c.gguf", drop=("qwen3.attention.value_length",),
                   fields={"qwen3.attention.value_length": (16, gguf.GGUFValueType.UINT32)}),
         "qwen3.attention.value_length 16 is not qwen3.attention.key_length 32"),
        (rewritten(qwen3, tmp_path / "d.gguf", drop=("qwen3.attention.key_length", "qwen3.attention.value_length")),
         "tensor blk.0.attn_q.weight has shape (128, 64), the hyperparameters say (64, 64)"),
        (rewritten(qwen3, tmp_path / "e.gguf", arch="llama"),  # heads of their own width are computed for qwen only
         "llama.attention.key_length 32 is not embedding_length / head_count (16)"),
        (rewritten(qwen2, tmp_path / "f.gguf", fields={"qwen2.rope.scaling.type": ("yarn", gguf.GGUFValueType.STRING),
                                                       "qwen2.rope.scaling.yarn_ext_factor": (
                                                           0.5, gguf.GGUFValueType.FLOAT32)}),
         "qwen2.rope.scaling.yarn_ext_factor other than 1 is not computed"),
        (rewritten(qwen2, tmp_path / "g.gguf", fields={"qwen2.rope.scaling.type": ("yarn", gguf.GGUFValueType.STRING),
                                                       "qwen2.rope.scaling.yarn_beta_fast": (
                                                           0.5, gguf.GGUFValueType.FLOAT32)}),
         "yarn_beta_fast must be above yarn_beta_slow"),
        (rewritten(qwen2, tmp_path / "h.gguf",
                   fields={names.KEY_FFN_ACTIVATION: ("fatrelu", gguf.GGUFValueType.STRING)}),
         "FFN activation 'fatrelu' is not supported for architecture qwen2"),  # ReLU and SiLU only: no FATReLU form
    ]
    for path, needle in cases:
        with pytest.raises(engine.EngineError) as exc:
            engine.Model(path, threads=1)
        assert len(str(exc.value).splitlines()) == 1 and needle in str(exc.value), str(exc.value)
    code, _, err = run_cli(capsys, "run", "-m", cases[0][0], "-p", "hi", "-n", "1")
    assert_one_line_error(code, err, cases[0][1])
