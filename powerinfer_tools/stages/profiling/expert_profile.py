"""Expert profiles (issue 67, item 2): which experts a mixture of experts' routers choose over calibration text, as the
engine routes them (Model.set_expert_trace), and how soon each choice recurs. Two measures decide between a fixed hot
set of experts (kept in memory or on a GPU) and a cache of recently used ones:

- static skew: the share of a layer's selections its C most selected experts take (a hot set of C, chosen with
  hindsight on the same tokens: an upper bound for a hot set chosen beforehand);
- temporal locality: the hit rate of an LRU cache of C experts per layer, exact from the selections' stack distances
  (Mattson et al. 1970): a layer's selections in order (tokens in order, each token's experts most probable first),
  a selection's stack distance being the number of distinct other experts the layer chose since it last chose this
  one; an LRU of C experts hits exactly the selections at a distance below C.

Also recorded: the reuse distance in tokens (how many tokens since the layer last chose the expert), and the choices
themselves in order (the trace), from which `plan` prices each layer's pinned experts and cache against the stream
(stages/placement/expert_tiers.py). The tokens are one stream across the calibration's sequences, as a server's cache
would see them one after another.

This module owns the record and its file (experts.npz beside profile.json, whose `experts` field names it).
"""
from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from powerinfer_tools.core.atomic import atomic_file
from powerinfer_tools.core.errors import UserError

FILE = "experts.npz"
REUSE_BINS = 1024        # token reuse distances 1..REUSE_BINS-1 each in its bin; REUSE_BINS: that far or farther
HOT_SHARE = 0.10         # the report's static skew: the share of selections the top 10 % of experts take


@dataclass
class ExpertProfile:
    """Per layer (rows; a layer without experts is all zeros): selections per expert, their token reuse distances
    and their LRU stack distances, as histograms."""

    n_expert: int
    top_k: int
    counts: np.ndarray  # [n_layer, n_expert] int64: selections of each expert
    reuse: np.ndarray   # [n_layer, REUSE_BINS + 1] int64: bin 0 first selections, bin d distance d (last: >= REUSE_BINS)
    stack: np.ndarray   # [n_layer, n_expert + 1] int64: bin s stack distance s, bin n_expert first selections
    trace: np.ndarray | None = None  # [tokens, n_layer, top_k] int16: the choices in order (-1: no experts); None in
    # profiles made before it was recorded

    @classmethod
    def empty(cls, n_layer: int, n_expert: int, top_k: int) -> "ExpertProfile":
        z = lambda n: np.zeros((n_layer, n), dtype=np.int64)  # noqa: E731
        return cls(n_expert, top_k, z(n_expert), z(REUSE_BINS + 1), z(n_expert + 1),
                   np.zeros((0, n_layer, top_k), dtype=np.int16))

    @property
    def n_layer(self) -> int:
        return int(self.counts.shape[0])

    def routed_layers(self) -> np.ndarray:
        """The layers with experts (selections recorded)."""
        return np.flatnonzero(self.counts.sum(axis=1) > 0)

    def selections(self) -> np.ndarray:
        """[n_layer] selections recorded per layer (tokens * top_k where the layer has experts)."""
        return self.counts.sum(axis=1)

    def hot_set_share(self, c: int) -> np.ndarray:
        """[n_layer] share of each layer's selections its c most selected experts take."""
        top = -np.sort(-self.counts, axis=1)[:, :c].sum(axis=1)
        return top / np.maximum(self.selections(), 1)

    def lru_hit_rate(self, c: int) -> np.ndarray:
        """[n_layer] share of each layer's selections an LRU cache of c experts would have held (first selections
        miss)."""
        return self.stack[:, :min(c, self.n_expert)].sum(axis=1) / np.maximum(self.selections(), 1)

    def median_reuse(self) -> np.ndarray:
        """[n_layer] median token reuse distance of the selections that recur (REUSE_BINS: that or farther; 0: none
        recur)."""
        recur = self.reuse[:, 1:]
        cum = np.cumsum(recur, axis=1)
        half = (cum[:, -1] + 1) // 2
        return np.where(cum[:, -1] > 0, np.argmax(cum >= half[:, None], axis=1) + 1, 0)

    def trace_fits(self) -> bool:
        """Whether the trace has this profile's shape and ids and gives its counts."""
        t = self.trace
        if t.dtype != np.int16 or t.ndim != 3 or t.shape[1:] != (self.n_layer, self.top_k) \
                or (t >= self.n_expert).any() or (t < -1).any():
            return False
        routed = self.routed_layers()
        if (t[:, routed] < 0).any():
            return False
        counted = np.zeros_like(self.counts)
        for il in routed:
            counted[il] = np.bincount(t[:, il].ravel(), minlength=self.n_expert)
        return bool((counted == self.counts).all())

    def save(self, path: Path) -> None:
        buf = io.BytesIO()
        trace = {} if self.trace is None else {"trace": self.trace}
        np.savez(buf, n_expert=self.n_expert, top_k=self.top_k, counts=self.counts, reuse=self.reuse,
                 stack=self.stack, **trace)
        with atomic_file(path) as tmp:
            tmp.write_bytes(buf.getvalue())

    @classmethod
    def load(cls, path: Path) -> "ExpertProfile":
        """experts.npz, checked for its fields' shapes and their agreement (one line naming the file otherwise)."""
        bad = UserError(f"{path} is not an expert profile of this version: profile again")
        try:
            with np.load(path, allow_pickle=False) as z:
                f = {k: z[k] for k in ("n_expert", "top_k", "counts", "reuse", "stack")}
                trace = z["trace"] if "trace" in z.files else None
        except (OSError, KeyError, ValueError):
            raise bad from None
        n, k = int(f["n_expert"]), int(f["top_k"])
        p = cls(n, k, f["counts"], f["reuse"], f["stack"], trace)
        if trace is not None and not p.trace_fits():
            raise bad
        return p


class ExpertRecorder:
    """An ExpertProfile accumulated from the engine's routing, batch after batch of tokens (one stream)."""

    def __init__(self, n_layer: int, n_expert: int, top_k: int):
        self._profile = ExpertProfile.empty(n_layer, n_expert, top_k)
        self._chunks = []  # the trace's batches since it was last joined (joined once, not at every batch)
        self.tokens = 0
        self._last_token = np.full((n_layer, n_expert), -1, dtype=np.int64)  # the token that last chose it
        self._last_use = np.full((n_layer, n_expert), -1, dtype=np.int64)    # the selection that last chose it
        self._uses = 0

    @property
    def profile(self) -> ExpertProfile:
        if self._chunks:
            self._profile.trace = np.concatenate([self._profile.trace, *self._chunks])
            self._chunks = []
        return self._profile

    def add(self, choices: np.ndarray) -> None:
        """choices: [n_tok, n_layer, top_k] expert ids as Model.expert_choices gives them (-1: no experts)."""
        p = self._profile
        n_tok, n_layer, k = choices.shape
        if n_layer != p.n_layer or k != p.top_k:
            raise ValueError(f"choices of shape {choices.shape} for a profile of {p.n_layer} layers, top-{p.top_k}")
        self._chunks.append(choices.astype(np.int16))
        layers = np.flatnonzero(choices[0, :, 0] >= 0)
        for t in range(n_tok):
            for i in range(k):
                e = choices[t, layers, i].astype(np.int64)
                prev = self._last_token[layers, e]
                d = np.where(prev >= 0, np.minimum(self.tokens - prev, REUSE_BINS), 0)
                np.add.at(p.reuse, (layers, d), 1)
                used = self._last_use[layers, e]
                since = (self._last_use[layers] > used[:, None]).sum(axis=1)
                np.add.at(p.stack, (layers, np.where(used >= 0, since, p.n_expert)), 1)
                np.add.at(p.counts, (layers, e), 1)
                self._last_token[layers, e] = self.tokens
                self._last_use[layers, e] = self._uses
                self._uses += 1
            self.tokens += 1


def lru_sizes(n_expert: int, top_k: int) -> list[int]:
    """The cache sizes the report compares: from one token's experts up to half of them."""
    sizes = [c for c in (top_k, 2 * top_k, 4 * top_k, 8 * top_k, n_expert // 4, n_expert // 2) if top_k <= c < n_expert]
    return sorted(set(sizes))


def summary_lines(p: ExpertProfile, tokens: int) -> list[str]:
    """The expert profile in a few lines: per layer the top 10 %'s share against an LRU of as many experts."""
    hot = max(1, round(HOT_SHARE * p.n_expert))
    sizes = lru_sizes(p.n_expert, p.top_k)
    lines = [f"\n{p.n_expert} experts, top-{p.top_k}, {tokens} tokens profiled",
             f"{'layer':>5} {f'hot{hot}':>7} {f'lru{hot}':>7} " + " ".join(f"{f'lru{c}':>7}" for c in sizes)
             + f" {'reuse':>6}"]
    hot_share, lru_hot = p.hot_set_share(hot), p.lru_hit_rate(hot)
    lru = {c: p.lru_hit_rate(c) for c in sizes}
    med = p.median_reuse()
    for il in p.routed_layers():
        lines.append(f"{il:>5} {hot_share[il]:>7.3f} {lru_hot[il]:>7.3f} "
                     + " ".join(f"{lru[c][il]:>7.3f}" for c in sizes) + f" {med[il]:>6}")
    lines.append(f"hotN = share of selections the layer's N most selected experts take (a fixed hot set, chosen "
                 f"on these tokens); lruN = hit rate of an LRU of N experts; reuse = median tokens between a "
                 f"layer's selections of an expert")
    return lines


# ---- the profile run ---------------------------------------------------------------------------------------------

def mixture_file(spec: str) -> Path | None:
    """--model as a GGUF or PowerInfer file of a mixture of experts (its architecture's expert_count > 0), else None
    (a directory, another model, or not a model file: models.resolve says which)."""
    from powerinfer_tools.formats.gguf_header import read_header

    path = Path(spec).expanduser()
    if not path.is_file():
        return None
    try:
        header = read_header(path, tensors=False)
    except (UserError, ValueError, OSError):
        return None
    return path if int(header.get(f"{header.get('general.architecture')}.expert_count", 0) or 0) > 0 else None


def _refuse_neuron_options(opts) -> None:
    """The options of a neuron profile that an expert profile has nothing to apply to, refused in one line each."""
    from powerinfer_tools.stages.options import ProfileOptions

    default = ProfileOptions(model=opts.model, out=opts.out)
    for name, flag in (("target_sparsity", "--target-sparsity"), ("max_samples", "--max-samples"),
                       ("input_allocation", "--input-allocation"), ("load", "--load"), ("device", "--device"),
                       ("dtype", "--dtype"), ("resume", "--resume"), ("batch", "--batch")):
        if getattr(opts, name) != getattr(default, name):
            raise UserError(f"{flag} applies to the neurons of dense FFNs; an expert profile records the engine's "
                            "routing of the file as it is (leave it out)")
    if not opts.calib:
        raise UserError("an expert profile needs --calib text (data-free text is generated by a dense model's "
                        "transformers run)")


def run(opts, path: Path, profile_format: str, work: Path, default_seq_len: int) -> dict:
    """Profile the experts of the model file `path` (mixture_file) into opts.out, through the work directory `work`
    (profiling.py's, which owns the profile format `profile_format` and the default sequence length): the engine
    evaluates the calibration sequences with its expert trace on; returns profile.json's contents."""
    import json
    import time

    import powerinfer_engine as engine
    from powerinfer_tools.core.atomic import check_output_dir, naming_output, publish_dir
    from powerinfer_tools.core.digests import file_sha256
    from powerinfer_tools.core.progress import progress_bar
    from powerinfer_tools.formats.tokenizer import tokenizer_from_file
    from powerinfer_tools.stages.profiling import calibration
    from powerinfer_tools.stages.profiling.profile_files import profile_digest

    _refuse_neuron_options(opts)
    texts = [calibration.read_text(p) for p in opts.calib]
    with engine.Model(path, threads=opts.threads, ctx_size=opts.seq_len or default_seq_len) as m:
        info = m.info
        seq_len = opts.seq_len or min(default_seq_len, info["n_ctx_train"] or default_seq_len)
        if opts.tokens <= 0 or seq_len <= 1 or seq_len > m.n_ctx:
            raise UserError(f"--tokens must be positive and --seq-len from 2 to the model's context {m.n_ctx}")
        seqs = calibration.sequences_from_text(tokenizer_from_file(path), texts, seq_len, opts.tokens).numpy()
        rec = ExpertRecorder(info["n_layer"], info["n_expert"], info["n_expert_used"])
        m.set_expert_trace(True)
        t0 = time.perf_counter()
        for seq in progress_bar(seqs, desc="profile experts", unit="seq"):
            m.reset()
            m.eval_hidden(seq)
            rec.add(m.expert_choices(len(seq)))
        elapsed = time.perf_counter() - t0
    p = rec.profile
    import shutil

    shutil.rmtree(work, ignore_errors=True)
    with naming_output(opts.out):
        work.mkdir(parents=True)
    p.save(work / FILE)
    hot = max(1, round(HOT_SHARE * p.n_expert))
    hot_share, lru = p.hot_set_share(hot), p.lru_hit_rate(hot)
    profile = {
        "format": profile_format,
        "model": {"source": str(path), "arch": info["arch"], "activation": info["activation"],
                  "n_layer": info["n_layer"], "n_embd": info["n_embd"], "n_ff": info["n_ff_exp"]},
        "rule": "experts",
        "experts": {"file": FILE, "n_expert": p.n_expert, "top_k": p.top_k, "hot": hot},
        "tokens": rec.tokens, "sequences": int(len(seqs)), "seq_len": seq_len,
        "tokens_per_second": rec.tokens / elapsed if elapsed > 0 else None,
        "layers": [{"layer": int(il), "selections": int(p.selections()[il]), "hot": float(hot_share[il]),
                    "lru": float(lru[il])} for il in p.routed_layers()],
        "sha256": {FILE: file_sha256(work / FILE)},
    }
    profile["digest"] = profile_digest(profile)
    (work / "profile.json").write_text(json.dumps(profile, indent=2))
    check_output_dir(opts.out, opts.force)
    publish_dir(work, opts.out)
    return profile


def load(directory: Path, profile: dict) -> ExpertProfile:
    """The ExpertProfile of an expert profile directory (profile.json's contents given), its file checked against
    the digest profile.json recorded."""
    from powerinfer_tools.stages.profiling.profile_files import check_recorded

    check_recorded(Path(directory), FILE, profile.get("sha256"))
    return ExpertProfile.load(Path(directory) / FILE)


def verdict(p: ExpertProfile) -> str:
    """Fixed hot set or cache, from the layers' mean shares at a quarter of the experts."""
    c = max(p.top_k, p.n_expert // 4)
    layers = p.routed_layers()
    hot, lru = float(p.hot_set_share(c)[layers].mean()), float(p.lru_hit_rate(c)[layers].mean())
    better = "an LRU cache of recent experts" if lru > hot else "a fixed hot set of the most selected experts"
    return (f"With {c} of {p.n_expert} experts per layer kept, a fixed hot set (chosen on these same tokens) serves "
            f"{hot:.1%} of selections and an LRU cache {lru:.1%}: {better} holds more.")
