"""Mixtures of experts through convert and the engine (models/arch/moe.py, engine/moe.h, issue 67): tiny random
Qwen3-MoE, Mixtral (SiLU and ReLU experts) and OLMoE models of 8 experts with every feature on (tiny_models.MOE_KINDS),
built with transformers' own classes, converted at f32 and run against them over 200 positions and 32 greedy steps, and
at q8_0 and q4_0 within looser bounds; a GGUF of the same checkpoint as llama.cpp's convert_hf_to_gguf.py writes one
(its architecture names, keys and 3-D expert tensors) run with the same logits; a prompt's batch, grouped by expert,
giving each token the bits of its decode step; ReLU experts gate first with dense mode's bits; what is refused, in one
line."""
from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
from cli_helpers import assert_one_line_error, run_cli
from engine_helpers import engine_prompt_then_decode, hf_logits, max_rel_err, random_tokens, write_gpuidx
from family_checks import (add_bpe_vocab, add_checkpoint_tensors, add_sentencepiece_vocab, convert_refusal_test,
                           hf_greedy, llama_cpp_writer)
from test_qwen import rewritten
from tiny_models import MOE_FF, MOE_KINDS, N_EXPERT, make_tiny

import powerinfer_engine as engine
from powerinfer_tools.formats import names
from powerinfer_tools.formats.gguf_io import open_reader

N_TOKENS, N_PROMPT, N_GREEDY = 200, 140, 32
GGUF_ARCH = {"qwen3-moe": gguf.MODEL_ARCH.QWEN3MOE, "mixtral": gguf.MODEL_ARCH.LLAMA,
             "mixtral-relu": gguf.MODEL_ARCH.LLAMA, "olmoe": gguf.MODEL_ARCH.OLMOE}
OUR_ARCH = {"qwen3-moe": "qwen3moe-silu", "mixtral": "llama-silu", "mixtral-relu": "llama", "olmoe": "olmoe-silu"}


def llama_cpp_gguf(model_dir, dst, kind: str):
    """The checkpoint at model_dir as llama.cpp's convert_hf_to_gguf.py writes a qwen3moe, llama (Mixtral) or olmoe
    GGUF: gguf-py's names, the experts stacked into ffn_{gate,up,down}_exps, the router as ffn_gate_inp, expert_count
    and expert_used_count (Qwen3-MoE: expert_feed_forward_length, key_length), q/k rows permuted for llama, its
    vocabulary. llama.cpp has no ReLU Mixtral: such a file says powerinfer.ffn_activation relu."""
    arch = GGUF_ARCH[kind]
    writer, config = llama_cpp_writer(model_dir, dst, arch)
    writer.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    writer.add_expert_count(config.get("num_experts") or config["num_local_experts"])
    writer.add_expert_used_count(config["num_experts_per_tok"])
    if kind == "qwen3-moe":
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    if kind == "mixtral-relu":
        writer.add_string(names.KEY_FFN_ACTIVATION, "relu")
    if kind.startswith("mixtral"):
        add_sentencepiece_vocab(writer, model_dir, config["vocab_size"])
    else:
        add_bpe_vocab(writer, model_dir, config["vocab_size"])
    qk = (config["num_attention_heads"], config["num_key_value_heads"]) if arch == gguf.MODEL_ARCH.LLAMA else None
    add_checkpoint_tensors(writer, model_dir, arch, config["num_hidden_layers"], qk_heads=qk)
    return dst


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    """family(kind, outtype="f32", **config) -> (model directory, its converted file, its llama.cpp GGUF)."""
    from powerinfer_tools.stages.conversion.conversion import convert_model

    sources, files = {}, {}

    def get(kind, outtype="f32", **overrides):
        key = (kind, json.dumps(overrides, sort_keys=True))
        if key not in sources:
            root = tmp_path_factory.mktemp(kind)
            src = make_tiny(kind, root / "hf", **overrides)
            sources[key] = src, llama_cpp_gguf(src, root / f"{kind}.llama.cpp.gguf", kind)
        src, theirs = sources[key]
        if (key, outtype) not in files:
            out = src.parent / f"{kind}.{outtype}.gguf"
            convert_model(str(src), out, outtype=outtype, progress=False)
            files[key, outtype] = out
        return src, files[key, outtype], theirs

    return get


def tokens_for(src, n=N_TOKENS):
    return random_tokens(n, json.loads((src / "config.json").read_text())["vocab_size"], seed=7)


def profiled_copy(family, kind, wtype, tmp_path, capsys):
    """The family's file copied into tmp_path (a plan is written beside its model) and profiled there into
    tmp_path / "prof" (its experts' trace): (source dir, the family's own file, the copy)."""
    import shutil

    src, path, _ = family(kind, wtype)
    model = tmp_path / path.name
    shutil.copy(path, model)
    calib = tmp_path / "calib.txt"
    calib.write_text("To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer. " * 60)
    code, _, err = run_cli(capsys, "profile", "-m", model, "--calib", calib, "--tokens", "256", "--seq-len", "64",
                           "--threads", "2", "-o", tmp_path / "prof")
    assert code == 0, err
    return src, path, model


@pytest.mark.parametrize("kind", MOE_KINDS)
def test_converted_file_computes_transformers_model(kind, family):
    src, path, _ = family(kind)
    tokens = tokens_for(src)
    with engine.Model(path, threads=2, ctx_size=512) as m:
        err = max_rel_err(engine_prompt_then_decode(m, tokens, N_PROMPT), hf_logits(src, tokens))
        stats = m.stats()
    assert err <= 1e-4, f"{kind} drifts from transformers: {err:.2e} relative"
    assert all(layer["tokens"] == N_TOKENS for layer in stats["layers"])
    prompt = tokens[:N_TOKENS - N_GREEDY]
    with engine.Model(path, threads=2, ctx_size=512) as m:
        assert list(m.generate(prompt, N_GREEDY)) == hf_greedy(src, prompt, N_GREEDY)


@pytest.mark.parametrize("outtype", ["q8_0", "q4_0"])
@pytest.mark.parametrize("kind", MOE_KINDS)
def test_quantized_experts_compute_their_weights(kind, outtype, family):
    """Each expert's matrix is a run of whole rows of its 3-D tensor, in the file's type: against transformers running
    the file's own (dequantized) weights, with the inputs of the projections and experts rounded through q8_0 as the
    engine's integer dot products take them (its down projections' inputs too, which the reference leaves unrounded),
    and the router kept f32 (as llama.cpp keeps it), so that both choose the same experts."""
    src, path, _ = family(kind, outtype)
    tokens = tokens_for(src)
    types = {t.name: t.tensor_type for t in open_reader(path).tensors}
    assert types[f"blk.0.{names.FFN_GATE_INP}.weight"] == gguf.GGMLQuantizationType.F32
    assert types[f"blk.0.{names.FFN_DOWN_EXPS}.weight"] == gguf.GGMLQuantizationType[outtype.upper()]
    ref = hf_logits(src, tokens, weights_from=path, q8_inputs=True)
    with engine.Model(path, threads=2, ctx_size=512) as m:
        got = engine_prompt_then_decode(m, tokens, N_PROMPT)
    per_position = np.abs(got - ref).max(axis=1) / np.abs(ref).max()
    assert (per_position <= 3e-2).mean() >= 0.97, np.sort(per_position)[::-1][:10]
    assert (got.argmax(1) == ref.argmax(1)).mean() >= 0.95


@pytest.mark.parametrize("kind", MOE_KINDS)
def test_converted_file_is_named_as_llama_cpp_names_the_family(kind, family):
    """general.architecture llama.cpp's name (-silu for SiLU experts, as every thresholded file), its keys, the router
    and the 3-D expert tensors in gguf-py's shapes, the same data as llama.cpp's file."""
    src, path, theirs = family(kind)
    config = json.loads((src / "config.json").read_text())
    reader = open_reader(path)
    arch = OUR_ARCH[kind]
    assert reader.fields[names.KEY_ARCHITECTURE].contents() == arch
    assert reader.fields[f"{arch}.expert_count"].contents() == N_EXPERT
    assert reader.fields[f"{arch}.expert_used_count"].contents() == config["num_experts_per_tok"]
    assert reader.fields[f"{arch}.expert_weights_norm"].contents() == config.get("norm_topk_prob", True)
    assert (f"{arch}.expert_feed_forward_length" in reader.fields) == (kind == "qwen3-moe")
    ours = {t.name: np.array(t.data) for t in reader.tensors}
    width = MOE_FF if kind != "mixtral" and kind != "mixtral-relu" else 2 * MOE_FF
    assert ours[f"blk.1.{names.FFN_GATE_EXPS}.weight"].shape == (N_EXPERT, width, 64)
    assert ours[f"blk.1.{names.FFN_DOWN_EXPS}.weight"].shape == (N_EXPERT, 64, width)
    assert ours[f"blk.1.{names.FFN_GATE_INP}.weight"].shape == (N_EXPERT, 64)
    assert not any(names.FFN_DOWN_T in name or ".ffn_gate.weight" in name for name in ours)
    llama_cpp = {t.name: np.array(t.data) for t in open_reader(theirs).tensors}
    assert set(llama_cpp) - set(ours) <= {"output.weight"}  # a tied head is stored once, as token_embd
    for name, data in llama_cpp.items():
        if name in ours:
            assert np.array_equal(ours[name], data), name


@pytest.mark.parametrize("kind", MOE_KINDS)
def test_llama_cpp_file_runs_with_the_same_logits(kind, family, capsys):
    src, _, theirs = family(kind)
    tokens = tokens_for(src)
    with engine.Model(theirs, threads=2, ctx_size=512) as m:
        assert m.info["magic"] == "GGUF" and m.info["n_expert"] == N_EXPERT
        err = max_rel_err(engine_prompt_then_decode(m, tokens, N_PROMPT), hf_logits(src, tokens))
    assert err <= 1e-4, f"llama.cpp's {kind} file drifts from transformers: {err:.2e} relative"
    code, _, err = run_cli(capsys, "run", "-m", theirs, "-p", "To be", "-n", "4")
    assert code == 0, err


@pytest.mark.parametrize("kind", MOE_KINDS)
def test_a_prompt_batch_gives_each_token_its_decode_steps_bits(kind, family):
    """A batch runs each expert once over the tokens routed to it (gemm8 on its rows packed), a decode step one token
    (dot_rows on the same rows: the same arithmetic), and each token's experts are added in one order: the same bits,
    whatever the thread count."""
    src, path, _ = family(kind, "q8_0")
    tokens = tokens_for(src, 96)
    with engine.Model(path, threads=2, ctx_size=512, batch_size=64) as m:
        batch = np.concatenate([m.eval(tokens[:64]), m.eval(tokens[64:])])
    with engine.Model(path, threads=1, ctx_size=512) as m:
        steps = np.concatenate([m.eval([t]) for t in tokens])
    np.testing.assert_array_equal(batch, steps)


@pytest.mark.parametrize("kind", ["qwen3-moe", "mixtral-relu"])
def test_experts_are_packed_in_groups_at_load(kind, family):
    """The experts' matrices are copied into 8-row groups at load, as attention's are (their gemm8 reads them whole):
    gate, up and down for SiLU experts; ReLU experts' gate only (their up and down rows are read by neuron)."""
    _, path, _ = family(kind, "q8_0")
    sizes = {t.name: int(t.n_bytes) for t in open_reader(path).tensors}
    grouped = ("ffn_gate_exps",) if kind == "mixtral-relu" else ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
    experts = sum(n for name, n in sizes.items() if name.split(".")[-2] in grouped)
    rest = sum(n for name, n in sizes.items() if "_exps" not in name)  # attention, the head: packed as before
    with engine.Model(path, threads=1, ctx_size=64) as m:
        packed = m.stats()["weight_copies"]["packed"]
    assert experts <= packed <= experts + rest


def test_relu_experts_go_gate_first_with_dense_bits(family):
    """ReLU experts (TurboSparse's kind): in gate and auto modes a neuron's up and down rows are read only where its
    gate passes, with the bits of dense mode, which reads every up."""
    src, path, _ = family("mixtral-relu", "q8_0")
    tokens = tokens_for(src, 80)

    def run(mode):
        with engine.Model(path, threads=2, ctx_size=512, sparse_mode=mode) as m:
            return engine_prompt_then_decode(m, tokens, 48), m.stats()

    dense, dense_stats = run("dense")
    for mode in ("gate", "auto"):
        logits, stats = run(mode)
        np.testing.assert_array_equal(logits, dense)
        for ours, theirs in zip(stats["layers"], dense_stats["layers"]):
            assert ours["density"] == pytest.approx(theirs["density"]) and ours["modes"] == {"gate": 80}
            assert ours["computed_density"] == pytest.approx(ours["density"], abs=0.02)  # ups of passing gates only
            assert 0.3 < ours["density"] < 0.7 and theirs["computed_density"] == 1.0


def test_expert_weights_norm_is_the_models_choice(family):
    """norm_topk_prob False: the chosen experts' softmax weights as they are (expert_weights_norm false), which moves
    the logits far from the renormalised model of the same weights."""
    src, path, _ = family("qwen3-moe", norm_topk_prob=False)
    assert open_reader(path).fields["qwen3moe-silu.expert_weights_norm"].contents() is False
    tokens = tokens_for(src, 64)
    with engine.Model(path, threads=2, ctx_size=512) as m:
        logits = m.eval(tokens)
    assert max_rel_err(logits, hf_logits(src, tokens)) <= 1e-4
    assert max_rel_err(logits, hf_logits(family("qwen3-moe")[0], tokens)) > 1e-2


def test_a_sliding_window_caps_the_context(family):
    """Mixtral's sliding_window, every layer's: within it the model is a causal one, so the file carries the window and
    the engine runs no longer context (Mistral's rule)."""
    src, path, _ = family("mixtral", sliding_window=64)
    assert open_reader(path).fields["llama-silu.attention.sliding_window"].contents() == 64
    tokens = tokens_for(src, 64)
    with engine.Model(path, threads=2) as m:
        assert m.n_ctx == 64
        assert max_rel_err(engine_prompt_then_decode(m, tokens, 48), hf_logits(src, tokens)) <= 1e-4


# YaRN over an original context of 64 (a third of the test's positions), every sub-field set (the ramp's betas and
# attention_factor in place of 0.1 ln 4 + 1)
MIXTRAL_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
                "beta_fast": 16.0, "beta_slow": 2.0, "attention_factor": 1.25}


def test_yarn_matches_transformers_past_the_original_context(family):
    """Mixtral's RoPE scaling goes through the Llama family's table; transformers' Mixtral applies it
    (MixtralRotaryEmbedding reads rope_parameters), so a YaRN Mixtral runs as transformers' over 200 positions, most of
    them past its original context, and unlike the same weights without the scaling."""
    src, path, _ = family("mixtral", head_dim=16, rope_parameters=MIXTRAL_YARN)  # transformers' YaRN reads head_dim
    fields = open_reader(path).fields
    assert fields["llama-silu.rope.scaling.type"].contents() == "yarn"
    assert fields["llama-silu.rope.scaling.yarn_attn_factor"].contents() == 1.25
    tokens = tokens_for(src)
    with engine.Model(path, threads=2, ctx_size=512) as m:
        logits = engine_prompt_then_decode(m, tokens, N_PROMPT)
    assert max_rel_err(logits, hf_logits(src, tokens)) <= 1e-4
    assert max_rel_err(logits, hf_logits(family("mixtral")[0], tokens)) > 1e-2


# ---- refusals ---------------------------------------------------------------------------------------------------
REFUSED = [  # (kind, config.json fields, what the line names)
    ("qwen3-moe", {"mlp_only_layers": [1]}, "mlp_only_layers = [1]"),
    ("qwen3-moe", {"decoder_sparse_step": 2}, "decoder_sparse_step = 2"),
    ("qwen3-moe", {"model_type": "qwen2_moe", "shared_expert_intermediate_size": 64},
     "unsupported architecture 'qwen2_moe'"),
    ("olmoe", {"clip_qkv": 8.0}, "clip_qkv = 8.0"),
    ("mixtral", {"head_dim": 16, "rope_scaling": {"rope_type": "longrope", "factor": 4.0, "short_factor": [1.0] * 8,
                                                  "original_max_position_embeddings": 128, "long_factor": [2.0] * 8}},
     "rope_parameters.rope_type = 'longrope'"),
    ("mixtral", {"hidden_act": "gelu"}, "unsupported architecture 'mixtral'"),
]


test_unsupported_field_is_refused_by_convert_and_its_dry_run = convert_refusal_test(REFUSED)


def test_what_experts_do_not_have_is_refused_in_one_line(family, tmp_path, capsys):
    """No predictors, profiles, neuron bundles, input sparsity, GPU index or VRAM-only plan for experts yet (a memory
    budget's expert tier and plan: test_moe_expert_tier.py): each refused in one line with a non-zero exit, never
    computed dense in their place."""
    src, path, _ = family("qwen3-moe")
    _, relu, _ = family("mixtral-relu")
    for flags in (["--predictors", tmp_path], ["--profile", tmp_path], ["--neuron-bundles"]):
        code, _, err = run_cli(capsys, "convert", "-m", src, "-o", tmp_path / "m.gguf", *flags)
        assert_one_line_error(code, err, "qwen3-moe is a mixture of experts")
        assert not (tmp_path / "m.gguf").exists()
    code, _, err = run_cli(capsys, "convert", "--dry-run", "-m", src)
    assert_one_line_error(code, err, "qwen3-moe is a mixture of experts")
    code, _, err = run_cli(capsys, "plan", "-m", path, "--profile", tmp_path, "--vram-budget", "0.5")
    assert_one_line_error(code, err, "a mixture of experts is placed across a device, memory and disk: give --memory-budget")
    calib = tmp_path / "calib.txt"
    calib.write_text("To be, or not to be, that is the question. " * 40)
    code, _, err = run_cli(capsys, "profile", "-m", src, "--calib", calib, "--tokens", "64", "--seq-len", "32", "-o",
                           tmp_path / "profile")
    assert_one_line_error(code, err, "qwen3-moe is a mixture of experts")
    runs = [  # (file, run flags, what the line says)
        (path, ["--sparse-mode", "predictor"], "predictor mode selects neurons by a predictor"),
        (relu, ["--sparse-mode", "oracle"], "oracle mode selects neurons by a predictor"),
        (path, ["--sparse-mode", "gate"], "gate mode thresholds SiLU neurons"),
        (path, ["--sparse-mode", "input"], "input sparsity is not computed for mixture-of-experts layers"),
        (path, ["--gpuidx", write_gpuidx(tmp_path / "x.gpuidx", [np.ones(128, bool)] * 2)],
         "are not split into hot and cold neurons"),
    ]
    for model, flags, needle in runs:
        code, _, err = run_cli(capsys, "run", "-m", model, "-p", "To be", "-n", "2", *flags)
        assert_one_line_error(code, err, needle)


def test_engine_refuses_what_it_would_not_compute(family, tmp_path):
    _, _, qwen3moe = family("qwen3-moe")
    _, _, olmoe = family("olmoe")
    u32 = gguf.GGUFValueType.UINT32
    cases = [  # (file, what the line says)
        (rewritten(qwen3moe, tmp_path / "a.gguf", fields={"qwen3moe.expert_shared_count": (1, u32)}),
         "key qwen3moe.expert_shared_count is not computed"),
        (rewritten(qwen3moe, tmp_path / "b.gguf", tensors={"blk.1.ffn_up_shexp.weight": np.ones((64, 64), np.float32)}),
         "tensor blk.1.ffn_up_shexp.weight beside the experts of layer 1"),
        (rewritten(qwen3moe, tmp_path / "c.gguf", drop=("qwen3moe.expert_count",)),
         "qwen3moe.expert_count is missing: qwen3moe is a mixture of experts"),
        (rewritten(qwen3moe, tmp_path / "d.gguf", arch="qwen3"), "experts (qwen3.expert_count) are not computed"),
        (rewritten(qwen3moe, tmp_path / "e.gguf", drop=("qwen3moe.expert_feed_forward_length",)),
         "tensor blk.0.ffn_gate_exps.weight has shape (8, 32, 64), the hyperparameters say (8, 128, 64)"),
        (rewritten(olmoe, tmp_path / "f.gguf", drop=("blk.0.attn_q_norm.weight",)),
         "tensor blk.0.attn_q_norm.weight is missing"),
        (rewritten(olmoe, tmp_path / "g.gguf", fields={"olmoe.expert_used_count": (9, u32)},
                   drop=("olmoe.expert_used_count",)),
         "olmoe.expert_used_count = 9 is out of range [1, 8]"),
    ]
    for path, needle in cases:
        with pytest.raises(engine.EngineError) as exc:
            engine.Model(path, threads=1)
        assert len(str(exc.value).splitlines()) == 1 and needle in str(exc.value), str(exc.value)


def test_a_router_of_nans_still_takes_each_expert_once(family, tmp_path):
    """NaN router weights (a damaged file): every token still takes n_expert_used distinct experts (each expert's
    group holds a token once, as its scratch is sized), a batch as its decode steps do, no crash."""
    _, _, theirs = family("olmoe")
    nan = np.full((N_EXPERT, 64), np.nan, np.float32)
    path = rewritten(theirs, tmp_path / "nan.gguf", drop=("blk.0.ffn_gate_inp.weight",),
                     tensors={"blk.0.ffn_gate_inp.weight": nan})
    with engine.Model(path, threads=2, ctx_size=512) as m:
        batch = m.eval(list(range(64)))
    with engine.Model(path, threads=2, ctx_size=512) as m:
        steps = np.concatenate([m.eval([t]) for t in range(64)])
    np.testing.assert_array_equal(batch, steps)
