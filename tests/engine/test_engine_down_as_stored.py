"""llama.cpp's ffn_down as stored (n_embd rows of n_ff, q4_0/q8_0 blocks along the neurons): a SiLU model's dense
steps and batches multiply it by gemm8 against h in q8_0 per 32 neurons, as llama.cpp does, with no transposed copy;
a mode that reads a down row per neuron transposes it then (docs/engine.md, "The down projection as stored")."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
from convert_helpers import read_tensors
from engine_helpers import converted, engine_prompt_then_decode, hf_logits, max_rel_err, random_tokens, rewrite  # noqa: F401
from tiny_models import HIDDEN, N_FF, N_LAYER

import powerinfer_engine as engine
from powerinfer_engine import kernels
from powerinfer_tools.bench.files import write_llamacpp_gguf

Q = gguf.GGMLQuantizationType
N_PROMPT, N_DECODE = 32, 16
TOKENS = random_tokens(N_PROMPT + N_DECODE, 384, seed=3)
ISAS = ["scalar"] + [i for i in ("avx2", "avx512") if kernels.available(i)]
BLOCK_BYTES = {"q4_0": 18, "q8_0": 34}


def as_llamacpp_file(path):
    with open(path, "r+b") as f:  # rewrite() writes PowerInfer's magic: this is a plain llama.cpp file
        f.write(b"GGUF")
    return path


@pytest.fixture(scope="module")
def llamacpp_file(converted, tiny_model_dir, tmp_path_factory):  # noqa: F811
    """llamacpp_file(outtype, down_only=False): the tiny SiLU llama in llama.cpp's naming (ffn_down), every matrix in
    outtype, or (down_only) every matrix f32 but ffn_down."""
    cache = {}
    root = tmp_path_factory.mktemp("llamacpp")

    def get(outtype: str, down_only: bool = False):
        key = (outtype, down_only)
        if key not in cache:
            out = root / f"llama-silu.{outtype}.{down_only}.gguf"
            if not down_only:
                write_llamacpp_gguf(converted("llama-silu", outtype), str(tiny_model_dir("llama-silu")), out)
            else:
                plain = root / "llama-silu.f32.gguf"
                write_llamacpp_gguf(converted("llama-silu", "f32"), str(tiny_model_dir("llama-silu")), plain)
                qtype = Q[outtype.upper()]
                downs = {name: (gguf.quants.quantize(w, qtype), qtype) for name, (_, w) in read_tensors(plain).items()
                         if name.endswith("ffn_down.weight")}
                as_llamacpp_file(rewrite(plain, out, tensors=downs))
            cache[key] = out
        return cache[key]

    return get


def run(path, mode="dense", tokens=TOKENS, **kw):
    with engine.Model(path, threads=2, sparse_mode=mode, **kw) as m:
        logits = engine_prompt_then_decode(m, tokens, N_PROMPT)
        return logits, m.stats(), m.info


@pytest.mark.parametrize("outtype", ["q4_0", "q8_0"])
def test_dense_steps_multiply_the_stored_down_by_h_in_q8_0(outtype, llamacpp_file, tiny_model_dir):
    """Every matrix f32 but ffn_down, so the down projection is the one place the engine rounds: its logits are
    transformers' in float64 with the down projection's input (h) rounded through q8_0 per 32 neurons, to float
    rounding (a few of h's roundings may flip), decode steps and batches alike, in every kernel set; and far from the
    same reference without that rounding, so a wrong orientation or a wrong quantization of h would not pass."""
    path = llamacpp_file(outtype, down_only=True)
    model = tiny_model_dir("llama-silu")
    want = hf_logits(model, TOKENS, weights_from=path, q8_down=True, float64=True)
    unrounded = hf_logits(model, TOKENS, weights_from=path, float64=True)
    # measured: the rounding moves the logits by 9.4e-3 (q4_0) / 1.0e-2 (q8_0); the engine is within 3e-7 / 2e-4 of
    # the rounded reference (q8_0: a few of h's roundings flip between float32 and float64)
    assert max_rel_err(unrounded, want) > 5e-3
    for isa in ISAS:
        decode, stats, info = run(path, isa=isa, batch_size=1)
        batch, _, _ = run(path, isa=isa)
        assert max_rel_err(decode, want) <= 1e-3, isa
        assert max_rel_err(batch, want) <= 1e-3, isa
        assert stats["weight_copies"]["down_rows"] == N_LAYER * HIDDEN * N_FF // 32 * BLOCK_BYTES[outtype]
        assert info["decoded"]["kinds"] == []  # no transposed copy


def test_a_llama_cpp_file_holds_its_down_once_and_transposes_it_for_a_mode_that_reads_rows(llamacpp_file, tiny_model_dir):
    """A q4_0 llama.cpp file in dense mode: its logits as close to float64 as a converted file's (the same bound as
    test_engine_logits.py's quantized files), the down projection held once, in groups (auto mode's dense steps
    too); a mode that reads a down
    row per neuron (gate) asked at open or later transposes it then and frees the groups, one copy either way, and
    computes the same logits whichever way it came to the rows."""
    path = llamacpp_file("q4_0")
    ref64 = hf_logits(tiny_model_dir("llama-silu"), TOKENS, weights_from=path, float64=True)
    dense, stats, info = run(path)
    assert max_rel_err(dense, ref64) <= 2.5e-2 and (dense.argmax(1) == ref64.argmax(1)).mean() >= 0.9
    assert stats["weight_copies"]["down_rows"] == N_LAYER * HIDDEN * N_FF // 32 * 18
    assert info["decoded"]["kinds"] == [] and stats["weight_copies"]["decoded"] == 0
    auto, stats, _ = run(path, "auto")  # a SiLU layer's auto steps without a predictor: dense, so the same path
    assert stats["weight_copies"]["down_rows"] == N_LAYER * HIDDEN * N_FF // 32 * 18
    np.testing.assert_array_equal(auto, dense)
    transposed = [{"from": "q4_0", "to": "q8_0", "transposed": True, "tensors": N_LAYER,
                   "bytes": N_LAYER * N_FF * HIDDEN // 32 * 34, "file_bytes": N_LAYER * HIDDEN * N_FF // 32 * 18}]
    gate, stats, info = run(path, "gate")
    assert stats["weight_copies"]["down_rows"] == 0 and info["decoded"]["kinds"] == transposed
    assert stats["weight_copies"]["decoded"] == transposed[0]["bytes"]
    with engine.Model(path, threads=2) as m:
        m.eval(TOKENS[:8])
        m.sparse_mode = "gate"
        m.reset()
        switched = engine_prompt_then_decode(m, TOKENS, N_PROMPT)
        copies = m.stats()["weight_copies"]  # (m.info is read at open)
        assert copies["down_rows"] == 0 and copies["decoded"] == transposed[0]["bytes"]
        m.sparse_mode = "dense"  # the rows stay: one copy
        assert m.stats()["weight_copies"]["down_rows"] == 0
    np.testing.assert_array_equal(switched, gate)


@pytest.mark.parametrize("outtype", ["q4_0", "q8_0"])
@pytest.mark.parametrize("threads", [1, 3])
def test_each_row_of_a_decode_step_is_its_sequence_alone(outtype, threads, llamacpp_file):
    """serve --parallel on a llama.cpp file: a step of several sequences multiplies the stored down for all its rows
    at once, and each row is still the bits of its sequence decoded alone."""
    from test_engine_sequences import check_rows_are_alone

    path = llamacpp_file(outtype)
    with engine.Model(path, threads=1) as m:
        assert m.stats()["weight_copies"]["down_rows"] > 0  # the stored down is what the steps read
    check_rows_are_alone(path, threads, "f32")
