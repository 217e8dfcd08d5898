"""`plan --memory-budget` for a mixture of experts: each layer's pinned experts and cache slots (expert_solver.py)
within the room the engine gives its expert tier at that budget, written into MODEL.tiers for the engine to follow
(docs/placement.md, "Three tiers"; docs/engine.md, "The expert tier").

The room is the engine's own: the model opened at the budget (through a link without the plan beside it, so that an
old plan does not decide it) reports its budget, the bytes it holds whatever the cache, and a slot's bytes. An
expert read from disk costs its three runs' reads at the disk tier's measured cost (tiers.DISK_READ_S per read,
tiers.DISK_BYTES_PER_S); pinned and cached experts are both in memory and cost the same, so the plan minimises the
reads.

With --vram-budget, the device's experts come first: the engine's placement (device_placement.py, as
csrc/backend/device_placement.cpp) gives the device its scratch, the output head and the attention blocks and KV
caches it takes, and what is left holds the experts' scratch and as many experts as device_choice picks (each
layer's most selected, serving the most selections); the memory plan then covers each layer's other experts.
"""
from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from powerinfer_tools.core.errors import UserError
from powerinfer_tools.formats import names, tier_plan
from powerinfer_tools.formats.gguf_header import read_header
from powerinfer_tools.stages.options import DEFAULT_KV_TYPE
from powerinfer_tools.stages.placement import device_placement, expert_solver, tiers
from powerinfer_tools.stages.placement.placement import GIB, model_ctx_size
from powerinfer_tools.stages.profiling import expert_profile


@dataclass
class ExpertPlan:
    model: Path
    n_expert: int
    n_ff: int            # the engine's n_ff (the plan file's neuron count; a mixture's FFN is its experts)
    budget: int          # bytes: the engine's memory_budget
    room_slots: int      # experts the engine's cache may hold at that budget
    slot_bytes: int
    read_s: float        # seconds one expert costs from disk
    tokens: int          # the trace's tokens the misses were counted on (its second half)
    slots: np.ndarray    # int64 [L]: pinned + cached
    pinned: list         # [L] int64 arrays of expert ids
    misses: float        # expected over `tokens`, with the plan
    misses_even: float   # with no pins and the room split evenly (today's one shared cache, approximately)
    seconds: float       # the solver's
    device: list | None = None  # [L] int64 arrays: the experts on the device (None: --vram-budget 0)
    vram_budget: int = 0
    device_room: float = 0.0    # bytes the engine's placement leaves the experts (their scratch included)
    device_bytes: float = 0.0   # what the chosen experts and their scratch take of it
    device_share: float = 0.0   # of the trace's first half's selections, those the device's experts serve
    tiers_path: Path | None = None

    def summary_lines(self) -> list[str]:
        per_token = lambda m: m / max(self.tokens, 1)  # noqa: E731
        device = self.device or [np.zeros(0, np.int64)] * len(self.slots)
        gpu = ([f"VRAM budget {self.vram_budget / GIB:.3f} GiB: {self.device_room / 2**20:.2f} MiB left for experts "
                f"after the scratch, output head and attention; {sum(map(len, device))} experts on the device "
                f"({self.device_bytes / 2**20:.2f} MiB with their scratch), serving {100 * self.device_share:.1f}% of "
                "the profile's selections"] if self.device is not None else [])
        return [*gpu,
                f"memory budget {self.budget / GIB:.3f} GiB: room for {self.room_slots} experts of "
                f"{self.slot_bytes / 2**20:.2f} MiB (the engine's expert tier at this budget)",
                f"an expert from disk costs {self.read_s * 1e3:.3f} ms (3 reads of "
                f"{tiers.DISK_READ_S * 1e6:.1f} us + its bytes at {tiers.DISK_BYTES_PER_S / 1e9:.2f} GB/s)",
                f"  {'layer':>5} {'device':>7} {'pinned':>7} {'cache':>6}",
                *(f"  {i:>5} {len(d):>7} {len(p):>7} {int(s) - len(p):>6}"
                  for i, (s, p, d) in enumerate(zip(self.slots, self.pinned, device))),
                f"expected expert reads a token: {per_token(self.misses):.2f} with this plan "
                f"({per_token(self.misses) * self.read_s * 1e3:.2f} ms), {per_token(self.misses_even):.2f} with no "
                f"pins and the room split evenly ({per_token(self.misses_even) * self.read_s * 1e3:.2f} ms); counted "
                f"on the profile's last {self.tokens} tokens (solver {self.seconds:.2f} s)"]


def engine_room(model_path: Path, budget: int, ctx_size: int | None) -> tuple[int, int, dict]:
    """(experts the cache may hold, a slot's bytes, the engine's info) with the model opened at `budget`."""
    import powerinfer_engine as engine

    with tempfile.TemporaryDirectory() as d:
        link = Path(d) / model_path.name
        link.symlink_to(model_path.resolve())
        try:
            ctx = ctx_size or model_ctx_size(read_header(model_path))
            with engine.Model(link, ctx_size=ctx, kv_type=DEFAULT_KV_TYPE, memory_budget=budget / GIB) as m:
                disk, info = m.stats()["disk"], m.info
        except engine.EngineError as e:
            raise UserError(f"--memory-budget: {e}") from None
    room = int(max(disk["budget_bytes"] - disk["fixed_bytes"], 0) // disk["slot_bytes"])
    return min(room, info["n_layer"] * info["n_expert"]), int(disk["slot_bytes"]), info


def expert_read_seconds(model_path: Path) -> float:
    """An expert from disk: its gate, up and down runs (the GGUF's bytes of layer 0's experts over their count)."""
    header = read_header(model_path)
    parts = [t for t in header.tensors if t.name in {names.layer_tensor(0, p) for p in
                                                        (names.FFN_GATE_EXPS, names.FFN_UP_EXPS, names.FFN_DOWN_EXPS)}]
    n_expert = int(header.get(f"{header.get('general.architecture')}.expert_count"))
    raw = sum(t.n_bytes for t in parts) / n_expert
    return len(parts) * tiers.DISK_READ_S + raw / tiers.DISK_BYTES_PER_S


def load_trace(profile_dir: Path, info: dict) -> np.ndarray:
    """The profile's trace of choices, checked against the model (one line otherwise)."""
    from powerinfer_tools.stages.profiling.profiling import load_profile

    meta = load_profile(profile_dir)
    if meta.get("rule") != "experts":
        raise UserError(f"--profile {profile_dir}: not an expert profile (pi-tools profile on this mixture writes one)")
    p = expert_profile.load(Path(profile_dir), meta)
    if (p.n_layer, p.n_expert, p.top_k) != (info["n_layer"], info["n_expert"], info["n_expert_used"]):
        raise UserError(f"--profile {profile_dir}: made for {p.n_layer} layers of {p.n_expert} experts, top-{p.top_k}, "
                        f"not this model's {info['n_layer']} of {info['n_expert']}, top-{info['n_expert_used']}")
    if p.trace is None or len(p.trace) < 2:
        raise UserError(f"--profile {profile_dir}: records no trace of the choices (made before plan placed "
                        "experts, or too short): profile again")
    return p.trace


@dataclass
class DeviceRoom:
    """What the engine's placement leaves a mixture's experts on the device at a VRAM budget."""

    room: float                # bytes after the scratch, output head and attention (the experts' scratch included)
    scratch: float             # the experts' scratch
    expert_bytes: np.ndarray   # [L] one of a layer's experts


def device_room(model_path: Path, vram_budget: int, ctx_size: int | None) -> DeviceRoom:
    """The room at `vram_budget` for the engine opened as plan opens it (its default batch, DEFAULT_KV_TYPE, ctx)."""
    header = read_header(model_path)
    costs = device_placement.device_costs(header, ctx_size or model_ctx_size(header), kv_type=DEFAULT_KV_TYPE)
    experts = device_placement.expert_device_costs(header, costs.shape)
    return DeviceRoom(device_placement.expert_room(costs, vram_budget), experts.scratch, experts.expert)


def selections(trace: np.ndarray, order: np.ndarray, n_expert: int) -> np.ndarray:
    """[L, E] each layer's selections in `trace` ([T, L, k]), in `order`'s order (most selected first)."""
    return np.take_along_axis(expert_solver.selection_counts(trace, n_expert), order, axis=1)


def plan_experts(profile_dir: str | Path, model_path: str | Path, vram_budget_bytes: float, memory_budget_gib: float,
                 ctx_size: int | None, time_limit: float = 20.0) -> ExpertPlan:
    """The plan (not written yet: write())."""
    model_path = Path(model_path)
    budget = int(memory_budget_gib * GIB)
    vram = int(vram_budget_bytes)
    room, slot_bytes, info = engine_room(model_path, budget, ctx_size)
    trace = load_trace(Path(profile_dir), info)
    E, k, L = info["n_expert"], info["n_expert_used"], info["n_layer"]
    half = len(trace) // 2
    order = expert_solver.hottest_first(trace[:half], E)
    on_device, device = np.zeros(L, np.int64), None
    if vram > 0:
        dev = device_room(model_path, vram, ctx_size)
        capacity = dev.room - dev.scratch
        if capacity < float(dev.expert_bytes.min()):
            raise UserError(f"--vram-budget {vram / GIB:g}: the device's scratch, output head and attention leave "
                            f"{max(dev.room, 0) / 2**20:.2f} MiB, too little for the experts' scratch "
                            f"({dev.scratch / 2**20:.2f} MiB) and one expert ({dev.expert_bytes.min() / 2**20:.2f} MiB); "
                            "raise --vram-budget or plan with --vram-budget 0")
        picked = selections(trace[:half], order, E)
        choice = expert_solver.device_choice(picked, dev.expert_bytes, capacity, time_limit)
        on_device = choice.counts
        device = [order[i, :d].copy() for i, d in enumerate(on_device)]
    misses = expert_solver.lru_misses(trace, order, E, warm=half, progress=True)
    options = [expert_solver.layer_options(m[d:], k) for m, d in zip(misses, on_device)]
    sol = expert_solver.solve(options, room, time_limit)
    if sol is None:
        raise UserError(f"--memory-budget {memory_budget_gib:g}: room for {room} experts, fewer than a token's {k} "
                        f"in each of the {L} layers (a plan gives each layer a cache of its own)")
    even = room // L
    misses_even = float(sum(m[d, min(even, E - d)] for m, d in zip(misses, on_device)))
    plan = ExpertPlan(model_path, E, info["n_ff"], budget, room, slot_bytes, expert_read_seconds(model_path),
                      len(trace) - half, sol.slots,
                      [order[i, d:d + p].copy() for i, (d, p) in enumerate(zip(on_device, sol.pinned))],
                      sol.misses, misses_even, sol.seconds, device, vram)
    if device is not None:
        plan.device_room = dev.room
        plan.device_bytes = dev.scratch + float(np.dot(on_device, dev.expert_bytes))
        plan.device_share = choice.served / max(float(picked.sum()), 1.0)
    return plan


def write(plan: ExpertPlan) -> Path:
    """MODEL.tiers with the plan's expert section, its device experts too (no neuron counts)."""
    L = len(plan.slots)
    experts = tier_plan.ExpertCounts(plan.n_expert, plan.slots - np.array([len(p) for p in plan.pinned], np.int64),
                                     tuple(plan.pinned), tuple(plan.device or ()))
    path = tier_plan.path_for(plan.model)
    tier_plan.write(tier_plan.TierCounts(plan.n_ff, np.zeros(L), np.zeros(L), plan.vram_budget, plan.budget, experts),
                    path)
    plan.tiers_path = path
    return path
