"""What converting a model would write, and what of it would fit in VRAM, from its config alone: no weights.

The model is built on torch's meta device (source_weights.MetaShapes), so transformers says which tensors the
checkpoint holds; the converter's own planning (convert.plan, tensor_type, add_header) turns them into the file's
tensors, types and header, and placement.costs_from_tensors into the byte costs `pi-tools plan` charges. Nothing
about tensor names or types is restated here.

A model is named by a bundled config (powerinfer_tools/configs/NAME.json: the public configs of the models
PowerInfer runs), a config.json, or a Hugging Face model directory (its config.json; its tokenizer too when
present, which makes the header exact; otherwise the vocabulary's bytes are estimated).
"""
from __future__ import annotations

import tempfile
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np

from powerinfer_tools.models import arch
from powerinfer_tools import models
from powerinfer_tools.stages.placement import placement
from powerinfer_tools.stages.conversion.conversion import (check_outtype, PlannedTensor, Predictors, add_header, encoded_nbytes, n_vocab_of, plan,
                                     stored_rank)
from powerinfer_tools.core.errors import UserError

CONFIG_DIR = Path(__file__).parents[2] / "configs"
DEFAULT_OUTTYPES = ("f16", "q8_0", "q4_0")
DEFAULT_PREDICTOR_FRACTION = 0.10  # train-predictor's --max-predictor-fraction default
TOKENIZER_FILES = ("tokenizer.model", "tokenizer.json", "vocab.json")
# Vocabulary bytes per token when no tokenizer is at hand: measured on SmolLM2's byte-level BPE vocabulary
# (tokens, types and merges: 1.77 MB for 49152 tokens); SentencePiece vocabularies (no merges) take less.
VOCAB_BYTES_PER_TOKEN = 36


def bundled_names() -> list[str]:
    return sorted(p.stem for p in CONFIG_DIR.glob("*.json"))


@dataclass
class ConfigModel:
    """A model known by its config: the adapter that converts it and, when at hand, its tokenizer."""

    spec: str
    name: str  # general.name in the file, as the converter would write it
    config: object
    adapter: arch.Arch
    tokenizer_dir: Path | None

    @cached_property
    def shapes(self):
        from powerinfer_tools.models.source_weights import MetaShapes

        return MetaShapes(self.adapter)


def load(spec: str) -> ConfigModel:
    """A bundled name, a config.json, or a model directory -> ConfigModel; UserError for anything else."""
    if spec in bundled_names():
        path, name, tokenizer_dir = CONFIG_DIR / f"{spec}.json", spec, None
    else:
        given = Path(spec).expanduser()
        if given.is_dir():
            path, name = given / "config.json", given.resolve().name
            if not path.is_file():
                raise UserError(f"{spec} has no config.json: not a Hugging Face model directory")
            has_tokenizer = any((given / f).is_file() for f in TOKENIZER_FILES)
            tokenizer_dir = given.resolve() if has_tokenizer else None
        elif given.is_file() and given.suffix == ".json":
            path, name, tokenizer_dir = given, given.resolve().parent.name, None
        else:
            raise UserError(f"unknown model '{spec}': give a bundled config ({', '.join(bundled_names())}), "
                            "a config.json, or a Hugging Face model directory")
    config = models.load_config_file(path, spec)
    adapter = arch.for_config(config)
    if adapter.experts:
        raise UserError(f"{spec}: {adapter.name} is a mixture of experts; the dry run sizes dense FFNs, their predictors "
                        "and their VRAM plan, not experts, in this version")
    return ConfigModel(spec, name, config, adapter, tokenizer_dir)


def predictor_rank_cap(adapter: arch.Arch, fraction: float = DEFAULT_PREDICTOR_FRACTION) -> int:
    """The rank at which each layer's predictor has `fraction` of the parameters of its FFN block: the cap
    train-predictor's --max-predictor-fraction puts on predictors (the largest they get by default)."""
    from powerinfer_tools.stages.predictors.predictor import rank_at_fraction

    dims = adapter.dims()
    return rank_at_fraction(dims.n_embd, dims.n_ff, adapter.gated, fraction)


@dataclass
class SizeReport:
    """The converted file of one outtype: its tensors, its bytes by part, and the VRAM costs they imply."""

    outtype: str
    predictor_rank: int  # 0: no predictors
    tensors: list[PlannedTensor]
    costs: placement.ModelCosts
    hparams: dict
    header_bytes: int  # metadata, vocabulary and tensor table
    vocab_estimated: bool  # no tokenizer at hand: the vocabulary's share of header_bytes is an estimate
    file_bytes: int
    source_bytes: int  # the Hugging Face checkpoint at its config's dtype

    def parts(self) -> dict[str, int]:
        """File bytes by part; they sum to file_bytes."""
        c = self.costs
        ffn = int(np.sum(c.n_ff * c.neuron_bytes))
        attention, predictors = int(c.attention_bytes.sum()), int(c.predictor_bytes.sum())
        data = sum(encoded_nbytes(t.shape, t.qtype) for t in self.tensors)
        return {"ffn": ffn, "attention": attention, "predictors": predictors, "output": c.output_bytes,
                "embeddings": data - ffn - attention - predictors - c.output_bytes,
                "header": self.file_bytes - data}

    def kv_cache_bytes(self, ctx_size: int) -> int:
        return self.costs.kv_bytes_per_layer(ctx_size) * self.costs.n_layer

    @property
    def context_length(self) -> int | None:
        return self.hparams.get(f"{self.costs.arch}.context_length")


def size_report(model: ConfigModel, outtype: str, predictor_rank: int | None = None) -> SizeReport:
    """What `pi-tools convert -t OUTTYPE` would write for this model with predictors of `predictor_rank`
    (default: the trainer's cap; 0: none)."""
    import gguf

    check_outtype(outtype)
    rank = predictor_rank_cap(model.adapter) if predictor_rank is None else int(predictor_rank)
    if rank < 0:
        raise UserError(f"--predictor-rank must be 0 (no predictors) or positive, not {rank}")
    n_layer = model.adapter.dims().n_layer
    predictors = Predictors.at_rank(n_layer, rank) if rank else None
    tensors = plan(model.adapter, model.shapes, predictors, outtype)
    n_vocab = n_vocab_of(tensors)
    add_vocab = None
    if model.tokenizer_dir is not None:
        from powerinfer_tools.formats.tokenizer import write_vocab

        def add_vocab(writer):
            write_vocab(writer, models.ModelSource(model.spec, model.tokenizer_dir), n_vocab)

    with tempfile.TemporaryDirectory(prefix="pi-tools-dry-run-") as tmp:
        header_file = Path(tmp) / "header.gguf"
        writer = gguf.GGUFWriter(header_file, model.adapter.gguf_arch)
        add_header(writer, model.adapter, model.name, outtype, predictors, [0.0] * n_layer, tensors, add_vocab)
        hparams = {key: value.value for key, value in writer.kv_data[0].items()}
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        writer.close()
        header = header_file.stat().st_size
    if add_vocab is None:
        header += n_vocab * VOCAB_BYTES_PER_TOKEN
    align = gguf.GGUF_DEFAULT_ALIGNMENT  # the writer pads the header and every tensor to this
    data = sum(gguf.GGUFWriter.ggml_pad(encoded_nbytes(t.shape, t.qtype), align) for t in tensors)
    costs = placement.costs_from_tensors(model.spec, hparams.get,
                                         [(t.name, t.shape, encoded_nbytes(t.shape, t.qtype)) for t in tensors])
    return SizeReport(outtype=outtype, predictor_rank=rank, tensors=tensors, costs=costs, hparams=hparams,
                      header_bytes=header, vocab_estimated=add_vocab is None,
                      file_bytes=gguf.GGUFWriter.ggml_pad(header, align) + data,
                      source_bytes=sum(model.shapes.stored_bytes.values()))


def describe(model: ConfigModel, report: SizeReport) -> str:
    """One line: the model's shape as the file will state it, and its checkpoint's size."""
    d, arch_name = model.adapter.dims(), report.costs.arch
    n_head = report.hparams[f"{arch_name}.attention.head_count"]
    n_kv = report.hparams.get(f"{arch_name}.attention.head_count_kv", n_head)
    return (f"{model.spec}: {model.adapter.name} -> {arch_name}, {d.n_layer} layers, n_embd {d.n_embd}, "
            f"n_ff {d.n_ff}, {n_head} heads / {n_kv} KV heads, context {report.context_length}; "
            f"checkpoint {placement.human_bytes(report.source_bytes)}")


def predictor_note(model: ConfigModel, reports: list[SizeReport]) -> str:
    """Which predictors the sizes include, why that rank, and the rank a quantized file stores them at."""
    rank = reports[0].predictor_rank
    if rank == 0:
        return "none (--predictor-rank 0)"
    cap = predictor_rank_cap(model.adapter)
    why = "train-predictor's cap: 10% of the FFN parameters" if rank == cap else "--predictor-rank"
    d = model.adapter.dims()
    stored: dict[int, list[str]] = {}
    for r in reports:
        stored.setdefault(stored_rank(rank, r.outtype, d.n_embd, d.n_ff), []).append(r.outtype)
    stored.pop(rank, None)
    padding = "".join(f"; stored at rank {s} in {'/'.join(types)} (whole 32-value blocks)" for s, types in stored.items())
    return f"rank {rank} in every layer ({why}){padding}"


@dataclass
class DryRunPlan:
    report: SizeReport
    plan: placement.Plan
    assumption: str | None  # how the activation counts were made up, None when they come from a profile


def plan_from_config(model: ConfigModel, outtype: str, vram_budget_bytes: float, profile_dir: str | Path | None = None,
                     predictor_rank: int | None = None, exponent: float = placement.SYNTHETIC_EXPONENT,
                     **options) -> DryRunPlan:
    """`pi-tools plan` for a model not converted yet: byte costs from its shapes, activation counts from a
    profile (PowerInfer's published activation files work) or, without one, the synthetic power law."""
    placement.check_options(vram_budget_bytes, options.get("ctx_size"),
                            options.get("reserve_bytes", placement.DEFAULT_RESERVE_BYTES),
                            options.get("dense", "all"))
    if not 0.0 < exponent < 2.0:
        raise UserError(f"the power-law exponent must be in (0, 2), not {exponent}")
    report = size_report(model, outtype, predictor_rank)
    costs = report.costs
    if profile_dir is not None:
        counts = placement.load_activation_counts(profile_dir, costs.n_ff)
        tokens, assumption = placement.profiled_tokens(profile_dir, counts), None
    else:
        counts = placement.synthetic_counts(costs.n_ff, exponent)
        tokens = placement.SYNTHETIC_TOKENS
        hot20 = _hot_share(counts[0], 0.2)
        assumption = (f"ASSUMED activation counts (no --profile): synthetic power law, neuron of rank r fires on "
                      f"min(1, {placement.SYNTHETIC_BASE_RATE} * (r/n_ff)^-{exponent:g}) of tokens "
                      f"({1 - float(counts[0].sum()) / (tokens * costs.n_ff[0]):.0%} sparse; hottest 20% of "
                      f"neurons fire {hot20:.0%} of activations). Real counts: --profile DIR")
    step = placement.parse_granularity(options.pop("granularity", 1), outtype == "q4_0")
    result = placement.plan_placement(costs, counts, tokens, vram_budget_bytes, granularity=step, **options)
    return DryRunPlan(report, result, assumption)


def _hot_share(counts: np.ndarray, fraction: float) -> float:
    ordered = np.sort(counts)[::-1]
    return float(ordered[:max(1, int(round(fraction * ordered.size)))].sum() / max(ordered.sum(), 1.0))
