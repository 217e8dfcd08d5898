"""Gemma 3, text only, through every stage (models/arch/gemma3.py, issue 66): a tiny random Gemma3ForCausalLM with
every feature on (GeGLU with tanh GELU, four RMSNorms a layer written as 1 + w, per-head q/k norms, heads 24 wide
beside 64 / 4, the embedding scaled by sqrt(64), query_pre_attn_scalar 20, five sliding-window layers in six with a
window of 32 and a RoPE base of their own beside a global layer with linear RoPE scaling, a tied head) converted at
f32 and run by the engine against transformers' own class over 300 positions (the window matters there) and 32
greedy steps; a GGUF of the same checkpoint as llama.cpp's convert_hf_to_gguf.py writes one (Gemma3Model) run with
the same logits and tokenizer; the device tier through its host emulation; input sparsity; what is refused."""
from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
import torch
from cli_helpers import run_cli
from family_checks import (add_checkpoint_tensors, add_sentencepiece_vocab, assert_convert_refuses,
                           assert_input_sparsity_runs, assert_relu_sparse_modes, assert_same_tokenizer_and_template,
                           emulated_device_run, hf_greedy, llama_cpp_writer)
from engine_helpers import (converted, engine_prompt_then_decode, hf_logits, hf_model, max_rel_err,  # noqa: F401
                            random_tokens)
from test_qwen import rewritten
from tiny_models import GEMMA3, GEMMA3_LAYERS, N_FF, make_tiny

import powerinfer_engine as engine
from powerinfer_tools.formats import names
from powerinfer_tools.formats.gguf_io import open_reader

N_TOKENS, N_PROMPT, N_GREEDY, N_LAYER = 300, 200, 32, GEMMA3_LAYERS
# what llama.cpp's gemma3 computes without keys for them: the local base 10000, scores by 1/sqrt(head_dim)
AS_LLAMA_CPP = {"rope_local_base_freq": 10000.0, "query_pre_attn_scalar": GEMMA3["head_dim"]}


def llama_cpp_gguf(model_dir, dst):
    """The checkpoint at model_dir as llama.cpp's convert_hf_to_gguf.py writes a gemma3 GGUF (Gemma3Model): gguf-py's
    names, every norm weight as 1 + w, key_length/value_length from head_dim, sliding_window, linear RoPE scaling, no
    output.weight (tied), the SentencePiece vocabulary with its chat template."""
    writer, config = llama_cpp_writer(model_dir, dst, gguf.MODEL_ARCH.GEMMA3)
    rope = config["rope_parameters"]["full_attention"]
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_sliding_window(config["sliding_window"])
    if rope["rope_type"] == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    add_sentencepiece_vocab(writer, model_dir, config["vocab_size"])
    writer.add_add_space_prefix(False)
    add_checkpoint_tensors(writer, model_dir, gguf.MODEL_ARCH.GEMMA3, config["num_hidden_layers"], norm_offset=1.0)
    return dst


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    """family(**config) -> (model directory, its f32 file, its llama.cpp GGUF), of GEMMA3_LAYERS layers."""
    from powerinfer_tools.stages.conversion.conversion import convert_model

    cache = {}

    def get(**overrides):
        key = json.dumps(overrides, sort_keys=True)
        if key not in cache:
            root = tmp_path_factory.mktemp("gemma3")
            src = make_tiny("gemma3", root / "hf", **{"num_hidden_layers": N_LAYER, **overrides})
            out = root / "gemma3.gguf"
            convert_model(str(src), out, outtype="f32", progress=False, powerinfer_compatible=False)
            cache[key] = src, out, llama_cpp_gguf(src, root / "gemma3.llama.cpp.gguf")
        return cache[key]

    return get


def tokens_for(src, n=N_TOKENS, seed=7):
    return random_tokens(n, json.loads((src / "config.json").read_text())["vocab_size"], seed=seed)


def test_converted_file_computes_transformers_model(family):
    src, path, _ = family()
    tokens = tokens_for(src)
    with engine.Model(path, threads=2, ctx_size=512) as m:
        assert m.n_ctx == 512  # the window is the local layers', not the context's
        err = max_rel_err(engine_prompt_then_decode(m, tokens, N_PROMPT), hf_logits(src, tokens))
    assert err <= 1e-4, f"gemma3 drifts from transformers: {err:.2e} relative"
    prompt = tokens[:N_TOKENS - N_GREEDY]
    with engine.Model(path, threads=2, ctx_size=512) as m:
        assert list(m.generate(prompt, N_GREEDY)) == hf_greedy(src, prompt, N_GREEDY)


def test_the_window_and_the_local_rope_base_matter(family):
    """A control: the same weights with no window, or one RoPE base for every layer, compute other logits past the
    window, so the test above checks both."""
    src, _, _ = family()
    tokens = tokens_for(src)
    ours = hf_logits(src, tokens)
    for field, value in (("sliding_window", 4096), ("rope_local_base_freq", 10000.0)):
        model, _ = hf_model(src)
        config = model.config
        if field == "sliding_window":
            config.sliding_window = value
            for layer in model.model.layers:
                layer.self_attn.sliding_window = value
        else:
            config.rope_parameters["sliding_attention"]["rope_theta"] = value
            model.model.rotary_emb.__init__(config)
        with torch.no_grad():
            other = model(torch.tensor([tokens])).logits[0].numpy()
        if field == "sliding_window":  # the same model as long as no query reaches past the window
            window = GEMMA3["sliding_window"]
            assert max_rel_err(other[:window], ours[:window]) <= 1e-5
        assert max_rel_err(other, ours) > 1e-2, field


def test_converted_file_is_named_as_llama_cpp_names_the_family(family):
    """general.architecture gemma3-gelu, gguf-py's tensor names, every norm as 1 + w (the same data as llama.cpp's
    converter writes), the window, the head width, the local RoPE base and the attention scale as keys."""
    src, path, theirs = family()
    reader = open_reader(path)
    arch = reader.fields[names.KEY_ARCHITECTURE].contents()
    assert arch == "gemma3-gelu"
    ours = {t.name: np.array(t.data) for t in reader.tensors}
    llama_cpp = {t.name: np.array(t.data) for t in open_reader(theirs).tensors}
    assert "output.weight" not in ours and "blk.5.post_ffw_norm.weight" in ours
    for name, data in llama_cpp.items():
        assert np.array_equal(ours[name], data) if name in ours else np.array_equal(
            ours[name.replace(names.FFN_DOWN, names.FFN_DOWN_T)], data.T), name
    fields = {k: reader.fields[f"{arch}.{k}"].contents() for k in
              ("attention.sliding_window", "attention.key_length", "rope.freq_base_swa", "attention.scale",
               "rope.freq_base", "rope.scaling.factor")}
    assert fields == pytest.approx({"attention.sliding_window": 32, "attention.key_length": 24,
                                    "rope.freq_base_swa": 100.0, "attention.scale": 20 ** -0.5,
                                    "rope.freq_base": 10000.0, "rope.scaling.factor": 2.0})


def test_llama_cpp_file_runs_with_the_same_logits_and_tokenizer(family, capsys):
    src, _, theirs = family(**AS_LLAMA_CPP)
    tokens = tokens_for(src)
    with engine.Model(theirs, threads=2, ctx_size=512) as m:
        assert m.info["magic"] == "GGUF"
        err = max_rel_err(engine_prompt_then_decode(m, tokens, N_PROMPT), hf_logits(src, tokens))
    assert err <= 1e-4, f"llama.cpp's gemma3 file drifts from transformers: {err:.2e} relative"
    assert_same_tokenizer_and_template(src, theirs)
    code, _, err = run_cli(capsys, "run", "-m", theirs, "-p", "To be", "-n", "4")
    assert code == 0, err


def test_the_device_tier_gives_the_cpu_logits(family, tmp_path, monkeypatch):
    """Through the host emulation of a device library: the device computes neither GELU neurons nor per-head norms,
    so attention and every neuron stay on the CPU, the output head goes to the device; past the window."""
    src, path, _ = family()
    cpu, dev, info, _ = emulated_device_run(path, tokens_for(src, 60), 40, N_LAYER, N_FF, tmp_path, monkeypatch)
    placed = info["gpu"]["device"]
    assert placed["attention_layers"] == placed["layers_on_device"] == 0 and placed["output_head"] == "device"
    assert max_rel_err(dev, cpu) <= 1e-4


def test_input_sparsity_from_a_profile_runs(family, tmp_path, capsys):
    src, _, _ = family()
    assert_input_sparsity_runs(src, tmp_path, capsys)


def test_relu_variant_runs_every_sparse_mode(tiny_model_dir, converted, tmp_path, monkeypatch):
    """hidden_activation relu (`pi-tools sparsify`'s output: relu(gate x) times up x): a file named gemma3, exact
    zeros, so the sparse modes are the model's own, past the window of its two sliding layers; the device computes
    its neurons, which it does not for GELU (family_checks.assert_relu_sparse_modes)."""
    path = converted("gemma3-relu", predictors=True)
    assert open_reader(path).fields[names.KEY_ARCHITECTURE].contents() == "gemma3"
    assert_relu_sparse_modes(tiny_model_dir("gemma3-relu"), path, random_tokens(80, 384, seed=7), 64, tmp_path,
                             monkeypatch)


# ---- refusals ---------------------------------------------------------------------------------------------------
REFUSED = [  # (config.json fields, what the line names)
    ({"final_logit_softcapping": 30.0}, "final_logit_softcapping = 30.0"),
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping = 50.0"),
    ({"layer_types": ["full_attention"] * N_LAYER}, "layer_types = ['full_attention'"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention = True"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}},
     "rope_parameters.full_attention.rope_type = 'yarn'"),
    ({"hidden_activation": "gelu"}, "unsupported architecture 'gemma3_text'"),
]


@pytest.mark.parametrize("fields,needle", REFUSED, ids=[n.split(" =")[0].split(" '")[0] for _, n in REFUSED])
def test_unsupported_field_is_refused_by_convert_and_its_dry_run(fields, needle, family, tmp_path, capsys):
    assert_convert_refuses(family()[0], fields, needle, tmp_path, capsys)


def test_engine_refuses_what_it_would_not_compute(family, tmp_path):
    _, ours, theirs = family()
    cases = [  # (file, what the line says)
        (rewritten(theirs, tmp_path / "a.gguf", drop=("blk.2.post_ffw_norm.weight",)),
         "tensor blk.2.post_ffw_norm.weight is missing"),
        (rewritten(theirs, tmp_path / "b.gguf", fields={"gemma3.final_logit_softcapping":
                                                        (30.0, gguf.GGUFValueType.FLOAT32)}),
         "key gemma3.final_logit_softcapping is not computed"),
        (rewritten(ours, tmp_path / "c.gguf", arch="qwen3-silu", fields={
            names.KEY_FFN_ACTIVATION: ("silu", gguf.GGUFValueType.STRING)}),
         "tensor blk.0.post_attention_norm.weight (a norm of a block's output) is not computed for architecture qwen3"),
        (rewritten(ours, tmp_path / "d.gguf", arch="gemma3-silu"), "unsupported architecture 'gemma3-silu'"),
    ]
    for path, needle in cases:
        with pytest.raises(engine.EngineError) as exc:
            engine.Model(path, threads=1)
        assert len(str(exc.value).splitlines()) == 1 and needle in str(exc.value), str(exc.value)
