"""Input sparsity (TEAL, arXiv 2408.14690): the inputs of every linear layer whose magnitude is at or below a
threshold are zeroed, so a decode step may skip the weight rows (of the transposed matrix) they multiply.
Training-free: one threshold per layer and *site*, the input a layer's matrices share (names.INPUT_SITES: q/k/v,
the attention output projection, gate/up, down), placed on the dense model's |x| over calibration tokens.

Two allocations of a model-wide share s (the share of every layer's weight bytes a decode step may skip):
  * uniform: every site of every layer zeroes a share s of its inputs;
  * greedy (TEAL's block-wise greedy search; worse than uniform on SmolLM2, docs/profile.md): per layer,
    starting from nothing, the share of one site at a time
    grows by a step of GREEDY_STEP of the layer's weights, the site whose step moves the layer's output least
    (squared error against the dense layer on the same inputs) taking it, until the layer's weighted share reaches
    each level. Every layer reaches the same level, so the model-wide share of bytes is the level.

The thresholds of every level in LEVELS are kept (`InputThresholds`, input_sparsity.json in the profile), so the
engine takes any share up to the last level at run time (interpolating between levels). Measured on SmolLM2:
docs/profile.md, "Input sparsity".
"""
from __future__ import annotations

import json
import math
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from powerinfer_tools.core.progress import progress_bar
from powerinfer_tools.core.atomic import atomic_file
from powerinfer_tools.core.errors import UserError
from powerinfer_tools.formats import names

FORMAT = "powerinfer-tools.input-sparsity/1"
FILE = "input_sparsity.json"
LEVELS = tuple(round(0.05 * k, 2) for k in range(1, 11))   # model-wide shares calibrated: 0.05 .. 0.50
ALLOCATIONS = ("uniform", "greedy")
DEFAULT_ALLOCATION = "uniform"   # it won on SmolLM2 (docs/profile.md, "Input sparsity")
SAMPLE_VALUES = 1 << 18     # |x| values kept per (layer, site) to place its thresholds
CALIBRATION_TOKENS = 8192   # tokens whose |x| place the thresholds
GREEDY_TOKENS = 512         # tokens whose layer outputs the greedy search compares
GREEDY_STEP = 0.025         # the share of a layer's weights one greedy step adds to one site
MAX_SITE_SHARE = 0.95       # no site zeroes more of its inputs than this


FLOAT32_MAX = 3.4028234663852886e38   # the largest threshold a converted file (float32) holds


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


@dataclass
class InputThresholds:
    """Per level, layer and site: the share of the site's calibration inputs zeroed and the |x| threshold that
    zeroes it (inputs with |x| <= threshold are zeroed)."""
    allocation: str
    levels: list[float]
    shares: list[list[list[float]]]       # [level][layer][site]
    thresholds: list[list[list[float]]]   # [level][layer][site]
    calibration_tokens: int
    format: str = FORMAT

    def save(self, directory: Path) -> None:
        with atomic_file(Path(directory) / FILE) as tmp:
            Path(tmp).write_text(json.dumps(asdict(self)))

    @classmethod
    def load(cls, directory: str | Path, n_layer: int) -> InputThresholds | None:
        """The profile's input thresholds, checked against the model; None when the profile has none."""
        from powerinfer_tools.stages.profiling.profile_files import check_recorded

        path = Path(directory) / FILE
        if not path.is_file():
            return None
        check_recorded(Path(directory), FILE)
        try:
            raw = json.loads(path.read_text())
            value = cls(**raw)
        except (json.JSONDecodeError, UnicodeDecodeError, TypeError) as exc:
            raise UserError(f"{path} is not an input-sparsity file ({exc})") from None
        if value.format != FORMAT or value.allocation not in ALLOCATIONS:
            raise UserError(f"{path}: unknown format {value.format!r} or allocation {value.allocation!r}")
        n_sites = len(names.INPUT_SITES)
        levels = value.levels
        if not isinstance(levels, list) or not levels or not all(_is_number(b) and 0 < b <= 1 for b in levels) \
                or sorted(set(levels)) != list(levels):
            raise UserError(f"{path}: 'levels' must be increasing shares in (0, 1]")
        if not _is_number(value.calibration_tokens) or value.calibration_tokens < 0:
            raise UserError(f"{path}: 'calibration_tokens' must be a count")
        for what in ("shares", "thresholds"):
            table = getattr(value, what)
            shape_ok = isinstance(table, list) and len(table) == len(levels) and all(
                isinstance(per_level, list) and len(per_level) == n_layer
                and all(isinstance(row, list) and len(row) == n_sites for row in per_level) for per_level in table)
            if not shape_ok:
                raise UserError(f"{path}: '{what}' must be {len(levels)} levels x {n_layer} layers x {n_sites} sites")
            # the file stores them as float32: a larger value would not fit
            if not all(_is_number(v) and 0 <= v <= FLOAT32_MAX for per_level in table for row in per_level for v in row):
                raise UserError(f"{path}: '{what}' holds a value that is not a finite non-negative float32 number")
        return value

    def flat_thresholds(self) -> list[float]:
        """The file's powerinfer.input_thresholds: [level][layer][site] in that order."""
        return [float(v) for per_level in self.thresholds for row in per_level for v in row]

    def at(self, share: float) -> list[list[float]]:
        """Thresholds [layer][site] for a model-wide share: a level's, or interpolated linearly between the two
        levels around it (from 0 below the first); the engine takes the same (csrc/engine/input_sparsity.cpp)."""
        return [list(row) for row in interpolate(self.levels, self.thresholds, share)]


def interpolate(levels: list[float], table: list[list[list[float]]], share: float) -> list[list[float]]:
    if not 0.0 <= share <= levels[-1]:
        raise UserError(f"input sparsity must be in [0, {levels[-1]:g}] (the shares calibrated), got {share:g}")
    n_layer, n_sites = len(table[0]), len(table[0][0])
    hi = next(k for k, b in enumerate(levels) if share <= b)
    lo_share = levels[hi - 1] if hi > 0 else 0.0
    w = (share - lo_share) / (levels[hi] - lo_share)
    return [[(1 - w) * (table[hi - 1][i][j] if hi > 0 else 0.0) + w * table[hi][i][j] for j in range(n_sites)]
            for i in range(n_layer)]


# ---- sampling the dense model's inputs ---------------------------------------------------------------------------

def site_modules(adapter, model) -> list[dict[str, list[torch.nn.Module]]]:
    return [adapter.input_modules(layer) for layer in adapter.layers(model)]


def site_weights(sites: list[dict[str, list[torch.nn.Module]]]) -> list[list[int]]:
    """Per layer and site, the weights its inputs multiply (what zeroing a share of them lets a step skip)."""
    return [[sum(m.weight.numel() for m in layer[s]) for s in names.INPUT_SITES] for layer in sites]


class _Sampler:
    """|x| values sampled per (layer, site) from every batch, each draw from its own seeded generator."""

    def __init__(self, n_layer: int, n_batches: int, seed: int):
        self.per_batch = max(1, SAMPLE_VALUES // max(1, n_batches))
        self.seed, self.batch = seed, 0
        self.kept = [[[] for _ in names.INPUT_SITES] for _ in range(n_layer)]

    def add(self, i: int, j: int, x: torch.Tensor) -> None:
        flat = x.detach().reshape(-1).abs().float().cpu()
        gen = torch.Generator().manual_seed((self.seed * 1_000_003 + (i * 16 + j) * 10_007 + self.batch) % 2**63)
        pick = torch.randint(0, flat.numel(), (min(self.per_batch, flat.numel()),), generator=gen)
        self.kept[i][j].append(flat[pick])

    def sorted_values(self) -> list[list[torch.Tensor]]:
        return [[torch.sort(torch.cat(v)).values for v in layer] for layer in self.kept]


def threshold_at(values: torch.Tensor, share: float) -> float:
    """The |x| at or below which a share `share` of the sorted sample `values` lies (0 for no share): midway
    between the last value zeroed and the next, so that no input seen in calibration lies on it (a layer's first
    inputs are a function of the token alone, and an engine's rounding would decide on which side they fall)."""
    if share <= 0:
        return 0.0
    k = min(len(values) - 1, max(0, int(round(share * len(values))) - 1))
    return float((values[k] + values[min(k + 1, len(values) - 1)]) / 2)


@torch.no_grad()
def sample_inputs(model, adapter, seqs: torch.Tensor, batch: int, seed: int) -> list[list[torch.Tensor]]:
    """Sorted |x| samples per (layer, site) of the dense model over `seqs`."""
    sites = site_modules(adapter, model)
    n_batches = math.ceil(len(seqs) / batch)
    sampler = _Sampler(len(sites), n_batches, seed)
    handles = []
    for i, layer in enumerate(sites):
        for j, s in enumerate(names.INPUT_SITES):
            def hook(module, args, i=i, j=j):
                sampler.add(i, j, args[0])
            handles.append(layer[s][0].register_forward_pre_hook(hook))
    device = next(model.parameters()).device
    try:
        for sampler.batch, start in enumerate(progress_bar(range(0, len(seqs), batch), desc="input thresholds",
                                                    unit="batch", leave=False)):
            model(input_ids=seqs[start:start + batch].to(device), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return sampler.sorted_values()


@contextmanager
def zeroed_inputs(adapter, model, thresholds: list[list[float]]):
    """The model with every site's inputs at or below its threshold [layer][site] zeroed (what the engine
    computes with input sparsity)."""
    handles = []
    for i, layer in enumerate(site_modules(adapter, model)):
        for j, s in enumerate(names.INPUT_SITES):
            for module in layer[s]:
                def hook(module, args, t=thresholds[i][j]):
                    x = args[0]
                    return (x * (x.abs() > t),) + tuple(args[1:])
                handles.append(module.register_forward_pre_hook(hook))
    try:
        yield model
    finally:
        for h in handles:
            h.remove()


# ---- allocations ---------------------------------------------------------------------------------------------------

def uniform_shares(n_layer: int, levels: tuple[float, ...] = LEVELS) -> list[list[list[float]]]:
    return [[[b] * len(names.INPUT_SITES) for _ in range(n_layer)] for b in levels]


def _layer_output(layer, args, kwargs) -> torch.Tensor:
    out = layer(*args, **kwargs)
    return out[0] if isinstance(out, tuple) else out


@torch.no_grad()
def greedy_shares(model, adapter, seqs: torch.Tensor, values: list[list[torch.Tensor]], batch: int,
                  levels: tuple[float, ...] = LEVELS) -> list[list[list[float]]]:
    """TEAL's block-wise greedy allocation (module docstring), on the dense model's inputs to each layer."""
    layers = adapter.layers(model)
    sites = site_modules(adapter, model)
    weights = site_weights(sites)
    captured: list[list[tuple]] = [[] for _ in layers]

    def capture(module, args, kwargs, i):
        captured[i].append((tuple(a.detach().clone() if torch.is_tensor(a) else a for a in args), dict(kwargs)))

    handles = [layer.register_forward_pre_hook(lambda m, a, k, i=i: capture(m, a, k, i), with_kwargs=True)
               for i, layer in enumerate(layers)]
    device = next(model.parameters()).device
    try:
        for start in range(0, len(seqs), batch):
            model(input_ids=seqs[start:start + batch].to(device), use_cache=False)
    finally:
        for h in handles:
            h.remove()

    n_sites = len(names.INPUT_SITES)
    shares = [[[0.0] * n_sites for _ in layers] for _ in levels]
    steps_per_level = round(levels[0] / GREEDY_STEP)
    n_steps = steps_per_level * len(levels)
    bar = progress_bar(total=len(layers) * n_steps, desc="greedy input sparsity", unit="step", leave=False)
    for i, layer in enumerate(layers):
        dense = [_layer_output(layer, a, k) for a, k in captured[i]]
        total = float(sum(weights[i]))

        def error(share: list[float]) -> float:
            thresholds = [[0.0] * n_sites for _ in layers]
            thresholds[i] = [threshold_at(values[i][j], share[j]) for j in range(n_sites)]
            with zeroed_inputs(adapter, model, thresholds):
                return sum(float((_layer_output(layer, a, k) - d).float().pow(2).sum())
                           for (a, k), d in zip(captured[i], dense))

        current = [0.0] * n_sites
        for step in range(1, n_steps + 1):
            best = None
            for j in range(n_sites):
                grown = current[j] + GREEDY_STEP * total / weights[i][j]
                if grown > MAX_SITE_SHARE:
                    continue
                trial = current[:j] + [grown] + current[j + 1:]
                e = error(trial)
                if best is None or e < best[0]:
                    best = (e, trial)
            if best is None:
                raise UserError(f"layer {i}: no site can zero more than {MAX_SITE_SHARE:g} of its inputs, so the "
                                f"layer cannot reach a share of {levels[-1]:g}")
            current = best[1]
            bar.update(1)
            if step % steps_per_level == 0:
                shares[step // steps_per_level - 1][i] = list(current)
        captured[i] = []
    bar.close()
    return shares


def calibrate(model, adapter, seqs: torch.Tensor, allocation: str, batch: int, seed: int,
              levels: tuple[float, ...] = LEVELS) -> InputThresholds:
    """Input thresholds of every level in `levels` (multiples of the first) for `allocation`, placed on the dense
    model's inputs over the first CALIBRATION_TOKENS tokens of `seqs` (the greedy search's errors on the first
    GREEDY_TOKENS)."""
    if allocation not in ALLOCATIONS:
        raise UserError(f"--input-allocation must be one of {', '.join(ALLOCATIONS)}, got {allocation!r}")
    seq_len = seqs.shape[1]
    calib = seqs[:max(1, math.ceil(CALIBRATION_TOKENS / seq_len))]
    values = sample_inputs(model, adapter, calib, batch, seed)
    n_layer = len(values)
    if allocation == "uniform":
        shares = uniform_shares(n_layer, levels)
    else:
        shares = greedy_shares(model, adapter, seqs[:max(1, math.ceil(GREEDY_TOKENS / seq_len))], values, batch,
                               levels)
    thresholds = [[[threshold_at(values[i][j], per_level[i][j]) for j in range(len(names.INPUT_SITES))]
                   for i in range(n_layer)] for per_level in shares]
    return InputThresholds(allocation, list(levels), shares, thresholds, int(calib.numel()))
