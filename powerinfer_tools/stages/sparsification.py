"""Make a SiLU Llama-family model genuinely sparse: ReLU in place of SiLU on the gate, then distillation from
the original that recovers its outputs while an L1 penalty on the FFN activations drives most of them to
exact zeros (the recipe of ProSparse and "ReLU Strikes Back", arXiv:2402.13516 and 2310.04564).

Two phases, both distilled from the original model (the teacher), never from labels:
  1. layer-local: each FFN, on its own, learns to reproduce the original FFN's output on the original FFN's
     inputs (cached once; no attention, no output head, one layer's weights at a time: cheap);
  2. end-to-end: the whole model's next-token distribution is pulled to the teacher's (KL), which also
     repairs what the layer-local phase cannot see (errors that compound across layers).
Each layer has its own L1 weight, steered step by step so that the layer's measured sparsity follows a
schedule that rises to the target (progressive regularisation) and then holds it.

Last, ReLU's cut-off may be raised from 0 to the largest t that keeps perplexity within --shift-budget
(threshold_shift.py). The result is a Llama checkpoint: `hidden_act: relu`, which transformers loads as it
is, when no t helps (or --shift-budget 0); else ProSparse's FATReLU form (`hidden_act: fatrelu`,
`hidden_act_param: t`). Every stage of the pipeline reads both (models/arch/llama_relu.py, models/arch/prosparse.py).
"""
from __future__ import annotations

import contextlib
import copy
import functools
import json
import math
import os
import shutil
import signal
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from powerinfer_tools.models import arch as arch_mod
from powerinfer_tools.models.arch.base import rope_theta
from powerinfer_tools.stages import calibration, data_parallel, threshold_shift
from powerinfer_tools.runtime import evaluate
from powerinfer_tools import models
from powerinfer_tools.core.atomic import check_output_dir, publish_dir
from powerinfer_tools.core.errors import UserError
from powerinfer_tools.core.safe_load import load_pt
from powerinfer_tools.stages.options import SparsifyOptions

FORMAT = "powerinfer-tools.sparsify/1"
REPORT_NAME = "sparsify.json"
LAMBDA_RANGE = (1e-6, 1e3)
LAMBDA_GAIN = 0.5     # per step: lambda *= exp(gain * (wanted - measured sparsity))
RAMP_SHARE = 0.6      # share of a phase-1 layer's steps over which its sparsity target rises to the goal


def partial_dir(out: Path) -> Path:
    """Where an unfinished sparsify run of `out` keeps its checkpoint until the model is written."""
    return out.parent / f".{out.name}.sparsify.partial"


# ---- setup ------------------------------------------------------------------------------------------------

def _check_options(opts: SparsifyOptions) -> None:
    if opts.self_tokens < 0:
        raise UserError(f"--self-tokens must be >= 0, not {opts.self_tokens}")
    if opts.self_tokens and not opts.calib:
        raise UserError("--self-tokens adds the model's own text to --calib files; without --calib all the text is "
                        "the model's own (give --tokens)")
    if not 0.0 < opts.target_sparsity < 1.0:
        raise UserError(f"--target-sparsity must be in (0, 1), got {opts.target_sparsity}")
    for name in ("tokens", "local_tokens", "eval_tokens", "batch"):
        if getattr(opts, name) < 0 or (name == "batch" and opts.batch == 0):
            raise UserError(f"--{name.replace('_', '-')} must be positive, got {getattr(opts, name)}")
    if not 0.0 <= opts.shift_budget < 1.0:
        raise UserError(f"--shift-budget must be in [0, 1), got {opts.shift_budget}")
    if opts.seq_len < 2:
        raise UserError(f"--seq-len must be at least 2, got {opts.seq_len}")
    if opts.local_epochs < 0:
        raise UserError(f"--local-epochs must be non-negative, got {opts.local_epochs}")
    if not (opts.lr > 0 and opts.local_lr > 0 and opts.checkpoint_minutes > 0):
        raise UserError("--lr, --local-lr and --checkpoint-minutes must be positive")
    if opts.device not in ("auto", "cpu", "cuda"):
        raise UserError(f"--device must be auto, cpu or cuda, got {opts.device!r}")
    if opts.dtype not in ("auto", "float32", "bfloat16"):
        raise UserError(f"--dtype must be auto, float32 or bfloat16, got {opts.dtype!r}")
    if opts.device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda: no CUDA device is available")


def _device_and_dtype(opts: SparsifyOptions) -> tuple[str, torch.dtype]:
    """`auto`: the GPU when there is one; bf16 compute where the GPU has it, f32 on the CPU (weights stay f32)."""
    device = ("cuda" if torch.cuda.is_available() else "cpu") if opts.device == "auto" else opts.device
    if opts.dtype == "auto":
        bf16 = device == "cuda" and torch.cuda.is_bf16_supported()
        return device, torch.bfloat16 if bf16 else torch.float32
    return device, {"float32": torch.float32, "bfloat16": torch.bfloat16}[opts.dtype]


def _check_writable(out: Path) -> None:
    """Refuse an OUT_DIR we could not create before any slow work starts."""
    parent = out.parent if out.parent != Path("") else Path(".")
    probe = parent
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir() or not os.access(probe, os.W_OK | os.X_OK):
        raise UserError(f"cannot write {out}: {probe} is not a writable directory")


def _check_source(adapter, spec: str) -> None:
    if adapter.activation in arch_mod.base.ACTIVE_IF_NONZERO:
        raise UserError(f"{spec} is already a {adapter.activation} model ({adapter.description}): its activations "
                        "are sparse as they are; profile it directly")
    if adapter.activation != "silu" or not adapter.gated or adapter.powerinfer_arch != "llama":
        raise UserError(f"sparsify makes ReLU Llama models from gated SiLU Llama-family ones; {spec} is "
                        f"{adapter.description}")


def _split_data(seqs: torch.Tensor, opts: SparsifyOptions, step_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(training rows, held-out rows): the held-out tail is never trained on; it measures the result."""
    n = len(seqs)
    n_eval = max(1, min(opts.eval_tokens // opts.seq_len, n // 10))
    if n - n_eval < step_rows:
        raise UserError(f"the calibration text gives {n} sequences of {opts.seq_len} tokens; sparsify needs at "
                        f"least {step_rows + 1} (a step's sequences, --batch times the processes, and one held "
                        "out): give more text, or a smaller --seq-len or --batch")
    return seqs[:n - n_eval], seqs[n - n_eval:]


def _calibration_text(tokenizer, opts: SparsifyOptions) -> torch.Tensor | None:
    """The calibration files cut into sequences (None without files: the model will write its own)."""
    if not opts.calib:
        return None
    texts = [calibration.read_text(p) for p in opts.calib]
    return calibration.sequences_from_text(tokenizer, texts, opts.seq_len,
                                           opts.local_tokens + opts.tokens + opts.eval_tokens)


def _self_generated(teacher, tokenizer, opts: SparsifyOptions) -> torch.Tensor:
    print("pi-tools sparsify: no --calib: generating calibration text with the model itself (slow on a CPU)")
    return calibration.self_generated(teacher, tokenizer, opts.seq_len,
                                      opts.local_tokens + opts.tokens + opts.eval_tokens, opts.seed)


# ---- measuring the FFN activations ---------------------------------------------------------------------------

class ActivationTap:
    """Forward hooks on every layer's activation module: the L1 term (mean activation over its layer's scale)
    and the share of exact zeros, per layer, of the latest forward."""

    def __init__(self, adapter, model, scales: torch.Tensor):
        self.scales = scales
        self.l1: list[torch.Tensor | None] = [None] * len(scales)
        self.zeros = torch.zeros(len(scales), dtype=torch.float64)
        self.handles = arch_mod.install_taps(adapter, model, on_activation=self._record)

    def _record(self, i: int, a: torch.Tensor) -> None:
        self.l1[i] = a.float().mean() / self.scales[i]
        self.zeros[i] = float((a == 0).float().mean())

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def _relu_student(teacher, adapter):
    """A trainable float copy of the teacher with ReLU on the gates. A model read from a GGUF file carries
    transformers' GGUF quantizer (its weights already dequantized at load): the copy drops it, so that it is
    saved as the plain float checkpoint it is."""
    student = copy.deepcopy(teacher)
    student.hf_quantizer = None
    student.is_quantized = False
    if hasattr(student.config, "quantization_config"):
        del student.config.quantization_config
    student.config.hidden_act = "relu"
    for p in student.parameters():
        p.requires_grad_(True)  # the teacher's are frozen
    threshold_shift.set_threshold(adapter, student, 0.0)  # ReLU on every gate
    return student


# ---- state, checkpoint ------------------------------------------------------------------------------------------

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


def _save_checkpoint(work: Path, state: TrainState, student, optimizer, scheduler, identity: dict) -> None:
    blob = {"identity": json.dumps(identity, sort_keys=True), "state": json.dumps(asdict(state)),
            "student": student.state_dict(),
            "optimizer": optimizer.state_dict() if optimizer is not None else {},
            "scheduler": scheduler.state_dict() if scheduler is not None else {}}
    tmp = work / "checkpoint.pt.tmp"
    torch.save(blob, tmp)
    os.replace(tmp, work / "checkpoint.pt")


E2E_ONLY = ("tokens", "lr")  # options only the end-to-end phase reads: may change on --resume before it starts


def _load_checkpoint(work: Path, identity: dict) -> dict:
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
            _save_checkpoint(self.work, state, student, optimizer, scheduler, self.identity)
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


def _steer(lam: float, measured: float, wanted: float) -> float:
    """The L1 weight's next value: up while the layer is less sparse than wanted, down while more."""
    lo, hi = LAMBDA_RANGE
    return min(hi, max(lo, lam * math.exp(LAMBDA_GAIN * (wanted - measured))))


def _generator(seed: int, *keys: int) -> torch.Generator:
    g = torch.Generator()
    value = seed
    for key in keys:
        value = value * 1_000_003 + key
    g.manual_seed(value & 0x7FFF_FFFF_FFFF_FFFF)
    return g


# ---- phase 1: layer-local ---------------------------------------------------------------------------------------

@torch.no_grad()
def _cache_ffn_io(teacher, adapter, seqs: torch.Tensor, batch: int, device: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's FFN inputs and outputs on `seqs` (rows = tokens), kept in bf16 on the CPU."""
    layers = adapter.layers(teacher)
    xs: list[list[torch.Tensor]] = [[] for _ in layers]
    ys: list[list[torch.Tensor]] = [[] for _ in layers]

    def hook(i):
        def record(_module, inputs, output):
            xs[i].append(inputs[0].flatten(0, -2).to("cpu", torch.bfloat16))
            ys[i].append(output.flatten(0, -2).to("cpu", torch.bfloat16))
        return record

    handles = [layer.mlp.register_forward_hook(hook(i)) for i, layer in enumerate(layers)]
    try:
        for start in tqdm(range(0, len(seqs), batch), desc="caching FFN inputs", unit="batch", leave=False):
            teacher(input_ids=seqs[start:start + batch].to(device))
    finally:
        for h in handles:
            h.remove()
    return [(torch.cat(x), torch.cat(y)) for x, y in zip(xs, ys)]


def _mlp_forward(mlp, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    a = F.relu(mlp.gate_proj(x))
    return mlp.down_proj(a * mlp.up_proj(x)), a


def local_step(mlp, optimizer, x, y, y_power: float, lam: float, scale: float, autocast) -> tuple[float, float]:
    """One optimiser step of a layer's FFN against the original's outputs; (normalised error, sparsity)."""
    with autocast():
        out, a = _mlp_forward(mlp, x)
        err = F.mse_loss(out.float(), y.float()) / y_power
        loss = err + lam * a.float().mean() / scale
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return float(err.detach()), float((a == 0).float().mean())


@torch.no_grad()
def _layer_baseline(teacher, adapter, i: int, x: torch.Tensor, device: str) -> tuple[float, float]:
    """(scale, sparsity) of layer i before training: the original's mean |silu(gate)|, which makes the L1 terms of
    all layers comparable, and the share of gates <= 0, the sparsity a plain swap to ReLU gives."""
    gate = adapter.layers(teacher)[i].mlp.gate_proj(x.to(device).float())
    return float(F.silu(gate).abs().mean()) or 1.0, float((gate <= 0).float().mean())


def _ffn_rows(mlp, x_all: torch.Tensor, device: str, chunk: int = 4096):
    """(row slice, h = relu(gate x) * up x) over the cached rows, a chunk at a time."""
    for start in range(0, len(x_all), chunk):
        x = x_all[start:start + chunk].to(device).float()
        yield slice(start, start + chunk), F.relu(mlp.gate_proj(x)) * mlp.up_proj(x)


@torch.no_grad()
def refit_down(mlp, x_all: torch.Tensor, y_all: torch.Tensor, y_power: float, device: str,
               ridge: float = 1e-6) -> tuple[float, float]:
    """Refit the down projection by least squares on all cached rows: given the gates and ups, the FFN's output is
    linear in it, so the best down projection for them has a closed form (ridge-regularised normal equations).
    Returns the normalised error on those rows (before, after); the refit is kept only if it is lower."""
    if mlp.down_proj.bias is not None:
        return (float("nan"),) * 2
    n_ff = mlp.down_proj.in_features
    gram = torch.zeros(n_ff, n_ff, dtype=torch.float64, device=device)
    cross = torch.zeros(n_ff, mlp.down_proj.out_features, dtype=torch.float64, device=device)
    before = 0.0
    for rows, h in _ffn_rows(mlp, x_all, device):
        y = y_all[rows].to(device).float()
        before += float((mlp.down_proj(h) - y).pow(2).sum())
        gram += (h.T @ h).double()
        cross += (h.T @ y).double()
    gram.diagonal().add_(ridge * float(gram.diagonal().mean()) + 1e-12)
    weight = torch.linalg.solve(gram, cross).T.to(mlp.down_proj.weight.dtype)
    old = mlp.down_proj.weight.detach().clone()
    mlp.down_proj.weight.copy_(weight)
    after = sum(float((mlp.down_proj(h) - y_all[rows].to(device).float()).pow(2).sum())
                for rows, h in _ffn_rows(mlp, x_all, device))
    scale = y_power * y_all.numel()
    if not after < before:
        mlp.down_proj.weight.copy_(old)
        after = before
    return before / scale, after / scale


def _layer_steps(n_rows: int, batch: int, opts: SparsifyOptions) -> tuple[int, int]:
    rows = batch * opts.seq_len
    return rows, opts.local_epochs * max(1, n_rows // rows)


def _phase1(teacher, student, adapter, train: torch.Tensor, state: TrainState, resumed: dict | None,
            opts: SparsifyOptions, batch: int, device: str, autocast, checkpointer: Checkpointer) -> None:
    """`batch`: sequences a step (of all processes: this phase runs in the main one alone)."""
    if opts.local_epochs == 0 or opts.local_tokens == 0:
        state.phase = 2
        return
    local = train[:max(1, opts.local_tokens // opts.seq_len)]
    io = _cache_ffn_io(teacher, adapter, local, batch, device)
    rows, steps = _layer_steps(len(io[0][0]), batch, opts)
    n_layer = len(io)
    bar = tqdm(total=n_layer * steps, initial=state.layer * steps + state.step, desc="layer-local", unit="step")
    layers = adapter.layers(student)
    for i in range(state.layer, n_layer):
        mlp = layers[i].mlp
        params = list(mlp.parameters())
        optimizer = torch.optim.Adam(params, lr=opts.local_lr)
        if resumed is not None and resumed["optimizer"]:
            optimizer.load_state_dict(resumed["optimizer"])
        resumed = None
        x_all, y_all = io[i]
        y_power = float(y_all.float().pow(2).mean()) or 1.0
        if state.step == 0:
            state.scales[i], state.start_sparsity[i] = _layer_baseline(teacher, adapter, i, x_all[:rows], device)
        start_sparsity = state.start_sparsity[i]
        ramp = max(1, int(RAMP_SHARE * steps))
        per_epoch = max(1, len(x_all) // rows)
        while state.layer == i:
            epoch, k = divmod(state.step, per_epoch)
            order = torch.randperm(len(x_all), generator=_generator(opts.seed, 1, i, epoch))
            idx = order[k * rows:(k + 1) * rows]
            x, y = x_all[idx].to(device).float(), y_all[idx].to(device).float()
            err, sparsity = local_step(mlp, optimizer, x, y, y_power, state.lam[i], state.scales[i], autocast)
            wanted = start_sparsity + (opts.target_sparsity - start_sparsity) * min(1.0, (state.step + 1) / ramp)
            state.lam[i] = _steer(state.lam[i], sparsity, wanted)
            state.step += 1
            bar.update(1)
            bar.set_postfix(layer=i, err=f"{err:.4f}", sparsity=f"{sparsity:.3f}", lam=f"{state.lam[i]:.3g}")
            if state.step == steps:
                trained, refit = refit_down(mlp, x_all, y_all, y_power, device)
                state.history.append({"phase": 1, "layer": i, "relu_sparsity_before": start_sparsity,
                                      "error_trained": trained, "error": refit, "sparsity": sparsity,
                                      "lambda": state.lam[i]})
                state.layer, state.step = i + 1, 0
            checkpointer.after_step(state, student, optimizer if state.step else None, None)
    bar.close()
    state.phase, state.layer, state.step = 2, 0, 0


# ---- phase 2: end-to-end ------------------------------------------------------------------------------------------

def _lr_lambda(total: int):
    warm = max(1, total // 20)

    def factor(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warm) / max(1, total - warm))))
    return factor


def e2e_step(student, teacher, tap: ActivationTap, optimizer, scheduler, ids, lam: list[float], autocast) -> tuple[float, torch.Tensor]:
    """One optimiser step: KL(teacher || student) per token plus each layer's weighted L1; (KL, sparsities)."""
    with torch.no_grad(), autocast():
        target = F.log_softmax(teacher(input_ids=ids).logits.float(), dim=-1)
    with autocast():
        logp = F.log_softmax(student(input_ids=ids).logits.float(), dim=-1)
        kl = F.kl_div(logp.flatten(0, 1), target.flatten(0, 1), log_target=True, reduction="batchmean")
        l1 = sum(w * t for w, t in zip(lam, tap.l1)) / len(lam)
        loss = kl + l1
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    scheduler.step()
    return float(kl.detach()), tap.zeros.clone()


def _recompute_activations(model, on: bool) -> None:
    """Gradient checkpointing on or off, under the name of the installed transformers (5.x renamed it)."""
    name = "activation_checkpointing" if hasattr(model, "activation_checkpointing_enable") else "gradient_checkpointing"
    getattr(model, f"{name}_{'enable' if on else 'disable'}")()


def _phase2(teacher, student, adapter, train: torch.Tensor, state: TrainState, resumed: dict | None,
            opts: SparsifyOptions, procs: data_parallel.Processes, autocast, checkpointer: Checkpointer) -> None:
    """Each process takes its --batch of a step's sequences; the sparsities that steer the L1 weights are
    averaged over them, so that every process keeps the same weights, and so is a stop that one of them asks
    for: the results are those of one process with --batch times as many sequences a step."""
    step_rows = opts.batch * procs.count
    steps = opts.tokens // (step_rows * opts.seq_len)
    if steps == 0:
        state.phase = 3
        return
    student.model.embed_tokens.weight.requires_grad_(False)  # tied to the output head in many models: kept as is
    params = [p for p in student.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=opts.lr, weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _lr_lambda(steps))
    if resumed is not None and resumed["optimizer"]:
        optimizer.load_state_dict(resumed["optimizer"])
        scheduler.load_state_dict(resumed["scheduler"])
    if opts.grad_checkpointing:
        _recompute_activations(student, True)
    student.train()
    trained = procs.wrap(student)
    tap = ActivationTap(adapter, student, torch.tensor(state.scales))
    per_epoch = max(1, len(train) // step_rows)
    bar = tqdm(total=steps, initial=state.step, desc="end-to-end", unit="step", disable=not procs.is_main)
    started, done_here = time.monotonic(), 0
    try:
        while state.step < steps:
            epoch, k = divmod(state.step, per_epoch)
            order = torch.randperm(len(train), generator=_generator(opts.seed, 2, epoch))
            first = k * step_rows + procs.index * opts.batch
            ids = train[order[first:first + opts.batch]].to(procs.device)
            kl, sparsity = e2e_step(trained, teacher, tap, optimizer, scheduler, ids, state.lam, autocast)
            asked = torch.tensor([kl, float(checkpointer.interrupts.requested)], dtype=sparsity.dtype)
            measured = procs.mean(torch.cat([sparsity, asked]))
            sparsity, kl = measured[:-2], float(measured[-2])
            stop = bool(measured[-1] > 0)   # one process was asked to: all stop after this step
            state.lam = [_steer(lam, float(s), opts.target_sparsity) for lam, s in zip(state.lam, sparsity)]
            state.step += 1
            state.tokens_seen += ids.numel() * procs.count
            done_here += ids.numel() * procs.count
            bar.update(1)
            rate = done_here / max(1e-9, time.monotonic() - started)
            bar.set_postfix(kl=f"{kl:.4f}", sparsity=f"{float(sparsity.mean()):.3f}", tok_s=f"{rate:.0f}")
            if state.step % max(1, steps // 50) == 0 or state.step == steps:
                state.history.append({"phase": 2, "step": state.step, "tokens": state.tokens_seen, "kl": kl,
                                      "sparsity": float(sparsity.mean())})
            if state.step == steps:
                state.phase = 3
            checkpointer.after_step(state, student, optimizer, scheduler, stop)
    finally:
        tap.remove()
        bar.close()
        if opts.grad_checkpointing:
            _recompute_activations(student, False)


# ---- the run -------------------------------------------------------------------------------------------------------

def _identity(opts: SparsifyOptions, source, config, processes: int) -> dict:
    # what a resumed run may change: where and how it computes, and the shift that follows the training; not
    # the number of processes, which splits every step's sequences
    keep = {k: v for k, v in asdict(opts).items() if k not in ("out", "force", "resume", "checkpoint_minutes",
                                                               "device", "dtype", "grad_checkpointing",
                                                               "shift_budget")}
    keep["calib"] = [str(Path(p).resolve()) for p in opts.calib]
    keep["model"] = "smollm2" if opts.model == "smollm2" else str(source.path)
    keep["config_hash"] = models.config_hash(config)
    keep["processes"] = processes
    return keep


def _write_rope_theta(config_path: Path, config) -> None:
    """PowerInfer's converters read config.json's top-level `rope_theta`, which transformers 5 writes under
    `rope_parameters` only: its convert.py then writes no RoPE base (its engine runs 10000 whatever the model's)
    and its convert-hf-to-powerinfer-gguf.py stops on a KeyError. Written at the top level as well
    (transformers reads `rope_parameters` first)."""
    data = json.loads(config_path.read_text())
    if "rope_theta" not in data:
        data["rope_theta"] = rope_theta(config)
        config_path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def _write_model(student, tokenizer, report: dict, out: Path, force: bool) -> None:
    check_output_dir(out, force)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.writing"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        t = report["threshold_shift"]["threshold"]
        student.config.hidden_act = "fatrelu" if t > 0 else "relu"
        if t > 0:
            student.config.hidden_act_param = t
        student.save_pretrained(tmp, safe_serialization=True)
        _write_rope_theta(tmp / "config.json", student.config)
        tokenizer.save_pretrained(tmp)
        (tmp / REPORT_NAME).write_text(json.dumps(report, indent=2))
        publish_dir(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _with_own_text(teacher, tokenizer, split: tuple[torch.Tensor, torch.Tensor] | None, opts: SparsifyOptions,
                   step_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(training rows, held-out rows) with the text the model writes itself: all of it without files (split
    None), else --self-tokens of it added to the files' training rows."""
    if split is None:
        torch.manual_seed(opts.seed)
        return _split_data(_self_generated(teacher, tokenizer, opts), opts, step_rows)
    # text of another kind than the files, in the training rows only: the held-out rows stay the files' tail
    print(f"pi-tools sparsify: generating {opts.self_tokens} tokens of training text with the model itself")
    torch.manual_seed(opts.seed)
    own = calibration.self_generated(teacher, tokenizer, opts.seq_len, opts.self_tokens, opts.seed)
    return torch.cat([split[0], own]), split[1]


def _main_process_state(procs: data_parallel.Processes, state: TrainState, interrupts: Interrupts) -> TrainState:
    """The main process's state after its layer-local phase, on every process. If it stopped there instead (a
    launcher stops all its processes at once), the others' wait ends in a broken connection: the same stop."""
    try:
        return procs.share(state)
    except RuntimeError:
        if interrupts.requested:
            raise KeyboardInterrupt from None
        raise


def run_sparsify(opts: SparsifyOptions) -> dict | None:
    """Sparsify opts.model into opts.out (a Hugging Face directory); returns what sparsify.json holds. Under
    `accelerate launch` (data_parallel.py) the main process returns it, the others None once they have trained."""
    _check_options(opts)
    check_output_dir(opts.out, opts.force)
    _check_writable(opts.out)
    for p in opts.calib:
        calibration.read_text(p)  # a missing or binary file is refused before the slow load
    source = models.resolve(opts.model)
    config = models.load_config(source)
    _check_source(arch_mod.for_config(config), opts.model)
    context = getattr(config, "max_position_embeddings", None)
    if context and opts.seq_len > context:
        raise UserError(f"--seq-len {opts.seq_len} is larger than the model's context length {context}")
    device, compute_dtype = _device_and_dtype(opts)
    procs = data_parallel.Processes(device)
    device, step_rows = procs.device, opts.batch * procs.count
    identity = _identity(opts, source, config, procs.count)
    work = partial_dir(opts.out)
    resumed = _load_checkpoint(work, identity) if opts.resume else None
    tokenizer = models.load_tokenizer(source)
    seqs = _calibration_text(tokenizer, opts)   # a text too short is refused before the slow load
    split = _split_data(seqs, opts, step_rows) if seqs is not None else None
    teacher, adapter = models.load_model(source, device=device)
    for p in teacher.parameters():
        p.requires_grad_(False)
    if split is None or opts.self_tokens:   # sampled once, by the main process
        split = procs.share(_with_own_text(teacher, tokenizer, split, opts, step_rows) if procs.is_main else None)
    train, held_out = split

    student = _relu_student(teacher, adapter)
    n_layer = adapter.dims().n_layer
    if resumed is not None:
        student.load_state_dict(resumed["student"])
        state = resumed["state"]
        if procs.is_main:
            print(f"pi-tools sparsify: resuming {opts.out} (phase {state.phase}, layer {state.layer}, "
                  f"step {state.step})")
    else:
        if procs.is_main:
            shutil.rmtree(work, ignore_errors=True)
            work.mkdir(parents=True)
        state = TrainState(lam=[1e-2] * n_layer, scales=[1.0] * n_layer, start_sparsity=[0.0] * n_layer)
    autocast = (functools.partial(torch.autocast, torch.device(device).type, dtype=compute_dtype)
                if compute_dtype != torch.float32 else contextlib.nullcontext)

    with Interrupts(quiet=not procs.is_main) as interrupts:
        checkpointer = Checkpointer(work, identity, opts.checkpoint_minutes, interrupts, state, procs.is_main)
        if state.phase == 1:
            if procs.is_main:   # the others wait; phase 2 then starts them from the main process's weights
                _phase1(teacher, student, adapter, train, state, resumed, opts, step_rows, device, autocast,
                        checkpointer)
                checkpointer.save(state, student, None, None)
            state = _main_process_state(procs, state, interrupts)
            resumed = None
        if state.phase == 2:
            _phase2(teacher, student, adapter, train, state, resumed, opts, procs, autocast, checkpointer)
        checkpointer.clock(state)
    if not procs.is_main:
        return None

    print(f"pi-tools sparsify: shifting the activation threshold (perplexity budget {opts.shift_budget:.1%})",
          flush=True)
    # calibrated on training rows: the held-out ones measure the result
    shift = threshold_shift.calibrate(student, adapter, train[:len(held_out)], opts.shift_budget, opts.batch)
    print("pi-tools sparsify: measuring the result on the held-out text", flush=True)
    before = evaluate.perplexity(teacher, adapter, held_out, batch=opts.batch)
    after, sparsity = evaluate.perplexity_and_sparsity(student, adapter, held_out, opts.batch)
    report = {
        "format": FORMAT,
        "source": identity["model"],
        "target_sparsity": opts.target_sparsity,
        "sparsity": sum(sparsity) / n_layer,
        "layer_sparsity": sparsity,
        "held_out": {"sequences": len(held_out), "tokens": int(held_out.numel()),
                     "perplexity_original": before, "perplexity_sparsified": after,
                     "perplexity_ratio": after / before},
        "threshold_shift": {"threshold": shift.threshold, "budget": opts.shift_budget,
                            "calibration_rows": min(len(train), len(held_out)),
                            "perplexity_relu": shift.perplexity_relu, "perplexity_shifted": shift.perplexity_shifted,
                            "sparsity_relu": shift.sparsity_relu, "sparsity_shifted": shift.sparsity_shifted,
                            "tried": [{"threshold": t, "perplexity": p, "sparsity": z} for t, p, z in shift.tried]},
        "tokens_seen": {"layer_local": min(len(train), opts.local_tokens // opts.seq_len) * opts.seq_len
                        * opts.local_epochs, "end_to_end": state.tokens_seen},
        "train_seconds": state.elapsed,
        "options": {k: v for k, v in identity.items() if k != "config_hash"},
        "device": torch.device(device).type, "compute_dtype": str(compute_dtype).removeprefix("torch."),
        "history": state.history,
    }
    _write_model(student, tokenizer, report, opts.out, opts.force)
    shutil.rmtree(work, ignore_errors=True)
    return report
