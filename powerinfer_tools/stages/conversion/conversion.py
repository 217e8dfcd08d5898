"""Hugging Face model (+ predictors, + profile) -> PowerInfer GGUF (docs/formats.md, "Model file").

The file is planned first (names, shapes, types: known from the source's headers without reading
data), so that gguf-py can write the header and tensor table; then each tensor is loaded,
transformed (architecture adapter's TensorMap), cast or quantized and written before the next is
read. Peak memory is therefore about one source tensor in float32 plus its encoded copy.
The file is built under a temporary name and renamed at the end (atomic.py), then its magic
becomes `PWRI`. With a profile, each layer's FFN neurons are stored in the order of neuron_order.py
(hottest-first blocks; the order is recorded in the file).
"""
from __future__ import annotations

import dataclasses
import math
import json
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from powerinfer_tools.models import arch
from powerinfer_tools import models
from powerinfer_tools.formats import names, neuron_order, q4_0_scale
from powerinfer_tools.core.atomic import atomic_file
from powerinfer_tools.core.errors import UserError, write_failure
from powerinfer_tools.core.safe_load import load_pt
from powerinfer_tools.formats.gguf_io import set_pwri_magic
from powerinfer_tools.stages.profiling.input_sparsity import InputThresholds

OUTTYPES = ("f32", "f16", "q8_0", "q4_0")
# llama.cpp's names of the types the engine reads but does not compute with (docs/formats.md, "Weight types read")
DECODED_ONLY = re.compile(r"q[2-6]_k(_[sml])?|q4_1|q5_[01]|bf16")


def check_outtype(outtype: str) -> None:
    """UserError unless convert writes `outtype`; a type the engine would only decode at load says so."""
    if outtype in OUTTYPES:
        return
    choose = f"choose from {', '.join(OUTTYPES)}"
    if DECODED_ONLY.fullmatch(outtype.lower()):
        raise UserError(f"outtype '{outtype}' is not written: the engine reads such files (llama.cpp's) but decodes "
                        f"them at load to {'f16' if outtype.lower() == 'bf16' else 'q8_0'}, and PowerInfer's sparse "
                        f"kernels read f16 and q4_0 only, so the file would be smaller on disk and nothing else "
                        f"({choose}; q4_0 is the smallest that computes as stored)")
    raise UserError(f"unknown outtype '{outtype}' ({choose})")


def _qtype(outtype: str):
    import gguf

    return {"f32": gguf.GGMLQuantizationType.F32, "f16": gguf.GGMLQuantizationType.F16,
            "q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_0": gguf.GGMLQuantizationType.Q4_0}[outtype]


def _file_type(outtype: str):
    import gguf

    return {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
            "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0, "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0}[outtype]


@dataclass
class Predictors:
    """A validated predictor directory (docs/formats.md, "Predictor directory")."""

    files: list[Path]             # empty for predictors known by their ranks only (the dry run)
    ranks: list[int]
    thresholds: list[float]       # per-layer logit thresholds
    sparse_threshold: float       # PowerInfer's single global threshold
    useful: list[bool]            # per layer: train-predictor found it better than chance (PowerInfer's: all)

    @classmethod
    def at_rank(cls, n_layer: int, rank: int) -> Predictors:
        """Predictors of one rank in every layer, shapes only: what a dry run sizes."""
        return cls([], [rank] * n_layer, [0.0] * n_layer, 0.0, [True] * n_layer)


def load_predictors(directory: str | Path, dims: arch.Dims) -> Predictors:
    """Check every layer's predictor against the model's shapes before anything is written."""
    from powerinfer_tools.stages.predictors.predictor import check_state

    directory = Path(directory)
    if not directory.is_dir():
        raise UserError(f"predictor directory not found: {directory}")
    config_path = directory / "config.json"
    config = {}
    if config_path.is_file():
        try:
            config = json.loads(config_path.read_text())
        except json.JSONDecodeError as exc:
            raise UserError(f"{config_path}: invalid JSON ({exc.msg})") from None
    files, ranks = [], []
    for i in range(dims.n_layer):
        path = directory / f"model_{i}.pt"
        if not path.is_file():
            raise UserError(f"{directory}: predictor of layer {i} is missing ({path.name}); "
                            f"the model has {dims.n_layer} layers")
        fc1, _ = check_state(load_pt(path, "predictor", mmap=True), str(path), dims.n_embd, dims.n_ff)
        files.append(path)
        ranks.append(fc1.shape[0])
    layers = {entry.get("layer"): entry for entry in config.get("layers", [])}
    if layers and set(layers) != set(range(dims.n_layer)):
        raise UserError(f"{config_path}: 'layers' must list layers 0..{dims.n_layer - 1}")
    thresholds = [float(layers[i].get("threshold", 0.0)) if layers else 0.0 for i in range(dims.n_layer)]
    useful = [bool(layers[i].get("useful", True)) if layers else True for i in range(dims.n_layer)]
    sparse_threshold = float(config.get("sparse_threshold", 0.0))
    if not all(math.isfinite(t) for t in [*thresholds, sparse_threshold]):
        raise UserError(f"{config_path}: a predictor threshold is not a finite number")
    return Predictors(files, ranks, thresholds, sparse_threshold, useful)


@dataclass
class ThresholdFold:
    """PowerInfer compares every layer's predictor logits with one threshold T (powerinfer.sparse_threshold: its
    llama.cpp llm_load_hparams, ggml.c's sparse_pred_threshold); ours has one a layer, t_i. Scaling layer i's fc2
    by T / t_i scales its logits by that factor, which is positive where t_i and T share a sign: "logit > t_i"
    becomes "logit' > T" exactly, so PowerInfer selects the neurons our engine does. Thresholds of both signs (or
    0 beside others) cannot be folded: PowerInfer then selects other neurons in some layers."""

    threshold: float | None   # T, every layer's threshold after the fold; None where they cannot be folded
    scales: list[float]       # fc2's factor per layer (all 1.0 where nothing is folded)
    note: str = ""            # why they could not be folded


def fold_thresholds(predictors: Predictors) -> ThresholdFold:
    t = predictors.thresholds
    if all(x == t[0] for x in t):
        return ThresholdFold(t[0], [1.0] * len(t))
    if not (all(x > 0 for x in t) or all(x < 0 for x in t)):
        return ThresholdFold(None, [1.0] * len(t),
                             f"the per-layer predictor thresholds ({min(t):g} to {max(t):g}) do not share a sign, so "
                             "they cannot be folded into fc2: PowerInfer, which reads one threshold "
                             f"({predictors.sparse_threshold:g}) for every layer, selects other neurons than this "
                             "engine in the layers whose threshold differs")
    common = predictors.sparse_threshold if predictors.sparse_threshold * t[0] > 0 else min(t)
    return ThresholdFold(common, [common / x for x in t])


def load_activation_thresholds(profile_dir: str | Path, n_layer: int) -> list[float]:
    """Per-layer |a| thresholds a profile calibrated (0 for ReLU-family models)."""
    path = Path(profile_dir) / "profile.json"
    if not path.is_file():
        raise UserError(f"profile not found: {path}")
    from powerinfer_tools.stages.profiling.profile_files import check_profile_digest, check_thresholds

    try:
        profile = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise UserError(f"{path}: invalid JSON ({exc.msg})") from None
    if not isinstance(profile, dict):
        raise UserError(f"{path} is not a profile: a JSON {type(profile).__name__}, not an object")
    check_profile_digest(profile, path)
    return check_thresholds(profile.get("thresholds"), path, n_layer)


@dataclass
class PlannedTensor:
    name: str
    shape: tuple[int, ...]            # numpy shape in the file (before quantization)
    qtype: object                     # gguf.GGMLQuantizationType
    load: Callable[[], np.ndarray]    # float32 data in the file's layout
    sources: tuple[str, ...]          # what it is made from (bytes accounting): tensors or files


def tensor_type(shape: tuple[int, ...], outtype: str):
    """Norms and biases f32; matrices, the predictors' included (as PowerInfer quantizes them), the
    outtype, f16 where a row does not split into whole quantization blocks (an fc2 of rank 16)."""
    import gguf

    if len(shape) == 1:
        return gguf.GGMLQuantizationType.F32
    qtype = _qtype(outtype)
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    return qtype if shape[-1] % block == 0 else gguf.GGMLQuantizationType.F16


ENCODE_ROWS = 4096  # rows converted at a time: bounds the temporaries of casting and quantizing


def encode(data: np.ndarray, qtype) -> np.ndarray:
    """`data` (float32, maybe a transposed view) in the file's type, C order, built block by block so
    that the only full-size temporaries are the input and the (smaller) output."""
    import gguf

    if qtype == gguf.GGMLQuantizationType.F32 and data.flags.c_contiguous:
        return data
    if qtype in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
        out = np.empty(data.shape, np.float32 if qtype == gguf.GGMLQuantizationType.F32 else np.float16)
    else:
        out = np.empty(gguf.quants.quant_shape_to_byte_shape(data.shape, qtype), np.uint8)
    rows = data.reshape(-1, data.shape[-1]) if data.flags.c_contiguous else data
    flat = out.reshape(-1, out.shape[-1])
    for r in range(0, rows.shape[0], ENCODE_ROWS):
        block = np.ascontiguousarray(rows[r:r + ENCODE_ROWS], dtype=np.float32)
        flat[r:r + ENCODE_ROWS] = block if out.dtype != np.uint8 else quantize(block, qtype)
    return out


def quantize(rows: np.ndarray, qtype) -> np.ndarray:
    """Quantized blocks of float32 rows: q4_0 with a searched scale (q4_0_scale.py), q8_0 by gguf-py (ggml's
    reference rounding; its one scale per block leaves nothing to search)."""
    import gguf

    if qtype == gguf.GGMLQuantizationType.Q4_0:
        return q4_0_scale.quantize(rows)
    return gguf.quants.quantize(rows, qtype)


def encoded_nbytes(shape: tuple[int, ...], qtype) -> int:
    import gguf

    return int(np.prod(gguf.quants.quant_shape_to_byte_shape(shape, qtype), dtype=np.int64))


# PowerInfer's sparse down projection (ggml.c, ggml_compute_forward_mul_mat_axpy and its _head variant) reads
# ffn_down_t's rows as f16 whatever their type; only q4_0 has a kernel of its own. A file PowerInfer computes
# right therefore stores ffn_down_t in f16 unless it is f16 or q4_0 already.
POWERINFER_DOWN_T_OUTTYPE = {"f32": "f16", "q8_0": "f16"}


# The matrices input sparsity reads row by input (docs/formats.md, "Input sparsity"), each stored a second time,
# transposed: row i holds what input i multiplies, so a decode step skips the rows of zeroed inputs, as it does
# ffn_down_t's. The down projection has its ffn_down_t already.
INPUT_TRANSPOSED = {"attn_q": names.ATTN_Q_T, "attn_k": names.ATTN_K_T, "attn_v": names.ATTN_V_T,
                    "attn_qkv": names.ATTN_QKV_T, "attn_output": names.ATTN_OUTPUT_T, names.FFN_GATE: names.FFN_GATE_T,
                    names.FFN_UP: names.FFN_UP_T}


def is_input_transposed(name: str) -> bool:
    """Whether tensor `name` (blk.N.attn_q_t.weight ...) is one of input sparsity's transposed copies."""
    return name.removesuffix(".weight").split(".")[-1] in INPUT_TRANSPOSED.values()


def input_transposed_maps(maps: list[arch.TensorMap]) -> list[arch.TensorMap]:
    """The transposed copies (INPUT_TRANSPOSED) of a file's matrices, made from the same sources."""
    out = []
    for tmap in maps:
        layer, _, rest = tmap.name.partition(".")[2].partition(".")
        base = rest.removesuffix(".weight")
        if tmap.name.startswith("blk.") and rest.endswith(".weight") and base in INPUT_TRANSPOSED:
            out.append(dataclasses.replace(tmap, name=names.layer_tensor(int(layer), INPUT_TRANSPOSED[base]),
                                           transpose=True))
    return out


# llama.cpp's quantizer keeps the output head above 4 bits (src/llama-quant.cpp, llama_tensor_get_type: Q6_K, or
# Q8_0 where a row does not split into Q6_K's 256-value blocks); the engine computes q8_0 as stored (types.h) and
# PowerInfer's ggml reads it, so a 4-bit file's head is q8_0. docs/bench.md, "Quantizer quality", measures it.
HEAD_OUTTYPE = {"q4_0": "q8_0"}
EMBEDDING, OUTPUT = "token_embd.weight", "output.weight"


def tie_head(maps: list[arch.TensorMap], compatible: bool) -> tuple[list[arch.TensorMap], str]:
    """The file's maps without output.weight where it is the embedding itself (a tied head) and the file is not one
    PowerInfer reads (its llama loader requires output.weight; the engine, as llama.cpp, takes token_embd as the
    head when output.weight is absent), and the name of the tensor that is the head."""
    embedding = next((m for m in maps if m.name == EMBEDDING), None)
    output = next((m for m in maps if m.name == OUTPUT), None)
    if output is None:
        return maps, EMBEDDING
    tied = embedding is not None and (output.source, output.reorder, output.transpose) == \
        (embedding.source, embedding.reorder, embedding.transpose)
    if tied and not compatible:
        return [m for m in maps if m is not output], EMBEDDING
    return maps, OUTPUT


def plan(adapter: arch.Arch, weights, predictors: Predictors | None, outtype: str,
         powerinfer_compatible: bool = True, fc2_scales: list[float] | None = None,
         input_sparse: bool = False) -> list[PlannedTensor]:
    """The tensors of the file, each with how to load it; fc2_scales: layer i's fc2 times fc2_scales[i]
    (ThresholdFold); input_sparse: also the transposed copies input sparsity reads (INPUT_TRANSPOSED). A mixture of
    experts' router stays f32, as llama.cpp's converter and quantizer keep ffn_gate_inp: the experts a token takes
    are decided by the router's exact logits."""
    import gguf

    # a file PowerInfer refuses by its architecture name (SiLU/GELU, or one it does not know): nothing to keep
    # compatible
    compatible = powerinfer_compatible and adapter.powerinfer_runs
    down_outtype = POWERINFER_DOWN_T_OUTTYPE.get(outtype, outtype) if compatible else outtype
    planned = []
    maps, head = tie_head(adapter.tensor_maps(weights.names_with_prefixes()), compatible)
    for tmap in maps + (input_transposed_maps(maps) if input_sparse else []):
        stored = tuple(weights.find(source) for source in tmap.sources())
        if None in stored:
            missing = tmap.sources()[stored.index(None)]
            raise UserError(f"the model has no tensor {missing} (needed for {tmap.name})")
        shape = tmap.out_shape(weights.shapes[stored[0]])
        if tmap.name == head:
            qtype = tensor_type(shape, HEAD_OUTTYPE.get(outtype, outtype))
        elif tmap.name.endswith(f".{names.weight(names.FFN_DOWN_T)}"):
            qtype = tensor_type(shape, down_outtype)
        elif tensor_kind(tmap.name) == names.FFN_GATE_INP:
            qtype = gguf.GGMLQuantizationType.F32
        else:
            qtype = tensor_type(shape, outtype)
        planned.append(PlannedTensor(tmap.name, shape, qtype,
                                     lambda t=tmap, s=stored: t.stacked([weights.load(x) for x in s]), stored))
    if predictors is not None:
        dims = adapter.dims()
        for i, rank in enumerate(predictors.ranks):
            path = predictors.files[i] if predictors.files else None
            padded = stored_rank(rank, outtype, dims.n_embd, dims.n_ff)
            for key, shape, qtype in predictor_tensors(padded, outtype, dims.n_embd, dims.n_ff):
                scale = fc2_scales[i] if fc2_scales and key == names.weight(names.PREDICTOR_FC2) else 1.0
                planned.append(PlannedTensor(f"blk.{i}.{key}", shape, qtype,
                                             lambda p=path, k=key, r=padded, s=scale: _load_predictor(p, k, r) * s,
                                             (str(path),)))
    for name, data in adapter.computed_tensors().items():  # made from the config: no source bytes
        planned.append(PlannedTensor(name, data.shape, tensor_type(data.shape, outtype), lambda d=data: d, ()))
    return planned


# A predictor's fc1 in a 4-bit file is stored at 8 bits: the trainer folds its per-feature input scales into
# fc1's columns (their magnitudes spread 0.007-0.11 within a row of SmolLM2's), which one q4_0 scale per
# 32 columns flattens. Measured on SmolLM2 q4_0, predictor-mode perplexity (wikitext-2, 16 x 512 tokens):
# fc1 f16 97.3, q8_0 95.1, q4_0 539; fc2 at q4_0 costs nothing (96.0 with fc1 f16).
FC1_OUTTYPE = {"q4_0": "q8_0"}


def predictor_tensors(rank: int, outtype: str, n_embd: int, n_ff: int) -> list[tuple[str, tuple[int, int], object]]:
    """fc1 and fc2 of a rank-`rank` predictor in an `outtype` file: key, shape, type."""
    fc1, fc2 = (rank, n_embd), (n_ff, rank)
    return [(names.weight(names.PREDICTOR_FC1), fc1, tensor_type(fc1, FC1_OUTTYPE.get(outtype, outtype))),
            (names.weight(names.PREDICTOR_FC2), fc2, tensor_type(fc2, outtype))]


def stored_rank(rank: int, outtype: str, n_embd: int, n_ff: int) -> int:
    """The rank a predictor is written at: in a quantized file, padded to whole 32-value blocks (zero rows
    of fc1, zero columns of fc2: a hidden unit that is always 0, so the logits do not change) where the
    padded predictor, its fc2 quantized, is smaller than the unpadded one with an f16 fc2 (so that it is
    also scored by the engine's integer kernels; for SmolLM2's shapes at q4_0 from rank 13 on). A rank
    stays at most n_ff (the engine's bound)."""
    import gguf

    block = gguf.GGML_QUANT_SIZES[_qtype(outtype)][0]
    padded = -(-rank // block) * block
    if padded == rank or padded > n_ff:
        return rank

    def nbytes(r: int) -> int:
        return sum(encoded_nbytes(shape, qtype) for _, shape, qtype in predictor_tensors(r, outtype, n_embd, n_ff))

    return padded if nbytes(padded) < nbytes(rank) else rank


def _load_predictor(path: Path, key: str, rank: int) -> np.ndarray:
    """A layer's fc1 or fc2 as float32, padded with zeros to `rank` (see stored_rank)."""
    weight = load_pt(path, "predictor")[key].float().numpy()
    fc1 = key == names.weight(names.PREDICTOR_FC1)
    missing = rank - (weight.shape[0] if fc1 else weight.shape[1])
    return np.pad(weight, ((0, missing), (0, 0)) if fc1 else ((0, 0), (0, missing)))


def model_name(path: Path) -> str:
    """general.name of the converted file: the source's name without the weight type a GGUF file's name carries
    (SmolLM2-135M-Instruct.Q4_1.gguf -> SmolLM2-135M-Instruct), which the conversion replaces."""
    return re.sub(r"[.\-_](?:I?Q\d\w*|B?F(?:16|32))$", "", path.stem, flags=re.IGNORECASE) or path.stem


def add_header(writer, adapter: arch.Arch, name: str, outtype: str, predictors: Predictors | None,
               activation_thresholds: list[float], tensors: list[PlannedTensor], add_vocab,
               neuron_orders: list[np.ndarray] | None = None,
               input_thresholds: InputThresholds | None = None) -> None:
    """Everything the file holds before its tensor data: metadata, the vocabulary (`add_vocab(writer)`, or
    nothing when None) and the tensor table. Shared with the dry run, which measures it."""
    import gguf

    writer.add_name(name)
    writer.add_file_type(_file_type(outtype))
    if outtype in ("q8_0", "q4_0"):
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    adapter.write_hparams(writer)
    f32 = gguf.GGUFValueType.FLOAT32
    writer.add_key_value(names.KEY_FFN_ACTIVATION, adapter.activation, gguf.GGUFValueType.STRING)
    writer.add_key_value(names.KEY_ACTIVATION_THRESHOLDS, activation_thresholds, gguf.GGUFValueType.ARRAY,
                         sub_type=f32)
    if predictors is not None:
        writer.add_key_value(names.KEY_SPARSE_THRESHOLD, predictors.sparse_threshold, f32)
        writer.add_key_value(names.KEY_PREDICTOR_THRESHOLDS, predictors.thresholds, gguf.GGUFValueType.ARRAY,
                             sub_type=f32)
        writer.add_key_value(names.KEY_PREDICTOR_USEFUL, predictors.useful, gguf.GGUFValueType.ARRAY,
                             sub_type=gguf.GGUFValueType.BOOL)
    if input_thresholds is not None:
        writer.add_key_value(names.KEY_INPUT_SPARSITY_LEVELS, [float(b) for b in input_thresholds.levels],
                             gguf.GGUFValueType.ARRAY, sub_type=f32)
        writer.add_key_value(names.KEY_INPUT_THRESHOLDS, input_thresholds.flat_thresholds(), gguf.GGUFValueType.ARRAY,
                             sub_type=f32)
    if neuron_orders is not None:
        writer.add_key_value(neuron_order.ORDER_KEY, neuron_order.encode(neuron_orders), gguf.GGUFValueType.STRING)
    if add_vocab is not None:
        add_vocab(writer)
    for t in tensors:
        nbytes = encoded_nbytes(t.shape, t.qtype)
        if t.qtype in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            dtype = np.float32 if t.qtype == gguf.GGMLQuantizationType.F32 else np.float16
            writer.add_tensor_info(t.name, t.shape, np.dtype(dtype), nbytes)
        else:
            byte_shape = gguf.quants.quant_shape_to_byte_shape(t.shape, t.qtype)
            writer.add_tensor_info(t.name, byte_shape, np.dtype(np.uint8), nbytes, raw_dtype=t.qtype)


def n_vocab_of(tensors: list[PlannedTensor]) -> int:
    """Rows of the token embedding: the vocabulary is padded to it."""
    return next(t.shape[0] for t in tensors if t.name == "token_embd.weight")


def convert_model(model: str, out_path: str | Path, outtype: str = "f16", predictors_dir: str | Path | None = None,
                  profile_dir: str | Path | None = None, progress: bool = True, order_neurons: bool = True,
                  powerinfer_compatible: bool = True, input_sparsity: bool = False) -> dict:
    """Write the PowerInfer GGUF of `model` (a --model spec) to `out_path`; returns a summary dict.

    With `input_sparsity` and a profile with input thresholds (stages/profiling/input_sparsity.py), the file holds them and
    the transposed copies input sparsity reads (INPUT_TRANSPOSED).

    Without `predictors_dir` the file has no fc1/fc2 tensors (dense / gate-only use of our engine). With
    `order_neurons` and a profile with activation counts, the FFN neurons follow neuron_order.py's order of
    those counts (a profile of thresholds alone leaves the model's order). `powerinfer_compatible` stores
    ffn_down_t as PowerInfer's kernels read it (POWERINFER_DOWN_T_OUTTYPE); False keeps it in `outtype`.
    """
    import gguf
    from powerinfer_tools.core.progress import progress_bar

    from powerinfer_tools.stages.profiling.profiling import has_activation_counts, load_activation_counts
    from powerinfer_tools.models.source_weights import open_weights
    from powerinfer_tools.formats.tokenizer import write_vocab

    started = time.time()
    check_outtype(outtype)
    out_path = Path(out_path)
    if out_path.is_dir():
        raise UserError(f"output path {out_path} is a directory")
    source = models.resolve(model)
    config = models.load_config(source)
    neurons = predictors_dir is not None or profile_dir is not None or input_sparsity
    adapter = arch.for_neurons(config) if neurons else arch.for_config(config)
    dims = adapter.dims()
    predictors = load_predictors(predictors_dir, dims) if predictors_dir is not None else None
    # a file PowerInfer refuses by its architecture name (SiLU/GELU, or one it does not know): nothing to fold for it
    fold = fold_thresholds(predictors) if predictors and powerinfer_compatible and adapter.powerinfer_runs else None
    if fold is not None and fold.threshold is not None:
        predictors = dataclasses.replace(predictors, thresholds=[fold.threshold] * dims.n_layer,
                                         sparse_threshold=fold.threshold)
    if profile_dir is not None:
        activation_thresholds = load_activation_thresholds(profile_dir, dims.n_layer)
    else:
        activation_thresholds = [0.0] * dims.n_layer
    if not adapter.thresholded:  # ReLU-family: active means a != 0, by the model's own rule
        activation_thresholds = adapter.rule_thresholds()
    inputs = InputThresholds.load(profile_dir, dims.n_layer) if profile_dir is not None and input_sparsity else None
    if input_sparsity and inputs is None:   # a file without them would fail only later, in run --sparse-mode input
        where = "no --profile was given" if profile_dir is None else f"{Path(profile_dir) / 'input_sparsity.json'} " \
                                                                     "does not exist"
        raise UserError(f"--input-thresholds needs a profile with input thresholds, but {where}: profile with "
                        "--input-allocation uniform (or greedy), or convert without --input-thresholds")
    orders = None
    if profile_dir is not None and order_neurons and has_activation_counts(profile_dir):
        counts = load_activation_counts(profile_dir, dims.n_layer, [dims.n_ff] * dims.n_layer)
        orders = neuron_order.orders_from_counts([c.double().numpy() for c in counts])
    weights = open_weights(source, config)
    tensors = plan(adapter, weights, predictors, outtype, powerinfer_compatible, fold.scales if fold else None,
                   input_sparse=inputs is not None)
    if orders is not None:
        tensors = [dataclasses.replace(t, load=lambda t=t: neuron_order.apply(t.name, t.load(), orders))
                   for t in tensors]
    n_vocab = n_vocab_of(tensors)

    with atomic_file(out_path) as tmp:
        writer = gguf.GGUFWriter(tmp, adapter.gguf_arch)
        try:
            add_header(writer, adapter, model_name(source.path), outtype, predictors, activation_thresholds, tensors,
                       lambda w: write_vocab(w, source, n_vocab, getattr(weights, "reader", None)), orders, inputs)
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_ti_data_to_file()
            for t in progress_bar(tensors, desc=f"convert {outtype}", unit="tensor", disable=not progress):
                data = t.load()
                if data.shape != t.shape:
                    raise UserError(f"{t.name}: source data has shape {data.shape}, expected {t.shape}")
                writer.write_tensor_data(encode(data, t.qtype))
                del data
            writer.close()
        except OSError as exc:
            writer.close()
            if write_failure(exc):  # numpy's short write drops errno: "589824 requested and 442208 written"
                raise UserError(f"disk full while writing {out_path}; nothing was written") from None
            raise UserError(f"cannot write {out_path}: {exc.strerror or exc}") from None
        except BaseException:
            writer.close()
            raise
        set_pwri_magic(tmp)

    sources_used = {s for t in tensors for s in t.sources}
    bytes_in = sum(weights.stored_bytes.get(s, 0) for s in sources_used) + \
        sum(Path(s).stat().st_size for s in sources_used if s and s not in weights.stored_bytes)
    return {
        "out": str(out_path), "model": source.spec, "arch": adapter.name, "gguf_arch": adapter.gguf_arch,
        "outtype": outtype, "powerinfer_compatible": powerinfer_compatible, "tensors": len(tensors),
        "predictors": predictors is not None,
        "predictor_threshold_note": fold.note if fold else "",
        "neuron_order": "profile" if orders is not None else "source",
        "thresholded": adapter.thresholded, "experts": adapter.experts, "activation_thresholds": activation_thresholds,
        "types": kind_types(tensors), "bytes_in": int(bytes_in),
        "input_sparsity": inputs.allocation if inputs is not None else None,
        "input_transposed_bytes": sum(encoded_nbytes(t.shape, t.qtype) for t in tensors
                                      if is_input_transposed(t.name)),
        "bytes_out": out_path.stat().st_size, "seconds": round(time.time() - started, 2),
    }


def tensor_kind(name: str) -> str:
    """A tensor's kind, the same in every layer: blk.3.attn_q.weight -> attn_q, blk.3.attn_q.bias -> attn_q.bias."""
    kind = re.sub(r"^blk\.\d+\.", "", name)
    return kind.removesuffix(".weight")


def kind_types(tensors: list[PlannedTensor]) -> dict[str, list[str]]:
    """The kinds of tensors the file holds, by type (lowercase, llama.cpp's spelling), each kind once a type, in
    the file's order: what convert prints so that a head kept above the outtype is seen."""
    types: dict[str, list[str]] = {}
    for t in tensors:
        kinds = types.setdefault(t.qtype.name.lower(), [])
        if tensor_kind(t.name) not in kinds:
            kinds.append(tensor_kind(t.name))
    return types


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def summary_lines(summary: dict) -> list[str]:
    """What convert_model wrote, as `pi-tools convert` prints it."""
    types = "; ".join(f"{qtype} {' '.join(kinds)}" for qtype, kinds in summary["types"].items())
    lines = [f"{summary['arch']} -> {summary['gguf_arch']} {summary['outtype']}: {summary['tensors']} tensors "
             f"({types}){', with predictors' if summary['predictors'] else ', no predictors'}"]
    if summary["neuron_order"] == "profile":
        lines.append("FFN neurons stored hottest first in blocks of 16 by the profile's counts (--source-order: "
                     "the model's order)")
    if summary.get("predictor_threshold_note"):
        lines.append(f"note: {summary['predictor_threshold_note']}")
    if summary.get("input_sparsity"):
        lines.append(f"input sparsity: the profile's {summary['input_sparsity']} thresholds and the transposed copies "
                     f"of q/k/v/o/gate/up it reads ({_mib(summary['input_transposed_bytes'])}; --no-input-thresholds "
                     "leaves both out)")
    lines.append(f"bytes: {_mib(summary['bytes_in'])} in the source -> {_mib(summary['bytes_out'])} written "
                 f"({summary['bytes_out'] / max(summary['bytes_in'], 1):.2f}x) in {summary['seconds']:.1f} s")
    return lines
