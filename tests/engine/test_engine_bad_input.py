"""Bad files never crash the engine: each defect becomes an EngineError naming it, and >= 500 random
mutations of a valid file are loaded (and run) in a subprocess, so that a crash fails the test."""
from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import gguf
import numpy as np
import pytest
from engine_helpers import converted, rewrite, run_with_timeout, write_gpuidx  # noqa: F401
from tiny_models import N_FF, N_LAYER

import powerinfer_engine as engine
from powerinfer_tools.formats.gguf_io import open_reader

Q = gguf.GGMLQuantizationType


@pytest.fixture(scope="module")
def good(converted):
    return converted("llama-relu")


def load_error(path, **kw) -> str:
    with pytest.raises(engine.EngineError) as info:
        engine.Model(path, threads=1, **kw)
    return str(info.value)


def test_valid_copy_loads(good, tmp_path):
    with engine.Model(rewrite(good, tmp_path / "copy.gguf"), threads=1) as m:
        with engine.Model(good, threads=1) as ref:
            np.testing.assert_array_equal(m.eval([1, 2, 3]), ref.eval([1, 2, 3]))


def test_missing_file_and_directory(tmp_path):
    assert "cannot open" in load_error(tmp_path / "nope.gguf")
    assert "not a regular file" in load_error(tmp_path)


def test_a_fifo_is_refused_without_waiting_for_a_writer(tmp_path):
    fifo = tmp_path / "model.gguf"
    os.mkfifo(fifo)
    done = run_with_timeout("import sys, powerinfer_engine as e\ntry:\n    e.Model(sys.argv[1], threads=1)\n"
                            "except e.EngineError as exc:\n    print(exc)", fifo, timeout=60)
    assert done.stdout.strip() == f"{fifo}: not a regular file", done


def test_truncated_file(good, tmp_path):
    data = good.read_bytes()
    for cut in (0, 10, 200, len(data) // 2, len(data) - 1):
        (tmp_path / "t.gguf").write_bytes(data[:cut])
        msg = load_error(tmp_path / "t.gguf")
        assert any(s in msg for s in ("too short", "ends inside", "past the end", "truncated")), msg


def test_wrong_magic(good, tmp_path):
    bad = tmp_path / "m.gguf"
    bad.write_bytes(b"GGML" + good.read_bytes()[4:])
    assert "not a GGUF/PowerInfer file" in load_error(bad)
    bad.write_bytes(b"GGUF" + good.read_bytes()[4:])  # plain GGUF magic is accepted
    with engine.Model(bad, threads=1) as m:
        assert m.info["magic"] == "GGUF"


def test_bad_version(good, tmp_path):
    data = bytearray(good.read_bytes())
    data[4:8] = (7).to_bytes(4, "little")
    (tmp_path / "v.gguf").write_bytes(bytes(data))
    assert "version 7" in load_error(tmp_path / "v.gguf")


def test_tensor_offset_past_end(good, tmp_path):
    reader = open_reader(good)
    t = next(t for t in reader.tensors if t.name == "blk.1.ffn_up.weight")
    offset_part = t.field.parts[-1]  # the tensor's data offset, a view into the mapped file
    pos = offset_part.ctypes.data - reader.data.ctypes.data
    data = bytearray(good.read_bytes())
    data[pos:pos + 8] = (len(data) * 4 // 32 * 32).to_bytes(8, "little")
    (tmp_path / "o.gguf").write_bytes(bytes(data))
    msg = load_error(tmp_path / "o.gguf")
    assert "blk.1.ffn_up.weight" in msg and "past the end" in msg


def test_shapes_contradicting_hyperparameters(good, tmp_path):
    bad = rewrite(good, tmp_path / "s.gguf", fields={"llama.feed_forward_length": (N_FF * 2, gguf.GGUFValueType.UINT32)})
    msg = load_error(bad)
    assert "ffn_gate.weight has shape (256, 64), the hyperparameters say (512, 64)" in msg
    bad = rewrite(good, tmp_path / "h.gguf", fields={"llama.attention.head_count": (3, gguf.GGUFValueType.UINT32)})
    assert "not a multiple of head_count 3" in load_error(bad)
    bad = rewrite(good, tmp_path / "e.gguf", fields={"llama.attention.layer_norm_rms_epsilon": None})
    assert "layer_norm_rms_epsilon is missing" in load_error(bad)


def test_alignment_below_eight(good, tmp_path):
    """The GGUF spec's alignment is a multiple of 8; a smaller one would let f32 tensors sit misaligned
    (found by the fuzzer as a misaligned load under UBSan)."""
    bad = rewrite(good, tmp_path / "a4.gguf", fields={"general.alignment": (4, gguf.GGUFValueType.UINT32)})
    assert "general.alignment must be a u32 power of two from 8" in load_error(bad)


def test_missing_tensor(good, tmp_path):
    bad = rewrite(good, tmp_path / "x.gguf", drop=("blk.1.ffn_up.weight",))
    assert "tensor blk.1.ffn_up.weight is missing" in load_error(bad)


def test_unsupported_tensor_type(good, tmp_path):
    """iq4_nl (an i-quant: not among the types decoded at load, docs/formats.md "Weight types read")."""
    w = next(t for t in open_reader(good).tensors if t.name == "blk.0.ffn_gate.weight")
    rows, cols = (int(n) for n in reversed(w.shape))
    iq4 = np.random.default_rng(0).integers(0, 256, size=(rows, cols // 32 * 18), dtype=np.uint8)
    bad = rewrite(good, tmp_path / "q.gguf", tensors={"blk.0.ffn_gate.weight": (iq4, Q.IQ4_NL)})
    msg = load_error(bad)
    assert "blk.0.ffn_gate.weight has type iq4_nl" in msg and "this engine reads f32, f16, bf16, q4_0, q4_1" in msg


def test_every_ggml_type_is_read_at_its_size(tmp_path):
    """A file may name any GGML type (only four are computed with): each of gguf-py's is known, and none is
    taken for more bytes than gguf-py writes (32 blocks a row, so no padding hides a larger size: the first
    tensor would overlap the second)."""
    for qtype, (_, block_bytes) in gguf.GGML_QUANT_SIZES.items():
        path = tmp_path / f"{qtype.name}.gguf"
        writer = gguf.GGUFWriter(path, "llama")
        for name in ("a", "b"):
            writer.add_tensor(name, np.full((2, 32 * block_bytes), 7, np.uint8), raw_dtype=qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        engine.check_gguf(path)


def test_unsupported_architecture(good, tmp_path):
    bad = rewrite(good, tmp_path / "a.gguf", fields={"general.architecture": ("gpt2", gguf.GGUFValueType.STRING)})
    assert "unsupported architecture 'gpt2'" in load_error(bad)
    nul = rewrite(good, tmp_path / "n.gguf", fields={"general.architecture": ("ll\0ma", gguf.GGUFValueType.STRING)})
    msg = load_error(nul)  # the message crosses the C API as a C string: a NUL in it would end it there
    assert "unsupported architecture 'll\\x00ma' (this engine runs llama" in msg, msg


def test_gpuidx_for_another_model(good, tmp_path):
    other_layers = write_gpuidx(tmp_path / "l.gpuidx", [np.ones(N_FF, bool)] * (N_LAYER + 1))
    assert f"for a model with {N_LAYER + 1} layers" in load_error(good, gpuidx=other_layers)
    other_ff = write_gpuidx(tmp_path / "f.gpuidx", [np.ones(2 * N_FF, bool)] * N_LAYER)
    assert f"n_ff {2 * N_FF}" in load_error(good, gpuidx=other_ff)
    assert "not a GPU index file" in load_error(good, gpuidx=good)
    assert "cannot open" in load_error(good, gpuidx=tmp_path / "missing.gpuidx")


FUZZ_SCRIPT = textwrap.dedent("""
    import random, sys
    import powerinfer_engine as engine
    src, work, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    data = open(src, "rb").read()
    header = int(sys.argv[4])
    rng = random.Random(1234)
    outcomes = {"loaded": 0, "rejected": 0}
    for i in range(n):
        b = bytearray(data)
        kind = i % 5
        if kind == 0:    # flip a few header bytes
            for _ in range(rng.randint(1, 4)):
                b[rng.randrange(header)] = rng.randrange(256)
        elif kind == 1:  # overwrite 8 header bytes with an extreme integer
            p = rng.randrange(header - 8)
            b[p:p + 8] = rng.choice([2**64 - 1, 2**63, 2**32, 0, 1, 2**31 - 1]).to_bytes(8, "little")
        elif kind == 2:  # truncate anywhere
            b = b[:rng.randrange(len(b))]
        elif kind == 3:  # corrupt the data section (NaN/inf weights, scrambled blocks)
            for _ in range(64):
                b[rng.randrange(header, len(b))] = rng.randrange(256)
        else:            # shift a byte range inside the header
            p = rng.randrange(8, header - 16)
            b[p:p + 16] = bytes(reversed(b[p:p + 16]))
        path = f"{work}/v.gguf"
        open(path, "wb").write(bytes(b))
        try:
            with engine.Model(path, threads=2, ctx_size=16) as m:
                m.eval([1, 2, 3, 4])
                m.eval([5], all_logits=False)
                m.sample(temperature=0.7)
            outcomes["loaded"] += 1
        except engine.EngineError as e:
            assert str(e) and "\\n" not in str(e), repr(str(e))
            outcomes["rejected"] += 1
    print(outcomes)
""")


def test_random_mutations_never_crash(good, tmp_path):
    reader = open_reader(good)
    header = int(reader.data_offset)
    script = tmp_path / "fuzz.py"
    script.write_text(FUZZ_SCRIPT)
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, str(script), str(good), str(tmp_path), "500", str(header)],
                          capture_output=True, text=True, timeout=600, cwd=root,
                          env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, f"crashed (status {proc.returncode}): {proc.stderr[-2000:]}"
    outcomes = ast.literal_eval(proc.stdout.strip().splitlines()[-1])
    print(outcomes)
    assert outcomes["loaded"] + outcomes["rejected"] == 500
    assert outcomes["rejected"] > 100 and outcomes["loaded"] > 50  # both paths exercised


def test_predictor_tensors_of_one_layer_half_missing(converted, tmp_path):
    with_predictors = converted("llama-relu", predictors=True)
    only_fc2 = rewrite(with_predictors, tmp_path / "fc2.gguf", drop=("blk.0.fc1.weight",))
    assert "tensor blk.0.fc1.weight is missing (blk.0.fc2.weight is there)" in load_error(only_fc2)
    later = rewrite(with_predictors, tmp_path / "l1.gguf", drop=("blk.1.fc1.weight",))
    assert "tensor blk.1.fc1.weight is missing (layer 0 has a predictor)" in load_error(later)
    none_at_0 = rewrite(with_predictors, tmp_path / "l0.gguf", drop=("blk.0.fc1.weight", "blk.0.fc2.weight"))
    assert "layer 1 has a predictor but layer 0 has none" in load_error(none_at_0)
