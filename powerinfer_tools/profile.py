"""`pi-tools profile`: run a model over calibration tokens and record, per FFN layer, how often each
neuron fires (PowerInfer's activation_{i}.pt), how large it is when it fires, and a bounded sample of
(predictor input, active mask) rows for predictor training. Layout: docs/formats.md.

ReLU-family activations are exactly zero when a neuron is off. SiLU/GELU ones never are, so a neuron
counts as active when |a| exceeds a per-layer threshold calibrated (CATS-style) to reach a target
sparsity on a first slice of the data; the main pass then runs the model *sparsified* by those
thresholds, as the sparse engine will, so later layers see the inputs they will see at inference.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file
from tqdm import tqdm

from powerinfer_tools import arch as arch_mod
from powerinfer_tools import calibration, models
from powerinfer_tools.atomic import atomic_dir, check_output_dir
from powerinfer_tools.errors import UserError

FORMAT = "powerinfer-tools.profile/1"
DEFAULT_TARGET_SPARSITY = 0.25
DEFAULT_SEQ_LEN = 512
CALIBRATION_VALUES = 1 << 20   # |a| values kept per layer to place a threshold
CALIBRATION_TOKENS = 8192      # tokens of the first pass that place thresholds
SHARD_ROWS = 4096


@dataclass
class ProfileOptions:
    model: str
    out: Path
    calib: list[Path] = field(default_factory=list)
    tokens: int = 32768
    seq_len: int | None = None   # default: min(512, the model's context length)
    batch: int = 4
    device: str = "cpu"
    dtype: str = "float32"
    target_sparsity: list[float] | None = None   # one value, or one per layer
    max_samples: int = 8192
    seed: int = 0
    force: bool = False


def skew(counts: torch.Tensor) -> dict[str, float]:
    """Share of all activations covered by the hottest 10/20/50% of neurons."""
    total = float(counts.sum())
    ordered = torch.sort(counts.double(), descending=True).values.cumsum(0)
    out = {}
    for pct in (10, 20, 50):
        k = max(1, math.ceil(len(counts) * pct / 100))
        out[f"hot{pct}"] = float(ordered[k - 1] / total) if total > 0 else 0.0
    return out


def _per_layer_targets(values: list[float] | None, n_layer: int) -> list[float]:
    values = values or [DEFAULT_TARGET_SPARSITY]
    if len(values) == 1:
        values = values * n_layer
    if len(values) != n_layer:
        raise UserError(f"--target-sparsity takes one value or {n_layer} (one per layer), got {len(values)}")
    for v in values:
        if not 0.0 <= v < 1.0:
            raise UserError(f"--target-sparsity must be in [0, 1), got {v}")
    return values


@torch.no_grad()
def calibrate_thresholds(model, adapter, seqs: torch.Tensor, targets: list[float], batch: int,
                         seed: int) -> list[float]:
    """Per-layer |a| thresholds whose share of sub-threshold activations is the target sparsity."""
    n_layer = adapter.dims().n_layer
    kept: list[list[torch.Tensor]] = [[] for _ in range(n_layer)]
    gen = torch.Generator().manual_seed(seed)
    n_tok = max(1, min(len(seqs), math.ceil(CALIBRATION_TOKENS / seqs.shape[1])))
    per_batch = max(1, CALIBRATION_VALUES // math.ceil(n_tok / batch))

    def on_activation(i, a):
        flat = a.detach().reshape(-1).abs().float().cpu()
        take = torch.randint(0, flat.numel(), (min(per_batch, flat.numel()),), generator=gen)
        kept[i].append(flat[take])

    handles = arch_mod.install_taps(adapter, model, on_activation=on_activation)
    device = next(model.parameters()).device
    try:
        for start in tqdm(range(0, n_tok, batch), desc="calibrating thresholds", unit="batch", leave=False):
            model(input_ids=seqs[start:start + batch].to(device), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    thresholds = []
    for i in range(n_layer):
        values = torch.sort(torch.cat(kept[i])).values
        idx = min(len(values) - 1, max(0, int(round(targets[i] * len(values))) - 1))
        thresholds.append(float(values[idx]) if targets[i] > 0 else 0.0)
    return thresholds


class _Recorder:
    """Counts, magnitudes and sampled rows for every layer, fed by the architecture taps."""

    def __init__(self, adapter, thresholds: list[float], sample_dir: Path, sparsify: bool):
        dims = adapter.dims()
        self.adapter, self.thresholds, self.sparsify = adapter, thresholds, sparsify
        self.counts = [torch.zeros(dims.n_ff, dtype=torch.int64) for _ in range(dims.n_layer)]
        self.magnitude = [torch.zeros(dims.n_ff, dtype=torch.float64) for _ in range(dims.n_layer)]
        self.sample_dir = sample_dir
        self.rows = [0] * dims.n_layer
        self.shards = [0] * dims.n_layer
        self.buffers: list[dict[str, list]] = [{"x": [], "mask": [], "seq": [], "pos": []}
                                               for _ in range(dims.n_layer)]
        self.pick: torch.Tensor | None = None       # flat row indices of this batch to sample
        self.pick_seq: torch.Tensor | None = None
        self.pick_pos: torch.Tensor | None = None

    def on_input(self, i: int, x: torch.Tensor) -> None:
        if self.pick is not None and len(self.pick):
            rows = x.reshape(-1, x.shape[-1])[self.pick.to(x.device)]
            self.buffers[i]["x"].append(rows.detach().to(torch.float16).cpu())

    def on_activation(self, i: int, a: torch.Tensor):
        active = arch_mod.is_active(self.adapter, a, self.thresholds[i])
        flat = active.reshape(-1, active.shape[-1])
        self.counts[i] += flat.sum(0, dtype=torch.int64).cpu()
        self.magnitude[i] += (a.detach().abs() * active).reshape(-1, a.shape[-1]).sum(0, dtype=torch.float64).cpu()
        if self.pick is not None and len(self.pick):
            mask = flat[self.pick.to(flat.device)].cpu().numpy()
            buf = self.buffers[i]
            buf["mask"].append(np.packbits(mask, axis=1, bitorder="little"))
            buf["seq"].append(self.pick_seq)
            buf["pos"].append(self.pick_pos)
            self.rows[i] += len(self.pick)
            if sum(len(m) for m in buf["mask"]) >= SHARD_ROWS:
                self.flush(i)
        if self.sparsify and self.adapter.thresholded:
            return a * active
        return None

    def flush(self, i: int) -> None:
        buf = self.buffers[i]
        if not buf["mask"]:
            return
        tensors = {
            "x": torch.cat(buf["x"]).contiguous(),
            "mask": torch.from_numpy(np.concatenate(buf["mask"])).contiguous(),
            "seq": torch.cat(buf["seq"]).contiguous(),
            "pos": torch.cat(buf["pos"]).contiguous(),
        }
        layer_dir = self.sample_dir / f"layer_{i}"
        layer_dir.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(layer_dir / f"shard_{self.shards[i]:04d}.safetensors"))
        self.shards[i] += 1
        self.buffers[i] = {"x": [], "mask": [], "seq": [], "pos": []}


def profile_pass(model, adapter, seqs: torch.Tensor, thresholds: list[float], batch: int,
                 chosen: np.ndarray, sample_dir: Path) -> tuple[_Recorder, float]:
    """One sparsified pass over `seqs`, recording counts and the rows at flat indices `chosen`."""
    n_seq, seq_len = seqs.shape
    rec = _Recorder(adapter, thresholds, sample_dir, sparsify=True)
    handles = arch_mod.install_taps(adapter, model, on_input=rec.on_input, on_activation=rec.on_activation)
    device = next(model.parameters()).device
    t0 = time.perf_counter()
    try:
        with torch.no_grad(), tqdm(total=seqs.numel(), desc="profiling", unit="tok", unit_scale=True) as bar:
            for start in range(0, n_seq, batch):
                rows = seqs[start:start + batch]
                lo, hi = start * seq_len, (start + len(rows)) * seq_len
                sel = chosen[(chosen >= lo) & (chosen < hi)]
                rec.pick = torch.from_numpy(sel - lo)
                rec.pick_seq = torch.from_numpy(sel // seq_len)
                rec.pick_pos = torch.from_numpy(sel % seq_len)
                model(input_ids=rows.to(device), use_cache=False)
                bar.update(rows.numel())
    finally:
        for h in handles:
            h.remove()
    elapsed = time.perf_counter() - t0
    for i in range(len(rec.counts)):
        rec.flush(i)
    return rec, elapsed


def _model_identity(spec: str, source, config, adapter) -> dict:
    dims = adapter.dims()
    return {"source": str(source.path) if spec != "smollm2" else "smollm2", "arch": adapter.name,
            "gguf_arch": adapter.gguf_arch, "model_type": config.model_type, "activation": adapter.activation,
            "n_layer": dims.n_layer, "n_embd": dims.n_embd, "n_ff": dims.n_ff,
            "config_hash": models.config_hash(config)}


def _context_length(config) -> int | None:
    for key in ("max_position_embeddings", "n_positions", "max_seq_len"):
        value = getattr(config, key, None)
        if value:
            return int(value)
    return None


def run_profile(opts: ProfileOptions) -> dict:
    """Profile a model; writes opts.out atomically and returns the profile.json contents."""
    check_output_dir(opts.out, opts.force)
    source = models.resolve(opts.model)
    config = models.load_config(source)
    adapter = arch_mod.for_config(config)
    ctx = _context_length(config)
    seq_len = opts.seq_len or min(DEFAULT_SEQ_LEN, ctx or DEFAULT_SEQ_LEN)
    if opts.tokens <= 0 or seq_len <= 1 or opts.batch <= 0 or opts.max_samples < 0:
        raise UserError("--tokens, --seq-len (>1), --batch must be positive and --max-samples non-negative")
    if ctx is not None and seq_len > ctx:
        raise UserError(f"--seq-len {seq_len} is larger than the model's context length {ctx}")
    texts = [calibration.read_text(p) for p in opts.calib]   # validate input before the slow load
    dims = adapter.dims()
    targets = _per_layer_targets(opts.target_sparsity, dims.n_layer) if adapter.thresholded else None
    if opts.device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda: no CUDA device is available")

    model, adapter = models.load_model(source, device=opts.device, dtype=opts.dtype)
    tokenizer = models.load_tokenizer(source)
    if texts:
        seqs = calibration.sequences_from_text(tokenizer, texts, seq_len, opts.tokens)
        calib_desc = [str(p) for p in opts.calib]
    else:
        print("pi-tools profile: no --calib given: data-free calibration on text the model generates itself")
        seqs = calibration.self_generated(model, tokenizer, seq_len, opts.tokens, opts.seed)
        calib_desc = "self-generated"

    thresholds = ([0.0] * dims.n_layer if targets is None
                  else calibrate_thresholds(model, adapter, seqs, targets, opts.batch, opts.seed))

    n_seq, seq_len = seqs.shape
    n_total = n_seq * seq_len
    rng = np.random.default_rng(opts.seed)
    chosen = np.sort(rng.choice(n_total, size=min(opts.max_samples, n_total), replace=False))

    with atomic_dir(opts.out, force=opts.force) as tmp:
        rec, elapsed = profile_pass(model, adapter, seqs, thresholds, opts.batch, chosen, tmp / "samples")
        (tmp / "activation").mkdir()
        (tmp / "magnitude").mkdir()
        layers = []
        for i in range(dims.n_layer):
            torch.save(rec.counts[i].clone(), tmp / "activation" / f"activation_{i}.pt")
            torch.save(rec.magnitude[i].float().clone(), tmp / "magnitude" / f"magnitude_{i}.pt")
            density = float(rec.counts[i].sum()) / (n_total * dims.n_ff)
            layers.append({"layer": i, "sparsity": 1.0 - density, **skew(rec.counts[i])})
        profile = {
            "format": FORMAT,
            "model": _model_identity(opts.model, source, config, adapter),
            "rule": "threshold" if adapter.thresholded else "nonzero",
            "thresholds": thresholds,
            "target_sparsity": targets,
            "tokens": n_total, "sequences": n_seq, "seq_len": seq_len, "calibration": calib_desc,
            "samples": {"rows": int(len(chosen)), "x_dtype": "float16", "shard_rows": SHARD_ROWS},
            "tokens_per_second": n_total / elapsed if elapsed > 0 else None,
            "layers": layers,
        }
        (tmp / "profile.json").write_text(json.dumps(profile, indent=2))
    return profile


def load_profile(directory: str | Path) -> dict:
    """profile.json of a profile directory, checked for format and completeness."""
    directory = Path(directory)
    path = directory / "profile.json"
    if not path.is_file():
        raise UserError(f"{directory} is not a profile directory (no profile.json); run 'pi-tools profile' first")
    try:
        profile = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise UserError(f"{path} is not valid JSON ({exc})") from None
    if profile.get("format") != FORMAT:
        raise UserError(f"{path}: unknown profile format {profile.get('format')!r} (expected {FORMAT})")
    return profile


def load_activation_counts(directory: str | Path, n_layer: int) -> list[torch.Tensor]:
    """activation_{i}.pt for every layer (PowerInfer's layout), loaded safely."""
    out = []
    for i in range(n_layer):
        path = Path(directory) / "activation" / f"activation_{i}.pt"
        if not path.is_file():
            raise UserError(f"missing activation file {path}")
        try:
            out.append(torch.load(path, weights_only=True))
        except Exception as exc:  # pickle errors come in many types
            raise UserError(f"cannot load {path} safely: {str(exc).splitlines()[0]}") from None
    return out
