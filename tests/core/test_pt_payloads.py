"""`.pt` files that weights_only loads but that hold the wrong thing (ints for tensors, 0-d, meta, quantized or
sparse tensors, NaN or huge weights, complex/bool/int64 predictors, extra keys, a rank past n_ff, bad counts)
and compressed payloads (a decompression bomb): every command that reads them answers one line and exit 1,
by the rules the engine loads a predictor with."""
from __future__ import annotations

import io
import warnings
import zipfile

import pytest
import torch
from cli_helpers import assert_one_line_error, run_cli
from convert_helpers import write_predictors
from placement_fixtures import write_model
from predictor_data import write_profile
from tiny_models import HIDDEN, N_FF, N_LAYER

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # torch's warnings on loading quantized tensors
E, F, RANK = 32, 128, 8  # the synthetic profile's shapes (predictor_data.write_profile's defaults but n_ff)


def compressed(value) -> bytes:
    """torch.save's zip of `value` with every entry deflated: a few KB that declare the tensor's full size."""
    raw = io.BytesIO()
    torch.save(value, raw)
    out = io.BytesIO()
    with zipfile.ZipFile(raw) as src, zipfile.ZipFile(out, "w") as dst:
        for entry in src.infolist():
            dst.writestr(entry.filename, src.read(entry.filename), compress_type=zipfile.ZIP_DEFLATED)
    return out.getvalue()


def quantized(x: torch.Tensor) -> torch.Tensor:
    with warnings.catch_warnings():  # torch deprecates quantized tensors; a hostile file may still hold one
        warnings.simplefilter("ignore")
        return torch.quantize_per_tensor(x, 0.1, 0, torch.qint8)


def predictor_cases(n_embd: int, n_ff: int) -> dict:
    """name -> (what model_0.pt holds, a phrase of the error)."""
    fc1, fc2 = torch.randn(RANK, n_embd), torch.randn(n_ff, RANK)

    def state(a=fc1, b=fc2, **extra):
        return {"fc1.weight": a, "fc2.weight": b, **extra}

    nan = fc1.clone()
    nan[0, 0] = float("nan")
    return {
        "int": (5, "found int"),
        "list": ([fc1, fc2], "found list"),
        "ints-for-tensors": (state(1, 2), "fc1.weight must be a tensor, not int"),
        "0-d": (state(torch.tensor(1.0), torch.tensor(1.0)), "fc1.weight must have 2 dimensions, not 0"),
        "rank-0": (state(fc1[:0], fc2[:, :0]), "predictor rank 0 is outside 1..n_ff"),
        "rank-past-n_ff": (state(torch.randn(n_ff + 1, n_embd), torch.randn(n_ff, n_ff + 1)),
                           f"predictor rank {n_ff + 1} is outside 1..n_ff ({n_ff})"),
        "nan": (state(nan), "fc1.weight holds NaN or infinity"),
        "huge": (state(fc1 * 1e30), "beyond 65504"),
        "complex": (state(fc1.to(torch.complex64)), "not complex64"),
        "bool": (state(fc1 > 0), "not bool"),
        "int64": (state(fc1.long()), "must hold floating-point numbers, not int64"),
        "extra-key": (state(**{"fc3.weight": fc1}), "found ['fc1.weight', 'fc2.weight', 'fc3.weight']"),
        "meta": (state(torch.empty(RANK, n_embd, device="meta")), "fc1.weight must be a dense tensor, not a meta one"),
        "quantized": (state(quantized(fc1)), "not a quantized one"),
        "sparse": (state(fc1.to_sparse()), "not a sparse one"),
    }


def count_cases(n_ff: int) -> dict:
    """name -> (what activation_0.pt holds, a phrase of the error)."""
    counts = torch.randint(0, 100, (n_ff,))
    nan = counts.double()
    nan[3] = float("nan")
    return {
        "int": (5, "the counts must be a tensor, not int"),
        "dict": ({"counts": counts}, "must be a tensor, not dict"),
        "0-d": (torch.tensor(7), "must have 1 dimension, not 0"),
        "empty": (torch.zeros(0), f"0 counts, but layer 0 of the model has {n_ff} neurons"),
        "one-too-many": (torch.ones(n_ff + 1), f"{n_ff + 1} counts, but layer 0 of the model has {n_ff} neurons"),
        "negative": (counts - 1000, "negative"),
        "nan": (nan, "NaN or infinity"),
        "complex": (counts.to(torch.complex64), "not complex64"),
        "bool": (counts > 50, "not bool"),
        "meta": (torch.empty(n_ff, device="meta"), "not a meta one"),
        "quantized": (quantized(counts.float()), "not a quantized one"),
        "sparse": (counts.to_sparse(), "not a sparse one"),
    }


def put(path, value) -> None:
    if isinstance(value, bytes):
        path.write_bytes(value)
    else:
        torch.save(value, path)


@pytest.fixture(scope="module")
def profile(tmp_path_factory):
    return write_profile(tmp_path_factory.mktemp("payloads") / "profile", n_layer=2, n_embd=E, n_ff=F, rows=512)


@pytest.mark.parametrize("case", list(predictor_cases(HIDDEN, N_FF)))
def test_convert_refuses_bad_predictor(case, tiny_model_dir, tmp_path, capsys):
    value, needle = predictor_cases(HIDDEN, N_FF)[case]
    pred = write_predictors(tmp_path / "pred", N_LAYER, HIDDEN, N_FF, rank=RANK)
    put(pred / "model_0.pt", value)
    out = tmp_path / "m.gguf"
    code, _, err = run_cli(capsys, "convert", "-m", tiny_model_dir("llama-relu"), "--predictors", pred, "-o", out, "-q")
    assert_one_line_error(code, err, "model_0.pt", needle)
    assert not out.exists()


@pytest.mark.parametrize("case", list(predictor_cases(E, F)))
def test_evaluate_refuses_bad_predictor(case, profile, tmp_path, capsys):
    value, needle = predictor_cases(E, F)[case]
    pred = write_predictors(tmp_path / "pred", 2, E, F, rank=RANK)
    put(pred / "model_0.pt", value)
    code, _, err = run_cli(capsys, "train-predictor", profile, "--out", pred, "--evaluate", "--threads", "1")
    assert_one_line_error(code, err, "model_0.pt", needle)


def bad_counts_profile(profile, tmp_path, value):
    import shutil

    copy = shutil.copytree(profile, tmp_path / "profile")
    put(copy / "activation" / "activation_0.pt", value)
    return copy


@pytest.mark.parametrize("case", list(count_cases(F)))
def test_plan_and_report_refuse_bad_counts(case, profile, tmp_path, capsys):
    value, needle = count_cases(F)[case]
    bad = bad_counts_profile(profile, tmp_path, value)
    model = write_model(tmp_path / "m.powerinfer.gguf", 2, F, "Q8_0")
    code, _, err = run_cli(capsys, "plan", "--profile", bad, "-m", model, "--vram-budget", "1", "-o",
                           tmp_path / "x.gpuidx")
    assert_one_line_error(code, err, "activation_0.pt", needle)
    code, _, err = run_cli(capsys, "report", bad, "-o", tmp_path / "r.html")
    assert_one_line_error(code, err, "activation_0.pt", needle)
    assert not (tmp_path / "x.gpuidx").exists() and not (tmp_path / "r.html").exists()


@pytest.mark.parametrize("case", ["int", "0-d", "meta", "bool", "negative", "one-too-many"])
def test_training_refuses_bad_counts(case, profile, tmp_path, capsys):
    value, _ = count_cases(F)[case]
    bad = bad_counts_profile(profile, tmp_path, value)
    code, _, err = run_cli(capsys, "train-predictor", bad, "--out", tmp_path / "pred", "--epochs", "1",
                           "--threads", "1", "--rank", "4")
    lines = err.strip().splitlines()  # after the progress bar of the training, which reads the counts last
    assert code == 1 and "Traceback" not in err and lines[-1].startswith("pi-tools: error: "), err
    assert "activation_0.pt" in lines[-1] and not (tmp_path / "pred").exists()


def test_compressed_payloads_are_refused_before_loading(profile, tmp_path, capsys):
    """A deflated .pt of 64 MiB of zeros is ~65 KB; torch.load would inflate all of it before any check."""
    bomb = compressed(torch.zeros(16 << 20))
    assert len(bomb) < 200_000
    pred = write_predictors(tmp_path / "pred", 2, E, F, rank=RANK)
    put(pred / "model_0.pt", bomb)
    code, _, err = run_cli(capsys, "train-predictor", profile, "--out", pred, "--evaluate", "--threads", "1")
    assert_one_line_error(code, err, "model_0.pt", "declares 67,10", "compressed entries")
    bad = bad_counts_profile(profile, tmp_path, bomb)
    code, _, err = run_cli(capsys, "report", bad, "-o", tmp_path / "r.html")
    assert_one_line_error(code, err, "activation_0.pt", "compressed entries")
