"""What a sparsify run carries across steps and restarts: its state, the checkpoint that holds it (written
atomically, read back only with the same options), and stop requests (Ctrl-C, SIGTERM) that end a run at a
step boundary with a checkpoint."""
from __future__ import annotations

import json
import signal
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from powerinfer_tools.core.atomic import atomic_file
from powerinfer_tools.core.errors import UserError
from powerinfer_tools.core.safe_load import load_pt


@dataclass
class TrainState:
    """Everything a run needs to continue bit for bit: where it is, the student, the L1 weights."""

    phase: int = 1               # 1 layer-local, 2 end-to-end, 3 done
    layer: int = 0               # phase 1: the layer being trained
    step: int = 0                # step within the layer (phase 1) or the phase (phase 2)
    tokens_seen: int = 0
    elapsed: float = 0.0
    lam: list[float] = field(default_factory=list)
    scales: list[float] = field(default_factory=list)
    start_sparsity: list[float] = field(default_factory=list)
    history: list[dict] = field(default_factory=list)


def save_checkpoint(work: Path, state: TrainState, student, optimizer, scheduler, identity: dict) -> None:
    blob = {"identity": json.dumps(identity, sort_keys=True), "state": json.dumps(asdict(state)),
            "student": student.state_dict(),
            "optimizer": optimizer.state_dict() if optimizer is not None else {},
            "scheduler": scheduler.state_dict() if scheduler is not None else {}}
    with atomic_file(work / "checkpoint.pt") as tmp:   # a process killed mid-save leaves the last one whole
        torch.save(blob, tmp)


E2E_ONLY = ("tokens", "lr")  # options only the end-to-end phase reads: may change on --resume before it starts


def load_checkpoint(work: Path, identity: dict) -> dict:
    path = work / "checkpoint.pt"
    if not path.is_file():
        raise UserError(f"--resume: no interrupted sparsify run to continue ({path} does not exist)")
    blob = load_pt(path, "sparsify checkpoint")
    if not isinstance(blob, dict) or not {"identity", "state", "student"} <= set(blob):
        raise UserError(f"{path} is not a sparsify checkpoint")
    saved = json.loads(blob["identity"])
    state = TrainState(**json.loads(blob["state"]))
    changed = sorted(k for k in set(saved) | set(identity) if saved.get(k) != identity.get(k))
    if state.phase < 2 or (state.phase == 2 and state.step == 0):
        changed = [k for k in changed if k not in E2E_ONLY]
    if changed:
        raise UserError(f"--resume: the checkpoint in {work} was made with other options ({', '.join(changed)}); "
                        "rerun with the same options, or without --resume to start over")
    blob["state"] = state
    return blob


class Interrupts:
    """Ctrl-C while training asks for a clean stop: the step in flight finishes and a checkpoint is written.
    A second Ctrl-C stops at once (the previous checkpoint stays). SIGTERM asks the same: it is how a launcher
    (accelerate launch on Ctrl-C, a job scheduler) stops its processes before it kills them."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, quiet: bool = False):
        self.requested = False
        self.quiet = quiet
        self._previous: dict = {}

    def __enter__(self):
        for sig in self.SIGNALS:
            if signal.getsignal(sig) is not signal.SIG_IGN:
                self._previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def _on_signal(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        if not self.quiet:
            tqdm.write("pi-tools sparsify: stopping after this step to save a checkpoint (Ctrl-C again to quit now)",
                       file=sys.stderr)

    def __exit__(self, *exc):
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        return False


class Checkpointer:
    """Writes a checkpoint every `minutes` of training and when a stop is asked for, with the training time
    so far (this run's and the runs it resumes). Of several processes only the main one writes (`writes`):
    they all hold the same student and optimiser."""

    def __init__(self, work: Path, identity: dict, minutes: float, interrupts: Interrupts, state: TrainState,
                 writes: bool = True):
        self.work, self.identity, self.period, self.interrupts = work, identity, minutes * 60.0, interrupts
        self.started, self.elapsed_before = time.monotonic(), state.elapsed
        self.last, self.writes = self.started, writes

    def clock(self, state: TrainState) -> None:
        state.elapsed = self.elapsed_before + time.monotonic() - self.started

    def save(self, state, student, optimizer, scheduler) -> None:
        self.clock(state)
        if self.writes:
            save_checkpoint(self.work, state, student, optimizer, scheduler, self.identity)
        self.last = time.monotonic()

    def after_step(self, state, student, optimizer, scheduler, stop: bool | None = None) -> None:
        """`stop`: whether to stop here (of several processes: what they agreed); by default whether this
        process was asked to."""
        stop = self.interrupts.requested if stop is None else stop
        if stop or time.monotonic() - self.last >= self.period:
            self.save(state, student, optimizer, scheduler)
        if stop:
            if self.writes:
                tqdm.write(f"pi-tools sparsify: checkpoint saved in {self.work}; rerun the same command with "
                           "--resume to continue", file=sys.stderr)
            raise KeyboardInterrupt
