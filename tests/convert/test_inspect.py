"""pi-tools inspect: metadata, a tensor table whose byte counts follow the formats' block sizes, the
per-layer GPU share of a gpuidx file, and one-line errors for files that are not GGUF."""
from __future__ import annotations

import json
import re

import gguf
import numpy as np
import pytest
from convert_helpers import write_predictors
from tiny_models import HIDDEN, N_FF, N_LAYER

from powerinfer_tools.cli import main
from powerinfer_tools.stages.conversion.conversion import convert_model
from powerinfer_tools.formats.gguf_io import set_pwri_magic

# bytes per 32 values: ggml's block layouts (f16 scale + 32 int8, f16 scale + 16 bytes of nibbles)
BYTES_PER_32 = {"F32": 128, "F16": 64, "Q8_0": 34, "Q4_0": 18}


def run(args, capsys) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exc:
        main(args)
        raise SystemExit(0)
    captured = capsys.readouterr()
    return exc.value.code, captured.out, captured.err


def test_tensor_table_and_metadata(tiny_model_dir, tmp_path, capsys):
    pred = write_predictors(tmp_path / "pred", N_LAYER, HIDDEN, N_FF, rank=32)
    out = tmp_path / "m.gguf"
    convert_model(str(tiny_model_dir("llama-silu")), out, "q4_0", predictors_dir=pred, progress=False)
    code, text, _ = run(["inspect", str(out)], capsys)
    assert code == 0
    assert "magic PWRI, GGUF v3" in text
    assert re.search(r"general\.architecture\s+'llama-silu'", text)  # a SiLU llama (docs/formats.md)
    assert re.search(r"powerinfer\.predictor_thresholds\s+\[0\.1, 0\.2\] \(2 items\)", text)
    rows = {m.group(1): (json.loads(m.group(2)), m.group(3), int(m.group(4).replace(",", "")))
            for m in re.finditer(r"^  (\S+)\s+(\[[\d, ]+\])\s+(\w+)\s+([\d,]+)$", text, re.M)}
    assert rows["blk.1.ffn_down_t.weight"][:2] == ([N_FF, HIDDEN], "Q4_0")
    assert rows["blk.0.fc1.weight"][:2] == ([32, HIDDEN], "Q8_0")  # predictors quantized, fc1 at 8 bits
    assert rows["blk.0.fc2.weight"][:2] == ([N_FF, 32], "Q4_0")
    assert rows["blk.0.attn_norm.weight"][:2] == ([HIDDEN], "F32")
    for name, (shape, qtype, nbytes) in rows.items():
        assert nbytes == int(np.prod(shape)) // 32 * BYTES_PER_32[qtype], name
    code, js, _ = run(["inspect", str(out), "--json"], capsys)
    info = json.loads(js)
    assert {t["name"] for t in info["tensors"]} == set(rows)
    assert info["metadata"]["llama-silu.block_count"] == N_LAYER


def write_gpuidx(path, shares: list[np.ndarray]):
    """A gpuidx in PowerInfer's format (docs/formats.md)."""
    w = gguf.GGUFWriter(path, "generic.gpu_index")
    w.add_uint32("generic.gpu_index.block_count", len(shares))
    w.add_uint64("split.vram_capacity", 123456)
    for i, mask in enumerate(shares):
        w.add_tensor(f"blk.{i}.gpu_idx", mask.astype(np.int32))
        w.add_tensor(f"blk.{i}.gpu_bucket", np.flatnonzero(mask).astype(np.int32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    set_pwri_magic(path)


def test_gpuidx_share_per_layer(tmp_path, capsys):
    rng = np.random.default_rng(0)
    masks = [rng.random(1000) < p for p in (0.1, 0.5, 0.0)]
    path = tmp_path / "m.generated.gpuidx"
    write_gpuidx(path, masks)
    code, text, _ = run(["inspect", str(path)], capsys)
    assert code == 0 and "GPU share per layer" in text
    for i, mask in enumerate(masks):
        line = re.search(rf"layer\s+{i}:\s+(\d+) / (\d+)\s+([\d.]+)%", text)
        assert (int(line.group(1)), int(line.group(2))) == (int(mask.sum()), 1000)
        assert abs(float(line.group(3)) - 100 * mask.mean()) < 0.051
    total = sum(int(m.sum()) for m in masks)
    assert re.search(rf"all\s+:\s+{total} / 3000", text)


@pytest.mark.parametrize("content,needle", [(b"", "not a GGUF"), (b"NOPE" + bytes(100), "not a GGUF"),
                                            (b"GGUF\x03\x00\x00\x00" + b"\xff" * 16, "exceeds what the file can hold")])
def test_bad_files(tmp_path, capsys, content, needle):
    path = tmp_path / "bad.gguf"
    path.write_bytes(content)
    code, _, err = run(["inspect", str(path)], capsys)
    assert code == 1 and len(err.strip().splitlines()) == 1 and needle in err


def test_missing_file(tmp_path, capsys):
    code, _, err = run(["inspect", str(tmp_path / "nope.gguf")], capsys)
    assert code == 1 and "no such file" in err
