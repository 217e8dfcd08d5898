"""Sparsify's second phase, end-to-end: the whole student's next-token distribution is pulled to the
teacher's (KL), which also repairs what the layer-local phase cannot see (errors that compound across layers),
while each layer's L1 weight holds its sparsity at the target. Data-parallel under accelerate launch."""
from __future__ import annotations

import math
import time

import torch
import torch.nn.functional as F

from powerinfer_tools.core.progress import progress_bar
from powerinfer_tools.models import arch as arch_mod
from powerinfer_tools.stages.sparsification import data_parallel
from powerinfer_tools.stages.options import SparsifyOptions
from powerinfer_tools.stages.sparsification import schedule
from powerinfer_tools.stages.sparsification.state import Checkpointer, TrainState


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


def train(teacher, student, adapter, sequences: torch.Tensor, state: TrainState, resumed: dict | None,
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
    per_epoch = max(1, len(sequences) // step_rows)
    bar = progress_bar(total=steps, initial=state.step, desc="end-to-end", unit="step", disable=not procs.is_main)
    started, done_here = time.monotonic(), 0
    try:
        while state.step < steps:
            epoch, k = divmod(state.step, per_epoch)
            order = torch.randperm(len(sequences), generator=schedule.generator(opts.seed, 2, epoch))
            first = k * step_rows + procs.index * opts.batch
            ids = sequences[order[first:first + opts.batch]].to(procs.device)
            kl, sparsity = e2e_step(trained, teacher, tap, optimizer, scheduler, ids, state.lam, autocast)
            asked = torch.tensor([kl, float(checkpointer.interrupts.requested)], dtype=sparsity.dtype)
            measured = procs.mean(torch.cat([sparsity, asked]))
            sparsity, kl = measured[:-2], float(measured[-2])
            stop = bool(measured[-1] > 0)   # one process was asked to: all stop after this step
            state.lam = [schedule.steer(lam, float(s), opts.target_sparsity) for lam, s in zip(state.lam, sparsity)]
            state.step += 1
            state.tokens_seen += ids.numel() * procs.count
            done_here += ids.numel() * procs.count
            bar.update(1)
            rate = done_here / max(1e-9, time.monotonic() - started)
            bar.set_postfix(kl=f"{kl:.4f}", sparsity=f"{float(sparsity.mean()):.3f}", tok_s=f"{rate:.0f}")
            if state.step % max(1, steps // 50) == 0 or state.step == steps:
                checkpointer.clock(state)
                state.history.append({"phase": 2, "step": state.step, "tokens": state.tokens_seen, "kl": kl,
                                      "sparsity": float(sparsity.mean()), "seconds": state.elapsed})
            if state.step == steps:
                state.phase = 3
            checkpointer.after_step(state, student, optimizer, scheduler, stop)
    finally:
        tap.remove()
        bar.close()
        if opts.grad_checkpointing:
            _recompute_activations(student, False)
