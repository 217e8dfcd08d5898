"""`--gpu` and `--vram-budget` of pi-tools run and perplexity: with the emulated device library in place of the
CUDA one (PI_GPU_LIBRARY), the hot tier runs on the "device" and the output is the CPU's; where the run asks
for a device that is not there, one line says what is missing; `auto` says on stderr where the hot tier went."""
from __future__ import annotations

import json

import numpy as np
import pytest
from cli_helpers import assert_one_line_error, run_cli
from engine_helpers import converted, write_gpuidx  # noqa: F401
from tiny_models import N_FF, N_LAYER, training_text

import powerinfer_engine as engine

PROMPT = "ROMEO: But soft, what light"


@pytest.fixture(scope="module")
def gpuidx(tmp_path_factory):
    hot = [np.random.default_rng(7 + i).random(N_FF) < 0.5 for i in range(N_LAYER)]
    return write_gpuidx(tmp_path_factory.mktemp("hot") / "hot.gpuidx", hot)


@pytest.fixture
def emulated_gpu(monkeypatch):
    monkeypatch.setenv("PI_GPU_LIBRARY", str(engine.device_library_path("emulated")))
    monkeypatch.setenv("PI_EMULATED_DEVICE_MIB", "1024")
    monkeypatch.delenv("PI_EMULATED_DEVICES", raising=False)


def test_run_on_the_device_streams_the_cpu_text(converted, gpuidx, emulated_gpu, capsys):
    # f32: a quantized file's prompt batch rounds its down projection differently on the CPU (in integers) and the
    # device (in floats), and a random tiny model's greedy text follows the rounding (test_engine_device.py bounds it)
    path = converted("llama-relu", "f32")
    args = ["run", "-m", path, "--gpuidx", gpuidx, "-p", PROMPT, "-n", "16", "--temp", "0", "-t", "2", "-v"]
    code, on_cpu, err_cpu = run_cli(capsys, *args, "--gpu", "off")
    assert code == 0, err_cpu
    assert "hot tier on" not in err_cpu and "gpu:" not in err_cpu
    code, on_gpu, err = run_cli(capsys, *args, "--gpu", "on", "--vram-budget", "0.5")
    assert code == 0, err
    assert on_gpu == on_cpu
    assert f"pi-tools: hot tier on emulated device (host memory) (device 0): {N_LAYER} of {N_LAYER} layers" in err
    assert "0.50 GiB budget" in err and "ms per token on the device" in err
    assert f"attention and KV cache of {N_LAYER} of {N_LAYER} layers" in err
    assert "upper case on the device): " + " ".join(["AH"] * N_LAYER) in err
    # half the neurons hot: every layer split, its cold tier here (attention jobs of their own only without)
    assert "split layers (attention and hot rows there, the cold tier here, one crossing each way): " in err


def test_auto_says_where_the_hot_tier_went(converted, gpuidx, monkeypatch, capsys):
    monkeypatch.setenv("PI_GPU_LIBRARY", str(engine.device_library_path("emulated")))
    monkeypatch.setenv("PI_EMULATED_DEVICES", "0")
    code, _, err = run_cli(capsys, "run", "-m", converted("llama-relu"), "--gpuidx", gpuidx, "-p", PROMPT, "-n", "2")
    assert code == 0, err
    assert err.count("pi-tools: no GPU for the GPU index (the emulated device library reports no device") == 1
    assert "): it is ignored, and --sparse-mode auto computes every neuron on the CPU\n" in err


def test_gpu_on_without_a_device_is_one_line(converted, gpuidx, monkeypatch, capsys):
    monkeypatch.setenv("PI_GPU_LIBRARY", str(engine.device_library_path("emulated")))
    monkeypatch.setenv("PI_EMULATED_DEVICES", "0")
    code, _, err = run_cli(capsys, "run", "-m", converted("llama-relu"), "--gpuidx", gpuidx, "-p", PROMPT, "--gpu", "on")
    assert_one_line_error(code, err, "gpu on:", "no device")


@pytest.mark.parametrize("flags, needle", [(["--gpu", "maybe"], "unknown --gpu 'maybe'"),
                                           (["--gpu", "on", "--vram-budget", "0"], "--vram-budget must be a number in (0, 1048576] GiB, not 0"),
                                           (["--gpu", "on", "--vram-budget", "4096"], "is more than the")])
def test_bad_gpu_flags_are_one_line(converted, gpuidx, emulated_gpu, capsys, flags, needle):
    code, _, err = run_cli(capsys, "run", "-m", converted("llama-relu"), "--gpuidx", gpuidx, "-p", PROMPT, *flags)
    assert_one_line_error(code, err, needle)


def test_perplexity_on_the_device_equals_the_cpu(converted, gpuidx, emulated_gpu, tmp_path, capsys):
    text = tmp_path / "text.txt"
    text.write_text(training_text())
    args = ["perplexity", "-m", converted("llama-silu", "f32"), "--gpuidx", gpuidx, "-f", text, "-c", "64",
            "--chunks", "4", "--json", "-q", "-t", "2"]
    results = {}
    for gpu in ("off", "on"):
        code, out, err = run_cli(capsys, *args, "--gpu", gpu)
        assert code == 0, err
        results[gpu] = json.loads(out)
    assert results["on"]["gpu"] and not results["off"]["gpu"]
    assert results["on"]["perplexity"] == pytest.approx(results["off"]["perplexity"], rel=1e-5)


def test_without_a_gpu_the_predictor_drives_every_layer(converted, tmp_path, capsys):
    """Issue 56, the README's recipe on a machine without a GPU: `plan` marks neurons hot, and run and perplexity
    ignore the index there (said once on stderr), so predictor mode is the predictor's in every layer; an index
    marking every neuron used to give exactly gate mode's perplexity (the marked neurons computed whole)."""
    path = converted("llama-relu", "q8_0", predictors=True)
    every = write_gpuidx(tmp_path / "all.gpuidx", [np.ones(N_FF, bool)] * N_LAYER)
    text = tmp_path / "text.txt"
    text.write_text(training_text())

    def perplexity(mode, *flags):
        code, out, err = run_cli(capsys, "perplexity", "-m", path, "-f", text, "-c", "64", "--chunks", "4", "--json",
                                 "-q", "-t", "2", "--sparse-mode", mode, *flags)
        assert code == 0, err
        return json.loads(out)["perplexity"], err

    alone, _ = perplexity("predictor", "--gpuidx", "none")
    ignored, err = perplexity("predictor", "--gpuidx", every, "--gpu", "off")
    assert ignored == alone != perplexity("gate")[0]
    assert err.count("pi-tools: no GPU for the GPU index (--gpu off): it is ignored, and --sparse-mode predictor "
                     "computes every neuron on the CPU, the predictor choosing them in every layer\n") == 1
