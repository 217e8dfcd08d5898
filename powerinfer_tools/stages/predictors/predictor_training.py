"""Train, size and calibrate per-layer predictors from a profile directory, and measure them.

Data: `pi-tools profile` rows (predictor input x, active mask, calibration sequence id). Rows are
split into train / held-out by *sequence*, never by row: neighbouring tokens share context, so a
random row split would leak and flatter the held-out numbers.

Quality of a predictor is measured where it is used: its logit threshold is calibrated on held-out
rows so that the layer reaches the target recall, and the cost is the predicted density there
(the share of neurons the engine then computes). Equivalently, for early stopping and for picking
the rank, a predictor is scored by its recall at a density budget (`predictor.density_budget`, from
`max_density_ratio` and the true density): recall at a fixed threshold can be bought by predicting more,
recall at a fixed density cannot. A predictor no better than chance is reported as such (`useless_warning`).
"""
from __future__ import annotations

import json
import math
import re
import sys
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from powerinfer_tools.models import arch as arch_registry
from powerinfer_tools.core.errors import UserError
from powerinfer_tools.core.safe_load import checked_tensor, load_pt
from powerinfer_tools.stages import options as limits
from powerinfer_tools.stages.options import PredictorOptions, TrainedPredictors
from powerinfer_tools.stages.predictors.predictor import (Predictor, density_budget, layer_metrics, neuron_weights, recall_at_density,
                                        threshold_for_recall, rank_at_fraction)

MIN_RANK = 4
REPORT_FORMAT = "powerinfer-tools.predictor-report/1"


# ---- the profile directory -------------------------------------------------------------------------

@dataclass
class ProfileDir:
    """A profile directory (pi-tools profile): profile.json's contents and the path of its files."""

    path: Path
    meta: dict

    @property
    def model(self) -> dict:
        return self.meta["model"]

    @property
    def n_layer(self) -> int:
        return int(self.model["n_layer"])

    @property
    def n_embd(self) -> int:
        return int(self.model["n_embd"])

    @property
    def n_ff(self) -> int:
        return int(self.model["n_ff"])

    @property
    def digests(self) -> dict[str, str]:
        """What profile.json recorded of its files: {} for a profile made before it recorded them."""
        return self.meta.get("sha256", {})

    @property
    def thresholded(self) -> bool:
        return self.meta.get("rule") == "threshold"

    @property
    def gated(self) -> bool:
        return {a.name: a.gated for a in arch_registry.ADAPTERS}.get(self.model.get("arch"), True)

    def ffn_params(self) -> int:
        """Weights of one FFN block: gate, up, down for gated architectures, up and down otherwise."""
        return (3 if self.gated else 2) * self.n_embd * self.n_ff

    def layer_stats(self, layer: int) -> dict:
        for entry in self.meta.get("layers", []):
            if int(entry.get("layer", -1)) == layer:
                return entry
        return {}

    def neuron_weights(self, layer: int) -> np.ndarray:
        counts = self._vector("activation", layer, torch.int64)
        sums = self._vector("magnitude", layer, torch.float32)
        return neuron_weights(counts, sums)

    def _vector(self, kind: str, layer: int, dtype) -> torch.Tensor:
        path = self.path / kind / f"{kind}_{layer}.pt"
        if not path.is_file():
            raise UserError(f"profile {self.path} is missing {kind}/{path.name}")
        from powerinfer_tools.stages.profiling.profile_files import check_recorded

        check_recorded(self.path, f"{kind}/{path.name}", self.digests)
        vec = checked_tensor(load_pt(path, f"{kind} file"), str(path), f"the {kind} values", ndim=1, integers=True)
        if vec.shape != (self.n_ff,) or bool((vec < 0).any()):
            raise UserError(f"{path}: expected {self.n_ff} non-negative values (one per neuron), found {vec.numel()}"
                            f"{' with negative ones' if bool((vec < 0).any()) else ''}")
        return vec.to(dtype)


def read_profile(path: Path) -> ProfileDir:
    from powerinfer_tools.stages.profiling.profile_files import check_thresholds
    from powerinfer_tools.stages.profiling.profiling import load_profile

    meta = load_profile(path)
    source = Path(path) / "profile.json"
    model = meta.get("model")
    if not isinstance(model, dict):
        raise UserError(f"{source}: 'model' must be an object giving n_layer, n_embd and n_ff")
    bad = [k for k in ("n_layer", "n_embd", "n_ff") if not (isinstance(model.get(k), int) and model[k] > 0)]
    if bad:
        raise UserError(f"{source}: the model block lacks {', '.join(bad)} as positive integers")
    check_thresholds(meta.get("thresholds"), source, model["n_layer"])
    if not isinstance(meta.get("samples", {}), dict):
        raise UserError(f"{source}: 'samples' must be an object")
    return ProfileDir(Path(path), meta)


@dataclass
class LayerSamples:
    """One layer's rows: x float32 [rows, n_embd], active bool [rows, n_ff], seq int64 [rows]."""

    x: torch.Tensor
    active: torch.Tensor
    seq: torch.Tensor

    def subset(self, rows: torch.Tensor) -> "LayerSamples":
        return LayerSamples(self.x[rows], self.active[rows], self.seq[rows])


def load_samples(profile: ProfileDir, layer: int) -> LayerSamples:
    """Read and check every shard of one layer; gaps in the shard numbering or a row count that
    disagrees with profile.json mean missing shards and are errors, not a smaller data set, and so is a shard whose
    bytes differ from the digest profile.json recorded (damage would otherwise train a different predictor)."""
    from safetensors import SafetensorError
    from safetensors.numpy import load

    from powerinfer_tools.stages.profiling.profile_files import check_recorded

    directory = profile.path / "samples" / f"layer_{layer}"
    shards = sorted(directory.glob("shard_*.safetensors")) if directory.is_dir() else []
    if not shards:
        raise UserError(f"profile {profile.path} has no samples for layer {layer} "
                        f"(expected {directory}/shard_0000.safetensors)")
    numbers = [int(m.group(1)) if (m := re.fullmatch(r"shard_(\d+)\.safetensors", s.name)) else -1 for s in shards]
    if numbers != list(range(len(shards))):
        gap = next(k for k in range(len(shards) + 1) if k not in numbers)
        raise UserError(f"profile {profile.path}: layer {layer} is missing shard_{gap:04d}.safetensors")
    packed_width = (profile.n_ff + 7) // 8
    prefix = f"samples/layer_{layer}/"
    gone = sorted({k for k in profile.digests if k.startswith(prefix)} - {prefix + s.name for s in shards})
    if gone:
        raise UserError(f"profile {profile.path}: {gone[0]} is missing; profile again")
    xs, masks, seqs = [], [], []
    for shard in shards:
        try:
            raw = shard.read_bytes()
            check_recorded(profile.path, prefix + shard.name, profile.digests, raw)
            data = load(raw)
        except (SafetensorError, OSError) as exc:
            raise UserError(f"cannot read {shard}: {exc}") from None
        if not {"x", "mask", "seq"} <= set(data):
            raise UserError(f"{shard}: needs tensors x, mask and seq, found {sorted(data)}")
        x, mask, seq = data["x"], data["mask"], data["seq"]
        rows = x.shape[0]
        if x.ndim != 2 or x.shape[1] != profile.n_embd or mask.shape != (rows, packed_width) \
                or mask.dtype != np.uint8 or seq.shape != (rows,):
            raise UserError(f"{shard}: shapes x{x.shape} mask{mask.shape} seq{seq.shape} do not match "
                            f"n_embd={profile.n_embd}, n_ff={profile.n_ff}")
        xs.append(x)
        masks.append(mask)
        seqs.append(seq)
    x = torch.from_numpy(np.concatenate(xs).astype(np.float32))
    bits = np.unpackbits(np.concatenate(masks), axis=1, count=profile.n_ff, bitorder="little")
    samples = LayerSamples(x, torch.from_numpy(bits.astype(bool)), torch.from_numpy(np.concatenate(seqs)))
    expected = (profile.meta.get("samples") or {}).get("rows")
    if expected is not None and samples.x.shape[0] != int(expected):
        raise UserError(f"profile {profile.path}: layer {layer} has {samples.x.shape[0]} rows, profile.json "
                        f"says {expected} (missing or truncated shards)")
    if not torch.isfinite(samples.x).all():
        raise UserError(f"profile {profile.path}: layer {layer} samples contain inf/NaN inputs")
    return samples


def split_by_sequence(seq: torch.Tensor, held_out_fraction: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Row indices (train, held-out); whole calibration sequences go to one side or the other."""
    sequences = torch.unique(seq)
    if sequences.numel() < 2:
        raise UserError("the profile has rows of a single calibration sequence; a held-out split by sequence "
                        "needs at least 2 (profile more tokens or shorter sequences)")
    generator = torch.Generator().manual_seed(seed)
    order = sequences[torch.randperm(sequences.numel(), generator=generator)]
    n_held = min(sequences.numel() - 1, max(1, round(held_out_fraction * sequences.numel())))
    held = torch.isin(seq, order[:n_held])
    return torch.nonzero(~held).squeeze(1), torch.nonzero(held).squeeze(1)


def parse_layers(spec: str | None, n_layer: int) -> list[int]:
    """'0-3,7' -> [0, 1, 2, 3, 7]; None -> every layer. Out-of-range layers are errors."""
    if spec is None or spec.strip() in ("", "all"):
        return list(range(n_layer))
    layers: set[int] = set()
    for part in spec.split(","):
        m = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", part)
        if not m:
            raise UserError(f"bad --layers item {part!r}: use e.g. '0-3,7'")
        lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
        if lo > hi or hi >= n_layer:
            raise UserError(f"--layers {part.strip()} is out of range: the model has layers 0-{n_layer - 1}")
        layers.update(range(lo, hi + 1))
    return sorted(layers)


# ---- training one predictor ------------------------------------------------------------------------

@dataclass
class TrainSettings:
    target_recall: float
    max_density_ratio: float = 1.3
    epochs: int = 8
    min_gain: float = 0.005           # rank search: a 1.5x larger rank must add this much held-out recall
    batch_size: int | None = None     # None: about 40 steps per epoch, within 64..512 rows
    lr: float = 1e-2
    weight_decay: float = 1e-2
    patience: int = 2
    device: str = "cpu"
    seed: int = 0


@dataclass
class Trained:
    """One trained predictor with its held-out calibration."""

    model: Predictor | None     # None once its layer's choice is in the output directory: only the numbers stay
    rank: int
    threshold: float            # calibrated: logit > threshold reaches target recall on held-out rows
    density_at_target: float    # held-out predicted density at that threshold
    recall_at_budget: float     # held-out recall at the density budget (predictor.density_budget)
    epochs: int
    seconds: float              # training and calibration time
    history: list[float] = field(default_factory=list)


def _logits(model: Predictor, x: torch.Tensor, device: str, batch: int = 8192) -> torch.Tensor:
    with torch.no_grad():
        return torch.cat([model(x[i:i + batch].to(device)).float().cpu() for i in range(0, x.shape[0], batch)])


def auto_batch_size(rows: int) -> int:
    """Enough optimizer steps per epoch to converge in a few epochs, batches large enough to be fast."""
    return int(min(512, max(64, 2 ** round(math.log2(max(rows, 1) / 40)))))


def train_one(train: LayerSamples, held: LayerSamples, rank: int, settings: TrainSettings) -> Trained:
    """AdamW on class-weighted BCE; keep the epoch with the best held-out recall at the density budget.

    The positive weight is one number per layer, (1 - density) / density: it balances the gradient
    of the rare class like Deja Vu's weighted BCE, but, being the same for every neuron, it shifts all
    logits alike and so keeps the ranking across neurons that the single calibrated threshold uses.
    Inputs are scaled per feature for training and the scale is folded into fc1 (no bias needed).
    """
    started = time.perf_counter()
    torch.manual_seed(settings.seed)
    device = settings.device
    n_embd, n_ff = train.x.shape[1], train.active.shape[1]
    scale = train.x.std(dim=0).clamp_min(1e-6)
    x_train = (train.x / scale).to(device)
    y_train = train.active.to(device)
    x_held = held.x / scale
    density = float(train.active.float().mean())
    held_density = float(held.active.float().mean())
    pos_weight = torch.tensor((1 - density) / density if 0 < density < 1 else 1.0, device=device)
    budget = density_budget(held_density, settings.max_density_ratio)

    model = Predictor(n_embd, rank, n_ff).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=settings.lr, weight_decay=settings.weight_decay)
    batch_size = settings.batch_size or auto_batch_size(x_train.shape[0])
    steps_per_epoch = math.ceil(x_train.shape[0] / batch_size)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=settings.lr, pct_start=0.1,
                                                   total_steps=max(1, settings.epochs * steps_per_epoch))
    loss_fn = torch.nn.BCEWithLogitsLoss(pos_weight=pos_weight)
    generator = torch.Generator().manual_seed(settings.seed)
    best_score, best_state, best_epoch, history, stale = -1.0, None, 0, [], 0
    for epoch in range(1, settings.epochs + 1):
        model.train()
        for idx in torch.randperm(x_train.shape[0], generator=generator).split(batch_size):
            idx = idx.to(device)
            loss = loss_fn(model(x_train[idx]), y_train[idx].float())
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            schedule.step()
        model.eval()
        score = recall_at_density(_logits(model, x_held, device), held.active, budget)
        history.append(score)
        if score > best_score + 1e-5:
            best_score, best_epoch, stale = score, epoch, 0
            best_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        else:
            stale += 1
            if stale >= settings.patience:
                break
    model.load_state_dict(best_state)
    model = model.cpu()
    with torch.no_grad():
        model.fc1.weight.div_(scale)  # fc1(x / scale) == (fc1 / scale)(x)
    logits = _logits(model, held.x, "cpu")
    threshold = threshold_for_recall(logits, held.active, settings.target_recall)
    return Trained(model, rank, threshold, float((logits > threshold).float().mean()),
                   recall_at_density(logits, held.active, budget), best_epoch, time.perf_counter() - started, history)


# ---- choosing the rank ------------------------------------------------------------------------------

def rank_ladder(n_embd: int, n_ff: int, cap: int) -> list[int]:
    """Candidate ranks 4, 6, 8, 12, 16, 24, ... (steps of about 1.5x) up to cap (<= n_embd), and cap."""
    cap = max(1, min(cap, n_embd, n_ff))
    ladder = {cap}
    r = MIN_RANK
    while r <= cap:
        ladder.update(x for x in (r, r * 3 // 2) if x <= cap)
        r *= 2
    return sorted(ladder)


def difficulty(stats: dict, density: float) -> float:
    """A starting guess of how much of the rank budget a layer needs, from its sparsity and skew:
    activations concentrated on a few hot neurons (high hot20) and sparse layers are easier to
    predict. 1.0 = a dense, uniform layer; the rank search corrects the guess either way."""
    hot20 = float(stats.get("hot20", 0.2))
    spread = (1.0 - hot20) / 0.8          # 1 when the hottest 20% hold only 20% of the activations
    return float(min(1.0, max(1 / 16, spread * min(1.0, 2.0 * density))))


def budget_rank(profile: ProfileDir, fraction: float) -> int:
    """The rank whose predictor costs `fraction` of one FFN block."""
    return rank_at_fraction(profile.n_embd, profile.n_ff, profile.gated, fraction)


def search_rank(train: LayerSamples, held: LayerSamples, ladder: list[int], start: int,
                settings: TrainSettings) -> dict[int, Trained]:
    """Train rungs of the ladder from `start`: down while the layer still meets its target (recall
    at the density budget >= target recall); up while it does not and each step still gains at least
    `min_gain` of that recall (past that, more bytes buy next to nothing). Returns every trained rung."""
    trained: dict[int, Trained] = {}

    def meets(i: int) -> bool:
        r = ladder[i]
        if r not in trained:
            trained[r] = train_one(train, held, r, settings)
        return trained[r].recall_at_budget >= settings.target_recall

    i = start
    if meets(i):
        while i > 0 and meets(i - 1):
            i -= 1
        return trained
    while i + 1 < len(ladder):
        before = trained[ladder[i]].recall_at_budget
        i += 1
        if meets(i) or trained[ladder[i]].recall_at_budget - before < settings.min_gain:
            break
    return trained


def choose(trained: dict[int, Trained], settings: TrainSettings) -> Trained:
    """The smallest rank that meets the target; if none does, the smallest within `min_gain` of the best."""
    meeting = [t for t in trained.values() if t.recall_at_budget >= settings.target_recall]
    if not meeting:
        best = max(t.recall_at_budget for t in trained.values())
        meeting = [t for t in trained.values() if t.recall_at_budget >= best - settings.min_gain]
    return min(meeting, key=lambda t: t.rank)


def next_growth(options: dict[int, dict[int, Trained]], chosen: dict[int, Trained], ladder: list[int],
                settings: TrainSettings, cost: int, leftover: int) -> tuple[int, int] | None:
    """(layer, rank) of the most promising affordable step up, or None: among layers that miss the
    target and whose last step up still gained >= min_gain, the one whose last gain per parameter
    was largest (a layer with a single rung tried goes first), if its next rung fits `leftover`."""
    best = None
    for layer, current in chosen.items():
        larger = [r for r in ladder if r > current.rank]
        if current.recall_at_budget >= settings.target_recall or not larger \
                or (larger[0] - current.rank) * cost > leftover or any(r > current.rank for r in options[layer]):
            continue
        smaller = [t for t in options[layer].values() if t.rank < current.rank]
        if smaller:
            below = max(smaller, key=lambda t: t.rank)
            gain = current.recall_at_budget - below.recall_at_budget
            if gain < settings.min_gain:
                continue
            priority = gain / ((current.rank - below.rank) * cost)
        else:
            priority = math.inf
        if best is None or priority > best[0]:
            best = (priority, layer, larger[0])
    return best[1:] if best else None


# ---- whole runs ---------------------------------------------------------------------------------------

@dataclass
class LayerResult:
    layer: int
    rank: int
    params: int
    threshold: float
    metrics: dict
    epochs: int | None = None                    # None when only evaluated
    tried: dict = field(default_factory=dict)   # rank -> held-out numbers of that rank's predictor
    seconds: float | None = None                 # training time of the layer, every rank tried

    def report(self) -> dict:
        out = {"layer": self.layer, "rank": self.rank, "params": self.params, "threshold": self.threshold,
               **self.metrics}
        if self.epochs is not None:
            out.update(epochs=self.epochs, train_seconds=self.seconds, ranks_tried=self.tried)
        return out


def _measure(layer: int, model: Predictor, threshold: float, samples: LayerSamples, weights: np.ndarray,
             budget_ratio: float, trained: Trained | None = None, tried: dict | None = None,
             seconds: float | None = None) -> LayerResult:
    metrics = layer_metrics(_logits(model, samples.x, "cpu"), samples.active, threshold, weights, budget_ratio)
    return LayerResult(layer, model.rank, model.params(), threshold, metrics, trained.epochs if trained else None,
                       tried or {}, seconds)


def check_rank(rank: int | None, n_embd: int) -> None:
    if rank is not None and not 1 <= rank <= n_embd:
        raise UserError(f"--rank {rank} is out of range: it must be between 1 and n_embd={n_embd} "
                        "(a larger rank cannot see more than the n_embd-dimensional input)")


def train_layers(profile: ProfileDir, layers: list[int], rank: int | None, settings: TrainSettings,
                 max_fraction: float, store: Path, held_out_fraction: float = 0.2, progress=None) -> list[LayerResult]:
    """Train every requested layer, write each chosen predictor to `store` (model_{i}.pt) and measure it on its
    layer's held-out sequences.

    Fixed `rank`: one predictor per layer. `rank` None (adaptive): first each layer searches the
    ranks up to its equal share of the byte cap; then the cap left over by layers that needed less
    is spent step by step where the last step up gained the most held-out recall per parameter.
    Memory holds one layer's rows and the predictors being trained: a layer's choice goes to `store` at once and
    only its numbers stay (at 70B's widths, predictors at 10 % of the FFN are 22 GB in float32).
    `progress(layer, chosen, tried, growing)` is called after each layer and each growth step."""
    from powerinfer_tools.stages.predictors.predictor import load_predictor, model_file, save_predictor

    n_embd, n_ff = profile.n_embd, profile.n_ff
    check_rank(rank, n_embd)
    cost = n_embd + n_ff                                   # parameters per unit of rank
    share = min(budget_rank(profile, max_fraction), n_embd)
    ladder = rank_ladder(n_embd, n_ff, n_embd)
    options: dict[int, dict[int, Trained]] = {}
    chosen: dict[int, Trained] = {}

    def keep(layer: int) -> None:
        """The layer's choice to `store`, every model of the layer out of memory."""
        if chosen[layer].model is not None:
            save_predictor(chosen[layer].model, model_file(store, layer))
        for trained in options[layer].values():
            trained.model = None

    def split(layer: int) -> tuple[LayerSamples, LayerSamples]:
        samples = load_samples(profile, layer)
        train_rows, held_rows = split_by_sequence(samples.seq, held_out_fraction, settings.seed)
        return samples.subset(train_rows), samples.subset(held_rows)

    for layer in layers:
        train, held = split(layer)
        if rank is not None:
            options[layer] = {rank: train_one(train, held, rank, settings)}
        else:
            first = [r for r in ladder if r < share] + [share]
            guess = share * difficulty(profile.layer_stats(layer), float(train.active.float().mean()))
            start = max(i for i, r in enumerate(first) if r <= max(guess, first[0]))
            options[layer] = search_rank(train, held, first, start, settings)
        chosen[layer] = choose(options[layer], settings)
        keep(layer)
        if progress:
            progress(layer, chosen[layer], options[layer], False)
    if rank is None:
        leftover = int(max_fraction * profile.ffn_params() * len(layers)) - sum(t.rank * cost for t in chosen.values())
        while (step := next_growth(options, chosen, ladder, settings, cost, leftover)) is not None:
            layer, bigger = step
            options[layer][bigger] = train_one(*split(layer), bigger, settings)
            previous, chosen[layer] = chosen[layer], choose(options[layer], settings)
            keep(layer)
            leftover -= (chosen[layer].rank - previous.rank) * cost
            if progress:
                progress(layer, chosen[layer], options[layer], True)
    results = []
    for layer in layers:
        _, held = split(layer)
        tried = {str(r): {"recall_at_budget": t.recall_at_budget, "density_at_target": t.density_at_target,
                          "epochs": t.epochs, "seconds": t.seconds, "held_out_recall_at_budget_by_epoch": t.history}
                 for r, t in sorted(options[layer].items())}
        results.append(_measure(layer, load_predictor(model_file(store, layer)), chosen[layer].threshold, held,
                                profile.neuron_weights(layer), settings.max_density_ratio, chosen[layer], tried,
                                sum(t.seconds for t in options[layer].values())))
    return results


def check_same_model(profile: ProfileDir, predictors) -> None:
    """Predictors must belong to the profiled model: same config hash when the predictor dir says
    (ours), and always the same n_embd / n_ff shapes (PowerInfer's published dirs carry no identity)."""
    theirs = predictors.model_identity
    if theirs and theirs.get("config_hash") and profile.model.get("config_hash") \
            and theirs["config_hash"] != profile.model["config_hash"]:
        raise UserError(f"predictors in {predictors.path} were trained for model {theirs.get('source', '?')} "
                        f"(config hash {theirs['config_hash'][:12]}), but profile {profile.path} is of "
                        f"{profile.model.get('source', '?')} (config hash {profile.model['config_hash'][:12]})")
    for layer, model in predictors.models.items():
        if layer >= profile.n_layer:
            raise UserError(f"{predictors.path} has model_{layer}.pt but the profiled model has "
                            f"{profile.n_layer} layers")
        shape = (model.fc1.in_features, model.fc2.out_features)
        if shape != (profile.n_embd, profile.n_ff):
            raise UserError(f"{predictors.path}/model_{layer}.pt maps n_embd={shape[0]} -> n_ff={shape[1]}, but the "
                            f"profiled model has n_embd={profile.n_embd}, n_ff={profile.n_ff}: another model")


def evaluate_layers(profile: ProfileDir, predictors, layers: list[int], budget_ratio: float = 1.3,
                    progress=None) -> list[LayerResult]:
    """Measure existing predictors on every row of the profile (a separate evaluation profile)."""
    check_same_model(profile, predictors)
    missing = [layer for layer in layers if layer not in predictors.models]
    if missing:
        raise UserError(f"{predictors.path} has no predictor for layer(s) {', '.join(map(str, missing))}")
    results = []
    for layer in layers:
        results.append(_measure(layer, predictors.models[layer], predictors.thresholds[layer],
                                load_samples(profile, layer), profile.neuron_weights(layer), budget_ratio))
        if progress:
            progress(layer, None, None)
    return results


def summarize(results: list[LayerResult]) -> dict:
    keys = ("recall", "weighted_recall", "precision", "true_density", "predicted_density", "density_ratio",
            "recall_at_budget", "auc")
    return {f"mean_{k}": float(np.mean([r.metrics[k] for r in results])) for k in keys
            if all(k in r.metrics for r in results)}


def format_layers(layers: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5' (as --layers takes them)."""
    runs: list[list[int]] = []
    for layer in sorted(layers):
        if runs and layer == runs[-1][1] + 1:
            runs[-1][1] = layer
        else:
            runs.append([layer, layer])
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs)


def useless_warning(results: list[LayerResult], rows: str = "held-out") -> str | None:
    """One line naming the layers whose predictors predict nothing useful on the `rows` measured
    (predictor.is_useful), with their AUC and predicted vs true density, or None."""
    from powerinfer_tools.stages.predictors.usefulness import MAX_USEFUL_DENSITY, MIN_USEFUL_AUC

    bad = [r for r in results if not r.metrics.get("useful", True)]
    if not bad:
        return None
    def mean(key):
        return float(np.mean([r.metrics[key] for r in bad]))
    return (f"warning: the predictors of layer(s) {format_layers([r.layer for r in bad])} predict nothing useful: "
            f"{rows} AUC {mean('auc'):.3f} (chance 0.5, useful from {MIN_USEFUL_AUC}), predicted density "
            f"{mean('predicted_density'):.3f} (useful up to {MAX_USEFUL_DENSITY}) vs true "
            f"{mean('true_density'):.3f}; a converted file's auto mode "
            "leaves them out, and predictor mode there computes about every neuron or drops them at random "
            "(profile a higher --target-sparsity, more tokens, or use gate mode)")


def predictor_verdict(results: list[LayerResult]) -> str:
    """One line on what the predictors buy, as `report` judges them (predictor.is_useful): how many layers' are
    useful, what predictor mode computes of those layers at what recall, and what runs where none is."""
    useful = [r for r in results if r.metrics.get("useful", True)]
    if not useful:
        return (f"none of the {len(results)} layers' predictors predicts anything useful: run gate or dense mode, or "
                "profile a higher --target-sparsity or more tokens and train again")
    recall = float(np.mean([r.metrics["recall"] for r in useful if "recall" in r.metrics] or [math.nan]))
    density = float(np.mean([r.metrics["predicted_density"] for r in useful if "predicted_density" in r.metrics]
                            or [math.nan]))
    rest = len(results) - len(useful)
    return (f"{len(useful)} of {len(results)} layers' predictors are useful: predictor mode computes about "
            f"{density:.0%} of their neurons at {recall:.1%} held-out recall"
            + (f"; auto mode runs the other {rest} without theirs" if rest else ""))


TABLE = (("recall", "recall", 7, ".4f", "share of the active (token, neuron) pairs predicted active"),
         ("weighted_recall", "w.rec", 7, ".4f", "the same, each pair weighed by its activation's size"),
         ("precision", "prec", 6, ".3f", "share of the predicted pairs that were active"),
         ("true_density", "true d", 7, ".4f", "share of neurons active"),
         ("predicted_density", "pred d", 7, ".4f", "share predicted active, what the engine computes"),
         ("density_ratio", "ratio", 6, ".2f", "pred d / true d"),
         ("recall_at_budget", "rec@bud", 7, ".4f", "recall when the best-ranked 'budget' x true d are predicted "
                                                   "(threshold-free ranking quality)"),
         ("auc", "auc", 6, ".3f", "ROC area of the predictor's scores"))
LEGEND = ("held-out rows: thresh, the logit above which a neuron is predicted active; "
          + "; ".join(f"{title}, {meaning}" for _, title, _, _, meaning in TABLE))


def format_table(results: list[LayerResult]) -> str:
    """Per-layer metrics on the held-out rows, then a legend of the columns."""
    def cells(values: dict) -> str:
        return " ".join(f"{values.get(key, math.nan):>{width}{fmt}}" for key, _, width, fmt, _ in TABLE)

    lines = [f"{'layer':>5} {'rank':>5} {'params':>8} {'thresh':>8} "
             + " ".join(f"{title:>{width}}" for _, title, width, _, _ in TABLE)]
    for r in results:
        lines.append(f"{r.layer:>5} {r.rank:>5} {r.params:>8} {r.threshold:>8.3f} {cells(r.metrics)}")
    mean = {k[len("mean_"):]: v for k, v in summarize(results).items()}
    lines.append(f"{'mean':>5} {'':>5} {sum(r.params for r in results):>8} {'':>8} {cells(mean)}")
    lines += textwrap.wrap(LEGEND, 116)
    return "\n".join(lines)


# ---- the stage: train, or measure, a predictor directory ---------------------------------------------------

def _parse_rank(rank: str | int) -> int | None:
    if rank == "auto":
        return None
    try:
        return int(rank)
    except ValueError:
        raise UserError(f"--rank must be 'auto' or a positive integer, not {rank!r}") from None


def _device(name: str) -> str:
    if name == "cpu":
        return name
    if name.startswith("cuda") and torch.cuda.is_available():
        return name
    if name == "mps" and torch.backends.mps.is_available():
        return name
    raise UserError(f"device {name!r} is not available here (use cpu)")


def _layer_bar(total: int, desc: str):
    from powerinfer_tools.core.progress import progress_bar

    return progress_bar(total=total, desc=desc, unit="layer", file=sys.stderr, dynamic_ncols=True)


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, allow_nan=True) + "\n")


def _report(mode: str, profile: ProfileDir, results: list[LayerResult], settings: dict) -> dict:
    params = sum(r.params for r in results)
    ffn = profile.ffn_params() * len(results)
    return {"format": REPORT_FORMAT, "mode": mode, "profile": str(profile.path), "model": profile.model,
            "rule": profile.meta.get("rule"), "settings": settings,
            "predictor_params": params, "ffn_params": ffn, "predictor_fraction": params / ffn,
            "summary": summarize(results), "layers": [r.report() for r in results]}


def _checked(profile: ProfileDir, opts: PredictorOptions) -> tuple[list[int], float]:
    """The layers to work on and the target recall, after refusing impossible options; sets torch's threads."""
    selected = parse_layers(opts.layers, profile.n_layer)
    target_recall = opts.target_recall
    if target_recall is None:
        target_recall = 0.95 if profile.thresholded else 0.99
    limits.SHARE.check("--target-recall", target_recall)
    limits.SHARE.check("--held-out", opts.held_out)
    limits.AT_LEAST_ONE.check("--max-density-ratio", opts.max_density_ratio)
    limits.FRACTION.check("--max-predictor-fraction", opts.max_predictor_fraction)
    if opts.epochs < 1 or opts.threads < 1:
        raise UserError("need --epochs >= 1 and --threads >= 1")
    torch.set_num_threads(opts.threads)
    return selected, target_recall


def train(profile: ProfileDir, opts: PredictorOptions) -> TrainedPredictors:
    """Train one predictor per selected layer and write the directory: model_{i}.pt (PowerInfer's state dict),
    config.json (thresholds, ranks) and report.json, all at once (atomic_dir)."""
    from powerinfer_tools.core.atomic import atomic_dir, check_output_dir, output_lock
    from powerinfer_tools.stages.predictors.predictor import write_config

    selected, target_recall = _checked(profile, opts)
    out = Path(opts.out) if opts.out is not None else profile.path.with_name(profile.path.name + "-predictors")
    check_output_dir(out, opts.force)   # before minutes of training, not after
    fixed_rank = _parse_rank(opts.rank)
    check_rank(fixed_rank, profile.n_embd)
    settings = TrainSettings(target_recall=target_recall, max_density_ratio=opts.max_density_ratio,
                             epochs=opts.epochs, device=_device(opts.device), seed=opts.seed)
    # a second run on one output is refused now, not after minutes of training
    with output_lock(out, wait=False), atomic_dir(out, opts.force) as tmp:
        with _layer_bar(len(selected), "train-predictor") as bar:
            def progress(layer, chosen, tried, growing):
                if growing:   # spending the byte cap left over: one more step on the bar
                    bar.total += 1
                seconds = sum(t.seconds for t in tried.values())
                bar.set_postfix_str(f"layer {layer}: ranks tried {sorted(tried)} in {seconds:.0f} s, picked "
                                    f"{chosen.rank}, held-out recall@budget {chosen.recall_at_budget:.3f}")
                bar.update(1)

            results = train_layers(profile, selected, fixed_rank, settings, opts.max_predictor_fraction, tmp,
                                   opts.held_out, progress)
        write_config(tmp, profile.model, profile.meta.get("rule", "nonzero"), profile.meta.get("thresholds"),
                     [{"layer": r.layer, "rank": r.rank, "threshold": r.threshold,
                       "useful": r.metrics["useful"]} for r in results])
        _write_json(tmp / "report.json", _report("train", profile, results, {
            "rank": opts.rank, "target_recall": target_recall, "max_density_ratio": opts.max_density_ratio,
            "max_predictor_fraction": opts.max_predictor_fraction, "epochs": opts.epochs,
            "held_out": opts.held_out, "seed": opts.seed, "split": "by calibration sequence"}))
    warning = useless_warning(results)
    return TrainedPredictors(out, results, [warning] if warning else [])


def evaluate(profile: ProfileDir, predictors_dir: Path, opts: PredictorOptions,
             report: Path | None = None) -> TrainedPredictors:
    """Measure an existing predictor directory (ours or PowerInfer's published model_{i}.pt) on every row of
    the profile; with `report`, also write the metrics there as JSON."""
    from powerinfer_tools.core.atomic import atomic_file
    from powerinfer_tools.stages.predictors.predictor import read_predictor_dir

    selected, _ = _checked(profile, opts)
    if report is not None and Path(report).is_dir():
        raise UserError(f"--report {report} is a directory")
    predictors = read_predictor_dir(predictors_dir)
    with _layer_bar(len(selected), "evaluate") as bar:
        results = evaluate_layers(profile, predictors, selected, opts.max_density_ratio, lambda *_: bar.update(1))
    warnings = [w for w in [useless_warning(results, "evaluation")] if w]
    if profile.thresholded and predictors.activation_thresholds is not None \
            and list(predictors.activation_thresholds) != list(profile.meta.get("thresholds") or []):
        warnings.append("note: 'active' was measured with this profile's |a| thresholds, which differ from "
                        "those of the profile the predictors were trained on")
    if report is not None:
        with atomic_file(report) as tmp:
            _write_json(tmp, _report("evaluate", profile, results, {"predictors": str(predictors_dir)}))
    return TrainedPredictors(Path(predictors_dir), results, warnings)
