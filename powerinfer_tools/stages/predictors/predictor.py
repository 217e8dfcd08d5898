"""PowerInfer's activation predictor: what one is, how it is stored, and how well it predicts.

A layer's predictor is `fc2(relu(fc1(x)))` without biases (fc1: n_embd -> rank, fc2: rank -> n_ff);
neuron j is predicted active when its logit exceeds the layer's threshold. On disk a predictor
directory holds PowerInfer's `model_{i}.pt` state dicts plus our `config.json` (docs/formats.md),
so PowerInfer's converter reads our predictors and we read its published ones.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from powerinfer_tools.core.errors import UserError
from powerinfer_tools.core.safe_load import checked_tensor, load_pt
from powerinfer_tools.formats import names
from powerinfer_tools.stages.predictors.usefulness import MAX_USEFUL_DENSITY, MIN_USEFUL_AUC

CONFIG_FORMAT = "powerinfer-tools.predictors/1"
STATE_KEYS = (names.weight(names.PREDICTOR_FC1), names.weight(names.PREDICTOR_FC2))  # PowerInfer's model_{i}.pt
F16_MAX = 65504.0  # the largest finite float16: the converter may store predictors as f16
AUC_SAMPLE = 500_000  # (row, neuron) pairs drawn to estimate the pooled ROC AUC (exact AUC is a sort of all pairs)


class Predictor(nn.Module):
    """fc2(relu(fc1(x))), no biases: PowerInfer's shape, so its converter and engine load it as is."""

    def __init__(self, n_embd: int, rank: int, n_ff: int):
        super().__init__()
        self.fc1 = nn.Linear(n_embd, rank, bias=False)
        self.fc2 = nn.Linear(rank, n_ff, bias=False)

    @property
    def rank(self) -> int:
        return self.fc1.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))

    def params(self) -> int:
        return self.fc1.weight.numel() + self.fc2.weight.numel()

    def state(self) -> dict[str, torch.Tensor]:
        """The PowerInfer state dict: float32, contiguous, detached from any graph or device."""
        return {k: v.detach().to("cpu", torch.float32).contiguous().clone() for k, v in self.state_dict().items()}

    @classmethod
    def from_state(cls, state: dict, source: str = "predictor") -> "Predictor":
        fc1, fc2 = check_state(state, source)
        rank, n_embd = fc1.shape
        model = cls(n_embd, rank, fc2.shape[0])
        model.load_state_dict(dict(zip(STATE_KEYS, (fc1.float(), fc2.float()))))
        return model


def check_state(state, source: str, n_embd: int | None = None, n_ff: int | None = None):
    """(fc1, fc2) of a model_{i}.pt state dict, by the rules the engine loads a predictor with (csrc/model.cpp:
    fc1 [rank, n_embd], fc2 [n_ff, rank], 1 <= rank <= n_ff), and finite weights that fit the f16 the
    converter may store them as; UserError naming the defect otherwise. With n_embd / n_ff: the model's."""
    if not isinstance(state, dict) or set(state) != set(STATE_KEYS):
        keys = sorted(map(str, state)) if isinstance(state, dict) else type(state).__name__
        raise UserError(f"{source}: expected a state dict with exactly {list(STATE_KEYS)}, found {keys}")
    fc1, fc2 = (checked_tensor(state[k], source, k, ndim=2, max_abs=F16_MAX) for k in STATE_KEYS)
    rank = fc1.shape[0]
    if fc2.shape[1] != rank:
        raise UserError(f"{source}: fc1.weight {tuple(fc1.shape)} and fc2.weight {tuple(fc2.shape)} "
                        "do not form fc2(relu(fc1(x)))")
    if not 1 <= rank <= fc2.shape[0]:
        raise UserError(f"{source}: predictor rank {rank} is outside 1..n_ff ({fc2.shape[0]}), which the engine loads")
    if (n_embd is not None and fc1.shape[1] != n_embd) or (n_ff is not None and fc2.shape[0] != n_ff):
        raise UserError(f"{source}: predictor shapes fc1 {tuple(fc1.shape)}, fc2 {tuple(fc2.shape)} do not match "
                        f"the model (expected fc1 [rank, {n_embd}], fc2 [{n_ff}, rank])")
    return fc1, fc2


def model_file(directory: Path, layer: int) -> Path:
    return Path(directory) / f"model_{layer}.pt"


def save_predictor(model: Predictor, path: Path) -> None:
    torch.save(model.state(), path)


def load_predictor(path: Path) -> Predictor:
    """Read a model_{i}.pt with weights_only=True (a pickle from elsewhere must not run code)."""
    return Predictor.from_state(load_pt(path, "predictor"), str(path))


@dataclass
class PredictorDir:
    """A predictor directory: per-layer models and thresholds, plus the model identity when ours."""

    path: Path
    models: dict[int, Predictor]
    thresholds: dict[int, float]
    model_identity: dict | None       # profile.json's "model" block (ours), None for PowerInfer's published dirs
    activation_thresholds: list | None


def read_predictor_dir(path: Path) -> PredictorDir:
    """Our predictor dirs (config.json with per-layer thresholds) and PowerInfer's (model_{i}.pt,
    an optional config.json holding only `sparse_threshold`, which then applies to every layer)."""
    path = Path(path)
    if not path.is_dir():
        raise UserError(f"predictor directory not found: {path}")
    layers = sorted(int(m.group(1)) for f in path.iterdir() if (m := re.fullmatch(r"model_(\d+)\.pt", f.name)))
    if not layers:
        raise UserError(f"{path} holds no model_{{i}}.pt predictor files")
    config = {}
    if (path / "config.json").is_file():
        try:
            config = json.loads((path / "config.json").read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise UserError(f"{path / 'config.json'} is not valid JSON: {exc}") from None
    default = float(config.get("sparse_threshold") or 0.0)
    per_layer = {int(e["layer"]): float(e["threshold"]) for e in config.get("layers", []) if "threshold" in e}
    models = {i: load_predictor(model_file(path, i)) for i in layers}
    return PredictorDir(path, models, {i: per_layer.get(i, default) for i in layers},
                        config.get("model"), config.get("activation_thresholds"))


def write_config(directory: Path, model_identity: dict, rule: str, activation_thresholds: list,
                 layers: list[dict]) -> None:
    """config.json: PowerInfer reads `sparse_threshold` (one value for all layers), so it gets the
    lowest per-layer threshold, which keeps every layer at or above its calibrated recall there."""
    config = {
        "format": CONFIG_FORMAT,
        "sparse_threshold": min((e["threshold"] for e in layers), default=0.0),
        "model": model_identity,
        "rule": rule,
        "activation_thresholds": activation_thresholds,
        "layers": layers,
    }
    (Path(directory) / "config.json").write_text(json.dumps(config, indent=2) + "\n")


# ---- calibration -------------------------------------------------------------------------------

def threshold_for_recall(logits: torch.Tensor, labels: torch.Tensor, target_recall: float) -> float:
    """The highest logit threshold t at which `logit > t` still recalls >= target_recall of the
    active (row, neuron) pairs: at most floor((1 - R) * positives) of them may score <= t."""
    positives = logits[labels].float()
    if positives.numel() == 0:
        return math.inf
    allowed_misses = int(math.floor((1.0 - target_recall) * positives.numel() + 1e-9))
    kth = torch.kthvalue(positives.flatten(), allowed_misses + 1).values
    return float(np.nextafter(np.float32(kth.item()), np.float32(-np.inf)))


def threshold_for_density(logits: torch.Tensor, density: float) -> float:
    """The threshold t at which `logit > t` holds for about `density` of all (row, neuron) pairs."""
    flat = logits.flatten().float()
    keep = min(flat.numel(), max(1, int(round(density * flat.numel()))))
    if keep == flat.numel():
        return float(np.nextafter(np.float32(flat.min().item()), np.float32(-np.inf)))
    return float(torch.kthvalue(flat, flat.numel() - keep).values.item())


def density_budget(true_density: float, ratio: float) -> float:
    """What a predictor may mark active when scored at `ratio`: at most `ratio` x the true density, and it must
    leave out at least 1/`ratio` of the inactive share. The second bound matters for dense layers (a SiLU
    profile at 0.2 sparsity: 1.3 x 0.8 > 1 would let a predictor that marks everything active score a
    perfect recall)."""
    return min(ratio * true_density, 1.0 - (1.0 - true_density) / ratio)


def recall_at_density(logits: torch.Tensor, labels: torch.Tensor, density: float) -> float:
    """Recall when the predictor may mark `density` of the pairs active: the quality of its ranking,
    which, unlike recall at a fixed threshold, cannot be bought by predicting more neurons."""
    t = threshold_for_density(logits, density)
    positives = int(labels.sum())
    return float(((logits > t) & labels).sum()) / positives if positives else 1.0


# ---- metrics (scikit-learn) ----------------------------------------------------------------------

def neuron_weights(activation_counts: torch.Tensor, magnitude_sums: torch.Tensor) -> np.ndarray:
    """Each neuron's mean |a| when active (magnitude sum / activation count; 0 for a neuron never
    active): the weight of a missed activation in `weighted_recall`, since dropping a large |a|
    changes the FFN output more than dropping a tiny one."""
    counts = activation_counts.double().numpy()
    sums = magnitude_sums.double().numpy()
    return np.divide(sums, counts, out=np.zeros_like(sums), where=counts > 0)


def layer_metrics(logits: torch.Tensor, labels: torch.Tensor, threshold: float,
                  weights: np.ndarray | None, budget_ratio: float, seed: int = 0) -> dict:
    """Held-out metrics of one layer at one threshold, pooled over (row, neuron) pairs, plus the
    threshold-free recall when `budget_ratio` x the true density may be predicted active."""
    from sklearn.metrics import precision_recall_fscore_support, recall_score, roc_auc_score

    y_true = labels.numpy().ravel()
    y_pred = (logits > threshold).numpy().ravel()
    precision, recall, _, _ = precision_recall_fscore_support(y_true, y_pred, average="binary", zero_division=0)
    out = {
        "rows": int(labels.shape[0]),
        "recall": float(recall),
        "precision": float(precision),
        "true_density": float(y_true.mean()),
        "predicted_density": float(y_pred.mean()),
    }
    out["density_ratio"] = out["predicted_density"] / out["true_density"] if out["true_density"] else math.inf
    out["recall_at_budget"] = recall_at_density(logits, labels, density_budget(out["true_density"], budget_ratio))
    if weights is not None:
        sample_weight = np.broadcast_to(weights.astype(np.float64), labels.shape).ravel()
        out["weighted_recall"] = float(recall_score(y_true, y_pred, sample_weight=sample_weight, zero_division=0))
    rng = np.random.default_rng(seed)
    pick = rng.choice(y_true.size, size=min(AUC_SAMPLE, y_true.size), replace=False)
    scores = logits.numpy().ravel()[pick]
    out["auc"] = float(roc_auc_score(y_true[pick], scores)) if 0 < y_true[pick].sum() < pick.size else math.nan
    out["useful"] = is_useful(out)
    return out


def is_useful(metrics: dict) -> bool:
    """Whether a predictor with these held-out metrics saves work (MIN_USEFUL_AUC, MAX_USEFUL_DENSITY). A layer of
    whose neurons (nearly) all or none are active has no ranking to judge (AUC undefined): its predictor is useful
    when it marks few neurons active, as where none fire."""
    auc = metrics.get("auc", math.nan)
    return (math.isnan(auc) or auc >= MIN_USEFUL_AUC) and metrics["predicted_density"] <= MAX_USEFUL_DENSITY


def rank_at_fraction(n_embd: int, n_ff: int, gated: bool, fraction: float) -> int:
    """The rank whose predictor (n_embd*r + r*n_ff weights) has `fraction` of one FFN block's weights."""
    ffn_params = (3 if gated else 2) * n_embd * n_ff
    return max(1, int(fraction * ffn_params / (n_embd + n_ff)))
