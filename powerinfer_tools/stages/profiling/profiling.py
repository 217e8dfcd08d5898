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
import os
import re
import shutil
import sys
import time
from collections.abc import Sequence

from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save as safetensors_bytes

from powerinfer_tools.core.progress import progress_bar
from powerinfer_tools.models import arch as arch_mod
from powerinfer_tools import models
from powerinfer_tools.core.atomic import atomic_file, check_output_dir, naming_output, output_lock, publish_dir
from powerinfer_tools.core.digests import bytes_sha256, check_file, file_sha256
from powerinfer_tools.core.errors import UserError, write_failure
from powerinfer_tools.core.safe_load import checked_tensor, load_pt
from powerinfer_tools.stages.options import ProfileOptions
from powerinfer_tools.stages.profiling.profile_files import (RESTART, check_profile_digest, check_recorded, check_thresholds,
                                                   checked_checkpoint, checked_shards, is_position, is_thresholds,
                                                   profile_digest, recorded_digests, save_checkpoint, shard_name)

FORMAT = "powerinfer-tools.profile/1"
DEFAULT_TARGET_SPARSITY = 0.2   # its cost in perplexity, per model: docs/profile.md
DEFAULT_SEQ_LEN = 512
CALIBRATION_VALUES = 1 << 20   # |a| values kept per layer to place a threshold
CALIBRATION_TOKENS = 8192      # tokens of the first pass that place thresholds
SHARD_ROWS = 4096
STAT_ROWS = 256             # activation rows per step of the recorder's statistics
CHECKPOINT_BATCHES = 8      # most batches between resumable checkpoints (fewer in a short run: checkpoint_every)


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


class ThresholdSampler:
    """|a| values sampled per layer from the first CALIBRATION_TOKENS tokens (the dense model's), and each layer's
    threshold at its target share of them. Each (layer, batch) draws from its own seeded generator, so the whole
    model's pass and the layer-by-layer one (which visit them in other orders) place the same thresholds."""

    def __init__(self, n_layer: int, seqs: torch.Tensor, batch: int, seed: int):
        self.n_seq = max(1, min(len(seqs), math.ceil(CALIBRATION_TOKENS / seqs.shape[1])))
        self.per_batch = max(1, CALIBRATION_VALUES // math.ceil(self.n_seq / batch))
        self.seed = seed
        self.kept: list[list[torch.Tensor]] = [[] for _ in range(n_layer)]

    def add(self, i: int, n_batch: int, a: torch.Tensor) -> None:
        flat = a.detach().reshape(-1).abs().float().cpu()
        gen = torch.Generator().manual_seed(((self.seed * 100_003 + i) * 1_000_003 + n_batch) % 2**63)
        self.kept[i].append(flat[torch.randint(0, flat.numel(), (min(self.per_batch, flat.numel()),), generator=gen)])

    def threshold(self, i: int, target: float) -> float:
        if target <= 0:
            return 0.0
        values = torch.sort(torch.cat(self.kept[i])).values
        return float(values[min(len(values) - 1, max(0, int(round(target * len(values))) - 1))])


@torch.no_grad()
def calibrate_thresholds(model, adapter, seqs: torch.Tensor, targets: list[float], batch: int,
                         seed: int) -> list[float]:
    """Per-layer |a| thresholds whose share of sub-threshold activations is the target sparsity."""
    sampler = ThresholdSampler(adapter.dims().n_layer, seqs, batch, seed)
    current = {"batch": 0}
    handles = arch_mod.install_taps(adapter, model, on_activation=lambda i, a: sampler.add(i, current["batch"], a))
    device = next(model.parameters()).device
    try:
        for n_batch, start in enumerate(progress_bar(range(0, sampler.n_seq, batch), desc="calibrating thresholds",
                                             unit="batch", leave=False)):
            current["batch"] = n_batch
            model(input_ids=seqs[start:start + batch].to(device), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return [sampler.threshold(i, t) for i, t in enumerate(targets)]


class _Recorder:
    """Counts, magnitudes and sampled rows for every layer, fed by the architecture taps."""

    def __init__(self, adapter, thresholds: list[float], sample_dir: Path, sparsify: bool):
        dims = adapter.dims()
        self.adapter, self.thresholds, self.sparsify = adapter, thresholds, sparsify
        self.counts = [torch.zeros(dims.n_ff, dtype=torch.int64) for _ in range(dims.n_layer)]
        self.magnitude = [torch.zeros(dims.n_ff, dtype=torch.float64) for _ in range(dims.n_layer)]
        self.sample_dir = sample_dir
        self.sha256: dict[str, str] = {}   # shard path under sample_dir -> digest of its bytes, as written
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

    def select_rows(self, chosen: np.ndarray, start: int, n: int, seq_len: int) -> None:
        """The next batch holds sequences start..start+n: pick its rows among the sampled flat indices `chosen`."""
        lo, hi = start * seq_len, (start + n) * seq_len
        sel = chosen[(chosen >= lo) & (chosen < hi)]
        self.pick = torch.from_numpy(sel - lo)
        self.pick_seq = torch.from_numpy(sel // seq_len)
        self.pick_pos = torch.from_numpy(sel % seq_len)

    def active(self, i: int, a: torch.Tensor) -> torch.Tensor:
        return a.abs() > self.thresholds[i] if self.adapter.thresholded else a != 0

    def on_activation(self, i: int, a: torch.Tensor):
        """Counts and magnitudes of a batch's activations, its sampled rows' masks; a thresholded model's
        activations below the threshold zeroed in place (the sparsified forward). The statistics go STAT_ROWS
        rows at a time: their temporaries stay small beside the activations (235 MB a batch at 70B's width)."""
        a = a.contiguous()   # a no-op for every adapter's activation module; `flat` must be a view of `a`
        flat = a.detach().view(-1, a.shape[-1])
        for start in range(0, flat.shape[0], STAT_ROWS):
            chunk = flat[start:start + STAT_ROWS]
            size = chunk.abs()
            active = self.active(i, chunk)
            self.counts[i] += active.sum(0).cpu()
            self.magnitude[i] += size.mul_(active).sum(0).double().cpu()
            if self.sparsify and self.adapter.thresholded:
                chunk.mul_(active)
        if self.pick is not None and len(self.pick):
            mask = self.active(i, flat[self.pick.to(flat.device)]).cpu().numpy()
            buf = self.buffers[i]
            buf["mask"].append(np.packbits(mask, axis=1, bitorder="little"))
            buf["seq"].append(self.pick_seq)
            buf["pos"].append(self.pick_pos)
            self.rows[i] += len(self.pick)
            if sum(len(m) for m in buf["mask"]) >= SHARD_ROWS:
                self.flush(i)
        return a if self.sparsify and self.adapter.thresholded else None

    def state(self) -> dict:
        """Everything needed to continue after the rows flushed so far (call flush_all first)."""
        return {"counts": torch.stack(self.counts), "magnitude": torch.stack(self.magnitude),
                "rows": torch.tensor(self.rows), "shards": torch.tensor(self.shards), "sha256": dict(self.sha256)}

    def load_state(self, state: dict) -> None:
        """`state` as _checked_checkpoint returns it."""
        self.counts = list(state["counts"].clone())
        self.magnitude = list(state["magnitude"].clone())
        self.rows = state["rows"].tolist()
        self.shards = state["shards"].tolist()
        self.sha256 = dict(state["sha256"])

    def flush_all(self) -> None:
        for i in range(len(self.buffers)):
            self.flush(i)

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
        name = shard_name(i, self.shards[i])
        data = safetensors_bytes(tensors)
        with atomic_file(self.sample_dir / name) as tmp:
            tmp.write_bytes(data)
        self.sha256[name] = bytes_sha256(data)
        self.shards[i] += 1
        self.buffers[i] = {"x": [], "mask": [], "seq": [], "pos": []}


def profile_pass(model, adapter, seqs: torch.Tensor, thresholds: list[float], batch: int,
                 chosen: np.ndarray, sample_dir: Path, rec: _Recorder | None = None, start_seq: int = 0,
                 checkpoint=None) -> tuple[_Recorder, float]:
    """A sparsified pass over seqs[start_seq:], recording counts and the rows at flat indices `chosen`.

    `checkpoint(rec, next_seq)` is called every checkpoint_every(...) batches after all rows are flushed,
    so an interrupted pass can continue from `next_seq` without counting anything twice.
    """
    n_seq, seq_len = seqs.shape
    every = checkpoint_every(-(-(n_seq - start_seq) // batch))
    rec = rec or _Recorder(adapter, thresholds, sample_dir, sparsify=True)
    handles = arch_mod.install_taps(adapter, model, on_input=rec.on_input, on_activation=rec.on_activation)
    device = next(model.parameters()).device
    t0 = time.perf_counter()
    try:
        with torch.no_grad(), progress_bar(total=seqs.numel(), initial=start_seq * seq_len, desc="profiling",
                                           unit="tok", unit_scale=True) as bar:
            for n_batch, start in enumerate(range(start_seq, n_seq, batch), 1):
                rows = seqs[start:start + batch]
                rec.select_rows(chosen, start, len(rows), seq_len)
                model(input_ids=rows.to(device), use_cache=False)
                bar.update(rows.numel())
                if checkpoint is not None and n_batch % every == 0 and start + batch < n_seq:
                    rec.flush_all()
                    checkpoint(rec, start + len(rows))
    finally:
        for h in handles:
            h.remove()
    elapsed = time.perf_counter() - t0
    rec.flush_all()
    return rec, elapsed


def checkpoint_every(n_batches: int) -> int:
    """Batches between checkpoints: CHECKPOINT_BATCHES, or fewer so that a short run (8192 tokens: 4 batches of 4
    sequences of 512) checkpoints too, about 4 times."""
    return max(1, min(CHECKPOINT_BATCHES, n_batches // 4))


def partial_dir(out: Path) -> Path:
    """Where an unfinished profile of `out` lives until it is complete (kept for --resume)."""
    return out.parent / f".{out.name}.partial"


def _save_checkpoint(work: Path, rec: _Recorder, next_seq: int) -> None:
    save_checkpoint(work / "checkpoint.pt", {**rec.state(), "next_seq": torch.tensor(next_seq)})


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
    """Profile a model into opts.out and return the profile.json contents.

    Work happens in partial_dir(opts.out), checkpointed every few batches; the finished directory is
    renamed into place, so an interrupted run never leaves a partial profile under the final name. A second
    run to the same output while one is going is refused (they would share the partial directory).
    """
    with output_lock(opts.out, wait=False):
        try:
            return _run_profile(opts)
        except UserError:   # its own line already, whatever it was raised from
            raise
        except Exception as exc:
            failure = write_failure(exc)
            if failure is None:
                raise
            raise UserError(_disk_full(partial_dir(opts.out), failure)) from None


def _disk_full(work: Path, message: str) -> str:
    """The line for a write that failed for want of space: work that --resume can continue is kept (saying so and
    its size); anything else is removed, so that it does not keep the disk full."""
    what = message.rpartition("; ")[0] or message
    if (work / "identity.json").is_file():
        size = sum(p.stat().st_size for p in work.rglob("*") if p.is_file())
        return (f"{what}: the profile so far is kept in {work} ({size / 2**20:.1f} MiB); free space and rerun with "
                "--resume, or delete it")
    shutil.rmtree(work, ignore_errors=True)
    return f"{what}; nothing was kept"


def _run_profile(opts: ProfileOptions) -> dict:
    check_output_dir(opts.out, opts.force)
    work = partial_dir(opts.out)
    if not opts.resume and (work / "identity.json").is_file() and not opts.force:
        raise UserError(f"an interrupted profile of {opts.out} is kept in {work}: continue it with --resume (same "
                        "options), or start over with --force (which deletes it)")
    from powerinfer_tools.stages.profiling import expert_profile

    if (moe := expert_profile.mixture_file(opts.model)) is not None:
        return expert_profile.run(opts, moe, FORMAT, partial_dir(opts.out), DEFAULT_SEQ_LEN)
    source = models.resolve(opts.model)
    config = models.load_config(source)
    if (named := arch_mod.for_config(config)).experts:
        raise UserError(f"{named.name} is a mixture of experts: its expert profile records the engine's routing of a "
                        f"converted file (pi-tools convert -m {opts.model} -o MODEL.gguf, then profile -m MODEL.gguf)")
    adapter = arch_mod.for_neurons(config)
    ctx = _context_length(config)
    seq_len = opts.seq_len or min(DEFAULT_SEQ_LEN, ctx or DEFAULT_SEQ_LEN)
    if opts.tokens <= 0 or seq_len <= 1 or opts.batch <= 0 or opts.max_samples < 0:
        raise UserError("--tokens, --seq-len (>1), --batch must be positive and --max-samples non-negative")
    if ctx is not None and seq_len > ctx:
        raise UserError(f"--seq-len {seq_len} is larger than the model's context length {ctx}")
    from powerinfer_tools.stages.profiling import calibration  # with transformers: not for a reader of counts (plan)

    from powerinfer_tools.stages.profiling import input_sparsity

    if opts.input_allocation not in (*input_sparsity.ALLOCATIONS, "none"):
        raise UserError(f"--input-allocation must be {', '.join(input_sparsity.ALLOCATIONS)} or none, got "
                        f"{opts.input_allocation!r}")
    texts = [calibration.read_text(p) for p in opts.calib]   # validate input before the slow load
    dims = adapter.dims()
    targets = _per_layer_targets(opts.target_sparsity, dims.n_layer) if adapter.thresholded else None
    if opts.device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda: no CUDA device is available")
    load = choose_load(opts, adapter)
    if load == "layer" and not texts:
        raise UserError("a profile layer by layer needs --calib text: data-free calibration generates its text with "
                        "the whole model (--load whole, if it fits in memory)")

    if load == "whole":
        model, adapter = models.load_model(source, device=opts.device, dtype=opts.dtype)
    else:
        from powerinfer_tools.models.layerwise import LayerwiseModel

        device = "cuda" if opts.device == "auto" and torch.cuda.is_available() else \
            "cpu" if opts.device == "auto" else opts.device
        model = LayerwiseModel(source, adapter, device=device, dtype=opts.dtype)
        print(f"pi-tools profile: {source.spec} one layer at a time ({dims.n_layer} layers, {opts.dtype} on {device})")
    identity = {"model": _model_identity(opts.model, source, config, adapter), "calib": [str(p) for p in opts.calib],
                "tokens": opts.tokens, "seq_len": seq_len, "targets": targets, "max_samples": opts.max_samples,
                "seed": opts.seed, "load": load}
    if opts.resume:
        plan = _resume_plan(work, identity, dims.n_layer, dims.n_ff)
        where = (f"from sequence {plan['next_seq']} of {len(plan['seqs'])}" if load == "whole" else
                 f"at layer {plan['next_layer']} of {dims.n_layer}")
        print(f"pi-tools profile: resuming {opts.out} {where}")
    else:
        shutil.rmtree(work, ignore_errors=True)
        with naming_output(opts.out):  # before the calibration text is made: minutes, data-free
            work.mkdir(parents=True)
        try:
            plan = _fresh_plan(model if load == "whole" else None, adapter, source, texts, seq_len, targets, opts)
        except BaseException:
            shutil.rmtree(work, ignore_errors=True)  # nothing saved yet that --resume could use
            raise
        with atomic_file(work / "inputs.pt") as tmp:
            torch.save({"seqs": plan["seqs"], "thresholds": torch.tensor(plan["thresholds"], dtype=torch.float64),
                        "chosen": torch.from_numpy(plan["chosen"])}, tmp)
        saved = {**identity, "calibration": plan["calibration"], "inputs_sha256": file_sha256(work / "inputs.pt")}
        with atomic_file(work / "identity.json") as tmp:   # last: with it, the work is one --resume continues
            tmp.write_text(json.dumps(saved))

    seqs, thresholds, chosen = plan["seqs"], plan["thresholds"], plan["chosen"]
    n_seq, seq_len = seqs.shape
    rec = _Recorder(adapter, thresholds, work / "samples", sparsify=True)
    if plan.get("state"):
        rec.load_state(plan["state"])
    try:
        if load == "whole":
            rec, elapsed = profile_pass(model, adapter, seqs, thresholds, opts.batch, chosen, work / "samples",
                                        rec=rec, start_seq=plan["next_seq"],
                                        checkpoint=lambda r, nxt: _save_checkpoint(work, r, nxt))
            done = (n_seq - plan["next_seq"]) * seq_len
        else:
            from powerinfer_tools.stages.profiling import profile_layers

            sampler = ThresholdSampler(dims.n_layer, seqs, opts.batch, opts.seed) if targets is not None else None
            thresholds, elapsed, layers_run = profile_layers.streamed_pass(
                model, adapter, seqs, targets, opts.batch, chosen, work, rec, sampler, plan["next_layer"],
                thresholds)
            done = n_seq * seq_len * layers_run / dims.n_layer   # tokens through the whole model, in layers run now
    except KeyboardInterrupt:
        if (work / "identity.json").is_file():
            print(f"pi-tools profile: the work so far is kept in {work}: the same command with --resume continues "
                  "it", file=sys.stderr)
        raise
    input_allocation = opts.input_allocation if load == "whole" else "none"
    if load != "whole" and opts.input_allocation != "none":
        print("pi-tools profile: input thresholds are calibrated on the whole model (--load whole); this profile "
              "has none")
    if input_allocation != "none":   # on the dense model: the pass's taps are gone
        input_sparsity.calibrate(model, adapter, seqs, input_allocation, opts.batch, opts.seed).save(work)
    n_total = n_seq * seq_len
    (work / "activation").mkdir(exist_ok=True)
    (work / "magnitude").mkdir(exist_ok=True)
    layers = []
    digests = {f"samples/{name}": digest for name, digest in sorted(rec.sha256.items())}
    if input_allocation != "none":
        digests[input_sparsity.FILE] = file_sha256(work / input_sparsity.FILE)
    for i in range(dims.n_layer):
        for name, value in ((f"activation/activation_{i}.pt", rec.counts[i].clone()),
                            (f"magnitude/magnitude_{i}.pt", rec.magnitude[i].float().clone())):
            torch.save(value, work / name)
            digests[name] = file_sha256(work / name)
        density = float(rec.counts[i].sum()) / (n_total * dims.n_ff)
        layers.append({"layer": i, "sparsity": 1.0 - density, **skew(rec.counts[i])})
    profile = {
        "format": FORMAT,
        "model": identity["model"],
        "rule": "threshold" if adapter.thresholded else "nonzero",
        "thresholds": thresholds,
        "target_sparsity": targets,
        "tokens": n_total, "sequences": n_seq, "seq_len": seq_len, "calibration": plan["calibration"],
        "samples": {"rows": int(len(chosen)), "x_dtype": "float16", "shard_rows": SHARD_ROWS},
        "load": load,
        "input_sparsity": input_allocation if input_allocation != "none" else None,
        "tokens_per_second": done / elapsed if elapsed > 0 and done else None,
        "layers": layers,
        "sha256": digests,
    }
    profile["digest"] = profile_digest(profile)
    (work / "profile.json").write_text(json.dumps(profile, indent=2))
    for scratch in SCRATCH:
        for path in work.glob(scratch):
            path.unlink(missing_ok=True)
    check_output_dir(opts.out, opts.force)
    publish_dir(work, opts.out)
    return profile


SCRATCH = ("inputs.pt", "identity.json", "checkpoint.pt", "layer_checkpoint.pt", "hidden_*.bin", "dense_*.bin")
WHOLE_MODEL_SHARE = 0.5   # --load auto: the whole model when its weights take at most this share of free memory


def weight_bytes(adapter, dtype: str) -> int:
    """The model's weights in `dtype` (from its config: the network built on the meta device)."""
    from powerinfer_tools.models.source_weights import MetaShapes

    element = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    return sum(math.prod(shape) for shape in MetaShapes(adapter).shapes.values()) * element


def available_memory(device: str) -> int:
    """Bytes free for the weights: the CUDA device's free memory, or the host's available memory."""
    if device == "cuda" and torch.cuda.is_available():
        return int(torch.cuda.mem_get_info()[0])
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def choose_load(opts: ProfileOptions, adapter) -> str:
    """'whole' (transformers loads the model, as before) or 'layer' (models.layerwise): --load, or for auto the
    whole model where its weights fit in WHOLE_MODEL_SHARE of the memory free now, and always for --device auto
    (accelerate's device map spreads it)."""
    if opts.load not in ("auto", "layer", "whole"):
        raise UserError(f"--load must be auto, layer or whole, got {opts.load!r}")
    if opts.load != "auto":
        if opts.load == "layer" and opts.device == "auto":
            raise UserError("--device auto spreads the whole model over the devices; with --load layer give "
                            "--device cpu or cuda")
        return opts.load
    if opts.device == "auto":
        return "whole"
    need, have = weight_bytes(adapter, opts.dtype), available_memory(opts.device)
    return "whole" if need <= WHOLE_MODEL_SHARE * have else "layer"


def _fresh_plan(model, adapter, source, texts, seq_len, targets, opts) -> dict:
    """Calibration sequences, thresholds and the sampled row positions of a new profile. Without `model` (a profile
    layer by layer), the thresholds are placed layer by layer during the pass and are zeros here."""
    from powerinfer_tools.stages.profiling import calibration

    tokenizer = models.load_tokenizer(source)
    if texts:
        seqs = calibration.sequences_from_text(tokenizer, texts, seq_len, opts.tokens)
        calib_desc = [str(p) for p in opts.calib]
    else:
        print("pi-tools profile: no --calib given: data-free calibration on text the model generates itself")
        seqs = calibration.self_generated(model, tokenizer, seq_len, opts.tokens, opts.seed)
        calib_desc = "self-generated"
    n_layer = adapter.dims().n_layer
    thresholds = ([0.0] * n_layer if targets is None or model is None
                  else calibrate_thresholds(model, adapter, seqs, targets, opts.batch, opts.seed))
    rng = np.random.default_rng(opts.seed)
    chosen = np.sort(rng.choice(seqs.numel(), size=min(opts.max_samples, seqs.numel()), replace=False))
    return {"seqs": seqs, "thresholds": thresholds, "chosen": chosen, "calibration": calib_desc, "next_seq": 0,
            "next_layer": 0}


def _saved_identity(work: Path) -> dict:
    """identity.json of an interrupted profile, checked for the fields a resume reads."""
    path = work / "identity.json"
    try:
        saved = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError):
        raise UserError(f"{path} is damaged (not JSON): {RESTART}") from None
    if not isinstance(saved, dict) or not isinstance(saved.get("inputs_sha256"), str) \
            or not isinstance(saved.get("calibration"), (str, list)):
        raise UserError(f"{path} is not the identity of an interrupted profile of this version: {RESTART}")
    return saved


def _checked_inputs(path: Path, n_layer: int, seq_len: int) -> dict:
    """inputs.pt (already matched with its digest): the sequences, thresholds and sampled rows, of their kinds."""
    inputs = load_pt(path, "profile inputs")
    bad = UserError(f"{path} does not hold this profile's sequences, thresholds and sampled rows: {RESTART}")
    if not isinstance(inputs, dict) or set(inputs) != {"seqs", "thresholds", "chosen"} \
            or not all(isinstance(v, torch.Tensor) for v in inputs.values()):
        raise bad
    seqs, thresholds, chosen = inputs["seqs"], inputs["thresholds"], inputs["chosen"]
    if seqs.dtype != torch.int64 or seqs.dim() != 2 or seqs.shape[1] != seq_len \
            or not is_thresholds(thresholds, n_layer) or chosen.dtype != torch.int64 or chosen.dim() != 1 \
            or (chosen.numel() and not 0 <= int(chosen.min()) <= int(chosen.max()) < seqs.numel()):
        raise bad
    return inputs


def _resume_plan(work: Path, identity: dict, n_layer: int, n_ff: int) -> dict:
    """The saved plan and progress of an interrupted profile, checked against the current options, and every file
    it continues from against the digest recorded when that file was written."""
    if not (work / "identity.json").is_file() or not (work / "inputs.pt").is_file():
        raise UserError(f"nothing to resume: no interrupted profile at {work}")
    saved = _saved_identity(work)
    calib, inputs_sha256 = saved.pop("calibration"), saved.pop("inputs_sha256")
    if json.loads(json.dumps(identity)) != saved:
        raise UserError("--resume: the interrupted profile was started with other options or another model; "
                        "rerun without --resume to start over")
    check_file(work / "inputs.pt", inputs_sha256, RESTART)
    inputs = _checked_inputs(work / "inputs.pt", n_layer, identity["seq_len"])
    plan = {"seqs": inputs["seqs"], "thresholds": inputs["thresholds"].tolist(), "chosen": inputs["chosen"].numpy(),
            "calibration": calib, "next_seq": 0, "next_layer": 0, "state": None}
    if identity["load"] == "layer":
        from powerinfer_tools.stages.profiling import profile_layers

        path = work / profile_layers.CHECKPOINT
        if path.is_file():
            plan.update(profile_layers.resume_point(path, n_layer, n_ff))
        return plan   # profile_layers.streamed_pass drops the rows of layers after the checkpoint
    path = work / "checkpoint.pt"
    if path.is_file():
        state = checked_checkpoint(path, n_layer, n_ff, ("next_seq",))
        next_seq = state.pop("next_seq")
        if not is_position(next_seq, 0, len(inputs["seqs"])):
            raise UserError(f"{path} does not hold a position in this profile's sequences: {RESTART}")
        checked_shards(path, state, range(n_layer))
        plan["next_seq"], plan["state"] = int(next_seq), state
        for i, n in enumerate(state["shards"].tolist()):   # drop shards written after the checkpoint
            for shard in sorted((work / "samples" / f"layer_{i}").glob("shard_*.safetensors"))[n:]:
                shard.unlink()
    else:
        shutil.rmtree(work / "samples", ignore_errors=True)
    return plan


def summary_lines(profile: dict) -> list[str]:
    """profile.json in a few lines: the model, then each layer's threshold, sparsity and hot-neuron shares."""
    m = profile["model"]
    lines = [f"\n{m['arch']} ({m['activation']}), {m['n_layer']} layers x {m['n_ff']} neurons, "
             f"{profile['tokens']} tokens profiled"
             + (f" at {profile['tokens_per_second']:.0f} tok/s" if profile.get("tokens_per_second") else ""),
             f"{'layer':>5} {'threshold':>10} {'sparsity':>9} {'hot10%':>7} {'hot20%':>7} {'hot50%':>7}"]
    for row, t in zip(profile["layers"], profile["thresholds"]):
        lines.append(f"{row['layer']:>5} {t:>10.4g} {row['sparsity']:>9.3f} {row['hot10']:>7.3f} "
                     f"{row['hot20']:>7.3f} {row['hot50']:>7.3f}")
    lines.append("hotN% = share of all activations served by the hottest N% of the layer's neurons")
    return lines


def load_profile(directory: str | Path) -> dict:
    """profile.json of a profile directory, checked for format and completeness."""
    directory = Path(directory)
    path = directory / "profile.json"
    if not path.is_file():
        raise UserError(f"{directory} is not a profile directory (no profile.json); run 'pi-tools profile' first")
    try:
        profile = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"{path} is not valid JSON ({exc})") from None
    if not isinstance(profile, dict):
        raise UserError(f"{path} is not a profile: a JSON {type(profile).__name__}, not an object")
    if profile.get("format") != FORMAT:
        raise UserError(f"{path}: unknown profile format {profile.get('format')!r} (expected {FORMAT})")
    check_profile_digest(profile, path)
    if "thresholds" in profile:
        check_thresholds(profile["thresholds"], path)
    digests = profile.get("sha256", {})
    if not isinstance(digests, dict) or not all(isinstance(v, str) for v in digests.values()):
        raise UserError(f"{path}: 'sha256' must map the profile's files to their digests")
    return profile


def _activation_folder(directory: Path) -> Path | None:
    if (directory / "activation").is_dir():
        return directory / "activation"
    if (directory / "activation_0.pt").is_file():
        return directory
    return None


def has_activation_counts(directory: str | Path) -> bool:
    return _activation_folder(Path(directory)) is not None


def activation_dir(directory: str | Path) -> Path:
    """DIR/activation of a profile; a bare directory of activation_{i}.pt files (as PowerInfer ships) also works."""
    folder = _activation_folder(Path(directory))
    if folder is None:
        raise UserError(f"{directory}: no activation/ directory (run `pi-tools profile --out {directory}` first)")
    return folder


def load_activation_counts(directory: str | Path, n_layer: int,
                           n_ff: Sequence[int] | None = None) -> list[torch.Tensor]:
    """activation_{i}.pt of every layer (PowerInfer's layout), loaded safely and checked against the model:
    files for exactly layers 0..n_layer-1, each a 1-D real tensor of finite, non-negative counts, one per
    neuron (n_ff[i] of them, when given)."""
    folder = activation_dir(directory)
    found = sorted(int(m.group(1)) for p in folder.iterdir() if (m := re.fullmatch(r"activation_(\d+)\.pt", p.name)))
    if found != list(range(n_layer)):
        missing = [i for i in range(n_layer) if i not in found]
        extra = [i for i in found if i >= n_layer]
        what = (f"activation_{missing[0]}.pt is missing" if len(missing) == 1 else
                f"the activation files of layers {', '.join(map(str, missing))} are missing" if missing else
                f"it has activation files for layers {', '.join(map(str, extra))}")
        raise UserError(f"{folder}: {what}, but the model has {n_layer} layers (0-{n_layer - 1})")
    counts = []
    directory = Path(directory)
    digests = recorded_digests(directory) if folder == directory / "activation" else {}
    for i in range(n_layer):
        path = folder / f"activation_{i}.pt"
        check_recorded(directory, f"activation/{path.name}", digests)
        value = checked_tensor(load_pt(path, "activation file"), str(path), "the counts", ndim=1, integers=True)
        if n_ff is not None and value.numel() != n_ff[i]:
            raise UserError(f"{path}: {value.numel()} counts, but layer {i} of the model has {n_ff[i]} neurons")
        if bool((value < 0).any()):
            raise UserError(f"{path}: counts contain negative values (min {float(value.min()):g})")
        counts.append(value)
    return counts
