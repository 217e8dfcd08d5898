"""Files both ways between this toolkit and PowerInfer's engine (SJTU-IPADS/PowerInfer d3ebd7c), checked
against fixtures written as PowerInfer's code writes and reads them (powerinfer_fixtures.py), without
PowerInfer itself."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
from convert_helpers import read_fields, read_tensors
from kquants import random_blocks
from engine_helpers import converted, hf_logits, max_rel_err, random_tokens, rewrite  # noqa: F401
from powerinfer_fixtures import POWERINFER_I32, tensor_types, write_powerinfer_gpuidx
from tiny_models import N_FF, N_LAYER

import powerinfer_engine as engine
from powerinfer_tools.formats import describe as pi_inspect
from powerinfer_tools.stages.placement import placement
from powerinfer_tools.stages.conversion.conversion import convert_model
from powerinfer_tools.formats.gguf_io import open_reader

TOKENS = random_tokens(24, 384, seed=3)
STR = gguf.GGUFValueType.STRING


def logits(path, **kw):
    with engine.Model(path, threads=1, **kw) as m:
        return m.eval(TOKENS), m.info, m.stats()


def under_arch(src, dst, new_arch: str, fields: dict | None = None):
    """A copy of `src` whose general.architecture and hyperparameter keys are named `new_arch`."""
    reader = open_reader(src)
    old_arch = reader.fields["general.architecture"].contents()
    renamed = {"general.architecture": (new_arch, STR)}
    for key, f in reader.fields.items():
        if key.startswith(f"{old_arch}."):
            renamed[key] = None
            renamed[new_arch + key[len(old_arch):]] = (f.contents(), f.types[0])
    return rewrite(src, dst, fields=renamed | (fields or {}))


# ---- a PWRI file without powerinfer.ffn_activation is ReLU (PowerInfer's converters never write the key) ----

@pytest.mark.parametrize("kind, magic, activation", [("llama-relu", b"PWRI", "relu"), ("llama-silu", b"GGUF", "silu")])
def test_a_llama_file_without_the_activation_key(kind, magic, activation, converted, tmp_path):
    """PowerInfer's converters never write powerinfer.ffn_activation: a PWRI llama file is then ReLU (its sparse
    FFN computes nothing else), a plain GGUF one (llama.cpp's) SiLU."""
    ours = converted(kind)
    theirs = under_arch(ours, tmp_path / "theirs.gguf", "llama", {"powerinfer.ffn_activation": None})
    data = bytearray(theirs.read_bytes())
    data[:4] = magic
    theirs.write_bytes(bytes(data))
    want, _, _ = logits(ours)
    got, info, _ = logits(theirs)
    assert info["activation"] == activation
    np.testing.assert_array_equal(got, want)


# ---- a SiLU model's file names an architecture PowerInfer refuses; the old name still reads here ----

def test_silu_file_is_named_so_that_powerinfer_refuses_it(converted, tiny_model_dir):
    path = converted("llama-silu")
    fields = read_fields(path)
    # PowerInfer's llama.cpp (LLM_ARCH_NAMES) knows llama, falcon, opt, bamboo, ...: llama-silu is
    # "unknown model architecture" there, where llama would run the ReLU-only sparse FFN.
    assert fields["general.architecture"] == "llama-silu"
    assert fields["powerinfer.ffn_activation"] == "silu"
    assert fields["llama-silu.block_count"] == N_LAYER and "llama.block_count" not in fields
    got, info, _ = logits(path)
    assert (info["arch"], info["activation"]) == ("llama", "silu")
    assert max_rel_err(got, hf_logits(tiny_model_dir("llama-silu"), TOKENS)) <= 1e-4
    assert pi_inspect.describe(path)["metadata"]["general.architecture"] == "llama-silu"
    from powerinfer_tools.formats.tokenizer import tokenizer_from_file

    assert tokenizer_from_file(path).encode("to be or not")  # the vocabulary reads as llama's


def test_silu_file_written_before_the_rename_still_runs_as_silu(converted, tmp_path):
    new = converted("llama-silu")
    old = under_arch(new, tmp_path / "old.gguf", "llama")
    assert read_fields(old)["general.architecture"] == "llama"
    want, _, _ = logits(new)
    got, info, _ = logits(old)
    assert info["activation"] == "silu"
    np.testing.assert_array_equal(got, want)


def test_llama_silu_with_another_activation_is_refused(converted, tmp_path):
    bad = rewrite(converted("llama-silu"), tmp_path / "bad.gguf", fields={"powerinfer.ffn_activation": ("relu", STR)})
    with pytest.raises(engine.EngineError, match="llama-silu with FFN activation 'relu'"):
        engine.Model(bad, threads=1)


# ---- an OPT file as PowerInfer's converter writes it: no layer-norm epsilon ----

def test_opt_file_without_a_norm_epsilon_uses_opts_own(converted, tmp_path):
    """convert-hf-to-powerinfer-gguf.py (OptModel.set_gguf_parameters) writes no opt.attention.layer_norm_epsilon;
    OPT's LayerNorms use torch's default 1e-5, which convert writes."""
    ours = converted("opt")
    assert read_fields(ours)["opt.attention.layer_norm_epsilon"] == pytest.approx(1e-5)
    theirs = rewrite(ours, tmp_path / "theirs.gguf", fields={"opt.attention.layer_norm_epsilon": None})
    want, _, _ = logits(ours)
    got, _, _ = logits(theirs)
    np.testing.assert_array_equal(got, want)


def test_opt_file_whose_context_length_counts_the_position_table(converted, tmp_path):
    """PowerInfer's OPT converter writes context_length 2050, the rows of OPT's position table (2048 positions
    from row 2); convert writes the positions. Both read as the same model."""
    ours = converted("opt")
    fields = read_fields(ours)
    rows = read_tensors(ours)["position_embd.weight"][1].shape[0]
    assert rows == fields["opt.context_length"] + 2
    theirs = rewrite(ours, tmp_path / "theirs.gguf", fields={"opt.context_length": (rows, gguf.GGUFValueType.UINT32)})
    want, info_ours, _ = logits(ours)
    got, info_theirs, _ = logits(theirs)
    assert info_theirs["n_ctx_train"] == info_ours["n_ctx_train"] == rows - 2
    np.testing.assert_array_equal(got, want)


# ---- gpu index: PowerInfer's type code for i32 (18), both ways ----

def hot_masks(seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.random(N_FF) < share for share in np.linspace(0.2, 0.6, N_LAYER)]


def test_powerinfer_gpu_index_loads_in_engine_and_inspect(converted, tmp_path):
    path = converted("llama-relu", predictors=True)
    masks = hot_masks()
    theirs = write_powerinfer_gpuidx(tmp_path / "theirs.gpuidx", masks, vram_capacity=12345)
    _, _, stats = logits(path, sparse_mode="predictor", gpuidx=theirs, cpu_hot_tier=True)
    assert [layer["hot_neurons"] for layer in stats["layers"]] == [int(m.sum()) for m in masks]
    info = pi_inspect.describe(theirs)
    assert [row["gpu"] for row in info["gpu_layers"]] == [int(m.sum()) for m in masks]
    assert {t["type"] for t in info["tensors"]} == {"I32"}
    reader = open_reader(theirs)
    for i, mask in enumerate(masks):
        np.testing.assert_array_equal(np.asarray(reader.tensors[2 * i].data), mask.astype(np.int32))


def test_our_gpu_index_is_written_as_powerinfer_reads_it(converted, tmp_path):
    """PowerInfer's llama_gpu_split_loader takes tensor 2i as layer i's gpu_idx and 2i+1 as its gpu_bucket, needs
    exactly 2 per layer, split.vram_capacity as a u64, and i32 as its ggml's type 18 (26 there is past
    GGML_TYPE_COUNT: a division by a zero block size)."""
    path = converted("llama-relu", predictors=True)
    masks = hot_masks(1)
    n_ff = np.full(N_LAYER, N_FF)
    plan = placement.Plan(model=str(path), vram_budget=1 << 20, ctx_size=64, dense="none", offload_output=False,
                          n_ff=n_ff, gpu_neurons=np.array([m.sum() for m in masks]),
                          gpu_index=[np.flatnonzero(m).astype(np.int32) for m in masks], min_neurons=n_ff * 0,
                          served=n_ff * 0, total=n_ff, breakdown={"ffn": 4096})
    ours = tmp_path / "ours.gpuidx"
    placement.write_gpuidx(plan, ours)
    types = tensor_types(ours)
    assert list(types) == [f"blk.{i}.{kind}" for i in range(N_LAYER) for kind in ("gpu_idx", "gpu_bucket")]
    assert set(types.values()) == {POWERINFER_I32}
    reader = open_reader(ours)
    assert reader.fields["split.vram_capacity"].types == [gguf.GGUFValueType.UINT64]
    assert reader.fields["generic.gpu_index.block_count"].types == [gguf.GGUFValueType.UINT32]
    theirs = write_powerinfer_gpuidx(tmp_path / "theirs.gpuidx", masks, vram_capacity=4096)
    assert [np.asarray(t.data).tolist() for t in reader.tensors] == \
        [np.asarray(t.data).tolist() for t in open_reader(theirs).tensors]
    _, _, stats = logits(path, sparse_mode="predictor", gpuidx=ours, cpu_hot_tier=True)
    assert [layer["hot_neurons"] for layer in stats["layers"]] == [int(m.sum()) for m in masks]


def test_type_18_outside_a_gpu_index_is_not_i32(converted, tmp_path):
    """In a model file 18 keeps later ggml's meaning (iq3_xxs), which the engine names and refuses."""
    path = converted("llama-relu")
    data = bytearray(path.read_bytes())
    reader = open_reader(path)
    t = next(t for t in reader.tensors if t.name == "blk.0.ffn_up.weight")
    type_at = int(t.field.offset) + sum(int(p.nbytes) for p in t.field.parts[:4])
    assert int.from_bytes(data[type_at:type_at + 4], "little") == 0  # f32
    data[type_at:type_at + 4] = POWERINFER_I32.to_bytes(4, "little")
    (tmp_path / "m.gguf").write_bytes(bytes(data))
    with pytest.raises(engine.EngineError, match="iq3_xxs"):
        engine.Model(tmp_path / "m.gguf", threads=1)


# ---- ffn_down_t in the type PowerInfer's axpy kernels read ----

@pytest.mark.parametrize("outtype, down", [("f32", "F16"), ("f16", "F16"), ("q8_0", "F16"), ("q4_0", "Q4_0")])
def test_down_projection_is_stored_as_powerinfer_computes_it(outtype, down, tiny_model_dir, tmp_path):
    out = tmp_path / "m.gguf"
    summary = convert_model(str(tiny_model_dir("llama-relu")), out, outtype, progress=False)  # the default
    assert summary["powerinfer_compatible"] is True
    tensors = read_tensors(out)
    assert {qtype for name, (qtype, _) in tensors.items() if name.endswith("ffn_down_t.weight")} == {down}
    assert tensors["blk.0.ffn_up.weight"][0] == outtype.upper()


def test_ours_only_keeps_the_down_projection_in_the_outtype(converted):
    tensors = read_tensors(converted("llama-relu", "q8_0", powerinfer_compatible=False))
    assert {qtype for name, (qtype, _) in tensors.items() if name.endswith("ffn_down_t.weight")} == {"Q8_0"}


@pytest.mark.parametrize("outtype", ["f32", "q8_0"])
def test_f16_down_projection_in_an_f32_or_q8_0_file_matches_its_weights(outtype, tiny_model_dir, converted):
    path = converted("llama-relu", outtype, powerinfer_compatible=True)
    assert read_tensors(path)["blk.0.ffn_down_t.weight"][0] == "F16"
    ref = hf_logits(tiny_model_dir("llama-relu"), TOKENS, weights_from=path, q8_inputs=outtype == "q8_0")
    got, _, _ = logits(path)
    assert max_rel_err(got, ref) <= (1e-4 if outtype == "f32" else 2e-2)


# ---- PowerInfer's quantizer: q6_K output.weight (rows of a multiple of 256), q5_0 predictors ----

def test_powerinfer_quantizer_types_are_decoded_at_load(tiny_model_dir, tmp_path):
    """The engine decodes q6_K and q5_0 at load to the q8_0 of gguf-py's dequantization: the same logits as the
    file with those q8_0 blocks, in dense and predictor mode (q6_K on fc2 here: rows of 256 need rank 256)."""
    from convert_helpers import write_predictors
    from tiny_models import HIDDEN

    Q = gguf.GGMLQuantizationType
    pred = write_predictors(tmp_path / "pred", N_LAYER, HIDDEN, N_FF, rank=256)
    src = tmp_path / "f32.gguf"
    convert_model(str(tiny_model_dir("llama-relu")), src, "f32", predictors_dir=pred, progress=False,
                  powerinfer_compatible=False)
    weights = {name: data for name, (_, data) in read_tensors(src).items()}
    rng = np.random.default_rng(0)
    quantized = {"output.weight": (gguf.quants.quantize(weights["output.weight"], Q.Q5_0), Q.Q5_0)}
    for i in range(N_LAYER):
        quantized[f"blk.{i}.fc1.weight"] = (gguf.quants.quantize(weights[f"blk.{i}.fc1.weight"], Q.Q5_0), Q.Q5_0)
        quantized[f"blk.{i}.fc2.weight"] = (random_blocks(Q.Q6_K, N_FF, 256, rng, scale=0.0005), Q.Q6_K)
    theirs = rewrite(src, tmp_path / "theirs.gguf", tensors=quantized)
    decoded = {name: (gguf.quants.quantize(gguf.quants.dequantize(data, qtype), Q.Q8_0), Q.Q8_0)
               for name, (data, qtype) in quantized.items()}
    reference = rewrite(src, tmp_path / "reference.gguf", tensors=decoded)
    assert {t["type"] for t in pi_inspect.describe(theirs)["tensors"] if ".fc" in t["name"]} == {"Q5_0", "Q6_K"}
    for mode in ("dense", "predictor"):
        got, _, stats = logits(theirs, sparse_mode=mode)
        want, _, _ = logits(reference, sparse_mode=mode)
        np.testing.assert_array_equal(got, want)
    assert 0.0 < stats["density"] < 1.0  # the predictor selected some neurons, not all
    assert stats["weight_copies"]["decoded"] == 0  # fc1 and the head packed, fc2 regrouped: no decoded rows held


def test_a_thresholded_file_keeps_its_down_projection_in_the_outtype(tiny_model_dir, tmp_path):
    """PowerInfer refuses a SiLU file by its architecture name, so its down projection need not be f16 there:
    the default model's q8_0 file stays all q8_0 (smaller and faster here)."""
    out = tmp_path / "silu.gguf"
    convert_model(str(tiny_model_dir("llama-silu")), out, "q8_0", progress=False)
    tensors = read_tensors(out)
    assert {qtype for name, (qtype, _) in tensors.items() if name.endswith("ffn_down_t.weight")} == {"Q8_0"}
