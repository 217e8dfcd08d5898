"""Qwen2/Qwen2.5 and Qwen3 through every stage (models/arch/qwen.py, issue 66): tiny random models with every feature
on (q/k/v biases, Qwen3's o bias, per-head q/k norms and heads 32 wide beside 64 / 4, a tied head, rope_theta 1e6)
converted at f32 and run by the engine against transformers' own classes over 300 positions and 32 greedy steps; a
GGUF of the same checkpoint written as llama.cpp's convert_hf_to_gguf.py writes one (gguf-py's names, no q/k
permutation, its vocabulary with pre-tokenizer qwen2 and chat template) run with the same logits and tokenizer; a
sliding window capping the context; the GPU tier through the host emulation; what is refused, in one line."""
from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
import torch
from cli_helpers import assert_one_line_error, run_cli
from family_checks import (add_bpe_vocab, add_checkpoint_tensors, assert_input_sparsity_runs,
                           assert_same_tokenizer_and_template, convert_refusal_test, emulated_device_run,
                           llama_cpp_writer)
from engine_helpers import (engine_prompt_then_decode, finish_gguf, hf_logits, hf_model, max_rel_err, random_tokens)
from tiny_models import N_FF, N_LAYER, QWEN3_HEAD_DIM, QWEN_KINDS, make_tiny

import powerinfer_engine as engine
from powerinfer_tools.formats import names
from powerinfer_tools.formats.gguf_io import open_reader
from powerinfer_tools.formats.tokenizer import tokenizer_from_file

VOCAB, N_TOKENS, N_PROMPT, N_GREEDY = 400, 300, 200, 32
TOKENS = random_tokens(N_TOKENS, VOCAB, seed=7)
GGUF_ARCH = {"qwen2": gguf.MODEL_ARCH.QWEN2, "qwen3": gguf.MODEL_ARCH.QWEN3}


def hf_greedy(model_dir, prompt: list[int], n: int) -> list[int]:
    model, _ = hf_model(model_dir)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


def llama_cpp_gguf(model_dir, dst, kind: str):
    """The checkpoint at model_dir as llama.cpp's convert_hf_to_gguf.py writes a qwen2/qwen3 GGUF (its Qwen2Model,
    Qwen3Model): gguf-py's tensor names for the architecture, q/k rows as they are (llama.cpp runs both with NeoX
    RoPE), no output.weight for a tied head, key_length/value_length from head_dim, the byte-level vocabulary with
    pre-tokenizer qwen2, its merges, special tokens and chat template (_set_vocab_gpt2)."""
    writer, config = llama_cpp_writer(model_dir, dst, GGUF_ARCH[kind])
    writer.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    add_bpe_vocab(writer, model_dir, config["vocab_size"])
    add_checkpoint_tensors(writer, model_dir, GGUF_ARCH[kind], config["num_hidden_layers"])
    return dst


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    """family(kind, **config) -> (model directory, its f32 file, its llama.cpp GGUF)."""
    from powerinfer_tools.stages.conversion import convert_model

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
    with engine.Model(path, threads=2, ctx_size=512) as m:
        err = max_rel_err(engine_prompt_then_decode(m, TOKENS, N_PROMPT), hf_logits(src, TOKENS))
    assert err <= 1e-4, f"{kind} drifts from transformers: {err:.2e} relative"
    prompt = TOKENS[:N_TOKENS - N_GREEDY]
    with engine.Model(path, threads=2, ctx_size=512) as m:
        assert list(m.generate(prompt, N_GREEDY)) == hf_greedy(src, prompt, N_GREEDY)


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


@pytest.mark.parametrize("kind,config", [("qwen2", {}), ("qwen2", {"head_dim": 32}), ("qwen3", {})],
                         ids=["qwen2", "qwen2-head_dim", "qwen3"])
def test_the_device_tier_gives_the_cpu_logits(kind, config, family, tmp_path, monkeypatch):
    """Through the host emulation of a device library (tests/engine/test_engine_device.py): Qwen2's attention and KV
    cache on the device (its biases, NeoX RoPE, heads of their own width where config.json sets head_dim, which
    Qwen2's class reads too); Qwen3's stay on the CPU (the device computes no per-head norms), its hot rows and
    output head on the device."""
    _, path, _ = family(kind, **config)
    cpu, dev, info, stats = emulated_device_run(path, TOKENS[:40], 24, N_LAYER, N_FF, tmp_path, monkeypatch)
    placed = info["gpu"]["device"]
    assert placed["layers_on_device"] == N_LAYER and placed["output_head"] == "device"
    assert placed["attention_layers"] == (N_LAYER if kind == "qwen2" else 0)
    assert (stats["gpu"]["attention_jobs"] > 0) == (kind == "qwen2")
    assert max_rel_err(dev, cpu) <= 1e-4


@pytest.mark.parametrize("kind", QWEN_KINDS)
def test_input_sparsity_from_a_profile_runs(kind, family, tmp_path, capsys):
    """profile --input-allocation, convert with its thresholds, run --sparse-mode input (the logits against
    transformers with the same inputs zeroed: tests/engine/test_engine_input_sparsity.py)."""
    src, _, _ = family(kind)
    assert_input_sparsity_runs(src, tmp_path, capsys)


# ---- refusals ---------------------------------------------------------------------------------------------------
REFUSED = [  # (kind, config.json fields, what the line names)
    ("qwen2", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}},
     "rope_parameters.rope_type = 'yarn'"),
    ("qwen3", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}},
     "rope_parameters.rope_type = 'yarn'"),
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
        (rewritten(qwen2, tmp_path / "f.gguf", fields={"qwen2.rope.scaling.type": ("yarn", gguf.GGUFValueType.STRING)}),
         "rope scaling 'yarn' is not supported"),
    ]
    for path, needle in cases:
        with pytest.raises(engine.EngineError) as exc:
            engine.Model(path, threads=1)
        assert len(str(exc.value).splitlines()) == 1 and needle in str(exc.value), str(exc.value)
    code, _, err = run_cli(capsys, "run", "-m", cases[0][0], "-p", "hi", "-n", "1")
    assert_one_line_error(code, err, cases[0][1])
