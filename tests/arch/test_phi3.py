"""Phi-3 / Phi-4 through every stage (models/arch/phi3.py, issue 66): a tiny random Phi3ForCausalLM with every
feature on (fused qkv_proj and gate_up_proj, NeoX RoPE over the first 0.75 of each head as Phi-4-mini's, a tied head;
and Phi-3-mini's untied head with full rotation) converted at f32 and run by the engine against transformers' own
class over 300 positions and 32 greedy steps; a GGUF of the same checkpoint as llama.cpp's convert_hf_to_gguf.py
writes one (Phi3MiniModel: fused attn_qkv, ffn_up holding gate and up, rope.dimension_count, sliding_window 0 for
none, its SentencePiece vocabulary and chat template) run with the same logits and tokenizer; a sliding window
capping the context; the device tier through its host emulation; input sparsity; what is refused, in one line."""
from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
from cli_helpers import run_cli
from family_checks import (add_checkpoint_tensors, add_sentencepiece_vocab, assert_convert_refuses,
                           assert_input_sparsity_runs, assert_same_tokenizer_and_template, emulated_device_run,
                           llama_cpp_writer)
from engine_helpers import engine_prompt_then_decode, hf_logits, max_rel_err, random_tokens
from test_qwen import hf_greedy, rewritten
from tiny_models import HIDDEN, N_FF, N_HEAD, N_KV, PHI3_ROTARY, make_tiny

import powerinfer_engine as engine
from powerinfer_tools.formats import names
from powerinfer_tools.formats.gguf_io import open_reader

N_TOKENS, N_PROMPT, N_GREEDY = 300, 200, 32
D_HEAD = HIDDEN // N_HEAD
PHI3_MINI = {"tie_word_embeddings": False,  # Phi-3-mini: untied, every dim rotated, a window past the context
             "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0},
             "sliding_window": 2047}
VARIANTS = {"phi4-mini": {}, "phi3-mini": PHI3_MINI}


def llama_cpp_gguf(model_dir, dst):
    """The checkpoint at model_dir as llama.cpp's convert_hf_to_gguf.py writes a phi3 GGUF (Phi3MiniModel): gguf-py's
    names (qkv_proj -> attn_qkv, gate_up_proj -> ffn_up, fused as they are), rope.dimension_count
    int(partial_rotary_factor * n_embd) // n_head, sliding_window 0 where the config has none, no output.weight for a
    tied head, the SentencePiece vocabulary (_set_vocab_sentencepiece) with its chat template."""
    writer, config = llama_cpp_writer(model_dir, dst, gguf.MODEL_ARCH.PHI3)
    rope = config["rope_parameters"]
    writer.add_rope_scaling_orig_ctx_len(config.get("original_max_position_embeddings", 4096))
    writer.add_rope_dimension_count(int(rope["partial_rotary_factor"] * config["hidden_size"])
                                    // config["num_attention_heads"])
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_sliding_window(config.get("sliding_window") or 0)
    add_sentencepiece_vocab(writer, model_dir, config["vocab_size"])
    add_checkpoint_tensors(writer, model_dir, gguf.MODEL_ARCH.PHI3, config["num_hidden_layers"])
    return dst


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    """family(variant) -> (model directory, its f32 file, its llama.cpp GGUF)."""
    from powerinfer_tools.stages.conversion import convert_model

    cache = {}

    def get(variant="phi4-mini", **overrides):
        key = (variant, json.dumps(overrides, sort_keys=True))
        if key not in cache:
            root = tmp_path_factory.mktemp(variant)
            src = make_tiny("phi3", root / "hf", **{**VARIANTS[variant], **overrides})
            out = root / "phi3.gguf"
            convert_model(str(src), out, outtype="f32", progress=False, powerinfer_compatible=False)
            cache[key] = src, out, llama_cpp_gguf(src, root / "phi3.llama.cpp.gguf")
        return cache[key]

    return get


@pytest.mark.parametrize("variant", VARIANTS)
def test_converted_file_computes_transformers_model(variant, family):
    src, path, _ = family(variant)
    vocab = json.loads((src / "config.json").read_text())["vocab_size"]
    tokens = random_tokens(N_TOKENS, vocab, seed=11)
    with engine.Model(path, threads=2, ctx_size=512) as m:
        err = max_rel_err(engine_prompt_then_decode(m, tokens, N_PROMPT), hf_logits(src, tokens))
    assert err <= 1e-4, f"{variant} drifts from transformers: {err:.2e} relative"
    prompt = tokens[:N_TOKENS - N_GREEDY]
    with engine.Model(path, threads=2, ctx_size=512) as m:
        assert list(m.generate(prompt, N_GREEDY)) == hf_greedy(src, prompt, N_GREEDY)


@pytest.mark.parametrize("variant", VARIANTS)
def test_converted_file_splits_the_fused_projections(variant, family):
    """general.architecture phi3-silu; qkv_proj split into attn_q/attn_k/attn_v and gate_up_proj into ffn_gate/ffn_up
    (the gate's rows first), rows as they are (NeoX RoPE); the rotated dims as rope.dimension_count."""
    src, path, theirs = family(variant)
    reader = open_reader(path)
    assert reader.fields[names.KEY_ARCHITECTURE].contents() == "phi3-silu"
    rotated = int(D_HEAD * (1.0 if variant == "phi3-mini" else PHI3_ROTARY))
    assert reader.fields["phi3-silu.rope.dimension_count"].contents() == rotated
    ours = {t.name: np.array(t.data) for t in reader.tensors}
    llama_cpp = {t.name: np.array(t.data) for t in open_reader(theirs).tensors}
    q, kv = N_HEAD * D_HEAD, N_KV * D_HEAD
    for i in range(2):
        qkv, gate_up = llama_cpp[f"blk.{i}.attn_qkv.weight"], llama_cpp[f"blk.{i}.ffn_up.weight"]
        assert np.array_equal(np.concatenate([ours[f"blk.{i}.attn_{p}.weight"] for p in "qkv"]), qkv)
        assert ours[f"blk.{i}.attn_k.weight"].shape == (kv, HIDDEN) and qkv.shape == (q + 2 * kv, HIDDEN)
        assert np.array_equal(ours[f"blk.{i}.ffn_gate.weight"], gate_up[:N_FF])
        assert np.array_equal(ours[f"blk.{i}.ffn_up.weight"], gate_up[N_FF:])
        assert np.array_equal(ours[f"blk.{i}.ffn_down_t.weight"], llama_cpp[f"blk.{i}.ffn_down.weight"].T)
    assert ("output.weight" in ours) == (variant == "phi3-mini") == ("output.weight" in llama_cpp)


@pytest.mark.parametrize("variant", VARIANTS)
def test_llama_cpp_file_runs_with_the_same_logits_and_tokenizer(variant, family, capsys):
    src, _, theirs = family(variant)
    vocab = json.loads((src / "config.json").read_text())["vocab_size"]
    tokens = random_tokens(N_TOKENS, vocab, seed=11)
    with engine.Model(theirs, threads=2, ctx_size=512) as m:
        assert m.info["magic"] == "GGUF" and m.n_ctx == 512  # sliding_window 0 (none), or one past the context
        err = max_rel_err(engine_prompt_then_decode(m, tokens, N_PROMPT), hf_logits(src, tokens))
    assert err <= 1e-4, f"llama.cpp's {variant} file drifts from transformers: {err:.2e} relative"
    assert assert_same_tokenizer_and_template(src, theirs) == "<|user|>\nWho art thou?<|end|>\n<|assistant|>\n"
    code, _, err = run_cli(capsys, "run", "-m", theirs, "-p", "To be", "-n", "4")
    assert code == 0, err


def test_a_sliding_window_caps_the_context(family):
    """Phi3Model masks attention to the window (create_sliding_window_causal_mask) in every layer: within it the model
    is a causal one, so the file carries the window and the engine runs no longer context (Mistral's rule)."""
    src, path, theirs = family("phi3-mini", sliding_window=64)
    assert open_reader(path).fields["phi3-silu.attention.sliding_window"].contents() == 64
    vocab = json.loads((src / "config.json").read_text())["vocab_size"]
    tokens = random_tokens(64, vocab, seed=5)
    for file in (path, theirs):
        with engine.Model(file, threads=2) as m:
            assert m.n_ctx == 64
            assert max_rel_err(engine_prompt_then_decode(m, tokens, 48), hf_logits(src, tokens)) <= 1e-4


@pytest.mark.parametrize("llama_cpp", [False, True], ids=["ours", "llama.cpp"])
def test_the_device_tier_gives_the_cpu_logits(llama_cpp, family, tmp_path, monkeypatch):
    """Through the host emulation of a device library (tests/engine/test_engine_device.py): attention with NeoX RoPE
    over the first 12 of 16 dims, the head and the hot rows on the device, from our split tensors or llama.cpp's fused
    ones (row views)."""
    src, ours, theirs = family()
    tokens = random_tokens(40, json.loads((src / "config.json").read_text())["vocab_size"], seed=3)
    cpu, dev, info, _ = emulated_device_run(theirs if llama_cpp else ours, tokens, 24, 2, N_FF, tmp_path, monkeypatch)
    placed = info["gpu"]["device"]
    assert placed["layers_on_device"] == placed["attention_layers"] == 2 and placed["output_head"] == "device"
    assert max_rel_err(dev, cpu) <= 1e-4


def test_input_sparsity_from_a_profile_runs(family, tmp_path, capsys):
    """profile --input-allocation (hooks on the fused qkv_proj and gate_up_proj), convert with its thresholds, run
    --sparse-mode input."""
    src, _, _ = family()
    assert_input_sparsity_runs(src, tmp_path, capsys)


# ---- refusals ---------------------------------------------------------------------------------------------------
LONGROPE = {"type": "longrope", "short_factor": [1.0] * 6, "long_factor": [2.0] * 6,
            "original_max_position_embeddings": 128}
REFUSED = [  # (config.json fields, what the line names)
    ({"rope_scaling": LONGROPE, "rope_theta": 10000.0, "partial_rotary_factor": PHI3_ROTARY},
     "rope_parameters.rope_type = 'longrope'"),
    ({"rope_scaling": {**LONGROPE, "type": "su"}, "rope_theta": 10000.0, "partial_rotary_factor": PHI3_ROTARY},
     "rope_parameters.rope_type = 'longrope'"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.2}},
     "rope_parameters.partial_rotary_factor = 0.2"),  # 3.2 dims: not whole pairs
    ({"head_dim": 32}, "head_dim = 32"),
    ({"hidden_act": "gelu"}, "unsupported architecture 'phi3'"),
]


@pytest.mark.parametrize("fields,needle", REFUSED, ids=[n.split(" =")[0] + str(i) for i, (_, n) in enumerate(REFUSED)])
def test_unsupported_field_is_refused_by_convert_and_its_dry_run(fields, needle, family, tmp_path, capsys):
    assert_convert_refuses(family()[0], fields, needle, tmp_path, capsys)


def test_engine_refuses_what_it_would_not_compute(family, tmp_path):
    _, _, theirs = family()
    factors = np.ones(6, np.float32)
    cases = [  # (file, what the line says)
        (rewritten(theirs, tmp_path / "a.gguf", tensors={"rope_factors_long.weight": factors,
                                                         "rope_factors_short.weight": factors}),
         "tensor rope_factors_long.weight (longrope RoPE scaling) is not computed"),
        (rewritten(theirs, tmp_path / "b.gguf",
                   fields={"phi3.rope.scaling.attn_factor": (1.19, gguf.GGUFValueType.FLOAT32)}),
         "key phi3.rope.scaling.attn_factor is not computed"),
        (rewritten(theirs, tmp_path / "c.gguf", tensors={"blk.0.ffn_up.bias": np.zeros(2 * N_FF, np.float32)}),
         "tensor blk.0.ffn_up.bias of a fused gate and up is not computed"),
        (rewritten(theirs, tmp_path / "d.gguf", drop=("blk.1.attn_qkv.weight",)),
         "tensor blk.1.attn_q.weight is missing"),
    ]
    for path, needle in cases:
        with pytest.raises(engine.EngineError) as exc:
            engine.Model(path, threads=1)
        assert len(str(exc.value).splitlines()) == 1 and needle in str(exc.value), str(exc.value)
