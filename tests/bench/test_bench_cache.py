"""bench's file cache (bench/files.py) as a hostile user leaves it: a manifest that is not JSON, an empty object or a
list was a traceback; 4 KiB of 0xff written into a cached model was reused and benchmarked; a truncated file was
never rebuilt. Each is now found (the manifest's recorded size and SHA-256 of both files), said on stderr, and
built again."""
from __future__ import annotations

import hashlib
import json
import shutil

import pytest

from convert_helpers import write_predictors
from tiny_models import HIDDEN, N_FF, N_LAYER

from powerinfer_tools.bench.files import bench_files


@pytest.fixture(scope="module")
def built(tiny_model_dir, tmp_path_factory):
    """(model, predictors, a work directory holding the tiny model's q8_0 bench files, their bytes)."""
    root = tmp_path_factory.mktemp("bench_cache")
    pred = write_predictors(root / "pred", N_LAYER, HIDDEN, N_FF)
    model = str(tiny_model_dir("llama-silu"))
    files = bench_files(model, "q8_0", root / "work", predictors=pred, progress=False)
    return model, pred, root / "work", {p.name: p.read_bytes() for p in (files.powerinfer, files.llamacpp)}


def overwrite_middle(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2:len(data) // 2 + 4096] = b"\xff" * 4096
    path.write_bytes(bytes(data))


def edit_manifest(**changes):
    def change(directory):
        manifest = json.loads((directory / "manifest.json").read_text())
        (directory / "manifest.json").write_text(json.dumps({**manifest, **changes}))
    return change


DAMAGE = {
    "manifest not JSON": (lambda d: (d / "manifest.json").write_text("{"), "not readable JSON"),
    "manifest empty": (lambda d: (d / "manifest.json").write_text("{}"), "not an object recording"),
    "manifest a list": (lambda d: (d / "manifest.json").write_text("[1, 2]"), "not an object recording"),
    "manifest not UTF-8": (lambda d: (d / "manifest.json").write_bytes(b"\xff\xfe{"), "not readable JSON"),
    "manifest names a path": (edit_manifest(powerinfer="../model.powerinfer.gguf"), "names no powerinfer file"),
    "manifest without digests": (edit_manifest(files={}), "records no size and digest"),
    "0xff in the model": (lambda d: overwrite_middle(d / "model.powerinfer.gguf"), "SHA-256 differs"),
    "0xff in llama.cpp's": (lambda d: overwrite_middle(d / "model.llamacpp.gguf"), "SHA-256 differs"),
    "model cut short": (lambda d: (d / "model.powerinfer.gguf").write_bytes(
        (d / "model.powerinfer.gguf").read_bytes()[:5000]), "5,000 bytes, not the"),
    "model missing": (lambda d: (d / "model.powerinfer.gguf").unlink(), "model.powerinfer.gguf is missing"),
}


@pytest.mark.parametrize("case", list(DAMAGE))
def test_a_damaged_cache_entry_is_built_again(case, built, tmp_path, capsys):
    model, pred, work, pristine = built
    shutil.copytree(work, tmp_path / "work")
    [directory] = (tmp_path / "work").iterdir()
    damage, reason = DAMAGE[case]
    damage(directory)
    capsys.readouterr()
    files = bench_files(model, "q8_0", tmp_path / "work", predictors=pred, progress=False)
    err = capsys.readouterr().err
    assert f"the files cached in {directory} cannot be reused" in err and reason in err, err
    assert "building them again" in err
    for path in (files.powerinfer, files.llamacpp):
        assert path.parent == directory and path.read_bytes() == pristine[path.name], path
        record = files.manifest["files"][path.name]
        assert record == {"size": path.stat().st_size, "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}


def test_an_intact_cache_entry_is_reused_silently(built, tmp_path, capsys):
    model, pred, work, _ = built
    shutil.copytree(work, tmp_path / "work")
    [directory] = (tmp_path / "work").iterdir()
    before = {p.name: p.stat().st_mtime_ns for p in directory.iterdir()}
    capsys.readouterr()
    files = bench_files(model, "q8_0", tmp_path / "work", predictors=pred, progress=False)
    assert capsys.readouterr().err == ""
    assert files.powerinfer.parent == directory
    assert {p.name: p.stat().st_mtime_ns for p in directory.iterdir()} == before
