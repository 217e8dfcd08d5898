"""Hot/cold neuron placement for a VRAM budget: byte costs from the model file, counts from the profile,
an exact MILP (placement_solver), and PowerInfer's gpu-index file.

What goes to VRAM, in PowerInfer's engine order: the dense parts first (attention weights and norms,
predictors, the output head), then the KV cache for the context size, then the hot FFN neurons. A neuron
costs its rows of ffn_gate, ffn_up and ffn_down_t at the file's quantization. The token embedding stays on
the CPU, as PowerInfer keeps it. A reserve covers the CUDA context and scratch buffers.

Dense policy: `all` (default) puts every layer's dense parts and KV cache on the GPU before any neuron, which
is what PowerInfer's engine does, so the file loads there at this budget. `with-ffn` charges a layer's dense
parts and KV cache only when the layer places neurons (a layer computed on the GPU keeps its attention there).

The per-layer minimum (`auto`): splitting a layer between CPU and GPU costs a fixed time per token (kernel
launches, one host/device synchronisation, the input vector up and the partial sum back over PCIe). Putting
the k hottest neurons on the GPU saves the CPU from streaming their rows for the expected F(k)/T activations per
token. The default minimum is the smallest k whose saving covers the overhead, see `auto_min_neurons`.
"""
from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from powerinfer_tools.formats import names, neuron_order, tier_plan
from powerinfer_tools.stages.placement import device_placement, placement_solver, tier_solver, tiers
from powerinfer_tools.core.atomic import atomic_file
from powerinfer_tools.core.errors import UserError
from powerinfer_tools.stages import options as limits
from powerinfer_tools.stages.options import (DEFAULT_RESERVE_BYTES, MIB, SYNTHETIC_EXPONENT, PlanFiles,
                                             default_ctx_size)
from powerinfer_tools.formats.gguf_header import GGUFHeader, read_header
from powerinfer_tools.formats.gguf_io import head_width, set_powerinfer_i32, set_pwri_magic

GIB = 1024**3
DENSE_POLICIES = ("all", "with-ffn")
KV_BYTES_PER_VALUE = 2  # PowerInfer keeps the KV cache in f16

# The cost model behind `--min-layer-neurons auto` (a desktop PC: PCIe 4.0 x16, dual-channel DDR5).
SPLIT_LAYER_OVERHEAD_S = 25e-6  # kernel launches for the hot part + one host/device sync per split layer
PCIE_BYTES_PER_S = 16e9  # effective host<->device copy rate for the per-layer vectors
CPU_BYTES_PER_S = 50e9  # CPU decode streams each active neuron's rows from RAM once: memory bound

FFN_SPLIT_TENSORS = tuple(names.weight(n) for n in (names.FFN_GATE, names.FFN_UP, names.FFN_DOWN_T))
PREDICTOR_TENSORS = (names.weight(names.PREDICTOR_FC1), names.weight(names.PREDICTOR_FC2))
OUTPUT_TENSORS = re.compile(r"^output(_norm)?\.(weight|bias)$")
LAYER_TENSOR = re.compile(r"^blk\.(\d+)\.(.+)$")
MAX_HPARAM = 1 << 20  # bound on a file's layer, head and width counts (arrays are sized by them)


@dataclass
class ModelCosts:
    """What each part of a converted model occupies in VRAM, from the file's tensor types and shapes."""

    path: str
    arch: str
    n_embd: int
    n_embd_gqa: int  # width of one K (or V) row: n_kv_heads * head_dim
    n_ff: np.ndarray  # [L] neurons per layer
    neuron_bytes: np.ndarray  # [L] bytes of one neuron's rows in gate/up/down_t
    attention_bytes: np.ndarray  # [L] every other per-layer tensor except the predictor (attention, norms, biases)
    predictor_bytes: np.ndarray  # [L]
    output_bytes: int  # output.weight and output_norm
    context_length: int | None = None  # the trained context (<arch>.context_length), None when the file has none

    @property
    def n_layer(self) -> int:
        return len(self.n_ff)

    def kv_bytes_per_layer(self, ctx_size: int) -> int:
        return 2 * ctx_size * self.n_embd_gqa * KV_BYTES_PER_VALUE


def model_costs(model_path: str | Path, header: GGUFHeader | None = None) -> ModelCosts:
    """Read a PowerInfer GGUF's metadata and tensor table (no tensor data, no vocabulary) into per-part byte
    costs (`header`: the file's, already read)."""
    header = header if header is not None else read_header(model_path)
    tensors = ((t.name, t.shape, t.n_bytes) for t in header.tensors)
    return costs_from_tensors(str(model_path), header.get, tensors)


def trained_context(hparam: Callable[..., Any]) -> int | None:
    """The model's trained context from its metadata (`hparam(key, default)`), None when absent or not a count."""
    value = hparam(f"{hparam('general.architecture')}.context_length", None)
    ok = isinstance(value, (int, np.integer)) and not isinstance(value, bool) and 0 < value <= 1 << 24
    return int(value) if ok else None


def model_ctx_size(header: GGUFHeader) -> int:
    """The context a model file runs with by default (options.default_ctx_size of its trained one)."""
    return default_ctx_size(trained_context(header.get))


def costs_from_tensors(label: str, hparam: Callable[..., Any],
                       tensors: Iterable[tuple[str, tuple[int, ...], int]]) -> ModelCosts:
    """Per-part byte costs from a tensor table: (name, numpy shape, bytes at the file's types) per tensor, and
    `hparam(key, default)` giving the file's metadata. Shared by a converted file and the config-only dry run."""
    arch = hparam("general.architecture")
    if not arch:
        raise UserError(f"{label}: no general.architecture: not a converted model file")
    n_embd = hparam(f"{arch}.embedding_length")
    n_layer = hparam(f"{arch}.block_count")
    n_head = hparam(f"{arch}.attention.head_count")
    if n_embd is None or n_layer is None or n_head is None:
        raise UserError(f"{label}: missing {arch}.embedding_length/block_count/attention.head_count")
    n_kv = hparam(f"{arch}.attention.head_count_kv", n_head)
    for key, value in (("embedding_length", n_embd), ("block_count", n_layer), ("attention.head_count", n_head),
                       ("attention.head_count_kv", n_kv)):
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or not 0 < value <= MAX_HPARAM:
            raise UserError(f"{label}: {arch}.{key} = {value!r} is not a count from 1 to {MAX_HPARAM}")
    n_ff = np.zeros(n_layer, np.int64)
    neuron = np.zeros(n_layer, np.int64)
    attention = np.zeros(n_layer, np.int64)
    predictor = np.zeros(n_layer, np.int64)
    output = 0
    for name, shape, nbytes in tensors:
        if OUTPUT_TENSORS.match(name):
            output += nbytes
            continue
        m = LAYER_TENSOR.match(name)
        if not m:
            continue  # token_embd and friends stay on the CPU
        i, part = int(m.group(1)), m.group(2)
        if i >= n_layer:
            raise UserError(f"{label}: tensor {name} beyond block_count {n_layer}")
        if part == names.weight(names.FFN_GATE_EXPS):
            raise UserError(f"{label}: a mixture of experts: its experts are placed across memory and disk by plan "
                            "--memory-budget on the converted file with its expert profile, not on the GPU or from a "
                            "config")
        if part in FFN_SPLIT_TENSORS:
            rows = int(shape[0]) if len(shape) == 2 else 0
            if rows == 0 or (n_ff[i] and rows != n_ff[i]):
                raise UserError(f"{label}: {name} has shape {list(shape)}, expected (n_ff, n_embd)")
            n_ff[i] = rows
            neuron[i] += nbytes // rows  # rows are contiguous and equally sized at any quantization
        elif part in PREDICTOR_TENSORS:
            predictor[i] += nbytes
        else:
            attention[i] += nbytes
    missing = np.flatnonzero(n_ff == 0)
    if missing.size:
        raise UserError(f"{label}: layer {missing[0]} has no ffn_up/ffn_down_t rows: not a converted PowerInfer model")
    return ModelCosts(path=label, arch=str(arch), n_embd=int(n_embd),
                      n_embd_gqa=head_width(hparam, arch, int(n_embd), int(n_head)) * int(n_kv), n_ff=n_ff, neuron_bytes=neuron,
                      attention_bytes=attention, predictor_bytes=predictor, output_bytes=int(output),
                      context_length=trained_context(hparam))


def load_activation_counts(profile_dir: str | Path, n_ff: np.ndarray) -> list[np.ndarray]:
    """Per-layer activation counts as float64, checked against the model's shape (profile.py's loader)."""
    import torch

    from powerinfer_tools.stages.profiling.profiling import load_activation_counts as load_counts

    return [c.to(torch.float64).numpy() for c in load_counts(profile_dir, len(n_ff), [int(n) for n in n_ff])]


# Synthetic counts, for a plan before any profile exists (the dry run) and the solver benchmark: neuron of rank r
# (1 = hottest) of a layer of n fires on a share min(1, base * (r / n)^-a) of tokens. With a = 0.9 about 95% of
# the layer's activations are zero, and its hottest 20% of neurons fire 68% of the activations (the middle of the
# exponents the solver benchmark draws from, docs/placement.md); a in stages/options.py (plan's default).
SYNTHETIC_BASE_RATE = 0.01
SYNTHETIC_TOKENS = 32768


def power_law_rates(n_ff: int, exponent: float = SYNTHETIC_EXPONENT,
                    base_rate: float = SYNTHETIC_BASE_RATE) -> np.ndarray:
    """Per-token activation rate of each neuron of a layer, hottest first (the power law above)."""
    return np.minimum(1.0, base_rate * (np.arange(1, n_ff + 1) / n_ff) ** -exponent)


def synthetic_counts(n_ff: Sequence[int], exponent: float = SYNTHETIC_EXPONENT,
                     tokens: int = SYNTHETIC_TOKENS) -> list[np.ndarray]:
    """Expected counts over `tokens` tokens under the power law, per layer in neuron order = hottest first."""
    return [np.rint(tokens * power_law_rates(int(n), exponent)) for n in n_ff]


def profiled_tokens(profile_dir: str | Path, counts: list[np.ndarray]) -> float:
    """Tokens behind the counts: profile.json's `tokens`, else the largest count (a neuron fires once per token)."""
    meta = Path(profile_dir) / "profile.json"
    largest = max((float(c.max()) for c in counts if c.size), default=0.0)
    if meta.is_file():
        try:
            tokens = float(json.loads(meta.read_text()).get("tokens") or 0)
        except (ValueError, AttributeError):
            raise UserError(f"{meta}: not valid JSON") from None
        return max(tokens, largest, 1.0)
    return max(largest, 1.0)


def auto_min_neurons(counts: list[np.ndarray], costs: ModelCosts, tokens: float) -> np.ndarray:
    """Per layer, the fewest hottest neurons whose CPU time saved per token pays for splitting the layer.

    saved(k) = F(k) / tokens * neuron_bytes / CPU_BYTES_PER_S (F(k): the k largest counts summed);
    overhead = SPLIT_LAYER_OVERHEAD_S + 2 * n_embd * 4 / PCIE_BYTES_PER_S. A layer where even all neurons do
    not pay gets its full width: it is either wholly on the GPU (no split, no merge) or wholly on the CPU.
    """
    overhead = SPLIT_LAYER_OVERHEAD_S + 2 * costs.n_embd * 4 / PCIE_BYTES_PER_S
    need = overhead * CPU_BYTES_PER_S * tokens  # in count * bytes
    out = np.zeros(len(counts), np.int64)
    for i, c in enumerate(counts):
        saved = np.cumsum(np.sort(c)[::-1]) * costs.neuron_bytes[i]
        out[i] = min(int(np.searchsorted(saved, need, side="left")) + 1, c.size)
    return out


def parse_min_layer_neurons(spec: str) -> str | int:
    """`auto` or a non-negative integer."""
    spec = str(spec).strip().lower()
    if spec == "auto":
        return "auto"
    if spec.isdigit():
        return int(spec)
    raise UserError(f"--min-layer-neurons must be 'auto' or a non-negative integer, not {spec!r}")


# PowerInfer's CUDA build (ggml-cuda.cu) takes a layer's GPU neurons in multiples of 32 (its batched down
# projection, over 100 tokens, asserts it) and, for a q4_0 down projection, of 256 (its decode axpy launches
# nrows / 256 blocks and drops the rest). A layer on the GPU whole, or not at all, needs neither.
POWERINFER_GRANULARITY = 32
POWERINFER_GRANULARITY_Q4_0 = 256


def parse_granularity(spec: str | int, down_is_q4_0: bool) -> int:
    """`powerinfer` (the multiple PowerInfer's CUDA build needs for this file) or a positive integer."""
    text = str(spec).strip().lower()
    if text == "powerinfer":
        return POWERINFER_GRANULARITY_Q4_0 if down_is_q4_0 else POWERINFER_GRANULARITY
    if text.isdigit() and int(text) > 0:
        return int(text)
    raise UserError(f"--granularity must be 'powerinfer' or a positive integer, not {spec!r}")


@dataclass
class Plan:
    """Which neurons of each layer live on the GPU, and the VRAM accounting behind it."""

    model: str
    vram_budget: int
    ctx_size: int
    dense: str
    offload_output: bool
    n_ff: np.ndarray
    gpu_neurons: np.ndarray  # [L] count per layer
    gpu_index: list[np.ndarray]  # sorted neuron indices on the GPU, per layer
    min_neurons: np.ndarray
    served: np.ndarray  # [L] activations served from the GPU
    total: np.ndarray  # [L] all activations
    breakdown: dict  # bytes: reserve, output, kv_cache, attention, predictors, ffn, free
    solver: dict = field(default_factory=dict)
    neuron_order: str | None = None  # the model file's neuron_order.ORDER_KEY: the gpu index numbers its positions
    granularity: int = 1  # each layer's GPU count is 0, a multiple of this, or the whole layer
    # what the bundled engine places on a device at this budget and ctx_size with this gpu index (f32 KV cache,
    # its default batch): device_placement.DevicePlacement.summary(); None for a plan from shapes alone
    engine: dict | None = None
    # with a memory budget: per layer the neurons held in memory after the GPU's (the next hottest), and the memory
    # tier's summary (budget, room, costs, expected seconds against the engine's frequency rule)
    memory_neurons: np.ndarray | None = None
    memory: dict | None = None

    @property
    def ffn_bytes(self) -> int:
        return int(self.breakdown["ffn"])

    def summary(self) -> dict:
        """The JSON summary written beside the gpu index."""
        total = float(self.total.sum())
        return {
            "format": "powerinfer-tools.plan/1",
            "model": self.model, "vram_budget": self.vram_budget, "ctx_size": self.ctx_size,
            "dense": self.dense, "offload_output": self.offload_output,
            "breakdown_bytes": {k: int(v) for k, v in self.breakdown.items()},
            "served_fraction": float(self.served.sum()) / total if total else 0.0,
            "gpu_neurons": int(self.gpu_neurons.sum()), "neurons": int(self.n_ff.sum()),
            "neuron_order": "source" if self.neuron_order is None else "profile",  # as the model file stores them
            "granularity": self.granularity,
            "solver": self.solver,
            "engine_placement": self.engine,
            "memory": self.memory,
            "layers": [{"layer": i, "n_ff": int(n), "gpu_neurons": int(k), "min_neurons": int(m),
                        "served_fraction": float(s / t) if t else 0.0}
                       | ({} if self.memory_neurons is None else {"memory_neurons": int(self.memory_neurons[i])})
                       for i, (n, k, m, s, t) in enumerate(zip(self.n_ff, self.gpu_neurons, self.min_neurons,
                                                               self.served, self.total))],
        }


def fixed_costs(costs: ModelCosts, ctx_size: int, reserve_bytes: int, offload_output: bool, dense: str):
    """(bytes due before any neuron, by part; bytes a layer pays when it places neurons, per layer)."""
    kv = np.full(costs.n_layer, costs.kv_bytes_per_layer(ctx_size), np.int64)
    per_layer = costs.attention_bytes + costs.predictor_bytes + kv
    fixed = {"reserve": int(reserve_bytes), "output": costs.output_bytes if offload_output else 0}
    if dense == "all":
        fixed |= {"kv_cache": int(kv.sum()), "attention": int(costs.attention_bytes.sum()),
                  "predictors": int(costs.predictor_bytes.sum())}
        per_layer = np.zeros(costs.n_layer, np.int64)
    return fixed, per_layer


def plan_for_model(profile_dir: str | Path, model_path: str | Path, vram_budget_bytes: int,
                   ctx_size: int | None = None, min_layer_neurons: str | int = "auto",
                   reserve_bytes: int = DEFAULT_RESERVE_BYTES, offload_output: bool = True, dense: str = "all",
                   time_limit: float = 20.0, granularity: str | int = 1, memory_budget_gib: float | None = None) -> Plan:
    """The best placement of a converted model's neurons for a VRAM budget (the converter's one-line entry), and
    with `memory_budget_gib` across GPU, memory and disk (tiers.py: the engine opened at that budget gives the room).
    The profile counts source neurons; the gpu index marks file positions (neuron_order.py). `granularity`:
    see parse_granularity (`powerinfer` reads the down projection's type from the file); `ctx_size` None: the
    model's default (plan_placement resolves it from the file's trained context)."""
    check_options(vram_budget_bytes, ctx_size, reserve_bytes, dense)
    tiers.check_memory_budget(memory_budget_gib, granularity)
    header = read_header(model_path)
    down_types = {t.type.name for t in header.tensors if t.name.endswith(f".{names.weight(names.FFN_DOWN_T)}")}
    step = parse_granularity(granularity, down_types == {"Q4_0"})
    costs = model_costs(model_path, header)
    order_text = header.get(neuron_order.ORDER_KEY)
    counts = neuron_order.in_file_order(load_activation_counts(profile_dir, costs.n_ff),
                                        neuron_order.decode(model_path, order_text, costs.n_ff))
    tokens = profiled_tokens(profile_dir, counts)
    memory = None
    if memory_budget_gib is not None:
        gate = next(t for t in header.tensors if t.name == names.layer_tensor(0, names.FFN_GATE))
        density = float(sum(c.sum() for c in counts)) / max(tokens * float(costs.n_ff.sum()), 1.0)
        memory = tiers.memory_tier(model_path, costs.neuron_bytes, gate.n_bytes // int(costs.n_ff[0]), density,
                                   int(memory_budget_gib * GIB), ctx_size or default_ctx_size(costs.context_length))
    plan = plan_placement(costs, counts, tokens, vram_budget_bytes, ctx_size, min_layer_neurons, reserve_bytes,
                          offload_output, dense, time_limit, step, memory)
    engine = device_placement.place_on_device(device_placement.device_costs(header, plan.ctx_size), vram_budget_bytes,
                                              plan.gpu_neurons) if vram_budget_bytes > 0 else None
    return dataclasses.replace(plan, neuron_order=order_text, engine=engine.summary() if engine else None)


def profile_frequencies(profile_dir: str | Path, model_path: str | Path) -> list[np.ndarray]:
    """Each layer's activation frequencies (counts / tokens) in the converted file's neuron order: what ranks its
    neurons for a hot set (here) and for the disk tier's resident set (formats/neuron_bundles.py)."""
    header = read_header(model_path)
    costs = model_costs(model_path, header)
    counts = neuron_order.in_file_order(load_activation_counts(profile_dir, costs.n_ff),
                                        neuron_order.decode(model_path, header.get(neuron_order.ORDER_KEY), costs.n_ff))
    tokens = max(profiled_tokens(profile_dir, counts), 1.0)
    return [np.asarray(c, np.float64) / tokens for c in counts]


def check_budget(vram_budget_bytes: float) -> None:
    """A budget is given in GiB (--vram-budget), and named so when it is impossible."""
    limits.PLAN_BUDGET_GIB.check("--vram-budget", vram_budget_bytes / GIB)


def check_options(vram_budget_bytes: float, ctx_size: int | None, reserve_bytes: int, dense: str) -> None:
    """Reject impossible settings before any file is read (ctx_size None: the model's default)."""
    check_budget(vram_budget_bytes)
    limits.CTX_SIZE.check("--ctx-size", ctx_size)
    if reserve_bytes < 0:
        raise UserError(f"the reserve must be non-negative, not {reserve_bytes}")
    if dense not in DENSE_POLICIES:
        raise UserError(f"dense policy must be one of {', '.join(DENSE_POLICIES)}, not {dense!r}")


def plan_placement(costs: ModelCosts, counts: list[np.ndarray], tokens: float, vram_budget_bytes: int,
                   ctx_size: int | None = None, min_layer_neurons: str | int = "auto",
                   reserve_bytes: int = DEFAULT_RESERVE_BYTES, offload_output: bool = True, dense: str = "all",
                   time_limit: float = 20.0, granularity: int = 1, memory: tiers.MemoryTier | None = None) -> Plan:
    """The best placement for byte costs (from a file or from shapes) and per-layer activation counts over
    `tokens` tokens; each layer's GPU count 0, a multiple of `granularity`, or the whole layer. `ctx_size` None:
    the trained context of costs' model, capped (options.default_ctx_size). With `memory`, the three-tier program
    (tier_solver) places the GPU's and memory's neurons together."""
    check_options(vram_budget_bytes, ctx_size, reserve_bytes, dense)
    ctx_size = ctx_size or default_ctx_size(costs.context_length)
    vram_budget_bytes = int(vram_budget_bytes)
    mins = parse_min_layer_neurons(min_layer_neurons)
    if mins == "auto":
        min_neurons = auto_min_neurons(counts, costs, tokens)
    else:
        min_neurons = np.minimum(np.full(costs.n_layer, mins, np.int64), costs.n_ff)
    fixed, per_layer = fixed_costs(costs, ctx_size, reserve_bytes, offload_output, dense)
    if vram_budget_bytes == 0:  # no GPU: nothing is offloaded, not even the dense parts
        fixed = {k: 0 for k in fixed}
    elif sum(fixed.values()) > vram_budget_bytes:
        parts = ", ".join(f"{_label(k, ctx_size)} {human_bytes(v)}" for k, v in fixed.items() if v)
        raise UserError(f"VRAM budget {human_bytes(vram_budget_bytes)} is below the fixed costs "
                        f"{human_bytes(sum(fixed.values()))} ({parts}); raise --vram-budget or lower "
                        "--ctx-size/--reserve-mib")
    capacity = vram_budget_bytes - sum(fixed.values())
    inst = placement_solver.Instance(counts, costs.neuron_bytes, per_layer, min_neurons, capacity, granularity)
    memory_neurons = memory_summary = None
    if memory is not None:
        sol, memory_neurons, memory_summary = _three_tiers(inst, memory, tokens, time_limit)
    elif capacity == 0:
        sol = placement_solver.Solution(np.zeros(costs.n_layer, np.int64), 0.0, 0, "no-budget", 0.0)
    else:
        sol = placement_solver.solve(inst, time_limit=time_limit)
    gpu_index = [np.sort(np.argsort(-c, kind="stable")[:k]).astype(np.int32) for c, k in zip(counts, sol.k)]
    opened = sol.k > 0
    breakdown = dict(fixed)
    if dense == "with-ffn":
        kv = costs.kv_bytes_per_layer(ctx_size)
        breakdown |= {"kv_cache": int(kv * opened.sum()), "attention": int(costs.attention_bytes[opened].sum()),
                      "predictors": int(costs.predictor_bytes[opened].sum())}
    breakdown["ffn"] = int(np.sum(sol.k * costs.neuron_bytes))
    breakdown["free"] = vram_budget_bytes - sum(breakdown.values())
    assert breakdown["free"] >= 0, "solver exceeded the budget"
    return Plan(model=costs.path, vram_budget=vram_budget_bytes, ctx_size=ctx_size, dense=dense,
                offload_output=offload_output, n_ff=costs.n_ff, gpu_neurons=sol.k, gpu_index=gpu_index,
                min_neurons=inst.min_neurons, served=np.array([p[k] for p, k in zip(inst.prefix, sol.k)]),
                total=np.array([p[-1] for p in inst.prefix]), breakdown=breakdown,
                solver={"method": sol.method, "seconds": round(sol.seconds, 4), "iterations": sol.iterations,
                        **sol.details}, granularity=granularity, memory_neurons=memory_neurons, memory=memory_summary)


def _three_tiers(inst: placement_solver.Instance, memory: tiers.MemoryTier, tokens: float, time_limit: float):
    """The GPU's counts (as a placement_solver Solution), memory's counts and the memory tier's summary."""
    problem = tier_solver.TierInstance(inst, memory.bundle_bytes, memory.room, memory.memory_s - memory.device_s,
                                       memory.disk_s - memory.memory_s)
    sol = tier_solver.solve(problem, time_limit=time_limit)
    resident = sol.resident
    by_frequency = tiers.frequency_rule(inst.counts, sol.k, memory)
    # the two tiers chosen apart: the VRAM-only plan's GPU counts, then the frequency rule over the rest
    apart = placement_solver.solve(inst, time_limit=time_limit).k if inst.capacity > 0 else np.zeros_like(sol.k)
    gpu = placement_solver.Solution(sol.k, inst.value(sol.k), inst.bytes_used(sol.k), "milp-3-tier", sol.seconds,
                                    sol.iterations, {"upper_bound_seconds_saved": sol.upper_bound / max(tokens, 1.0),
                                                     "timed_out": sol.timed_out})
    summary = {"budget_bytes": memory.budget, "room_bytes": memory.room, "bundle_bytes": int(memory.bundle_bytes.max()),
               "memory_bytes_per_s": memory.memory_bytes_per_s, "disk_read_s": tiers.DISK_READ_S,
               "disk_bytes_per_s": tiers.DISK_BYTES_PER_S, "device_bytes_per_s": tiers.DEVICE_BYTES_PER_S,
               "seconds_per_activation": {"device": float(memory.device_s.mean()), "memory": float(memory.memory_s.mean()),
                                          "disk": float(memory.disk_s.mean())},
               "ffn_seconds_per_token": {
                   "plan": tiers.seconds_per_token(inst.prefix, memory, sol.k, resident, tokens),
                   "frequency_rule": tiers.seconds_per_token(inst.prefix, memory, sol.k, by_frequency, tokens),
                   "apart": tiers.seconds_per_token(inst.prefix, memory, apart,
                                                    tiers.frequency_rule(inst.counts, apart, memory), tokens)},
               "frequency_rule_memory_neurons": by_frequency.tolist(), "apart_gpu_neurons": apart.tolist()}
    return gpu, resident, summary


def human_bytes(n: int) -> str:
    for unit, size in (("GiB", GIB), ("MiB", MIB), ("KiB", 1024)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def _label(part: str, ctx_size: int) -> str:
    return f"KV cache (ctx {ctx_size})" if part == "kv_cache" else part.replace("_", " ")


BREAKDOWN_ORDER = ("reserve", "output", "kv_cache", "attention", "predictors", "ffn", "free")


def breakdown_lines(plan: Plan) -> list[str]:
    """The budget breakdown as aligned text lines, for the CLI."""
    rows = [(_label(k, plan.ctx_size), plan.breakdown[k]) for k in BREAKDOWN_ORDER if k in plan.breakdown]
    rows.append(("total budget", plan.vram_budget))
    return [f"  {name:<22} {human_bytes(v):>12}" for name, v in rows]


def write_gpuidx(plan: Plan, path: str | Path) -> None:
    """PowerInfer's gpu-index file: per layer blk.N.gpu_idx (i32 [n_ff], 1 = GPU) then blk.N.gpu_bucket (sorted
    GPU neuron indices) in that order (the engine reads them by position), `split.vram_capacity` = the bytes the
    GPU neurons need (PowerInfer's engine loads the file when its remaining budget covers that), PWRI magic, and
    i32 in PowerInfer's type code (gguf_io.POWERINFER_I32). For a model that stores its neurons in a profile's
    order, the model's neuron_order.ORDER_KEY is copied too: our engine refuses an index without it on such a
    model (one built for the source order, as PowerInfer's solver builds from a profile's activation files)."""
    import gguf

    with atomic_file(path) as tmp:
        writer = gguf.GGUFWriter(str(tmp), names.GPU_INDEX_ARCH)
        for i, (n, idx) in enumerate(zip(plan.n_ff, plan.gpu_index)):
            mask = np.zeros(int(n), np.int32)
            mask[idx] = 1
            writer.add_tensor(names.layer_tensor(i, names.GPU_IDX, None), mask, raw_dtype=gguf.GGMLQuantizationType.I32)
            writer.add_tensor(names.layer_tensor(i, names.GPU_BUCKET, None), idx.astype(np.int32), raw_dtype=gguf.GGMLQuantizationType.I32)
        writer.add_block_count(len(plan.n_ff))
        writer.add_uint64(names.KEY_VRAM_CAPACITY, plan.ffn_bytes)
        if plan.neuron_order is not None:
            writer.add_string(neuron_order.ORDER_KEY, plan.neuron_order)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        set_powerinfer_i32(tmp)
        set_pwri_magic(tmp)


def write_summary(plan: Plan, path: str | Path, extra: dict | None = None) -> None:
    with atomic_file(path) as tmp:
        Path(tmp).write_text(json.dumps(plan.summary() | (extra or {}), indent=2) + "\n")


def default_gpuidx_path(model_path: str | Path) -> Path:
    """Where PowerInfer's engine looks: the model's file name + `.generated.gpuidx`."""
    return Path(f"{model_path}.generated.gpuidx")


def write_plan(plan: Plan, out: str | Path) -> PlanFiles:
    """The gpu-index file and its JSON summary (OUT.json); with a memory tier, the three-tier plan beside the model
    (tier_plan.path_for), where the engine looks."""
    summary = Path(f"{out}.json")
    write_gpuidx(plan, out)
    tiers_path = None
    if plan.memory_neurons is not None:
        tiers_path = tier_plan.path_for(plan.model)
        tier_plan.write(tier_plan.TierCounts(int(plan.n_ff.max()), plan.gpu_neurons, plan.memory_neurons,
                                             plan.vram_budget, plan.memory["budget_bytes"]), tiers_path)
    write_summary(plan, summary, extra={"tiers": str(tiers_path)} if tiers_path else None)
    return PlanFiles(plan, Path(out), summary, tiers_path)


def report_lines(plan: Plan) -> list[str]:
    """The budget breakdown and each layer's GPU share, as `pi-tools plan` prints them."""
    s = plan.summary()
    solver = s["solver"]
    return ["VRAM budget breakdown:", *breakdown_lines(plan),
            f"solver: {solver['method']}, {solver['seconds']:.2f} s"
            + (f", {solver['iterations']} MILP rounds" if solver.get("iterations") else "")
            + (" (time limit hit: best plan found)" if solver.get("timed_out") else ""),
            f"GPU neurons {s['gpu_neurons']}/{s['neurons']}, activations served from GPU "
            f"{100 * s['served_fraction']:.1f}%",
            f"  {'layer':>5} {'gpu/n_ff':>13} {'min':>6} {'served':>7}",
            *(f"  {layer['layer']:>5} {layer['gpu_neurons']:>6}/{layer['n_ff']:<6} {layer['min_neurons']:>6} "
              f"{100 * layer['served_fraction']:>6.1f}%" for layer in s["layers"]),
            "  (gpu/n_ff: the layer's FFN neurons placed on the GPU; min: the fewest a layer may have there if it has "
            "any (--min-layer-neurons); served: the share of the layer's activations those neurons serve)",
            *engine_lines(plan), *memory_lines(plan)]


def memory_lines(plan: Plan) -> list[str]:
    """The memory tier of a three-tier plan: the room, the costs, each layer's memory share against the engine's
    frequency rule, and the expected FFN seconds a token of both."""
    m = plan.memory
    if not m:
        return []
    t, cost = m["ffn_seconds_per_token"], m["seconds_per_activation"]
    rule = m["frequency_rule_memory_neurons"]
    return [f"memory budget {human_bytes(m['budget_bytes'])}: {human_bytes(m['room_bytes'])} for resident neurons "
            f"(the engine's room at this budget), {m['bundle_bytes']} bytes each",
            f"an activation costs {cost['device'] * 1e9:.1f} ns on the GPU, {cost['memory'] * 1e9:.1f} ns in memory "
            f"(read probe: {m['memory_bytes_per_s'] / 1e9:.1f} GB/s), {cost['disk'] * 1e6:.2f} us from disk",
            f"  {'layer':>5} {'memory':>8} {'by frequency':>13}",
            *(f"  {i:>5} {int(k):>8} {int(r):>13}" for i, (k, r) in enumerate(zip(plan.memory_neurons, rule))),
            f"expected FFN time a token: {t['plan'] * 1e3:.3f} ms with this plan, {t['frequency_rule'] * 1e3:.3f} ms "
            f"with the engine's frequency rule at the same GPU counts, {t['apart'] * 1e3:.3f} ms with the tiers "
            "chosen apart (the VRAM-only plan, then the frequency rule)"]


def engine_lines(plan: Plan) -> list[str]:
    """Where the bundled engine puts each layer's parts at this budget with this index (docs/engine.md, "The GPU
    tier"): its own rule and bytes, which differ from the budget above (its f32 KV cache, its scratch, no
    predictors or output head on the device)."""
    if not plan.engine:
        return []
    n = len(plan.n_ff)
    attention, hot = plan.engine["attention_layers"], plan.engine["hot_layers"]
    with_hot = int(np.count_nonzero(plan.gpu_neurons))
    head = "the output head, " if plan.engine["output_head"] else ""
    return [f"bundled engine at this budget (ctx {plan.ctx_size}, f32 KV cache): {head}attention + KV cache of "
            f"{len(attention)}/{n} layers and the hot rows of {len(hot)}/{with_hot} layers on the device"
            + ("" if len(hot) == with_hot else " (the rest on the CPU: pi-tools run --verbose shows each layer)")]
