"""A mixture's experts on a device (issue 67 item 5; docs/engine.md "Experts on a device"): the experts a three-tier
plan (MODEL.tiers version 3) puts on the device are uploaded at open, and each layer's pairs routed to them run there
while the CPU computes the others, the two weighted sums added. Through the host emulation of a device (the CUDA
library runs the same tests where a device is: scripts/gpu_check.sh), tiny random Qwen3-MoE and Mixtral files at f32,
q8_0 and q4_0: the logits of every position within the dense device tests' tolerance of the all-CPU run, 32 greedy
tokens equal, every pair routed to a device expert counted there and none other; Mixtral's attention, KV cache and head
on the device too (Qwen3-MoE's per-head q/k norms keep its attention on the CPU); with an expert tier under a memory
budget, the device's experts are never read from the file. `pi-tools plan --vram-budget --memory-budget` chooses the
device's experts and the engine opened at that budget takes them all; what cannot run is refused in one line."""
from __future__ import annotations

import shutil

import numpy as np
import pytest
from cli_helpers import run_cli
from engine_helpers import max_rel_err
from test_moe import family, profiled_copy, tokens_for  # noqa: F401 (family: the module's fixture)
from tiny_models import N_EXPERT

import powerinfer_engine as engine
from powerinfer_tools.formats import tier_plan

N_PROMPT, N_DECODE, N_GREEDY = 40, 24, 32
VRAM_GIB = 0.25  # every tiny model's experts, attention and head, within the emulated device's 512 MiB
TOPK = {"qwen3-moe": 4, "mixtral": 2}


@pytest.fixture
def emulated(monkeypatch):
    """The emulated device library, with a device of 512 MiB."""
    monkeypatch.setenv("PI_EMULATED_DEVICE_MIB", "512")
    monkeypatch.delenv("PI_EMULATED_DEVICES", raising=False)
    path = engine.device_library_path("emulated")
    assert path is not None, "the emulated device library is built with the engine"
    return path


@pytest.fixture(params=["emulated", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request, monkeypatch):
    """A device library: the emulated one, or the CUDA one where a CUDA device is present."""
    if request.param == "emulated":
        return request.getfixturevalue("emulated")
    import ctypes

    from test_device_library_boundary import Api

    path = engine.device_library_path("cuda")
    if path is None:
        pytest.skip("built without nvcc: no CUDA library")
    lib = ctypes.CDLL(str(path))
    lib.pi_device_api_get.restype = ctypes.POINTER(Api)
    err = ctypes.create_string_buffer(256)
    if lib.pi_device_api_get().contents.device_count(err, 256) == 0:
        pytest.skip(err.value.decode())
    return path


def shape_of(path) -> tuple[int, int]:
    with engine.Model(path, threads=2, ctx_size=256) as m:
        return m.info["n_layer"], m.info["n_ff"]


def with_plan(path, tmp_path, device: list[list[int]], pinned=None, cached=None):
    """The model copied beside a plan of its own putting device[layer] on the device (pinning pinned[layer], caching
    cached[layer] where given: a memory budget's)."""
    n_layer, n_ff = shape_of(path)
    model = tmp_path / path.name
    shutil.copy(path, model)
    experts = tier_plan.ExpertCounts(N_EXPERT, cached or [0] * n_layer, tuple(pinned or [[]] * n_layer), tuple(device))
    tier_plan.write(tier_plan.TierCounts(n_ff, np.zeros(n_layer), np.zeros(n_layer), experts=experts),
                    tier_plan.path_for(model))
    return model


def run(path, tokens, **kw):
    """Logits of every position (a prompt batch, then decode steps), each step's experts [token, layer, k], stats."""
    with engine.Model(path, threads=2, ctx_size=256, **kw) as m:
        m.set_expert_trace(True)
        rows = [m.eval(tokens[:N_PROMPT])]
        chosen = [m.expert_choices(N_PROMPT)]
        for t in tokens[N_PROMPT:]:
            rows.append(m.eval([t])[None, 0])
            chosen.append(m.expert_choices(1))
        return np.concatenate(rows), np.concatenate(chosen), m.stats(), m.info


def greedy(path, prompt, **kw):
    with engine.Model(path, threads=2, ctx_size=256, **kw) as m:
        return list(m.generate(prompt, N_GREEDY))


EVEN = [0, 2, 4, 6]  # half of each layer's experts on the device: a token's experts mixed between the two


@pytest.mark.parametrize("outtype", ["f32", "q8_0", "q4_0"])
@pytest.mark.parametrize("kind", ["qwen3-moe", "mixtral"])
def test_experts_on_the_device_give_the_cpu_logits(kind, outtype, family, tmp_path, device):
    src, path, _ = family(kind, outtype)
    n_layer, _ = shape_of(path)
    model = with_plan(path, tmp_path, [EVEN] * n_layer)
    tokens = tokens_for(src, N_PROMPT + N_DECODE)
    cpu, cpu_chosen, _, _ = run(model, tokens, gpu="off")
    dev, chosen, stats, info = run(model, tokens, gpu="on", gpu_library=device, vram_budget=VRAM_GIB)
    # the dense device tests' tolerances (tests/engine/test_engine_device_attention.py)
    tol = 1e-4 if outtype == "f32" else 2e-3
    assert max_rel_err(dev, cpu) <= tol, max_rel_err(dev, cpu)
    np.testing.assert_array_equal(chosen, cpu_chosen)
    g, placed = stats["gpu"], info["gpu"]["device"]
    assert info["gpu"]["used"] and placed["experts_on_device"] == len(EVEN) * n_layer
    assert [layer["device_experts"] for layer in placed["layers"]] == [len(EVEN)] * n_layer
    # every pair routed to a device expert ran there, in one job per layer and batch, and no other pair
    on_device = int(np.isin(chosen, EVEN).sum())
    assert 0 < on_device < chosen.size
    jobs = int(np.isin(chosen[:N_PROMPT], EVEN).any(axis=(0, 2)).sum() + np.isin(chosen[N_PROMPT:], EVEN).any(axis=2).sum())
    assert g["expert_pairs"] == on_device and g["expert_jobs"] == jobs
    # Mixtral's attention and head on the device too; Qwen3-MoE's attention stays (per-head q/k norms)
    assert placed["output_head"] == "device" and g["head_jobs"] == 1 + N_DECODE
    if kind == "mixtral":
        assert g["attention_jobs"] == n_layer * (1 + N_DECODE)
    else:
        assert g["attention_jobs"] == 0 and "per-head q/k norms" in placed["attention_reason"]
    prompt = tokens[:N_PROMPT]
    assert greedy(model, prompt, gpu="on", gpu_library=device, vram_budget=VRAM_GIB) == greedy(model, prompt, gpu="off")


def test_every_expert_on_the_device_gives_the_cpu_logits(family, tmp_path, device):
    """Every expert of every layer on the device: the CPU computes none (only the routers), every pair runs there."""
    src, path, _ = family("mixtral", "f32")
    n_layer, _ = shape_of(path)
    tokens = tokens_for(src, N_PROMPT + N_DECODE)
    model = with_plan(path, tmp_path, [list(range(N_EXPERT))] * n_layer)
    cpu, _, _, _ = run(model, tokens, gpu="off")
    dev, _, stats, _ = run(model, tokens, gpu="on", gpu_library=device, vram_budget=VRAM_GIB)
    assert max_rel_err(dev, cpu) <= 1e-4, max_rel_err(dev, cpu)
    assert stats["gpu"]["expert_pairs"] == (N_PROMPT + N_DECODE) * n_layer * TOPK["mixtral"]
    assert stats["gpu"]["expert_jobs"] == n_layer * (1 + N_DECODE)


def test_with_an_expert_tier_the_devices_experts_are_never_read(family, tmp_path, device):
    """A memory budget's expert tier beside the device: the plan pins one expert a layer and caches a token's two;
    the device's four never reach the cache (every tier hit or miss is a CPU expert's), the in-memory logits."""
    src, path, _ = family("mixtral", "q8_0")
    n_layer, _ = shape_of(path)
    with engine.Model(path, threads=2, ctx_size=256, memory_budget=4.0) as m:
        d = m.stats()["disk"]
    budget = (d["fixed_bytes"] + 3 * n_layer * d["slot_bytes"] + d["slot_bytes"] // 2) / 2**30
    model = with_plan(path, tmp_path, [EVEN] * n_layer, pinned=[[1]] * n_layer, cached=[2] * n_layer)
    tokens = tokens_for(src, N_PROMPT + N_DECODE)
    cpu, _, _, _ = run(model, tokens, gpu="off")
    dev, chosen, stats, _ = run(model, tokens, gpu="on", gpu_library=device, vram_budget=VRAM_GIB,
                                memory_budget=budget)
    assert max_rel_err(dev, cpu) <= 2e-3
    disk = stats["disk"]
    decode = chosen[N_PROMPT:]
    assert disk["cache_hits"] + disk["cache_misses"] == int((~np.isin(decode, EVEN)).sum())
    assert disk["pinned_hits"] == int((decode == 1).sum())


def test_what_the_device_cannot_take_is_refused_in_one_line(family, tmp_path, emulated):
    src, path, _ = family("qwen3-moe", "q8_0")
    n_layer, _ = shape_of(path)
    # no plan beside the model: gpu on fails, gpu auto runs on the CPU saying why
    with pytest.raises(engine.EngineError) as exc:
        engine.Model(path, threads=2, ctx_size=256, gpu="on", gpu_library=emulated)
    assert "\n" not in str(exc.value) and "gpu on: no device experts" in str(exc.value)
    with engine.Model(path, threads=2, ctx_size=256, gpu="auto", gpu_library=emulated) as m:
        assert not m.info["gpu"]["used"] and "no device experts" in m.info["gpu"]["reason"]
    # a plan whose device experts the budget cannot hold after the scratch and head: plan again (auto or on)
    model = with_plan(path, tmp_path, [EVEN] * n_layer)
    with engine.Model(model, threads=2, ctx_size=256, gpu="on", gpu_library=emulated, vram_budget=VRAM_GIB) as m:
        placed = m.info["gpu"]["device"]["placed_bytes"]
    short = (sum(placed.values()) - placed["experts"] / 2) / 2**30
    with pytest.raises(engine.EngineError, match="plan again at this budget") as exc:
        engine.Model(model, threads=2, ctx_size=256, gpu="auto", gpu_library=emulated, vram_budget=short)
    assert "\n" not in str(exc.value) and f"puts {len(EVEN) * n_layer} experts on the device" in str(exc.value)
    # ReLU experts: the device computes SiLU's
    _, relu, _ = family("mixtral-relu", "q8_0")
    (tmp_path / "relu").mkdir()
    relu_model = with_plan(relu, tmp_path / "relu", [EVEN] * shape_of(relu)[0])
    with pytest.raises(engine.EngineError) as exc:
        engine.Model(relu_model, threads=2, ctx_size=256, gpu="on", gpu_library=emulated)
    assert "\n" not in str(exc.value) and "the device computes SiLU experts" in str(exc.value)


def test_a_device_section_the_engine_cannot_follow_is_refused_in_one_line(family, tmp_path):
    """MODEL.tiers version 3: a device expert past the layer's, twice, also pinned, more experts than the layer's; a
    version 2 plan (no device section) is read as one without device experts."""
    import struct

    from powerinfer_tools.formats import neuron_bundles

    _, path, _ = family("qwen3-moe", "q8_0")
    n_layer, n_ff = shape_of(path)
    model = with_plan(path, tmp_path, [EVEN] * n_layer)
    plan_path = tier_plan.path_for(model)

    def raw(device, pinned=(), slots=0, version=3):
        body = tier_plan.HEADER.pack(b"PITP", version, n_layer, n_ff, 0, 0) + bytes(8 * n_layer)
        body += struct.pack("<I", N_EXPERT) + struct.pack("<2I", slots, len(pinned)) * n_layer
        body += struct.pack("<I", len(device)) * n_layer if version >= 3 else b""
        body += b"".join(struct.pack("<I", e) for e in pinned) * n_layer
        body += b"".join(struct.pack("<I", e) for e in device) * n_layer if version >= 3 else b""
        return body + struct.pack("<Q", neuron_bundles.checksum(body))

    cases = {f"puts on the device expert {N_EXPERT}, past its": raw([0, N_EXPERT]),
             "puts on the device expert 2 twice": raw([2, 2]),
             "puts on the device expert 3 twice, or pins it too": raw([3], pinned=[3]),
             "more than its": raw(EVEN, pinned=[1], slots=4)}
    for words, data in cases.items():
        plan_path.write_bytes(data)
        with pytest.raises(engine.EngineError, match=words) as exc:
            engine.Model(model, threads=2, ctx_size=256, gpu="on", gpu_library=engine.device_library_path("emulated"))
        assert "\n" not in str(exc.value)
        with pytest.raises(Exception, match=words.split(",")[0]):
            tier_plan.read(plan_path, n_layer, n_ff, N_EXPERT)
    plan_path.write_bytes(raw([], pinned=[1], slots=4, version=2))
    assert all(len(d) == 0 for d in tier_plan.read(plan_path, n_layer, n_ff, N_EXPERT).experts.device)
    with engine.Model(model, threads=2, ctx_size=256, gpu="auto", gpu_library=engine.device_library_path("emulated")) as m:
        assert not m.info["gpu"]["used"] and "no device experts" in m.info["gpu"]["reason"]


def test_plan_puts_the_most_selected_experts_on_the_device_and_the_engine_takes_them(family, tmp_path, capsys, emulated,
                                                                                      monkeypatch):
    """`pi-tools profile`, then `pi-tools plan --vram-budget X --memory-budget Y` on a Mixtral: at a VRAM budget with
    room for a few experts after the device's scratch, head and attention, MODEL.tiers puts each layer's most
    selected experts (by the profile's trace) on the device, within the room, and pins and caches the others; the
    engine opened at X and Y takes every planned device expert, near the CPU's logits. A budget a little below
    refuses the plan in one line; one leaving no room for an expert is refused by plan in one line."""
    from powerinfer_tools.stages.options import DEFAULT_KV_TYPE
    from powerinfer_tools.stages.placement import expert_solver, expert_tiers

    src, _, model = profiled_copy(family, "mixtral", "q8_0", tmp_path, capsys)
    n_layer, n_ff = shape_of(model)
    dev = expert_tiers.device_room(model, 2**30, 256)
    fixed = 2**30 - dev.room  # what the device holds before the experts: their room grows with the budget
    vram = int(fixed + dev.scratch + 5.5 * dev.expert_bytes[0])  # room for 5 experts
    with engine.Model(model, threads=2, ctx_size=256, memory_budget=4.0, kv_type=DEFAULT_KV_TYPE) as m:
        d = m.stats()["disk"]
    memory = (d["fixed_bytes"] + 4 * n_layer * d["slot_bytes"] + d["slot_bytes"] // 2) / 2**30
    code, out, err = run_cli(capsys, "plan", "--profile", tmp_path / "prof", "-m", model, "--vram-budget",
                             vram / 2**30, "--memory-budget", memory, "-c", 256)
    assert code == 0, err
    assert "5 experts on the device" in out
    x = tier_plan.read(tier_plan.path_for(model), n_layer, n_ff, N_EXPERT).experts
    assert sum(map(len, x.device)) == 5
    # the most selected of each layer (the trace's first half, as the plan learns), and the program's counts
    from powerinfer_tools.stages.profiling import expert_profile
    from powerinfer_tools.stages.profiling.profiling import load_profile

    trace = expert_profile.load(tmp_path / "prof", load_profile(tmp_path / "prof")).trace
    order = expert_solver.hottest_first(trace[:len(trace) // 2], N_EXPERT)
    for il, ids in enumerate(x.device):
        np.testing.assert_array_equal(ids, order[il, :len(ids)])
        assert not set(ids) & set(x.pinned[il].tolist())
    tokens = tokens_for(src, N_PROMPT + N_DECODE)
    kv = {"kv_type": DEFAULT_KV_TYPE}
    cpu, _, _, _ = run(model, tokens, gpu="off", memory_budget=memory, **kv)
    got, _, stats, info = run(model, tokens, gpu="on", gpu_library=emulated, vram_budget=vram / 2**30,
                              memory_budget=memory, **kv)
    assert info["gpu"]["device"]["experts_on_device"] == 5 and stats["gpu"]["expert_jobs"] > 0
    assert max_rel_err(got, cpu) <= 2e-3
    with pytest.raises(engine.EngineError, match="plan again at this budget") as exc:
        engine.Model(model, threads=2, ctx_size=256, gpu="on", gpu_library=emulated,
                     vram_budget=(vram - dev.expert_bytes[0]) / 2**30, **kv)
    assert "\n" not in str(exc.value)
    # the CLI runs it (the device library as PI_GPU_LIBRARY names it; no GPU index for a mixture)
    monkeypatch.setenv("PI_GPU_LIBRARY", str(emulated))
    code, out, err = run_cli(capsys, "run", "-m", model, "-p", "To be", "-n", "4", "--gpu", "on", "--vram-budget",
                             vram / 2**30, "--memory-budget", memory, "-c", 256, "-v")
    assert code == 0, err
    assert "5 experts on the device: " in out + err
    code, _, err = run_cli(capsys, "plan", "--profile", tmp_path / "prof", "-m", model, "--vram-budget",
                           (fixed + dev.scratch) / 2**30, "--memory-budget", memory, "-c", 256)
    assert code != 0 and len(err.strip().splitlines()) == 1 and "too little for the experts' scratch" in err
