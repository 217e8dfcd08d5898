"""The engine's placement on a device for a VRAM budget (csrc/backend/device_placement.h), from a converted file's
header: the GPU tier's scratch, then the output norm and head, then the attention block and KV cache of as many
layers as fit, in layer order, then each layer's hot rows (the gpu index's neurons) in layer order while they fit,
with its predictor where its attention is placed and a cold tier stays beside (a split layer's); a layer past the
budget, and every one after it, keeps that part on the CPU. The bytes are the device libraries' (csrc/device/attention_math.h,
tier_math.h): each part of a layer's block rounded up to 16 bytes. `pi-tools plan` reports it for the plan it
writes; tests/placement/test_device_placement.py checks it against what the engine places for the same file,
budget, context, batch and cache type.
"""
from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from powerinfer_tools.core.errors import UserError
from powerinfer_tools.formats import names
from powerinfer_tools.formats.gguf_header import GGUFHeader
from powerinfer_tools.formats.gguf_io import head_width
from powerinfer_tools.stages.options import DEFAULT_KV_TYPE, KV_ELEMENT_BYTES

QK = 32
Q8_0_BLOCK_BYTES = 34
COMPUTED_TYPES = {"F32", "F16", "Q4_0", "Q8_0"}  # what the device's kernels read (tier_math.h)
ENGINE_DEFAULT_BATCH = 64  # csrc/engine/engine.cpp kDefaultBatch
JOB_COUNTERS_BYTES = 24  # tier_math.h kJobCountersBytes: a job's counters of neurons and rows read
_ATTENTION_PART = re.compile(r"^blk\.(\d+)\.(attn_norm|attn_norm_2|ffn_norm|attn_q|attn_k|attn_v|attn_qkv|attn_output)"
                             r"\.(weight|bias)$")
_FFN_PART = re.compile(r"^blk\.(\d+)\.(ffn_gate|ffn_up|ffn_down_t)\.(weight|bias)$")
_PREDICTOR_PART = re.compile(rf"^blk\.(\d+)\.({names.PREDICTOR_FC1}|{names.PREDICTOR_FC2})\.weight$")


def _aligned(n: int) -> int:
    return (n + 15) // 16 * 16


@dataclass(frozen=True)
class DeviceShape:
    """The tier's description (pi_device_tier_desc) as far as sizes go."""

    n_embd: int
    n_head: int
    n_head_kv: int
    d_head: int
    n_rot: int  # 0 without RoPE
    n_vocab: int
    n_batch: int
    n_ctx: int
    kv_element_bytes: int

    def kv_cache_bytes(self) -> int:
        """One layer's keys and values, each part aligned as the libraries lay them out."""
        return 2 * _aligned(self.n_ctx * self.n_head_kv * self.d_head * self.kv_element_bytes)

    def attention_scratch_bytes(self) -> float:
        """attention_math.h's attention_scratch_bytes."""
        b, e = self.n_batch, self.n_embd
        q, kv = self.n_head * self.d_head, self.n_head_kv * self.d_head
        q8 = Q8_0_BLOCK_BYTES / QK
        return (b * (e * 4 * 6 + e * q8 + q * 4 * 2 + kv * 4 * 2 + q * q8 + self.n_head * self.n_ctx * 4)
                + self.n_ctx * (self.n_rot // 2) * 4 * 2)

    def head_scratch_bytes(self) -> float:
        """attention_math.h's head_scratch_bytes."""
        b, e = self.n_batch, self.n_embd
        return b * (e * 4 * 2 + e / QK * Q8_0_BLOCK_BYTES + self.n_vocab * 4)

    def hot_scratch_bytes(self, rows: int) -> float:
        """device_placement.cpp's hot_scratch_bytes for the largest hot tier of `rows` neurons."""
        b, e = self.n_batch, self.n_embd
        return b * e * 4 * 2 + b * (e / QK) * Q8_0_BLOCK_BYTES + b * rows * 4 + JOB_COUNTERS_BYTES


@dataclass(frozen=True)
class DeviceCosts:
    shape: DeviceShape
    attention: np.ndarray  # [L] bytes of a layer's attention block (norm, matrices, biases) and KV cache
    attention_refused: str | None  # why no layer's attention can go (a matrix the device cannot read)
    neuron: np.ndarray  # [L] bytes of one hot neuron's rows and biases
    head: int | None  # the output norm's and head's bytes; None where the device cannot read the head
    neurons_refused: str | None = None  # why no hot neuron can go (an activation the device does not compute)
    # a split layer's predictor (attention_math.h's PredictorLayout): [L] bytes of fc1 and the hidden layer's
    # scratch (0 where the device cannot take it), [L] bytes of one hot neuron's fc2 row, the layers' neurons
    predictor: np.ndarray | None = None
    predictor_row: np.ndarray | None = None
    n_ff: np.ndarray | None = None


@dataclass(frozen=True)
class DevicePlacement:
    attention: np.ndarray  # [L] bool: the layer's attention and KV cache on the device
    hot: np.ndarray  # [L] bool: the layer's hot rows on the device
    head: bool  # the output norm and head on the device
    head_bytes: float  # with its scratch
    scratch: float
    attention_bytes: float
    kv_cache_bytes: float
    hot_bytes: float
    predictor: np.ndarray  # [L] bool: the layer's predictor on the device (a split layer's)
    predictor_bytes: float

    def summary(self) -> dict:
        return {"output_head": self.head, "attention_layers": [int(i) for i in np.flatnonzero(self.attention)],
                "hot_layers": [int(i) for i in np.flatnonzero(self.hot)],
                "predictor_layers": [int(i) for i in np.flatnonzero(self.predictor)],
                "bytes": {"scratch": self.scratch, "head": self.head_bytes, "attention": self.attention_bytes,
                          "kv_cache": self.kv_cache_bytes, "hot": self.hot_bytes, "predictor": self.predictor_bytes}}


def device_costs(header: GGUFHeader, ctx_size: int, n_batch: int = ENGINE_DEFAULT_BATCH,
                 kv_type: str = DEFAULT_KV_TYPE) -> DeviceCosts:
    """Per-layer device bytes of a converted file, as the engine opened with these ctx_size, batch_size and
    kv_type counts them (the engine caps n_batch at the context)."""
    arch = header.get("general.architecture")
    if not arch:
        raise UserError(f"{header.path}: no general.architecture: not a converted model file")
    n_embd, n_layer = header.get(f"{arch}.embedding_length"), header.get(f"{arch}.block_count")
    n_head = header.get(f"{arch}.attention.head_count")
    if not all(isinstance(v, int) and v > 0 for v in (n_embd, n_layer, n_head)):
        raise UserError(f"{header.path}: missing {arch}.embedding_length/block_count/attention.head_count")
    n_kv = header.get(f"{arch}.attention.head_count_kv", n_head)
    d_head = head_width(header.get, arch, n_embd, n_head)
    n_rot = 0 if arch == "opt" else header.get(f"{arch}.rope.dimension_count", d_head)
    tensors = {t.name: t for t in header.tensors}
    out = tensors.get("output.weight") or tensors.get("token_embd.weight")  # tied embeddings: the head is token_embd
    if out is None:
        raise UserError(f"{header.path}: no output.weight or token_embd.weight")
    shape = DeviceShape(n_embd, n_head, n_kv, d_head, n_rot, int(out.shape[0]), min(n_batch, ctx_size), ctx_size,
                        KV_ELEMENT_BYTES[kv_type])
    head = (sum(_aligned(tensors[n].n_bytes) for n in ("output_norm.weight", "output_norm.bias") if n in tensors)
            + _aligned(out.n_bytes)) if out.type.name in COMPUTED_TYPES else None
    q_rows, kv_rows = n_head * d_head, n_kv * d_head
    attention = np.zeros(n_layer, np.int64)
    neuron = np.zeros(n_layer, np.int64)
    n_ff = np.zeros(n_layer, np.int64)
    fc1: dict[int, object] = {}
    fc2: dict[int, object] = {}
    norms: dict[int, dict[str, int]] = {}
    refused = "the device does not compute an attention.scale" if header.get(f"{arch}.attention.scale") else None
    for t in header.tensors:
        if t.name.startswith("blk.") and t.name.endswith(f".{names.ATTN_Q_NORM}.weight"):
            refused = refused or "the device does not compute per-head q/k norms"
        if m := _ATTENTION_PART.match(t.name):
            i, part, kind = int(m.group(1)), m.group(2), m.group(3)
            if part.startswith("attn_norm") or part == "ffn_norm":
                norms.setdefault(i, {})[f"{part}.{kind}"] = _aligned(t.n_bytes)
            elif kind == "bias":  # split as the rows are (falcon's fused q, k, v), each part its own
                rows = [q_rows, kv_rows, kv_rows] if part == "attn_qkv" else [t.n_bytes // 4]
                attention[i] += sum(_aligned(r * 4) for r in rows)
            else:
                if t.type.name not in COMPUTED_TYPES:
                    refused = refused or f"{t.name} is {t.type.name}, which the device does not read"
                rows = [q_rows, kv_rows, kv_rows] if part == "attn_qkv" else [int(t.shape[0])]
                row_bytes = t.n_bytes // sum(rows)
                attention[i] += sum(_aligned(r * row_bytes) for r in rows)
        elif m := _PREDICTOR_PART.match(t.name):
            (fc1 if m.group(2) == names.PREDICTOR_FC1 else fc2)[int(m.group(1))] = t
        elif m := _FFN_PART.match(t.name):
            i, part, kind = int(m.group(1)), m.group(2), m.group(3)
            if kind == "weight":
                neuron[i] += t.n_bytes // int(t.shape[0])
                n_ff[i] = int(t.shape[0])
            elif part != "ffn_down_t":
                neuron[i] += 4
    for i in range(n_layer):  # attention's norm: attn_norm_2 where falcon's new decoder has one, else attn_norm
        parts = norms.get(i, {})
        name = "attn_norm_2" if "attn_norm_2.weight" in parts else "attn_norm"
        attention[i] += parts.get(f"{name}.weight", 0) + parts.get(f"{name}.bias", 0) + shape.kv_cache_bytes()
        if arch != "falcon":  # the FFN's norm, for a whole layer on the device (a parallel block has none of its own)
            attention[i] += parts.get("ffn_norm.weight", 0) + parts.get("ffn_norm.bias", 0)
    # the engine's device computes SiLU, ReLU and dReLU neurons; a GELU model's (gemma3-gelu) stay on the CPU
    gelu = "the device does not compute GELU neurons" if arch.endswith("-gelu") else None
    predictor, predictor_row = np.zeros(n_layer, np.int64), np.zeros(n_layer, np.int64)
    for i in range(n_layer):  # refuse_predictor's: a sequential block, types the device reads, a rank of 32s
        a, b = fc1.get(i), fc2.get(i)
        if arch == "falcon" or a is None or b is None or {a.type.name, b.type.name} - COMPUTED_TYPES:
            continue
        rank = int(a.shape[0])
        if rank % QK or int(b.shape[1]) != rank:
            continue
        batch = shape.n_batch
        predictor[i] = (_aligned(a.n_bytes) + _aligned(batch * rank * 4) + _aligned(batch * rank)
                        + _aligned(batch * (rank // QK) * 2))
        predictor_row[i] = b.n_bytes // int(b.shape[0])
    return DeviceCosts(shape, attention, refused, neuron, head, gelu, predictor, predictor_row, n_ff)


@dataclass(frozen=True)
class ExpertDeviceCosts:
    """A mixture's experts on the device (csrc/device/expert_math.h): [L] bytes of one of a layer's experts (its
    gate, up and down, each part aligned), and the experts' scratch."""

    expert: np.ndarray
    scratch: float


def expert_device_costs(header: GGUFHeader, shape: DeviceShape) -> ExpertDeviceCosts:
    """The device bytes of a mixture's experts (refused in one line where the device cannot read their type)."""
    arch = header.get("general.architecture")
    n_expert, k = header.get(f"{arch}.expert_count"), header.get(f"{arch}.expert_used_count")
    n_layer = int(header.get(f"{arch}.block_count"))
    tensors = {t.name: t for t in header.tensors}
    expert = np.zeros(n_layer, np.int64)
    n_ff = 0
    for i in range(n_layer):
        for part in (names.FFN_GATE_EXPS, names.FFN_UP_EXPS, names.FFN_DOWN_EXPS):
            t = tensors.get(names.layer_tensor(i, part))
            if t is None:
                raise UserError(f"{header.path}: no {names.layer_tensor(i, part)}: not a mixture of experts")
            if t.type.name not in COMPUTED_TYPES:
                raise UserError(f"--vram-budget: {t.name} is {t.type.name}, which the device does not read (convert "
                                "to f32, f16, q8_0 or q4_0)")
            expert[i] += _aligned(t.n_bytes // n_expert)
            if part == names.FFN_GATE_EXPS:
                n_ff = int(np.prod(t.shape)) // (n_expert * shape.n_embd)
    b, p, e, f = shape.n_batch, shape.n_batch * k, shape.n_embd, n_ff
    q8 = Q8_0_BLOCK_BYTES / QK
    scratch = (b * e * 4 + p * e * (4 + q8) + 2 * p * f * 4 + p * f * (4 + q8) + p * e * 4 + b * e * 4
               + 4 * (3 * p + b + 1))
    return ExpertDeviceCosts(expert, float(scratch))


def expert_room(costs: DeviceCosts, budget: float, with_attention: bool = True) -> float:
    """What the engine's placement leaves a mixture's device experts at `budget`: the budget less the tier's scratch,
    the output head and the attention blocks and KV caches placed before them (device_placement.cpp)."""
    p = place_on_device(costs, budget, np.zeros(len(costs.attention), np.int64), with_attention)
    return budget - p.scratch - p.head_bytes - p.attention_bytes - p.kv_cache_bytes


def place_on_device(costs: DeviceCosts, budget: float, hot_neurons: Sequence[int],
                    with_attention: bool = True) -> DevicePlacement:
    """The engine's placement (device_placement.cpp's place_on_device) for `hot_neurons` per layer."""
    n_layer = len(costs.attention)
    hot_neurons = np.asarray(hot_neurons, np.int64)
    attention, hot = np.zeros(n_layer, bool), np.zeros(n_layer, bool)
    scratch = costs.shape.hot_scratch_bytes(int(hot_neurons.max(initial=0)))
    room = budget - scratch
    head_bytes = 0.0
    if with_attention and costs.head is not None and costs.head + costs.shape.head_scratch_bytes() <= room:
        head_bytes = costs.head + costs.shape.head_scratch_bytes()
        room -= head_bytes
    attention_bytes = kv_bytes = 0.0
    kv = costs.shape.kv_cache_bytes()
    if with_attention and costs.attention_refused is None:
        attention_scratch = costs.shape.attention_scratch_bytes()
        for i in range(n_layer):
            need = costs.attention[i] + (attention_scratch if i == 0 else 0.0)
            if need > room:
                break
            attention[i] = True
            room -= need
            attention_bytes += costs.attention[i] - kv
            kv_bytes += kv
            scratch += attention_scratch if i == 0 else 0.0
    hot_bytes = predictor_bytes = 0.0
    predictor = np.zeros(n_layer, bool)
    for i in range(n_layer if costs.neurons_refused is None else 0):
        if hot_neurons[i] == 0:
            continue
        need = float(hot_neurons[i] * costs.neuron[i])
        split = (attention[i] and costs.predictor is not None and costs.predictor[i] > 0
                 and hot_neurons[i] < costs.n_ff[i])
        pred = float(costs.predictor[i] + _aligned(int(hot_neurons[i] * costs.predictor_row[i]))) if split else 0.0
        if need + pred > room:
            break
        hot[i], predictor[i] = True, split
        room -= need + pred
        hot_bytes += need
        predictor_bytes += pred
    return DevicePlacement(attention, hot, head_bytes > 0, head_bytes, scratch, attention_bytes, kv_bytes, hot_bytes,
                           predictor, predictor_bytes)
