"""The run-ready cache: a model built through profile -> train-predictor -> convert once, then reused;
VRAM plans cached beside the model file for their budget."""
from __future__ import annotations

import pytest

import engine
from powerinfer_tools import gguf_io, inference, pipeline, placement
from powerinfer_tools.errors import UserError


@pytest.fixture()
def built(tiny_model_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("POWERINFER_TOOLS_CACHE", str(tmp_path / "cache"))
    model = str(tiny_model_dir("llama-silu"))
    path = pipeline.build(model, outtype="f32", tokens=1024, rank=8)
    reports = capsys.readouterr()
    # the build's reports go to stderr: the stdout of `pi-tools run` is the generated text alone
    assert reports.out == ""
    assert "1/3 profile" in reports.err and "hotN%" in reports.err and "predictors to" in reports.err
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
