"""`pi-tools sparsify` under `accelerate launch --multi_gpu`, two processes on a tiny random SiLU Llama (on a
machine without GPUs accelerate runs them on the CPU over gloo, through the same code as on GPUs). Two processes
with --batch 1 train as one process with --batch 2: the same rows a step, the same steered L1 weights. Ctrl-C to
the launcher stops both at the same step with a checkpoint that --resume continues bit for bit."""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import psutil
import pytest
import torch
from safetensors.torch import load_file

from cli_helpers import assert_one_line_error, run_cli
from powerinfer_tools.stages import sparsification as sparsify

TRAIN = ("--seq-len", "32", "--local-tokens", "1024", "--local-epochs", "2", "--tokens", "1536",
         "--eval-tokens", "256", "--shift-budget", "0")


BAR = re.compile(r"\|\s*\d+/\d+ \[")   # a tqdm redraw: "name:  41%|####  | 26/64 [00:00<...]"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Launched:
    """`accelerate launch --multi_gpu --num_processes N -m powerinfer_tools ARGS`, its output in a file."""

    def __init__(self, log, *args, processes: int = 2):
        command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes",
                   str(processes), "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                   "--main_process_port", str(_free_port()), "-m", "powerinfer_tools", *map(str, args)]
        self.log = log
        env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo"}   # gloo over loopback, whatever the host's name resolves to
        with open(log, "w") as f:
            self.proc = subprocess.Popen(command, stdout=f, stderr=subprocess.STDOUT, env=env)

    def output(self) -> str:
        return self.log.read_text()

    def wait_for(self, ready, what: str) -> None:
        deadline = time.monotonic() + 300
        while not ready() and self.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert ready(), f"no {what}: {self.output()}"

    def worker(self, rank: int) -> psutil.Process:
        """The process of that rank (the launcher's agent starts them as its children)."""
        (found,) = [p for p in psutil.Process(self.proc.pid).children() if p.environ().get("RANK") == str(rank)]
        return found

    def finish(self) -> tuple[int, str]:
        """The exit code and the output without its progress bars' redraws (a failure's cause stays readable)."""
        self.proc.wait(timeout=600)
        lines = re.split(r"[\r\n]+", self.output())
        return self.proc.returncode, "\n".join(line for line in lines if line.strip() and not BAR.search(line))


def _weights(out):
    return load_file(out / "model.safetensors")


def test_two_processes_train_as_one_with_both_batches(tiny_model_dir, calib, tmp_path, capsys):
    model = tiny_model_dir("llama-silu")
    code, log = Launched(tmp_path / "two.log", "sparsify", "-m", model, "--calib", calib, "-o", tmp_path / "two",
                         *TRAIN, "--batch", "1").finish()
    assert code == 0, log
    assert log.count("wrote ") == 1 and log.count("mean FFN sparsity") == 1   # the main process reports
    code, _, err = run_cli(capsys, "sparsify", "-m", model, "--calib", calib, "-o", tmp_path / "one", *TRAIN,
                           "--batch", "2")
    assert code == 0, err

    two, one = (json.loads((tmp_path / d / "sparsify.json").read_text()) for d in ("two", "one"))
    assert (two["options"]["processes"], one["options"]["processes"]) == (2, 1)
    assert two["tokens_seen"] == one["tokens_seen"] == {"layer_local": 2048, "end_to_end": 1536}
    # the KL and sparsity of every logged step, averaged over both processes, are the single process's
    logged = [[h[k] for h in report["history"] if h["phase"] == 2 for k in ("kl", "sparsity")]
              for report in (two, one)]
    assert len(logged[0]) == 2 * 24
    assert logged[0] == pytest.approx(logged[1], rel=1e-3)
    # the same weights up to the order of float sums (rows taken twice instead of once each move them 5e-3)
    a, b = _weights(tmp_path / "two"), _weights(tmp_path / "one")
    assert a.keys() == b.keys()
    for name in a:
        scale = float(b[name].abs().max())
        assert float((a[name] - b[name]).abs().max()) <= 1e-4 * scale, name


def _training_in_step(run: Launched) -> bool:
    """The main process's end-to-end bar has moved: both processes have joined a step (each step's averaged
    sparsities are a collective), so both are past their start and stop cleanly."""
    return run.output().count("end-to-end:") >= 2


def _checkpoint_state(work) -> dict:
    return json.loads(torch.load(work / "checkpoint.pt", weights_only=True)["state"])


def test_a_stop_stops_both_and_resume_continues_bit_for_bit(tiny_model_dir, calib, tmp_path, capsys):
    """Stopped twice: Ctrl-C to the launcher (which sends both processes SIGTERM), then SIGTERM to the second
    process alone, which the first must follow at the same step; the twice-resumed run ends as a straight one."""
    args = ("sparsify", "-m", tiny_model_dir("llama-silu"), "--calib", calib, *TRAIN, "--local-epochs", "0",
            "--tokens", "24576", "--batch", "1")      # 384 end-to-end steps
    out = tmp_path / "resumed"
    work = sparsify.partial_dir(out)
    straight = Launched(tmp_path / "straight.log", *args, "-o", tmp_path / "straight")

    run = Launched(tmp_path / "first.log", *args, "-o", out)
    run.wait_for(lambda: _training_in_step(run), "end-to-end step")
    run.proc.send_signal(signal.SIGINT)
    code, log = run.finish()
    assert code != 0 and "rerun the same command with --resume" in log and not out.exists(), log
    first = _checkpoint_state(work)
    assert first["phase"] == 2 and 0 < first["step"] < 384, first

    code, _, err = run_cli(capsys, *args, "-o", out, "--resume")     # one process cannot take it up
    assert_one_line_error(code, err, "other options", "processes")

    run = Launched(tmp_path / "second.log", *args, "-o", out, "--resume")
    run.wait_for(lambda: _training_in_step(run), "end-to-end step")
    run.worker(1).send_signal(signal.SIGTERM)
    code, log = run.finish()
    assert code != 0 and "rerun the same command with --resume" in log and not out.exists(), log
    second = _checkpoint_state(work)
    assert first["step"] < second["step"] < 384, (first, second)

    code, log = Launched(tmp_path / "third.log", *args, "-o", out, "--resume").finish()
    assert code == 0 and f"phase 2, layer 0, step {second['step']}" in log, log
    code, log = straight.finish()
    assert code == 0, log
    a, b = _weights(tmp_path / "straight"), _weights(out)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert not work.exists()
