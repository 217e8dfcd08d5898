"""pi-tools report and the locality analysis: figures present and readable, table numbers equal the
input JSON files, locality numbers equal an independent computation."""
from __future__ import annotations

import base64
import io
import html
import json
from html.parser import HTMLParser

import numpy as np
import pytest
import torch

from cli_helpers import run_cli
from powerinfer_tools.stages.profiling import locality
from powerinfer_tools.cli import main
from powerinfer_tools.stages.profiling.profiling import ProfileOptions, run_profile

LOCALITY_FIGURES = ("fig-cumulative", "fig-hot-coverage", "fig-sparsity")
PREDICTOR_FIGURES = ("fig-predictor-quality", "fig-predictor-density")
PLACEMENT_FIGURES = ("fig-gpu-share", "fig-budget")


class PageParser(HTMLParser):
    """Collects <img id=...> sources and <table id=...> cell texts of a report page."""

    def __init__(self):
        super().__init__()
        self.images: dict[str, str] = {}
        self.tables: dict[str, list[list[str]]] = {}
        self._table = None
        self._cell: list[str] | None = None

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "img":
            self.images[attrs["id"]] = attrs["src"]
        elif tag == "table":
            self._table = self.tables.setdefault(attrs["id"], [])
        elif tag == "tr" and self._table is not None:
            self._table.append([])
        elif tag in ("td", "th") and self._table is not None:
            self._cell = []

    def handle_endtag(self, tag):
        if tag in ("td", "th") and self._cell is not None:
            self._table[-1].append("".join(self._cell).strip())
            self._cell = None
        elif tag == "table":
            self._table = None

    def handle_data(self, data):
        if self._cell is not None:
            self._cell.append(data)


def parse_page(path) -> PageParser:
    parser = PageParser()
    parser.feed(path.read_text(encoding="utf-8"))
    return parser


def png_shape(src: str) -> tuple[int, ...]:
    """Decode a data: URL PNG with matplotlib's reader; returns the pixel array shape."""
    from matplotlib import image

    prefix = "data:image/png;base64,"
    assert src.startswith(prefix)
    raw = base64.b64decode(src[len(prefix):], validate=True)
    assert raw[:8] == b"\x89PNG\r\n\x1a\n"
    pixels = image.imread(io.BytesIO(raw), format="png")
    assert pixels.std() > 0.01, "blank figure"
    return pixels.shape


def table_dicts(rows: list[list[str]]) -> list[dict[str, str]]:
    header, *body = rows
    return [dict(zip(header, row)) for row in body]


def assert_cell(cell: str, value) -> None:
    """A table cell shows `value` (floats to 4 decimals, like the report)."""
    if isinstance(value, float):
        assert float(cell) == pytest.approx(value, abs=5.001e-5), (cell, value)
    else:
        assert cell == str(value)


@pytest.fixture(scope="module")
def tiny_profile(tiny_model_dir, tmp_path_factory):
    """A data-free profile of the tiny ReLU Llama (exact zeros, so real locality)."""
    out = tmp_path_factory.mktemp("report") / "prof"
    run_profile(ProfileOptions(model=str(tiny_model_dir("llama-relu")), out=out, tokens=512, seq_len=64,
                               max_samples=128))
    return out


@pytest.fixture(scope="module")
def tiny_predictors(tiny_profile):
    """Predictors trained by train-predictor on the tiny profile (small rank, few epochs)."""
    out = tiny_profile.with_name("pred")
    main_ok(["train-predictor", str(tiny_profile), "-o", str(out), "--rank", "8", "--epochs", "2",
             "--threads", "1"])
    return out


@pytest.fixture(scope="module")
def tiny_plan(tiny_profile):
    """A placement of the tiny profile on a PowerInfer file of the same shape, at a budget that fits
    about half of the neurons."""
    from placement_fixtures import write_model

    profile = json.loads((tiny_profile / "profile.json").read_text())
    model = write_model(tiny_profile.with_name("tiny.powerinfer.gguf"), profile["model"]["n_layer"],
                        profile["model"]["n_ff"], "Q8_0")
    gpuidx = tiny_profile.with_name("tiny.gpuidx")
    main_ok(["plan", "--profile", str(tiny_profile), "-m", str(model), "--vram-budget", str(120 * 1024 / 2**30),
             "--ctx-size", "16", "--reserve-mib", "0", "--min-layer-neurons", "1", "-o", str(gpuidx)])
    return gpuidx


def main_ok(args) -> None:
    try:
        main(args)
    except SystemExit as exc:
        assert exc.code == 0, f"pi-tools {' '.join(args)} failed"


# ---- locality -----------------------------------------------------------------------------------------

def test_locality_on_known_counts():
    counts = torch.tensor([10, 0, 70, 20], dtype=torch.int64)   # hottest: 70, 20, 10, 0
    neurons, activation = locality.cumulative_share(counts)
    np.testing.assert_allclose(neurons, [0, 0.25, 0.5, 0.75, 1.0])
    np.testing.assert_allclose(activation, [0, 0.7, 0.9, 1.0, 1.0])
    assert locality.neuron_share_for(counts, 0.7) == 0.25
    assert locality.neuron_share_for(counts, 0.75) == 0.5
    assert locality.neuron_share_for(counts, 0.9) == 0.5
    assert locality.neuron_share_for(counts, 1.0) == 0.75
    assert locality.sparsity(counts, tokens=100) == pytest.approx(1 - 100 / 400)
    zero = torch.zeros(4, dtype=torch.int64)
    assert locality.cumulative_share(zero)[1].max() == 0 and locality.neuron_share_for(zero, 0.9) == 0.0


def test_analyse_agrees_with_profile_json(tiny_profile):
    loc = locality.analyse(tiny_profile)
    profile = json.loads((tiny_profile / "profile.json").read_text())
    assert len(loc.layers) == profile["model"]["n_layer"]
    for layer, row in zip(loc.layers, profile["layers"]):
        counts = torch.load(tiny_profile / "activation" / f"activation_{row['layer']}.pt", weights_only=True)
        # independent: brute-force share of the top-k neurons
        top = sorted(counts.tolist(), reverse=True)
        n = len(top)
        for pct in (10, 20, 50):
            k = -(-n * pct // 100)
            assert layer.hot[f"hot{pct}"] == pytest.approx(sum(top[:k]) / sum(top))
            assert layer.hot[f"hot{pct}"] == pytest.approx(row[f"hot{pct}"])
            assert layer.activation_share[k] == pytest.approx(row[f"hot{pct}"])
        assert layer.sparsity == pytest.approx(row["sparsity"])
        assert layer.sparsity == pytest.approx(1 - counts.sum().item() / (profile["tokens"] * n))
        assert np.all(np.diff(layer.activation_share) >= 0) and layer.activation_share[-1] == pytest.approx(1)


def test_the_verdict_says_what_the_numbers_mean():
    silu = locality.verdict("silu", 0.2, 0.115)
    assert "no exact zeros" in silu and "pi-tools sparsify" in silu and "Almost no locality" in silu
    dense = locality.verdict("relu", 0.3, 0.5)
    assert "run it dense" in dense and "serve 50% of activations" in dense
    sparse = locality.verdict("drelu", 0.9, 0.6)
    assert "90% of the FFN neurons are inactive" in sparse and "no exact zeros" not in sparse


# ---- the report ---------------------------------------------------------------------------------------

def test_report_figures_and_tables(tiny_profile, tmp_path, capsys):
    out = tmp_path / "report.html"
    code, stdout, stderr = run_cli(capsys, *["report", str(tiny_profile), "-o", str(out)])
    assert code == 0, stderr
    page = parse_page(out)
    for fig in LOCALITY_FIGURES:
        height, width, _ = png_shape(page.images[fig])
        assert width > 300 and height > 200
    assert "http" not in out.read_text().replace("http-equiv", ""), "report must be self-contained"
    profile = json.loads((tiny_profile / "profile.json").read_text())
    mean = {k: np.mean([row[k] for row in profile["layers"]]) for k in ("sparsity", "hot10")}
    verdict = locality.verdict(profile["model"]["activation"], mean["sparsity"], mean["hot10"])
    assert html.escape(verdict) in out.read_text()  # the report says what its numbers mean

    profile = json.loads((tiny_profile / "profile.json").read_text())
    loc = locality.analyse(tiny_profile)
    rows = table_dicts(page.tables["tbl-locality"])
    assert len(rows) == len(profile["layers"])
    for cells, row, threshold, layer in zip(rows, profile["layers"], profile["thresholds"], loc.layers):
        assert_cell(cells["layer"], row["layer"])
        assert_cell(cells["threshold"], float(threshold))
        for key in ("sparsity", "hot10", "hot20", "hot50"):
            assert_cell(cells[key], row[key])
        for share in locality.COVERAGE_TARGETS:
            assert_cell(cells[f"neurons for {share:.0%}"], layer.neurons_for[share])


def test_report_with_predictors_and_plan(tiny_profile, tiny_predictors, tiny_plan, tmp_path, capsys):
    out = tmp_path / "report.html"
    code, _, stderr = run_cli(capsys, *["report", str(tiny_profile), "--predictors", str(tiny_predictors),
                               "--plan", str(tiny_plan), "-o", str(out)])
    assert code == 0, stderr
    page = parse_page(out)
    assert "Not included" not in out.read_text()
    for fig in LOCALITY_FIGURES + PREDICTOR_FIGURES + PLACEMENT_FIGURES:
        png_shape(page.images[fig])

    pred = json.loads((tiny_predictors / "report.json").read_text())
    rows = table_dicts(page.tables["tbl-predictors"])
    assert len(rows) == len(pred["layers"]) > 0
    for cells, row in zip(rows, pred["layers"]):
        assert_cell(cells["layer"], row["layer"])
        assert_cell(cells["rank"], row["rank"])
        for key in ("threshold", "recall", "precision", "true_density", "predicted_density"):
            assert_cell(cells[key.replace("_", " ")], float(row[key]))

    plan = json.loads(tiny_plan.with_name(tiny_plan.name + ".json").read_text())
    assert 0 < plan["gpu_neurons"] < plan["neurons"], "the fixture budget should place some neurons, not all"
    rows = table_dicts(page.tables["tbl-placement"])
    assert len(rows) == len(plan["layers"])
    for cells, row in zip(rows, plan["layers"]):
        for column, key in (("layer", "layer"), ("n_ff", "n_ff"), ("min neurons", "min_neurons"),
                            ("gpu neurons", "gpu_neurons")):
            assert_cell(cells[column], row[key])
        assert_cell(cells["gpu share"], row["gpu_neurons"] / row["n_ff"])
        assert_cell(cells["served fraction"], float(row["served_fraction"]))
    budget = {cells["part"]: cells for cells in table_dicts(page.tables["tbl-budget"])}
    assert len(budget) == len(plan["breakdown_bytes"])
    for part, nbytes in plan["breakdown_bytes"].items():
        cells = budget[part.replace("_", " ")]
        assert_cell(cells["bytes"], nbytes)
        assert_cell(cells["share of budget"], nbytes / plan["vram_budget"])

    # the plan summary may be given directly, the predictors as their report file
    again = tmp_path / "again.html"
    code, _, stderr = run_cli(capsys, *["report", str(tiny_profile), "--predictors", str(tiny_predictors / "report.json"),
                               "--plan", str(tiny_plan) + ".json", "-o", str(again)])
    assert code == 0, stderr
    assert parse_page(again).tables == page.tables


def _bad(args, capsys, expect):
    code, _, stderr = run_cli(capsys, *args)
    assert code == 1
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and expect in lines[0], stderr
    assert "Traceback" not in stderr


def test_report_bad_input(tiny_profile, tmp_path, capsys):
    out = tmp_path / "report.html"
    _bad(["report", str(tmp_path), "-o", str(out)], capsys, "not a profile directory")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "profile.json").write_text((tiny_profile / "profile.json").read_text())
    _bad(["report", str(broken), "-o", str(out)], capsys, "no activation/ directory")
    _bad(["report", str(tiny_profile), "-o", str(tmp_path)], capsys, "is a directory")
    _bad(["report", str(tiny_profile), "--predictors", str(tmp_path), "-o", str(out)], capsys, "no such predictor report")
    _bad(["report", str(tiny_profile), "--plan", str(tmp_path / "x.gpuidx"), "-o", str(out)], capsys,
         "no such plan summary")
    assert not out.exists()


def test_report_refuses_inputs_of_another_model(tiny_profile, tiny_predictors, tiny_plan, tmp_path, capsys):
    out = tmp_path / "report.html"
    pred = json.loads((tiny_predictors / "report.json").read_text())
    pred["model"]["config_hash"] = "0" * 64
    other = tmp_path / "other-report.json"
    other.write_text(json.dumps(pred))
    _bad(["report", str(tiny_profile), "--predictors", str(other), "-o", str(out)], capsys, "config hash")
    plan = json.loads(tiny_plan.with_name(tiny_plan.name + ".json").read_text())
    plan["layers"] = plan["layers"][:-1]
    short = tmp_path / "short.json"
    short.write_text(json.dumps(plan))
    _bad(["report", str(tiny_profile), "--plan", str(short), "-o", str(out)], capsys, "do not match")
    (tmp_path / "garbled.json").write_text("{not json")
    _bad(["report", str(tiny_profile), "--plan", str(tmp_path / "garbled.json"), "-o", str(out)], capsys,
         "not valid JSON")
    assert not out.exists()


def test_report_says_which_predictors_predict_nothing(tiny_profile, tiny_predictors, tmp_path, capsys):
    import shutil

    pred = tmp_path / "pred"
    shutil.copytree(tiny_predictors, pred)
    report = json.loads((pred / "report.json").read_text())
    report["layers"][0].update(auc=0.9, useful=True, predicted_density=0.6)
    report["layers"][1].update(auc=0.5, useful=False, predicted_density=1.0, recall=1.0)
    (pred / "report.json").write_text(json.dumps(report))
    out = tmp_path / "report.html"
    code, _, stderr = run_cli(capsys, "report", str(tiny_profile), "--predictors", str(pred), "-o", str(out))
    assert code == 0, stderr
    text = out.read_text()
    assert "The predictors of layer(s) 1 predict nothing useful" in text
    rows = table_dicts(parse_page(out).tables["tbl-predictors"])
    assert [row["useful"] for row in rows][:2] == ["True", "False"] and "auc" in rows[0]
