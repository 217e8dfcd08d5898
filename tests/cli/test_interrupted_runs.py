"""Real signals mid-run: `python -m powerinfer_tools convert/profile` in a subprocess is interrupted
(SIGINT = Ctrl-C, SIGKILL = a crash or the OOM killer) once its progress shows; the final output is then
either the previous one, untouched, or absent (never partial), and a rerun (`profile --resume`) succeeds."""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import powerinfer_engine as engine
from powerinfer_tools.stages.profiling.profiling import partial_dir
from tiny_models import DATA

ROOT = Path(__file__).resolve().parents[2]
TEXT = DATA / "tinyshakespeare.txt"


def default_sigint() -> None:
    """A shell that starts a job in the background (`.ci/run &`) makes it ignore SIGINT, and Python keeps an
    ignored SIGINT ignored: give the child Ctrl-C's default behaviour whatever the test runner inherited."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def start(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "powerinfer_tools", *args], cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                            preexec_fn=default_sigint)


def interrupt_when(proc: subprocess.Popen, ready, sig: int, timeout: float = 120.0) -> str:
    """Send `sig` to `proc` as soon as `ready(stderr so far)` holds; returns stderr at the end."""
    os.set_blocking(proc.stderr.fileno(), False)
    seen = b""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        chunk = proc.stderr.read()
        seen += chunk or b""
        if proc.poll() is not None:
            pytest.fail(f"the run ended (exit {proc.returncode}) before it could be interrupted:\n"
                        f"{seen.decode()[-2000:]}")
        if ready(seen.decode("utf-8", "replace")):
            proc.send_signal(sig)
            break
        time.sleep(0.02)
    else:
        proc.kill()
        pytest.fail("no progress shown in time")
    proc.wait(timeout=60)
    os.set_blocking(proc.stderr.fileno(), True)
    return (seen + proc.stderr.read()).decode("utf-8", "replace")


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def wide_model(tiny_model_dir, tmp_path_factory) -> Path:
    """The tiny llama-relu's tokenizer with wider, deeper random weights: slow enough to interrupt."""
    from transformers import LlamaConfig, LlamaForCausalLM

    src = tiny_model_dir("llama-relu")
    out = tmp_path_factory.mktemp("wide")
    for name in ("tokenizer.model", "tokenizer_config.json"):
        shutil.copy(src / name, out / name)
    config = LlamaConfig.from_pretrained(src)
    config.hidden_size, config.intermediate_size, config.num_hidden_layers = 384, 1536, 16
    config.head_dim = 384 // config.num_attention_heads
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out, safe_serialization=True)
    return out


def tensors_done(stderr: str) -> bool:
    """tqdm's bar of `convert` shows a count strictly between 0 and the total."""
    counts = re.findall(r"convert q8_0:.*?(\d+)/(\d+)", stderr)
    return any(0 < int(n) < int(total) for n, total in counts)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL], ids=["SIGINT", "SIGKILL"])
def test_killed_conversion_keeps_the_previous_file(wide_model, tmp_path, sig):
    out = tmp_path / "model.powerinfer.gguf"
    first = subprocess.run([sys.executable, "-m", "powerinfer_tools", "convert", "-m", str(wide_model), "-o", str(out),
                            "--outtype", "f16", "-q"], cwd=ROOT, capture_output=True, text=True)
    assert first.returncode == 0, first.stderr
    before = digest(out)

    stderr = interrupt_when(start(["convert", "-m", str(wide_model), "-o", str(out), "--outtype", "q8_0"]),
                            tensors_done, sig)
    assert digest(out) == before, "the interrupted conversion changed the previous output"
    leftovers = [p.name for p in tmp_path.iterdir() if p.name != out.name]
    if sig == signal.SIGINT:  # Ctrl-C: one line, exit 130, the temporary file removed
        assert "Traceback" not in stderr
        assert leftovers == []
    else:  # nothing runs after SIGKILL: at most a dot-named temporary file, never the final name
        assert all(name.startswith(f".{out.name}.") and name.endswith(".tmp") for name in leftovers), leftovers

    again = subprocess.run([sys.executable, "-m", "powerinfer_tools", "convert", "-m", str(wide_model), "-o", str(out),
                            "--outtype", "q8_0", "-q"], cwd=ROOT, capture_output=True, text=True)
    assert again.returncode == 0, again.stderr
    assert digest(out) != before
    with engine.Model(out, threads=1, ctx_size=16) as m:
        assert m.eval([1, 5, 7]).shape[-1] == m.n_vocab


PROFILE_ARGS = ["--calib", str(TEXT), "--tokens", "4096", "--seq-len", "64", "--batch", "1", "--max-samples", "64"]


def profile_cli(model: str, out: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "powerinfer_tools", "profile", "-m", model, "-o", str(out),
                           *PROFILE_ARGS, *extra], cwd=ROOT, capture_output=True, text=True)


@pytest.fixture(scope="module")
def whole_profile(tiny_model_dir, tmp_path_factory) -> Path:
    """The same profile, never interrupted: what a resumed one must equal."""
    out = tmp_path_factory.mktemp("whole") / "profile"
    done = profile_cli(str(tiny_model_dir("llama-relu")), out)
    assert done.returncode == 0, done.stderr
    return out


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL], ids=["SIGINT", "SIGKILL"])
def test_killed_profile_resumes(tiny_model_dir, whole_profile, tmp_path, sig):
    model = str(tiny_model_dir("llama-relu"))
    out = tmp_path / "profile"
    checkpoint = partial_dir(out) / "checkpoint.pt"
    proc = start(["profile", "-m", model, "-o", str(out), *PROFILE_ARGS])
    stderr = interrupt_when(proc, lambda _: checkpoint.is_file(), sig)
    assert not out.exists(), "an interrupted profile left output under the final name"
    assert checkpoint.is_file()
    if sig == signal.SIGINT:
        assert proc.returncode == 130 and "Traceback" not in stderr
    else:
        assert proc.returncode == -signal.SIGKILL

    resumed = profile_cli(model, out, "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming" in resumed.stdout
    assert not partial_dir(out).exists()
    # no double counting: the resumed profile equals the uninterrupted one, count for count
    assert json.loads((out / "profile.json").read_text())["layers"] == \
        json.loads((whole_profile / "profile.json").read_text())["layers"]
    for i in range(2):
        a = torch.load(out / "activation" / f"activation_{i}.pt", weights_only=True)
        b = torch.load(whole_profile / "activation" / f"activation_{i}.pt", weights_only=True)
        assert torch.equal(a, b)


IMPORT_INTERRUPTED = """
import runpy, sys

class CtrlCAt:  # Ctrl-C lands while the toolkit is importing `name`
    def __init__(self, name):
        self.name = name

    def find_spec(self, name, path=None, target=None):
        if name == self.name:
            raise KeyboardInterrupt
        return None

sys.meta_path.insert(0, CtrlCAt(sys.argv[1]))
sys.argv = ["pi-tools", "inspect", "--help"]
runpy.run_module("powerinfer_tools", run_name="__main__")
"""


@pytest.mark.parametrize("module", ["typer", "powerinfer_tools.cli.inspect_file"])
def test_ctrl_c_during_imports_is_one_line(module):
    done = subprocess.run([sys.executable, "-c", IMPORT_INTERRUPTED, module], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 130 and done.stderr.strip() == "pi-tools: interrupted", done.stderr[-2000:]


@pytest.fixture(scope="module")
def interpreter_start() -> float:
    """Seconds a bare interpreter takes to start here (site included): a signal before then is Python's own."""
    started = time.monotonic()
    subprocess.run([sys.executable, "-c", "pass"], check=True, cwd=ROOT)
    return time.monotonic() - started


@pytest.mark.parametrize("after", [0.05, 0.2, 0.5])
def test_real_ctrl_c_in_the_first_second(after, interpreter_start):
    proc = start(["inspect", "--help"])
    time.sleep(2 * interpreter_start + after)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    err = err.decode("utf-8", "replace")
    assert "Traceback" not in err, err
    assert proc.returncode in (0, 130, -signal.SIGINT), (proc.returncode, err)  # done, or interrupted
