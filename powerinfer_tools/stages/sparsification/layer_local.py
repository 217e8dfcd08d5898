"""Sparsify's first phase, layer-local: each FFN, on its own, learns to reproduce the original FFN's output on
the original FFN's inputs (cached once for all layers) under its L1 penalty, whose target rises from the plain
swap's sparsity (to ReLU or dReLU: student.py) to the goal; then its down projection is refit by least squares."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from powerinfer_tools.core.progress import progress_bar
from powerinfer_tools.stages.options import SparsifyOptions
from powerinfer_tools.stages.sparsification import schedule
from powerinfer_tools.stages.sparsification.state import Checkpointer, TrainState
from powerinfer_tools.stages.sparsification.student import StudentForm

RAMP_SHARE = 0.6      # share of a layer's steps over which its sparsity target rises to the goal


@torch.no_grad()
def cache_ffn_io(teacher, adapter, seqs: torch.Tensor, batch: int, device: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
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
        for start in progress_bar(range(0, len(seqs), batch), desc="caching FFN inputs", unit="batch", leave=False):
            teacher(input_ids=seqs[start:start + batch].to(device))
    finally:
        for h in handles:
            h.remove()
    return [(torch.cat(x), torch.cat(y)) for x, y in zip(xs, ys)]


def local_step(form: StudentForm, mlp, optimizer, x, y, y_power: float, lam: float, scale: float,
               autocast) -> tuple[float, float]:
    """One optimiser step of a layer's FFN against the original's outputs; (normalised error, sparsity)."""
    with autocast():
        a, h = form.ffn(mlp, x)
        err = F.mse_loss(mlp.down_proj(h).float(), y.float()) / y_power
        loss = err + lam * a.float().mean() / scale
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return float(err.detach()), float((a == 0).float().mean())


def _ffn_rows(form: StudentForm, mlp, x_all: torch.Tensor, device: str, chunk: int = 4096):
    """(row slice, h: the down projection's input) over the cached rows, a chunk at a time."""
    for start in range(0, len(x_all), chunk):
        x = x_all[start:start + chunk].to(device).float()
        yield slice(start, start + chunk), form.ffn(mlp, x)[1]


@torch.no_grad()
def refit_down(form: StudentForm, mlp, x_all: torch.Tensor, y_all: torch.Tensor, y_power: float, device: str,
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
    for rows, h in _ffn_rows(form, mlp, x_all, device):
        y = y_all[rows].to(device).float()
        before += float((mlp.down_proj(h) - y).pow(2).sum())
        gram += (h.T @ h).double()
        cross += (h.T @ y).double()
    gram.diagonal().add_(ridge * float(gram.diagonal().mean()) + 1e-12)
    weight = torch.linalg.solve(gram, cross).T.to(mlp.down_proj.weight.dtype)
    old = mlp.down_proj.weight.detach().clone()
    mlp.down_proj.weight.copy_(weight)
    after = sum(float((mlp.down_proj(h) - y_all[rows].to(device).float()).pow(2).sum())
                for rows, h in _ffn_rows(form, mlp, x_all, device))
    scale = y_power * y_all.numel()
    if not after < before:
        mlp.down_proj.weight.copy_(old)
        after = before
    return before / scale, after / scale


def _layer_steps(n_rows: int, batch: int, opts: SparsifyOptions) -> tuple[int, int]:
    rows = batch * opts.seq_len
    return rows, opts.local_epochs * max(1, n_rows // rows)


def train(teacher, student, adapter, form: StudentForm, sequences: torch.Tensor, state: TrainState,
          resumed: dict | None, opts: SparsifyOptions, batch: int, device: str, autocast,
          checkpointer: Checkpointer) -> None:
    """`batch`: sequences a step (of all processes: this phase runs in the main one alone); `adapter`: the
    teacher's (the student's layers are its copies)."""
    if opts.local_epochs == 0 or opts.local_tokens == 0:
        state.phase = 2
        return
    local = sequences[:max(1, opts.local_tokens // opts.seq_len)]
    io = cache_ffn_io(teacher, adapter, local, batch, device)
    rows, steps = _layer_steps(len(io[0][0]), batch, opts)
    n_layer = len(io)
    bar = progress_bar(total=n_layer * steps, initial=state.layer * steps + state.step, desc="layer-local", unit="step")
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
            original = adapter.layers(teacher)[i].mlp
            state.scales[i], state.start_sparsity[i] = form.baseline(original, x_all[:rows].to(device).float())
        start_sparsity = state.start_sparsity[i]
        ramp = max(1, int(RAMP_SHARE * steps))
        per_epoch = max(1, len(x_all) // rows)
        while state.layer == i:
            epoch, k = divmod(state.step, per_epoch)
            order = torch.randperm(len(x_all), generator=schedule.generator(opts.seed, 1, i, epoch))
            idx = order[k * rows:(k + 1) * rows]
            x, y = x_all[idx].to(device).float(), y_all[idx].to(device).float()
            err, sparsity = local_step(form, mlp, optimizer, x, y, y_power, state.lam[i], state.scales[i], autocast)
            wanted = start_sparsity + (opts.target_sparsity - start_sparsity) * min(1.0, (state.step + 1) / ramp)
            state.lam[i] = schedule.steer(state.lam[i], sparsity, wanted)
            state.step += 1
            bar.update(1)
            bar.set_postfix(layer=i, err=f"{err:.4f}", sparsity=f"{sparsity:.3f}", lam=f"{state.lam[i]:.3g}")
            if state.step == steps:
                trained, refit = refit_down(form, mlp, x_all, y_all, y_power, device)
                checkpointer.clock(state)
                state.history.append({"phase": 1, "layer": i, "relu_sparsity_before": start_sparsity,
                                      "error_trained": trained, "error": refit, "sparsity": sparsity,
                                      "lambda": state.lam[i], "seconds": state.elapsed})
                state.layer, state.step = i + 1, 0
            checkpointer.after_step(state, student, optimizer if state.step else None, None)
    bar.close()
    state.phase, state.layer, state.step = 2, 0, 0
