"""The GGUF types of downloaded files (llama.cpp's quantizer and converters), which the engine decodes at load to
a type it computes with (csrc/model/decode.h): every value as gguf-py's dequantizer gives it, then q8_0 as gguf-py
quantizes (bf16: f16), so a file in any of them computes exactly what the file of those q8_0 (f16) values does.
llama.cpp's down projection (ffn_down, a row per output) is transposed into the engine's ffn_down_t likewise."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
from engine_helpers import converted, random_tokens, rewrite  # noqa: F401
from kquants import Q, random_bf16, random_blocks

import powerinfer_engine as engine
from powerinfer_tools.formats.gguf_io import open_reader
from powerinfer_tools.runtime.inference import decoded_line

E, F, V, N_HEAD, N_KV = 256, 512, 64, 4, 2  # rows of 256 values: k-quant super-blocks fit every matrix
KV = E // N_HEAD * N_KV
TOKENS = random_tokens(12, V, seed=5)
SHAPES = {"token_embd": (V, E), "attn_q": (E, E), "attn_k": (KV, E), "attn_v": (KV, E), "attn_output": (E, E),
          "ffn_gate": (F, E), "ffn_up": (F, E), "ffn_down": (E, F)}


def write_llama(path, matrices: dict, down_name: str = "ffn_down") -> str:
    """A one-layer llama GGUF (magic GGUF: llama.cpp's SiLU llama). matrices: SHAPES' names -> (data, ggml type);
    the data are float32 values or raw bytes; `down_name` ffn_down_t takes ffn_down's data as (F, E)."""
    w = gguf.GGUFWriter(str(path), arch="llama")
    w.add_embedding_length(E)
    w.add_block_count(1)
    w.add_feed_forward_length(F)
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(N_KV)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_context_length(64)
    w.add_tensor("output_norm.weight", np.ones(E, np.float32))
    w.add_tensor("blk.0.attn_norm.weight", np.ones(E, np.float32))
    w.add_tensor("blk.0.ffn_norm.weight", np.ones(E, np.float32))
    for name, (data, qtype) in matrices.items():
        full = name if name == "token_embd" else f"blk.0.{down_name if name == 'ffn_down' else name}"
        w.add_tensor(f"{full}.weight", data, raw_dtype=None if data.dtype == np.float32 else qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def values(data: np.ndarray, qtype) -> np.ndarray:
    return data if data.dtype == np.float32 else gguf.quants.dequantize(data, qtype)


def as_decoded(x: np.ndarray, qtype) -> tuple[np.ndarray, Q]:
    """What the engine makes of values x read from a tensor of qtype: f32 and f16 as they are, bf16 as f16, every
    quantized type as gguf-py's q8_0."""
    if qtype in (Q.F32, Q.F16, Q.BF16):
        return (x, Q.F32) if qtype == Q.F32 else (x.astype(np.float16), Q.F16)
    return gguf.quants.quantize(np.ascontiguousarray(x), Q.Q8_0), Q.Q8_0


def random_matrices(qtype, rng) -> dict:
    if qtype == Q.BF16:
        return {n: (random_bf16(*shape, rng), qtype) for n, shape in SHAPES.items()}
    return {n: (random_blocks(qtype, *shape, rng, scale=0.004 if qtype in (Q.Q2_K, Q.Q3_K, Q.Q6_K) else 0.01), qtype)
            for n, shape in SHAPES.items()}


def logits(path, **kw):
    with engine.Model(path, threads=2, **kw) as m:
        return m.eval(TOKENS), m.info


DECODED = [Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.BF16]


@pytest.mark.parametrize("qtype", DECODED, ids=lambda t: t.name)
def test_a_file_of_each_type_computes_as_its_decoded_values(qtype, tmp_path):
    """Every matrix (the embedding too) in the type, the down projection in llama.cpp's layout: the same logits,
    bit for bit, as the file holding gguf-py's dequantized values requantized to q8_0 (bf16: as f16), with the
    down projection transposed into ffn_down_t."""
    matrices = random_matrices(qtype, np.random.default_rng(int(qtype)))
    theirs = write_llama(tmp_path / "theirs.gguf", matrices)
    ref = {n: as_decoded(values(d, t).T if n == "ffn_down" else values(d, t), t) for n, (d, t) in matrices.items()}
    reference = write_llama(tmp_path / "reference.gguf", ref, down_name="ffn_down_t")
    got, info = logits(theirs)
    want, ref_info = logits(reference)
    assert np.isfinite(want).all() and want.std() > 0.1
    np.testing.assert_array_equal(got, want)
    target = "f16" if qtype == Q.BF16 else "q8_0"
    assert info["weight_type"] == ref_info["weight_type"] == target
    row_bytes = {"f16": 2 * E, "q8_0": E // 32 * 34}[target]
    kinds = {(k["from"], k["to"], k["transposed"]): k for k in info["decoded"]["kinds"]}
    name = qtype.name.lower().replace("_k", "_K")
    assert kinds.keys() == {(name, target, False), (name, target, True)}
    assert kinds[(name, target, False)]["tensors"] == 7 and kinds[(name, target, True)]["tensors"] == 1
    assert kinds[(name, target, True)]["bytes"] == F * row_bytes  # the transposed down projection: F rows of E
    assert kinds[(name, target, True)]["file_bytes"] == matrices["ffn_down"][0].nbytes
    assert ref_info["decoded"]["kinds"] == []
    # q8_0 attention is read from its packed 8-row groups alone, so its decoded rows are freed (f16 does not
    # pack); the embedding's rows are looked up one by one, gate and up read as rows: theirs stay
    kept = V + 2 * F + (0 if target == "q8_0" else 2 * E + 2 * KV)
    assert kinds[(name, target, False)]["bytes"] == kept * row_bytes


def test_decoded_parts_of_a_fused_tensor(converted, tmp_path):
    """Falcon's attn_qkv, decoded once and viewed as its q, k and v parts (freed once all three are packed), and
    its other matrices in q5_1 / q4_1: the logits of the file of their q8_0 values."""
    src = converted("falcon")
    tensors = {t.name: np.array(t.data) for t in open_reader(src).tensors}
    theirs, ref = {}, {}
    for name, x in tensors.items():
        if x.ndim == 2 and name != "token_embd.weight":
            qtype = Q.Q5_0 if "attn_qkv" in name else Q.Q5_1 if "ffn" in name else Q.Q4_1
            theirs[name] = (gguf.quants.quantize(x, qtype), qtype)
            ref[name] = as_decoded(gguf.quants.dequantize(theirs[name][0], qtype), qtype)
    got, info = logits(rewrite(src, tmp_path / "theirs.gguf", tensors=theirs))
    want, _ = logits(rewrite(src, tmp_path / "reference.gguf", tensors=ref))
    np.testing.assert_array_equal(got, want)
    held = {k["from"]: k["bytes"] for k in info["decoded"]["kinds"]}
    assert held.keys() == {"q5_0", "q5_1", "q4_1"}
    assert held["q5_0"] == held["q4_1"] == 0 and held["q5_1"] > 0  # attention and the head: packed groups alone


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.Q4_0, Q.Q8_0], ids=lambda t: t.name)
def test_llama_cpp_down_projection_of_a_computed_type_is_transposed(qtype, tmp_path):
    """ffn_down in a type the engine computes, in a mode that reads a down row per neuron (gate): transposed, f32 and
    f16 kept, q4_0 and q8_0 as q8_0 of the values (requantized along the other axis); the other matrices stay mapped
    as they are. In dense mode q4_0 and q8_0 are read as stored, nothing decoded (test_engine_down_as_stored.py)."""
    rng = np.random.default_rng(1)
    x = {n: rng.normal(0, 0.05, size=shape).astype(np.float32) for n, shape in SHAPES.items()}
    stored = {n: (v if qtype == Q.F32 else v.astype(np.float16) if qtype == Q.F16 else gguf.quants.quantize(v, qtype),
                  qtype) for n, v in x.items()}
    theirs = write_llama(tmp_path / "theirs.gguf", stored)
    ref = dict(stored)
    ref["ffn_down"] = as_decoded(values(*stored["ffn_down"]).T if qtype != Q.F16 else stored["ffn_down"][0].T, qtype)
    reference = write_llama(tmp_path / "reference.gguf", ref, down_name="ffn_down_t")
    got, info = logits(theirs, sparse_mode="gate")
    want, _ = logits(reference, sparse_mode="gate")
    np.testing.assert_array_equal(got, want)
    name = "q8_0" if qtype in (Q.Q4_0, Q.Q8_0) else qtype.name.lower()
    assert [(k["from"], k["to"], k["transposed"], k["tensors"]) for k in info["decoded"]["kinds"]] == [
        (qtype.name.lower(), name, True, 1)]
    _, info = logits(theirs, sparse_mode="dense")
    assert bool(info["decoded"]["kinds"]) == (qtype in (Q.F32, Q.F16))


def test_bf16_beyond_the_range_of_f16_is_decoded_to_f32(tmp_path):
    """A bf16 tensor with a value f16 cannot hold (here 2^17) keeps f32; the others of the file become f16."""
    rng = np.random.default_rng(2)
    matrices = random_matrices(Q.BF16, rng)
    big = gguf.quants.dequantize(matrices["attn_v"][0], Q.BF16)
    big[0, 0] = 2.0 ** 17
    matrices["attn_v"] = (gguf.quants.quantize(big, Q.BF16), Q.BF16)
    _, info = logits(write_llama(tmp_path / "big.gguf", matrices))
    counts = {(k["to"], k["transposed"]): k["tensors"] for k in info["decoded"]["kinds"]}
    assert counts == {("f16", False): 6, ("f32", False): 1, ("f16", True): 1}


def test_the_decoded_line_says_what_how_much_and_where_it_is_kept(tmp_path):
    kinds = [
        {"from": "q4_1", "to": "q8_0", "transposed": False, "tensors": 180, "bytes": 84602880, "file_bytes": 49766400},
        {"from": "q4_1", "to": "q8_0", "transposed": True, "tensors": 30, "bytes": 28200960, "file_bytes": 16588800}]
    cache = tmp_path / "m.decoded"
    assert decoded_line({"seconds": 0.47, "cache": "written", "kinds": kinds}, cache) == (
        "decoded 180 q4_1 tensors to q8_0, transposed 30 q4_1 ffn_down tensors (llama.cpp's layout) to q8_0 "
        f"ffn_down_t at load in 0.47 s (+107.6 MiB in memory, 63.3 MiB in the file); kept in {cache} for the next load")
    assert decoded_line({"seconds": 0.47, "cache": "not written", "kinds": kinds}, cache).endswith(
        f"could not keep them in {cache}: decoded again at every load")
    assert decoded_line({"seconds": 0.01, "cache": "read", "kinds": kinds}, cache) is None  # quiet once kept
    assert decoded_line({"seconds": 0.0, "cache": "off", "kinds": []}) is None


@pytest.mark.parametrize("qtype", [Q.IQ2_XXS, Q.TQ1_0, Q.Q8_K], ids=lambda t: t.name)
def test_a_type_it_does_not_read_is_one_line_naming_those_it_reads(qtype, tmp_path):
    rng = np.random.default_rng(3)
    matrices = random_matrices(Q.Q4_K, rng)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    matrices["attn_q"] = (rng.integers(0, 256, size=(E, E // block * size), dtype=np.uint8), qtype)
    with pytest.raises(engine.EngineError) as err:
        logits(write_llama(tmp_path / "odd.gguf", matrices))
    message = str(err.value)
    assert "\n" not in message
    assert f"tensor blk.0.attn_q.weight has type {qtype.name.lower()}" in message.replace("_K", "_k")
    assert "this engine reads f32, f16, bf16, q4_0, q4_1, q5_0, q5_1, q8_0, q2_K, q3_K, q4_K, q5_K, q6_K" in message


def test_a_down_projection_of_the_wrong_shape_names_the_one_expected(tmp_path):
    matrices = random_matrices(Q.Q4_K, np.random.default_rng(4))
    matrices["ffn_down"] = (random_blocks(Q.Q4_K, F, E, np.random.default_rng(4)), Q.Q4_K)  # ffn_down_t's shape
    with pytest.raises(engine.EngineError, match=r"tensor blk\.0\.ffn_down\.weight has shape \(512, 256\), the "
                                                 r"hyperparameters say \(256, 512\)"):
        logits(write_llama(tmp_path / "wrong.gguf", matrices))
