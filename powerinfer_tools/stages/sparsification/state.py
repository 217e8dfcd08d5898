"""What a sparsify run carries across steps and restarts: its state, the checkpoint that holds it (written
atomically, read back only with the same options), and stop requests (Ctrl-C, SIGTERM) that end a run at a
step boundary with a checkpoint."""
from __future__ import annotations

import json
import math
import signal
import sys
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch
from tqdm import tqdm

from powerinfer_tools.core.atomic import atomic_file
from powerinfer_tools.core.digests import tree_sha256 as _digest
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
    blob["digest"] = _digest(blob)
    with atomic_file(work / "checkpoint.pt") as tmp:   # a process killed mid-save leaves the last one whole
        torch.save(blob, tmp)


E2E_ONLY = ("tokens", "lr")  # options only the end-to-end phase reads: may change on --resume before it starts
_FIELDS = ("identity", "state", "student", "optimizer", "scheduler", "digest")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return (_is_int(v) or isinstance(v, float)) and math.isfinite(v)


def _checked_state(text, n_layer: int, path: Path) -> TrainState:
    """The TrainState a checkpoint's JSON describes, each field of its kind and in range for a model of n_layer
    layers (a phase or layer out of range would skip training, or publish a half-trained model)."""
    def bad(why: str) -> UserError:
        return UserError(f"{path} is damaged: its training state {why}")
    try:
        raw = json.loads(text)
    except (TypeError, ValueError):
        raise bad("is not JSON") from None
    names = [f.name for f in fields(TrainState)]
    if not isinstance(raw, dict) or sorted(raw) != sorted(names):
        raise bad(f"does not have the fields {', '.join(names)}")
    for name in ("phase", "layer", "step", "tokens_seen"):
        if not _is_int(raw[name]) or raw[name] < 0:
            raise bad(f"has {name} {raw[name]!r}, not a count")
    if not _is_number(raw["elapsed"]) or raw["elapsed"] < 0:
        raise bad(f"has elapsed {raw['elapsed']!r}, not a time")
    for name in ("lam", "scales", "start_sparsity"):
        if not isinstance(raw[name], list) or len(raw[name]) != n_layer or not all(map(_is_number, raw[name])):
            raise bad(f"has {name} that is not {n_layer} numbers, one per layer")
    if not isinstance(raw["history"], list) or not all(isinstance(h, dict) for h in raw["history"]):
        raise bad("has a history that is not a list of records")
    if raw["phase"] not in (1, 2, 3):
        raise bad(f"is in phase {raw['phase']} (1 layer-local, 2 end-to-end, 3 done)")
    if raw["layer"] > (n_layer if raw["phase"] == 1 else 0):
        raise bad(f"is at layer {raw['layer']} in phase {raw['phase']}, past the model's {n_layer} layers")
    return TrainState(**raw)


def check_student(saved, student, path: Path) -> None:
    """The checkpoint's student weights: this model's, name for name, in shape and type."""
    expected = student.state_dict()
    if not isinstance(saved, dict) or set(saved) != set(expected):
        names = set(saved) if isinstance(saved, dict) else set()
        raise UserError(f"{path} is damaged: its student weights are not this model's ({len(expected.keys() - names)} "
                        f"missing, {len(names - expected.keys())} unknown)")
    for name, want in expected.items():
        got = saved[name]
        if not isinstance(got, torch.Tensor) or got.shape != want.shape or got.dtype != want.dtype:
            what = f"{got.dtype} {tuple(got.shape)}" if isinstance(got, torch.Tensor) else type(got).__name__
            raise UserError(f"{path} is damaged: its student weight {name} is {what}, not {want.dtype} "
                            f"{tuple(want.shape)}")


def load_checkpoint(work: Path, identity: dict, n_layer: int) -> dict:
    """The checkpoint in `work`, checked field by field and against its digest, made with `identity`."""
    path = work / "checkpoint.pt"
    if not path.is_file():
        raise UserError(f"--resume: no interrupted sparsify run to continue ({path} does not exist)")
    blob = load_pt(path, "sparsify checkpoint")
    if not isinstance(blob, dict) or sorted(blob, key=repr) != sorted(_FIELDS):
        raise UserError(f"{path} is not a sparsify checkpoint (it lacks {', '.join(_FIELDS)} or holds more)")
    digest = blob.pop("digest")
    if digest != _digest(blob):
        raise UserError(f"{path} is damaged: its contents do not match the checksum it was saved with")
    kinds = {"identity": str, "state": str, "student": dict, "optimizer": dict, "scheduler": dict}
    for name, kind in kinds.items():
        if not isinstance(blob[name], kind):
            raise UserError(f"{path} is damaged: its {name} is {type(blob[name]).__name__}, not {kind.__name__}")
    try:
        saved = json.loads(blob["identity"])
    except ValueError:
        saved = None
    if not isinstance(saved, dict):
        raise UserError(f"{path} is damaged: its options are not a JSON object")
    state = _checked_state(blob["state"], n_layer, path)
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
