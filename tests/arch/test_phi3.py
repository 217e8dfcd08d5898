"""Phi-3 / Phi-4 through every stage (models/arch/phi3.py, issue 66): a tiny random Phi3ForCausalLM with every
feature on (fused qkv_proj and gate_up_proj, NeoX RoPE over the first 0.75 of each head as Phi-4-mini's, a tied head;
and Phi-3-mini's untied head with full rotation) converted at f32 and run by the engine against transformers' own
class over 300 positions and 32 greedy steps; a GGUF of the same checkpoint as llama.cpp's convert_hf_to_gguf.py
writes one (Phi3MiniModel: fused attn_qkv, ffn_up holding gate and up, rope.dimension_count, sliding_window 0 for
none, longrope's factors and attention factor, its SentencePiece vocabulary and chat template) run with the same
logits and tokenizer; longrope (Phi-3 128k, Phi-4-mini) within its original context; a sliding window capping the
context; the device tier through its host emulation; input sparsity; what is refused, in one line."""
from __future__ import annotations

import json
import math

import gguf
import numpy as np
import pytest
from cli_helpers import run_cli
from family_checks import (add_checkpoint_tensors, add_sentencepiece_vocab, assert_computes_transformers_model,
                           assert_context_capped, assert_convert_refuses, assert_input_sparsity_runs,
                           assert_relu_sparse_modes, assert_same_tokenizer_and_template, emulated_device_run,
                           llama_cpp_writer)
from engine_helpers import (converted, engine_prompt_then_decode, hf_logits, max_rel_err,  # noqa: F401
                            random_tokens)
from test_qwen import rewritten
from tiny_models import HIDDEN, N_FF, N_HEAD, N_KV, PHI3_ROTARY, make_tiny

import powerinfer_engine as engine
from powerinfer_tools.formats import names
from powerinfer_tools.formats.gguf_io import open_reader

N_TOKENS, N_PROMPT, N_GREEDY = 300, 200, 32
D_HEAD = HIDDEN // N_HEAD
PHI3_MINI = {"tie_word_embeddings": False,  # Phi-3-mini: untied, every dim rotated, a window past the context
             "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0},
             "sliding_window": 2047}
# Phi-3 128k's longrope over a small original context: per rotated pair (6 of them), the frequency's divisor within
# original_max_position_embeddings (short) and past it (long); max_position_embeddings / original = 4 sets the
# attention factor sqrt(1 + ln 4 / ln 128)
LONGROPE = {"rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": PHI3_ROTARY,
                                "short_factor": [1.0, 1.3, 1.8, 2.5, 4.0, 6.0],
                                "long_factor": [1.0, 2.0, 4.0, 8.0, 16.0, 32.0]},
            "original_max_position_embeddings": 128}
VARIANTS = {"phi4-mini": {}, "phi3-mini": PHI3_MINI, "phi3-128k": LONGROPE}


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
    if rope["rope_type"] == "longrope":  # its generate_extra_tensors: no rope.scaling.type
        scale = config["max_position_embeddings"] / config["original_max_position_embeddings"]
        writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(
            config["original_max_position_embeddings"])))
        writer.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], np.float32))
        writer.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], np.float32))
    add_sentencepiece_vocab(writer, model_dir, config["vocab_size"])
    add_checkpoint_tensors(writer, model_dir, gguf.MODEL_ARCH.PHI3, config["num_hidden_layers"])
    return dst


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    """family(variant) -> (model directory, its f32 file, its llama.cpp GGUF)."""
    from powerinfer_tools.stages.conversion.conversion import convert_model

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


@pytest.mark.parametrize("variant", ["phi4-mini", "phi3-mini"])
def test_converted_file_computes_transformers_model(variant, family):
    src, path, _ = family(variant)
    vocab = json.loads((src / "config.json").read_text())["vocab_size"]
    assert_computes_transformers_model(src, [path], random_tokens(N_TOKENS, vocab, seed=11), N_PROMPT, N_GREEDY,
                                       ctx_size=512)


def test_longrope_runs_within_its_original_context(family):
    """Our file carries longrope as llama.cpp's does (rope_factors_short/long.weight, rope.scaling.attn_factor, the
    original context) and runs, as llama.cpp's own file does, in at most the original context, where transformers
    takes the short factors: there the logits and greedy tokens are transformers' at every position."""
    src, path, theirs = family("phi3-128k")
    reader = open_reader(path)
    factors = {t.name: np.array(t.data) for t in reader.tensors if t.name.startswith("rope_factors")}
    for part in ("short", "long"):
        assert np.array_equal(factors[f"rope_factors_{part}.weight"],
                              np.float32(LONGROPE["rope_parameters"][f"{part}_factor"])), part
    assert reader.fields["phi3-silu.rope.scaling.attn_factor"].contents() == pytest.approx(
        math.sqrt(1 + math.log(4) / math.log(128)))
    for file in (path, theirs):
        assert_context_capped(file, 128, "rope.scaling.original_context_length = 128")
    tokens = random_tokens(128, json.loads((src / "config.json").read_text())["vocab_size"], seed=11)
    assert_computes_transformers_model(src, [path, theirs], tokens, 96, N_GREEDY)


@pytest.mark.parametrize("variant", ["phi4-mini", "phi3-mini"])
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


@pytest.mark.parametrize("variant", ["phi4-mini", "phi3-mini"])
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


def test_relu_variant_runs_every_sparse_mode(tiny_model_dir, converted, tmp_path, monkeypatch):
    """hidden_act relu (`pi-tools sparsify`'s output): a file named phi3, its fused gate_up_proj split as the SiLU
    model's, exact zeros, so the sparse modes are the model's own (family_checks.assert_relu_sparse_modes)."""
    path = converted("phi3-relu", predictors=True)
    assert open_reader(path).fields[names.KEY_ARCHITECTURE].contents() == "phi3"
    assert_relu_sparse_modes(tiny_model_dir("phi3-relu"), path, random_tokens(80, 384, seed=11), 64, tmp_path,
                             monkeypatch)


# ---- refusals ---------------------------------------------------------------------------------------------------
REFUSED = [  # (config.json fields, what the line names)
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
    _, _, longrope = family("phi3-128k")
    factors = np.ones(6, np.float32)
    cases = [  # (file, what the line says)
        (rewritten(theirs, tmp_path / "a.gguf", tensors={"rope_factors_long.weight": factors}),
         "longrope RoPE scaling needs both tensors rope_factors_short.weight and rope_factors_long.weight"),
        (rewritten(longrope, tmp_path / "b.gguf", drop=("rope_factors_long.weight",),
                   tensors={"rope_factors_long.weight": np.array([1, 2, 4, 0, 16, 32], np.float32)}),
         "tensor rope_factors_long.weight holds a value that is not a positive number"),
        (rewritten(longrope, tmp_path / "e.gguf", drop=("rope_factors_short.weight",),
                   tensors={"rope_factors_short.weight": np.ones(8, np.float32)}),
         "tensor rope_factors_short.weight has shape (8), the hyperparameters say (6,)"),
        (rewritten(longrope, tmp_path / "f.gguf",
                   fields={"phi3.rope.scaling.factor": (4.0, gguf.GGUFValueType.FLOAT32)}),
         "rope.scaling.factor with longrope's tensors"),
        (rewritten(theirs, tmp_path / "c.gguf", tensors={"blk.0.ffn_up.bias": np.zeros(2 * N_FF, np.float32)}),
         "tensor blk.0.ffn_up.bias of a fused gate and up is not computed"),
        (rewritten(theirs, tmp_path / "d.gguf", drop=("blk.1.attn_qkv.weight",)),
         "tensor blk.1.attn_q.weight is missing"),
    ]
    for path, needle in cases:
        with pytest.raises(engine.EngineError) as exc:
            engine.Model(path, threads=1)
        assert len(str(exc.value).splitlines()) == 1 and needle in str(exc.value), str(exc.value)
