"""pi-tools bench: the two files (same weights), threshold rewriting, sparsity calibration, byte model,
statistics and reporting, and a small end-to-end run on a tiny model (timings are never asserted)."""
from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from cli_helpers import assert_one_line_error, run_cli
from peer_helpers import llama_cpp_python
from convert_helpers import write_predictors
from placement_fixtures import power_law_counts, write_profile
from tiny_models import HIDDEN, N_FF, N_LAYER

from powerinfer_tools.models import arch
from powerinfer_tools.bench import harness as bench
from powerinfer_tools.bench import report
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import bench_targets  # noqa: E402  (the project's goals: a script, not the product)
from powerinfer_tools.bench import byte_model
from powerinfer_tools.bench import machine
from powerinfer_tools import models
from powerinfer_tools.formats import neuron_order
from powerinfer_tools.bench import sparsity_levels
from powerinfer_tools.bench.files import bench_files, set_thresholds, thresholds, working_copy
from powerinfer_tools.core.errors import UserError
from powerinfer_tools.formats.gguf_io import open_reader, read_magic

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def silu_files(tiny_model_dir, tmp_path_factory):
    """q8_0 bench files of the tiny llama-silu model, with random predictors (rank 16)."""
    work = tmp_path_factory.mktemp("bench_work")
    pred = write_predictors(work / "pred", N_LAYER, HIDDEN, N_FF)
    model = str(tiny_model_dir("llama-silu"))
    return model, bench_files(model, "q8_0", work, predictors=pred, progress=False), work


@pytest.mark.parametrize("outtype, ordered", [("q4_0", False), ("q8_0", False), ("q8_0", True)])
def test_llamacpp_file_holds_the_same_weights(tiny_model_dir, tmp_path, outtype, ordered):
    """Byte copies of every tensor llama.cpp reads but ffn_down, which is the source's, quantized the same way and,
    when the file's neurons are in the profile's order (neuron_order.py), its columns in that order."""
    import gguf

    from powerinfer_tools.stages.conversion.conversion import encode

    model = str(tiny_model_dir("llama-silu"))
    profile = write_profile(tmp_path / "prof", power_law_counts(N_LAYER, N_FF), tokens=4096) if ordered else None
    files = bench_files(model, outtype, tmp_path, predictors=write_predictors(tmp_path / "p", N_LAYER, HIDDEN, N_FF),
                        profile=profile, progress=False)
    orders = neuron_order.read(files.powerinfer, [N_FF] * N_LAYER)
    assert (orders is not None) == ordered
    assert read_magic(files.powerinfer) == b"PWRI" and read_magic(files.llamacpp) == b"GGUF"
    ours = {t.name: t for t in open_reader(files.powerinfer).tensors}
    plain_reader = gguf.GGUFReader(files.llamacpp)
    plain = {t.name: t for t in plain_reader.tensors}
    assert not any(".fc1." in n or ".fc2." in n or "ffn_down_t" in n for n in plain)
    assert not any(k.startswith(("powerinfer.", "powerinfer_tools.")) for k in plain_reader.fields)
    source = models.resolve(model)
    hf = models.load_model(source)[0].state_dict()
    for name, t in ours.items():
        if ".fc1." in name or ".fc2." in name:
            continue
        if ".ffn_down_t." in name:
            layer = int(name.split(".")[1])
            p = plain[name.replace("ffn_down_t", "ffn_down")]
            assert p.tensor_type == t.tensor_type
            down = hf[f"model.layers.{layer}.mlp.down_proj.weight"].numpy()
            expected = encode(down[:, orders[layer]] if ordered else down, t.tensor_type)
            assert np.array_equal(np.asarray(p.data), expected), name  # same source, same quantizer
        else:
            assert np.array_equal(np.asarray(plain[name].data), np.asarray(t.data)), name  # byte copies
    ours_reader = open_reader(files.powerinfer)
    ours_arch = ours_reader.fields["general.architecture"].contents()  # llama-silu for a SiLU model
    assert plain_reader.fields["general.architecture"].contents() == "llama"
    for key in ("block_count", "rope.freq_base"):
        assert plain_reader.fields[f"llama.{key}"].contents() == ours_reader.fields[f"{ours_arch}.{key}"].contents()
    assert plain_reader.fields["tokenizer.ggml.tokens"].contents() == ours_reader.fields["tokenizer.ggml.tokens"].contents()
    # cached: a second call reuses the files
    again = bench_files(model, outtype, tmp_path, predictors=tmp_path / "p", profile=profile, progress=False)
    assert again.powerinfer == files.powerinfer and again.powerinfer.stat().st_mtime_ns == \
        files.powerinfer.stat().st_mtime_ns


def test_cached_files_are_rebuilt_by_another_converter(tiny_model_dir, tmp_path, monkeypatch):
    """The work directory's files are keyed by the toolkit's sources too: after an upgrade (or any edit) the
    benchmark converts anew instead of timing what an older converter wrote."""
    from powerinfer_tools.bench import files as module

    model, pred = str(tiny_model_dir("llama-silu")), write_predictors(tmp_path / "p", N_LAYER, HIDDEN, N_FF)
    first = bench_files(model, "q8_0", tmp_path, predictors=pred, progress=False)
    assert bench_files(model, "q8_0", tmp_path, predictors=pred, progress=False).powerinfer == first.powerinfer
    monkeypatch.setattr(module, "converter_fingerprint", lambda: "another version")
    rebuilt = bench_files(model, "q8_0", tmp_path, predictors=pred, progress=False)
    assert rebuilt.powerinfer != first.powerinfer and rebuilt.powerinfer.is_file() and first.powerinfer.is_file()


def test_cache_key_changes_with_the_converter_and_not_with_other_modules(tmp_path):
    """The key covers the modules the converter imports (found by following its imports, those inside functions
    too), so that editing the CLI, placement or the bench harness keeps a multi-GB cached file, and editing the
    converter or anything it imports, directly or not, rebuilds it. Edits are made to a copy of the package."""
    from powerinfer_tools.bench.files import converter_fingerprint, converter_sources

    package = ROOT / "powerinfer_tools"
    copy = tmp_path / "powerinfer_tools"
    shutil.copytree(package, copy, ignore=shutil.ignore_patterns("__pycache__"))
    key = converter_fingerprint(copy)
    assert key == converter_fingerprint(package)
    sources = {p.relative_to(copy).as_posix() for p in converter_sources(copy)}
    assert {"stages/conversion/conversion.py", "bench/files.py", "formats/gguf_io.py", "formats/names.py",
            "formats/neuron_order.py", "formats/tokenizer.py", "models/source_weights.py", "models/arch/base.py",
            "models/arch/llama_silu.py", "stages/predictors/predictor.py", "core/atomic.py"} <= sources
    assert not {"cli/app.py", "cli/convert.py", "stages/placement/placement.py", "bench/harness.py", "runtime/inference.py",
                "stages/sparsification/run.py", "formats/describe.py"} & sources

    def edit(rel: str) -> str:
        path = copy / rel
        path.write_text(path.read_text() + "\n# edited\n")
        return converter_fingerprint(copy)

    for unrelated in ("cli/app.py", "stages/placement/placement.py", "bench/harness.py", "runtime/inference.py"):
        assert edit(unrelated) == key, unrelated
    for used in ("stages/conversion/conversion.py", "models/arch/llama_family.py", "formats/names.py", "core/errors.py"):
        changed = edit(used)
        assert changed != key, used
        key = changed
    # an import added inside a converter function brings its module in
    conversion = copy / "stages" / "conversion" / "conversion.py"
    conversion.write_text(conversion.read_text() + "\n\ndef _plan():\n    from powerinfer_tools.stages.placement import placement\n")
    key = converter_fingerprint(copy)
    assert edit("stages/placement/placement.py") != key


def test_llamacpp_file_refuses_other_architectures(tiny_model_dir, tmp_path):
    with pytest.raises(UserError, match="llama.cpp comparison supports"):
        bench_files(str(tiny_model_dir("falcon")), "q8_0", tmp_path, progress=False)


@pytest.mark.parametrize("kind", ["qwen3-moe", "olmoe"])
def test_llamacpp_file_of_a_mixture_is_its_experts_as_they_are(kind, tiny_model_dir, tmp_path):
    """A mixture of experts' llama.cpp copy (the bench's peer file): llama.cpp's architecture name and keys, none of
    ours, every tensor copied (no down projection to requantize: the experts keep llama.cpp's layout), and the same
    logits in our engine as the PowerInfer file; the byte model prices a token's router and chosen experts."""
    import powerinfer_engine as engine

    files = bench_files(str(tiny_model_dir(kind)), "q8_0", tmp_path, progress=False)
    reader = open_reader(files.llamacpp)
    arch_name = reader.fields["general.architecture"].contents()
    assert read_magic(files.llamacpp) == b"GGUF" and arch_name == kind.replace("-", "")
    assert not [k for k in reader.fields if k.startswith(("powerinfer", f"{arch_name}-"))]
    assert files.manifest["llamacpp_file"]["requantized"] == 0
    # the byte model: a token reads the router (f32) and its k experts' gate, up and down rows
    with engine.Model(files.powerinfer, threads=1, ctx_size=64) as m:
        n_expert, k, n_ff = m.info["n_expert"], m.info["n_expert_used"], m.info["n_ff_exp"]
    gate_exps = next(t for t in open_reader(files.powerinfer).tensors if t.name == "blk.0.ffn_gate_exps.weight")
    layer = byte_model.model_bytes(files.powerinfer).layers[0]
    assert layer.router == n_expert * HIDDEN * 4 and layer.n_ff == k * n_ff
    assert layer.n_ff * layer.gate_row == k * int(gate_exps.n_bytes) // n_expert
    tokens = list(range(5, 45))
    logits = []
    for path in (files.powerinfer, files.llamacpp):
        with engine.Model(path, threads=2, ctx_size=64) as m:
            logits.append(m.eval(tokens))
    np.testing.assert_array_equal(*logits)


def test_thresholds_rewritten_in_place_on_a_copy(silu_files, tmp_path):
    _, files, _ = silu_files
    before = thresholds(files.powerinfer)
    copy = working_copy(files.powerinfer, tmp_path)
    act, pred = [0.125, 0.5], [-1.5, 3.25]
    set_thresholds(copy, activation=act, predictor=pred)
    assert thresholds(copy) == {"activation": act, "predictor": pred}
    assert thresholds(files.powerinfer) == before
    assert read_magic(copy) == b"PWRI"
    with pytest.raises(UserError, match="entries"):
        set_thresholds(copy, activation=[0.1])


def test_calibrated_thresholds_reach_the_sparsity(silu_files):
    model_path, files, work = silu_files
    hf, adapter = models.load_model(models.resolve(model_path))
    seqs = torch.randint(3, 200, (3, 40), generator=torch.Generator().manual_seed(1))
    sample = sparsity_levels.collect(hf, adapter, seqs)
    logits = sparsity_levels.predictor_logits(sample, sparsity_levels.predictor_weights(files.powerinfer))
    # independent recount: a second forward pass, predictors from their .pt files evaluated in torch
    acts, inputs = {}, {}
    handles = arch.install_taps(adapter, hf, on_input=lambda i, x: inputs.setdefault(i, []).append(x),
                                on_activation=lambda i, a: acts.setdefault(i, []).append(a))
    with torch.no_grad():
        for row in seqs:
            hf(input_ids=row[None], use_cache=False)
    for h in handles:
        h.remove()
    for level in (0.3, 0.7, 0.9):
        act = sparsity_levels.activation_thresholds(sample, level)
        pred = sparsity_levels.predictor_thresholds(logits, level)
        for i in range(N_LAYER):
            a = torch.cat([t.reshape(-1, N_FF) for t in acts[i]])
            assert abs(float((~arch.is_active(adapter, a, act[i])).float().mean()) - level) < 0.01
            state = torch.load(work / "pred" / f"model_{i}.pt", weights_only=True)
            x = torch.cat([t.reshape(-1, HIDDEN) for t in inputs[i]])
            z = torch.relu(x @ state["fc1.weight"].T) @ state["fc2.weight"].T
            # the file stores the predictors in f16: a few logits may cross the threshold
            assert abs(float((z <= pred[i]).float().mean()) - level) < 0.02


def test_relu_models_have_no_activation_threshold_to_set():
    sample = sparsity_levels.ActivationSample([np.ones(4, np.float32)], [np.ones((1, 4), np.float32)], False)
    with pytest.raises(UserError, match="ReLU-family"):
        sparsity_levels.activation_thresholds(sample, 0.5)


def test_byte_model_counts_rows_used(silu_files):
    _, files, _ = silu_files
    mb = byte_model.model_bytes(files.powerinfer)
    tensors = {t.name: int(t.n_bytes) for t in open_reader(files.powerinfer).tensors}
    kv = 2 * HIDDEN // 4 * 2 * 4  # K and V of 2 kv heads of d_head 16, f32
    assert mb.kv_per_position == kv
    assert byte_model.model_bytes(files.powerinfer, kv_type="q8_0").kv_per_position == kv * 17 // 64  # 34 B per 32
    ffn = sum(v for n, v in tensors.items() if ".ffn_gate." in n or ".ffn_up." in n or ".ffn_down_t." in n)
    pred = sum(v for n, v in tensors.items() if ".fc1." in n or ".fc2." in n)
    rest = sum(v for n, v in tensors.items() if n.startswith("blk.")) - ffn - pred
    emb_row = tensors["token_embd.weight"] // (open_reader(files.powerinfer).tensors[0].shape[-1])
    dense = byte_model.token_bytes(mb, None, position=10)
    assert dense["total"] == rest + ffn + tensors["output.weight"] + emb_row + 10 * kv * N_LAYER
    # gate mode, half the up/down rows used: gate read whole, up and down halved
    gate_stats = [{"tokens": 4, "computed_density": 0.5, "predicted_density": None, "modes": {"gate": 4}}] * N_LAYER
    gate = byte_model.token_bytes(mb, gate_stats, position=10)
    up_down = sum(v for n, v in tensors.items() if ".ffn_up." in n or ".ffn_down_t." in n)
    assert gate["ffn"] == pytest.approx(ffn - up_down / 2)
    # predictor mode, 20% predicted, 10% used: predictor read, 20% of gate, 10% of up/down
    pred_stats = [{"tokens": 4, "computed_density": 0.1, "predicted_density": 0.2, "modes": {"predictor": 4}}] * N_LAYER
    p = byte_model.token_bytes(mb, pred_stats, position=0)
    gate_bytes = ffn - up_down
    assert p["predictor"] == pred
    assert p["ffn"] == pytest.approx(0.2 * gate_bytes + 0.1 * up_down)


def test_machine_seconds_price_rows_by_index_at_the_probed_rates(silu_files):
    _, files, _ = silu_files
    mb = byte_model.model_bytes(files.powerinfer)
    gate_at = lambda used: [{"tokens": 4, "computed_density": used, "predicted_density": None,  # noqa: E731
                             "modes": {"gate": 4}}] * N_LAYER
    # one rate for every access: the byte model's bytes at that rate
    flat = {"density": [0.1, 1.0], "bytes_per_second": [1e9, 1e9]}
    for stats in (None, gate_at(0.3)):
        assert byte_model.machine_seconds(mb, stats, 10, flat) == pytest.approx(
            byte_model.token_bytes(mb, stats, 10)["total"] / 1e9)
    # rows by index at half the rate: 30 % of the up/down rows cost 0.6 of the whole matrix in order, while at
    # 70 % reading the whole matrix in order (1.0) beats picking them (1.4)
    halved = {"density": [0.1, 0.9, 1.0], "bytes_per_second": [0.5e9, 0.5e9, 1e9]}
    up_down = sum(l.n_ff * (l.up_row + l.down_row) for l in mb.layers)
    dense = byte_model.machine_seconds(mb, None, 10, halved)
    assert dense == pytest.approx(byte_model.token_bytes(mb, None, 10)["total"] / 1e9)
    assert byte_model.machine_seconds(mb, gate_at(0.3), 10, halved) == pytest.approx(dense - 0.4 * up_down / 1e9)
    assert byte_model.machine_seconds(mb, gate_at(0.7), 10, halved) == pytest.approx(dense)
    # a probe that read rows by index faster than in order (noise) prices them as rows in order
    noisy = {"density": [0.1, 1.0], "bytes_per_second": [2e9, 1e9]}
    assert byte_model.machine_seconds(mb, gate_at(0.3), 10, noisy) == pytest.approx(
        byte_model.token_bytes(mb, gate_at(0.3), 10)["total"] / 1e9)


def test_paired_ratio_and_summary():
    # per-round seconds: a twice as fast as b in every round, whatever the drift between rounds
    assert bench.paired_ratio([1.0, 2.0, 4.0], [2.0, 4.0, 8.0]) == pytest.approx(2.0)
    s = bench.summarize(128, {"wall": [1.0, 2.0, 4.0], "cpu": [0.5, 1.0, 1.0]})
    assert s["median"] == pytest.approx(64.0) and s["tps"] == [128.0, 64.0, 32.0]
    assert s["cpu_median"] == pytest.approx(128.0)


def test_bandwidth_is_sampled_once_per_round():
    """_time_rounds samples the bandwidth before each round (contestants stopped) and reports the median."""
    class Probe:
        values = [3e10, 1e10, 2e10]

        def measure(self, passes):
            return self.values.pop(0)

    class Contestant:
        label, calls = "x", []

        def pp(self, tokens):
            return 0.1, 0.1

        def tg(self, tokens):
            self.calls.append(len(Probe.values))
            return 0.2, 0.2

    times, bandwidth = bench._time_rounds([Contestant()], {"tg": {"tokens": [1, 2, 3]}}, 3, "t", False, Probe())
    assert bandwidth == 2e10 and len(times["x"]["tg"]["wall"]) == 3
    assert Contestant.calls == [3, 2, 1, 0]  # warm-up before any sample, then one sample ahead of each round
    assert bench._time_rounds([Contestant()], {"tg": {"tokens": [1]}}, 2, "t", False)[1] is None


def test_read_bandwidth_is_measured():
    bw = machine.read_bandwidth(2, buffer_bytes=64 << 20, passes=2)
    assert 1e8 < bw < 1e13
    rec = machine.machine_record(2, measure_bandwidth=False)
    assert rec["cores"] >= 1 and isinstance(rec["simd"], list)


def _record(tg_llama, tg_dense, tg_gate, pp_ratio, achieved_over_predicted):
    runs = [{"label": "llama.cpp", "backend": "llama.cpp", "mode": "dense", "target_sparsity": None,
             "tg": {"median": tg_llama, "stdev": 1.0, "cpu_median": 2 * tg_llama},
             "pp": {"median": 100.0, "stdev": 1.0}},
            {"label": "ours dense", "backend": "ours", "mode": "dense", "target_sparsity": None,
             "tg": {"median": tg_dense, "stdev": 1.0, "cpu_median": 2 * tg_dense},
             "pp": {"median": 100 * pp_ratio, "stdev": 1.0},
             "vs_llamacpp": {"tg": tg_dense / tg_llama, "pp": pp_ratio, "tg_cpu": 1.5, "pp_cpu": 0.5},
             "of_limit": 0.7,
             "sparsity": {"ffn_sparsity": 0.0}, "bytes_per_token": {"total": 2**20}, "predicted_speedup": 1.0}]
    sweep = [{"label": "ours gate", "backend": "ours", "mode": "gate", "target_sparsity": 0.5,
              "tg": {"median": tg_gate, "stdev": 1.0, "cpu_median": 2 * tg_gate},
              "vs_llamacpp": {"tg": tg_gate / tg_llama, "tg_cpu": 1.3},
              "achieved_speedup": tg_gate / tg_dense, "predicted_speedup": 1.3,
              "achieved_over_predicted": achieved_over_predicted, "of_limit": 0.5,
              "achieved_speedup_cpu": 1.1, "achieved_over_predicted_cpu": 0.85,
              "machine_predicted_speedup": 1.1, "achieved_over_machine_predicted": 1.02,
              "sparsity": {"ffn_sparsity": 0.5, "gate_rows_read": 1.0}}]
    return {"settings": {"model": "m", "outtype": "q4_0", "threads": 2, "repeats": 3, "n_prompt": 512, "n_gen": 128},
            "machine": {"cpu": "cpu", "cores": 2, "simd": ["avx2"], "read_bandwidth": {"2": 1e10},
                        "rows_by_index": {"row_bytes": 324, "threads": 2, "density": [0.1, 0.5, 0.8, 1.0],
                                          "bytes_per_second": [2e10, 2.5e10, 3e10, 4.5e10]}},
            "tokens": {"text": "t"}, "runs": runs, "sweep": sweep, "command": "pi-tools bench -m m"}


def test_targets_and_markdown():
    rec = _record(tg_llama=100.0, tg_dense=105.0, tg_gate=118.0, pp_ratio=0.7, achieved_over_predicted=0.9)
    targets = {t["target"]: t for t in bench_targets.check_targets(rec)}
    assert targets["dense_tg_vs_llamacpp"]["met"] and not targets["dense_pp_vs_llamacpp"]["met"]
    assert targets["dense_tg_vs_llamacpp (CPU time)"]["met"] and not targets["dense_pp_vs_llamacpp (CPU time)"]["met"]
    assert not targets["gate@0.5_vs_llamacpp"]["met"]            # 1.18 < 1.2
    assert targets["gate@0.5_vs_llamacpp (CPU time)"]["met"]     # 1.3 >= 1.2
    assert targets["achieved_over_predicted gate@0.5"]["met"]     # 0.9 >= 0.85
    assert targets["achieved_over_predicted gate@0.5 (CPU time)"]["met"]
    assert targets["of_physical_limit dense"]["met"] and not targets["of_physical_limit gate@0.5"]["met"]
    md = report.render_markdown(rec)
    assert "| ours dense | 0.00 | 70.0 ± 1.0 | 105.0 ± 1.0 | 210.0 | 0.70x | 1.05x | 1.50x |" in md
    assert "| 0.50 | ours gate | 0.50 | 1.00 | 118.0 ± 1.0 | 236.0 | 1.18x | 1.30x | 1.12x | 1.10x | 1.30x | 90% | 85% " \
           "| 50% | 102% |" in md
    assert "rows read by index (324-byte rows, 2 threads, engine.read_rows_rate): 20.0 GB/s at 10% of them, " \
           "25.0 GB/s at 50% of them, 30.0 GB/s at 80% of them, 45.0 GB/s all in order" in md
    assert "Columns: t/s" in md and "MiB/token, the bytes a generated token reads" in md  # the legend
    assert "| gate@0.5_vs_llamacpp (sweep) | 1.180 | ≥ 1.20 | **no** |" in bench_targets.targets_table(
        list(targets.values()))
    assert "| target | measured | goal | met |" not in md  # the goals are the project's, not the product's output
    summary = report.render_summary(rec)
    assert summary.splitlines()[0] == "m q4_0, 2 threads, cpu; medians of 3 interleaved rounds"
    assert "| ours | dense | 0.00 | 70.0 | 105.0 | 1.05x |" in summary and len(summary.splitlines()) == 6
    short = _record(tg_llama=100.0, tg_dense=105.0, tg_gate=118.0, pp_ratio=0.7, achieved_over_predicted=0.849)
    assert "| achieved_over_predicted gate@0.5 (sweep) | 0.849 | ≥ 0.85 | **no** |" in bench_targets.targets_table(
        bench_targets.check_targets(short))
    # a ceiling: met at or below its goal
    rec["files"] = {"powerinfer_bytes": 100 * 2**20}
    rec["engine"] = {"kv_cache_bytes": 10 * 2**20, "work_buffer_bytes": 5 * 2**20, "memory_by_mode": {
        "dense": {"peak_rss_bytes": 150 * 2**20, "rss_before_model_bytes": 30 * 2**20},
        "auto": {"peak_rss_bytes": 190 * 2**20, "rss_before_model_bytes": 30 * 2**20}}}
    targets = {t["target"]: t for t in bench_targets.check_targets(rec)}
    assert targets["peak_rss_over_file_kv_buffers dense"]["value"] == pytest.approx(120 / 115)
    assert targets["peak_rss_over_file_kv_buffers dense"]["met"]
    assert not targets["peak_rss_over_file_kv_buffers auto"]["met"]
    md = report.render_markdown(rec)
    assert "one mode per process, less the worker before the model opened: dense 120.0 MiB, auto 160.0 MiB " \
           "(file 100.0 + KV cache 10.0 + work buffers 5.0 MiB)" in md
    assert "| peak_rss_over_file_kv_buffers auto (main) | 1.391 | ≤ 1.05 | **no** |" in bench_targets.targets_table(
        list(targets.values()))


def test_sweep_plot(tmp_path):
    rec = _record(100.0, 105.0, 118.0, 0.9, 0.9)
    rec["sweep"] = rec["runs"][:2] + rec["sweep"]
    for e in rec["sweep"]:
        e.setdefault("target_sparsity", 0.5)
    report.plot_sweep(rec, tmp_path / "s.png")
    assert (tmp_path / "s.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _cli(*args, cwd=ROOT):
    return subprocess.run([sys.executable, "-m", "powerinfer_tools", "bench", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("args,message", [
    (["-m", "/nonexistent/model"], "model not found"),
    (["-m", "smollm2", "--png", "x.png"], "--png draws the sparsity sweep"),
    (["-m", "smollm2", "--modes", "dense,fast"], "unknown mode 'fast'"),
    (["-m", "smollm2", "--peers", "vllm"], "unknown peer 'vllm'"),
    (["-m", "smollm2", "--sweep-sparsity", "--sweep-levels", "0.5,1.5"], "--sweep-levels must be a number in [0, 1), not 1.5"),
    (["-m", "smollm2", "--depth", "-1"], "--depth must be at least 0"),
    (["-m", "smollm2", "--first-token"], "--first-token times our `run` against llama.cpp alone"),
    (["-m", "smollm2", "--kv-type", "q4_0"], "--kv-type must be one of f32, f16, q8_0, not 'q4_0'"),
    (["-m", "smollm2", "--gpu", "maybe"], "unknown --gpu 'maybe'"),
    (["-m", "/nonexistent/model", "--vram-budget", "4"], "--vram-budget solves the hot tier from --profile"),
    (["-m", "smollm2", "--peer-python", "/no/such/python"], "--peer-python /no/such/python: no such executable"),
    (["-m", "smollm2", "--ppl-file", "/no/such/text.txt"], "--ppl-file file not found: /no/such/text.txt"),
    (["-m", "smollm2", "--ppl-file", "README.md", "--ppl-chunks", "0"], "--ppl-chunks must be at least 1"),
])
def test_cli_bad_input(args, message):
    r = _cli(*args)
    assert r.returncode == 1 and message in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_cli_help_has_examples():
    r = _cli("--help")
    assert r.returncode == 0 and "Examples" in r.stdout and "--sweep-sparsity" in r.stdout


def _peer_python(tmp_path: Path) -> str:
    """A Python with llama-cpp-python: $PI_BENCH_PEER_PYTHON, or this one when it has it; otherwise this one
    with tests/llama_cpp_double first on its path (the worker runs in isolated mode, `-I`, which ignores
    PYTHONPATH, so a small launcher drops the flag and puts the double in front)."""
    real = llama_cpp_python()
    if real:
        return real
    launcher = tmp_path / "peer-python"
    code = (f"import runpy, sys; sys.path.insert(0, {str(ROOT / 'tests' / 'llama_cpp_double')!r}); "
            "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')")
    launcher.write_text(f'#!/bin/sh\n[ "$1" = -I ] && shift\nexec {sys.executable} -c "{code}" "$@"\n')
    launcher.chmod(0o755)
    return str(launcher)


def test_bench_end_to_end_tiny(silu_files, tmp_path):
    """Our engine in every mode + llama.cpp (the real one when available, else the transformers double) +
    torch on the tiny model, with a sweep: the record is complete, llama.cpp is compared on the same weights,
    and the engine's measured sparsity follows the rewritten thresholds."""
    engine = pytest.importorskip("powerinfer_engine")
    if not hasattr(engine, "Model"):
        pytest.skip("the C++ engine package is not in this tree")
    model, files, work = silu_files
    peer = _peer_python(tmp_path)
    opts = bench.BenchOptions(model=model, outtype="q8_0", threads=2, repeats=2, n_prompt=24, n_gen=12, batch=16,
                              predictors=work / "pred", work_dir=work, sweep=True, sweep_levels=(0.5, 0.8),
                              sweep_repeats=1, peers=("llama.cpp", "torch"), peer_python=peer, progress=False,
                              text=ROOT / "README.md")
    rec = bench.run_bench(opts)
    labels = [e["label"] for e in rec["runs"]]
    assert {"ours dense", "ours gate", "ours predictor", "ours auto"} <= set(labels)
    assert any(label.startswith("torch") for label in labels)
    assert any(label.startswith("llama.cpp") for label in labels)
    assert rec["llamacpp"]["omp_wait_policy"].startswith("faster of") and rec["llamacpp"]["peak_rss_bytes"] > 0
    for e in rec["runs"]:
        assert e["tg"]["median"] > 0 and len(e["tg"]["tps"]) == 2
    by_key = {(e["label"], e["target_sparsity"]): e for e in rec["sweep"]}
    for level in (0.5, 0.8):
        gate = by_key[("ours gate", level)]
        assert abs(gate["sparsity"]["ffn_sparsity"] - level) < 0.15  # calibrated on other tokens
        pred = by_key[("ours predictor", level)]
        assert abs(pred["sparsity"]["gate_rows_read"] - (1 - level)) < 0.15
        assert gate["predicted_speedup"] > 1.0
    assert rec["agreement"]["top1_ours_dense_vs_llamacpp"] >= 0.9
    ours_dense = next(e for e in rec["runs"] if e["label"] == "ours dense")
    assert ours_dense["vs_llamacpp"]["tg"] > 0 and ours_dense["vs_llamacpp"]["pp"] > 0
    for e in rec["sweep"]:
        if e["backend"] == "ours":
            assert e["vs_llamacpp"]["tg"] > 0
    targets = bench_targets.check_targets(rec)
    assert {t["target"] for t in targets} >= {"dense_tg_vs_llamacpp", "dense_pp_vs_llamacpp"}
    memory = rec["engine"]["memory_by_mode"]  # each mode in a process of its own
    assert set(memory) == {"dense", "gate", "predictor", "auto"}
    for mode, m in memory.items():
        assert m["peak_rss_bytes"] > m["rss_before_model_bytes"] > 0
        rss_target = next(t for t in targets if t["target"] == f"peak_rss_over_file_kv_buffers {mode}")
        assert rss_target["value"] == pytest.approx((m["peak_rss_bytes"] - m["rss_before_model_bytes"]) / (
            rec["files"]["powerinfer_bytes"] + rec["engine"]["kv_cache_bytes"] + rec["engine"]["work_buffer_bytes"]))
    for e in rec["runs"] + rec["sweep"]:  # of limit: against the bandwidth sampled during that table's rounds
        if e["backend"] == "ours":
            assert e["read_bandwidth"] > 1e8
            assert e["of_limit"] == pytest.approx(e["tg"]["median"] * e["bytes_per_token"]["total"] / e["read_bandwidth"])
    probe = rec["machine"]["rows_by_index"]
    assert probe["density"] == list(machine.PROBE_DENSITIES) and all(r > 1e7 for r in probe["bytes_per_second"])
    for e in rec["runs"] + rec["sweep"]:  # at the probed rates: dense is the yardstick, the byte model the ceiling
        if e["backend"] == "ours":
            assert e["achieved_over_machine_predicted"] == pytest.approx(
                e["achieved_speedup"] / e["machine_predicted_speedup"])
            if e["mode"] == "dense":
                assert e["machine_predicted_speedup"] == pytest.approx(1.0)
            else:
                assert 0 < e["machine_predicted_speedup"] <= e["predicted_speedup"] + 1e-9
    md = report.render_markdown(rec)
    assert "ours predictor" in md and "Sparsity sweep" in md and "during the timed rounds" in md
    phase_rows = [line for line in md.splitlines() if line.startswith("| ours ") and line.count("|") == 9]
    assert len(phase_rows) == 4  # one per mode of ours in the time-split table
    for row in phase_rows:  # the phases and the rest add up to the token's time (rounded per cell)
        cells = [float(c) for c in row.strip("|").split("|")[1:]]
        assert cells[-1] > 0 and abs(sum(cells[:-1]) - cells[-1]) <= len(cells)
    report.write_json(rec, tmp_path / "r.json")
    assert json.loads((tmp_path / "r.json").read_text())["format"] == "powerinfer-tools.bench/1"


def test_bench_scores_every_row_on_the_ppl_file(silu_files, tmp_path):
    """--ppl-file: each row's perplexity on the same windows, our engine in each of its modes on its file,
    llama.cpp on its own (the real one or the transformers double) and torch on the float32 source; ours dense is
    what the engine scores outside the bench, and the q8_0 files stay within their rounding of the source."""
    import powerinfer_engine as engine

    from powerinfer_tools.runtime.inference import perplexity
    from powerinfer_tools.stages.profiling.calibration import sequences_from_text

    model, files, work = silu_files
    opts = bench.BenchOptions(model=model, outtype="q8_0", threads=2, repeats=1, n_prompt=24, n_gen=8, batch=16,
                              modes=("dense", "gate"), peers=("llama.cpp", "torch"), peer_python=_peer_python(tmp_path),
                              predictors=work / "pred", work_dir=work, progress=False, text=ROOT / "README.md",
                              ppl_file=ROOT / "README.md", ppl_chunks=2, ppl_ctx=64)
    rec = bench.run_bench(opts)
    assert rec["perplexity"] == {"file": str(ROOT / "README.md"), "windows": 2, "ctx": 64}
    ppl = {e["label"].split()[0] if e["backend"] != "ours" else e["label"]: e["perplexity"] for e in rec["runs"]}
    assert set(ppl) == {"ours dense", "ours gate", "llama.cpp", "torch"} and all(1 < v < 1e4 for v in ppl.values())
    windows = sequences_from_text(models.load_tokenizer(models.resolve(model)),
                                  [(ROOT / "README.md").read_text()], 64, 128).numpy()
    with engine.Model(files.powerinfer, threads=2, ctx_size=64, sparse_mode="dense", kv_type=opts.kv_type) as m:
        assert ppl["ours dense"] == pytest.approx(perplexity(m, windows, progress=False)["perplexity"], rel=1e-4)
    assert ppl["ours dense"] == pytest.approx(ppl["torch"], rel=0.02)
    assert ppl["llama.cpp"] == pytest.approx(ppl["torch"], rel=0.02)
    table = report.render_summary(rec)
    assert "perplexity |" in table and "2 windows of 64 tokens" in table
    rows = [line for line in table.splitlines() if line.startswith(("| ours", "| llama.cpp", "| torch"))]
    assert len(rows) == 4 and all(f"{float(r.rstrip(' |').split('|')[-1]):.2f}" != "nan" for r in rows)
    assert "Quality: perplexity on README.md" in report.render_markdown(rec)


@pytest.mark.parametrize("kv_type", ["f32", "f16"])
def test_bench_at_depth(silu_files, tmp_path, kv_type):
    """--depth: tg runs after that many tokens went into the cache, for ours and the llama.cpp peer alike; the
    byte model's KV reads are those of the deeper positions (in --kv-type's element size), and the tables name
    the test as llama-bench does."""
    pytest.importorskip("powerinfer_engine")
    model, files, work = silu_files
    depth, n_gen = 40, 8
    opts = bench.BenchOptions(model=model, outtype="q8_0", threads=2, repeats=1, modes=("dense",), n_prompt=16,
                              n_gen=n_gen, depth=depth, batch=16, kv_type=kv_type, work_dir=work, peers=("llama.cpp",),
                              peer_python=_peer_python(tmp_path), progress=False, text=ROOT / "README.md")
    rec = bench.run_bench(opts)
    assert rec["settings"]["depth"] == depth and rec["tokens"]["context"] == depth
    assert rec["engine"]["kv_type"] == kv_type
    ours = next(e for e in rec["runs"] if e["label"] == "ours dense")
    assert ours["stats"]["n_past"] == depth + n_gen and ours["stats"]["decode_tokens"] == n_gen
    mb = byte_model.model_bytes(files.powerinfer, kv_type=kv_type)
    assert mb.kv_per_position == byte_model.model_bytes(files.powerinfer).kv_per_position // (2 if kv_type == "f16" else 1)
    assert ours["bytes_per_token"]["kv_cache"] == pytest.approx(
        mb.kv_per_position * len(mb.layers) * (depth + (n_gen - 1) / 2))
    md = report.render_markdown(rec)
    assert f"tg{n_gen} @ d{depth} t/s" in md and f"KV cache {kv_type}" in md


def test_bench_with_the_hot_tier_on_a_device(silu_files, tmp_path, monkeypatch):
    """--gpu on --gpuidx: our worker's hot tier on the device (here the emulated device library, in place of the
    CUDA one), recorded in the bench's engine record; its numbers are the engine's stats as always."""
    pytest.importorskip("powerinfer_engine")
    import powerinfer_engine as engine
    from engine_helpers import write_gpuidx

    monkeypatch.setenv("PI_GPU_LIBRARY", str(engine.device_library_path("emulated")))
    model, files, work = silu_files
    hot = [np.random.default_rng(i).random(N_FF) < 0.5 for i in range(N_LAYER)]
    gpuidx = write_gpuidx(tmp_path / "hot.gpuidx", hot)
    opts = bench.BenchOptions(model=model, outtype="q8_0", threads=2, repeats=1, modes=("dense", "gate"), n_prompt=16,
                              n_gen=8, batch=16, work_dir=work, peers=(), progress=False, text=ROOT / "README.md",
                              gpu="on", gpuidx=gpuidx)
    for attention in (True, False):  # --gpu-attention (the default) and --gpu-ffn-only
        rec = bench.run_bench(dataclasses.replace(opts, gpu_attention=attention))
        gpu = rec["engine"]["gpu"]
        assert gpu["used"] and gpu["device"]["layers_on_device"] == N_LAYER, gpu
        assert gpu["device"]["attention_layers"] == (N_LAYER if attention else 0), gpu
        ours = next(e for e in rec["runs"] if e["label"] == "ours gate")
        assert ours["stats"]["gpu"]["tokens"] > 0
        # half the neurons hot: with attention there each layer runs split (its attention in the split's job)
        assert (ours["stats"]["gpu"]["split_jobs"] > 0) == attention
        assert ours["stats"]["gpu"]["attention_jobs"] == 0


def test_a_peer_killed_by_a_signal_is_named(tmp_path):
    """A native crash (llama.cpp built for instructions this CPU lacks dies of SIGILL) leaves no message on
    stderr: the error names the signal instead of saying nothing."""
    from powerinfer_tools.bench import runners
    from powerinfer_tools.core.errors import UserError

    crashing = tmp_path / "crashing-python"
    crashing.write_text("#!/bin/sh\nkill -ILL $$\n")
    crashing.chmod(0o755)
    with pytest.raises(UserError, match=r"llama.cpp worker exited \(killed by SIGILL\): no message"):
        runners.Worker("llama.cpp", tmp_path / "model.gguf", 1, 64, python=str(crashing))


def test_bench_times_the_input_modes_against_dense(tiny_model_dir, tmp_path, monkeypatch):
    """--modes dense,input,predictor,predictor+input with a profile of input thresholds: all timed on one worker,
    the input modes' statistics are their own (inputs zeroed at the share asked: every matrix's in input mode,
    attention's in predictor+input, whose FFN is predictor mode's) and the others' have none. The column kernel is
    forced (the workers inherit it): it is the one whose skipped bytes are counted, whatever this CPU's probe says."""
    import torch

    monkeypatch.setenv("PI_INPUT_KERNEL", "columns")

    from powerinfer_tools.stages.profiling import input_sparsity

    model_dir = tiny_model_dir("llama-silu")
    hf, adapter = models.load_model(models.resolve(str(model_dir)))
    seqs = torch.randint(0, 384, (2, 64), generator=torch.Generator().manual_seed(0))
    prof = tmp_path / "prof"
    prof.mkdir()
    input_sparsity.calibrate(hf, adapter, seqs, "uniform", 2, 0).save(prof)
    (prof / "profile.json").write_text(json.dumps({"thresholds": [0.0] * N_LAYER}))
    opts = bench.BenchOptions(model=str(model_dir), outtype="q8_0", threads=2, repeats=2, n_prompt=16, n_gen=8,
                              batch=16, modes=("dense", "input", "predictor", "predictor+input"), input_sparsity=0.3,
                              peers=(), profile=prof, predictors=write_predictors(tmp_path / "pred", N_LAYER, HIDDEN,
                                                                                  N_FF),
                              work_dir=tmp_path / "work", progress=False, text=ROOT / "README.md")
    rec = bench.run_bench(opts)
    runs = {e["label"]: e for e in rec["runs"]}
    assert set(runs) == {"ours dense", "ours input", "ours predictor", "ours predictor+input"}
    both, alone = runs["ours predictor+input"], runs["ours predictor"]
    assert both["stats"]["input_sparsity"]["share"] == pytest.approx(0.3) and alone["stats"]["input_sparsity"]["share"] == 0
    # the same FFN rows as predictor mode's (its own layer statistics), less attention's skipped input rows
    assert 0 < both["bytes_per_token"]["input_skipped"] < runs["ours input"]["bytes_per_token"]["input_skipped"]
    assert both["bytes_per_token"]["total"] < alone["bytes_per_token"]["total"]
    assert 0 < both["stats"]["layers"][0]["predicted_density"] < 1
    # the llama.cpp file of the same weights leaves the transposed copies and the predictors out (llama.cpp refuses
    # unknown tensors)
    import gguf
    ours = {t.name for t in open_reader(rec["files"]["powerinfer"]).tensors}
    plain = {t.name for t in gguf.GGUFReader(rec["files"]["llamacpp"]).tensors}
    transposed = {n for n in ours if n.startswith("blk.") and n.split(".")[2].endswith("_t") and ".ffn_down_t." not in n}
    assert len(transposed) == 6 * N_LAYER and not plain & transposed
    predictors = {n for n in ours if n.startswith("blk.") and n.split(".")[2] in ("fc1", "fc2")}
    assert predictors and not plain & predictors
    assert runs["ours input"]["tg"]["median"] > 0 and runs["ours input"]["achieved_speedup"] > 0
    skipped = runs["ours input"]["bytes_per_token"]["input_skipped"]
    assert 0 < skipped and runs["ours input"]["predicted_speedup"] > 1
    assert rec["settings"]["input_sparsity"] == 0.3
    assert "| ours | input |" in report.render_summary(rec) and "ours input" in report.render_markdown(rec)
    with pytest.raises(UserError, match="--input-sparsity"):
        bench.run_bench(dataclasses.replace(opts, input_sparsity=1.5))


def _no_float32_model(*args, **kwargs):
    raise AssertionError("the source model was loaded in float32")


def test_bench_without_text_times_text_our_engine_wrote(silu_files, monkeypatch):
    """Without --text the timed tokens are written by our engine from the bench's own file: the source model is
    never loaded in float32 (a 7B's 27 GB got the bench killed for memory), and the record says whose text it is."""
    pytest.importorskip("powerinfer_engine")
    monkeypatch.setattr(models, "load_model", _no_float32_model)
    model, files, work = silu_files
    opts = bench.BenchOptions(model=model, outtype="q8_0", threads=2, repeats=1, modes=("dense",), n_prompt=16,
                              n_gen=8, batch=16, predictors=work / "pred", work_dir=work, peers=(), progress=False)
    rec = bench.run_bench(opts)
    assert rec["tokens"] == {"text": "self-generated (engine, dense, seed 0)", "prompt": 16, "context": 0,
                             "generated": 8}
    assert rec["runs"][0]["label"] == "ours dense" and rec["runs"][0]["tg"]["median"] > 0
    assert "text: self-generated (engine, dense, seed 0)" in report.render_markdown(rec)


def test_engine_text_repeats_with_its_seed(silu_files):
    """The same seed writes the same tokens (runs time the same text), BOS first, as many as asked."""
    pytest.importorskip("powerinfer_engine")
    model, files, _ = silu_files
    tokenizer = models.load_tokenizer(models.resolve(model))
    first = bench.engine_text(files.powerinfer, tokenizer, 48, threads=2, progress=False)
    assert len(first) == 48 and first[0] == tokenizer.bos_token_id
    assert bench.engine_text(files.powerinfer, tokenizer, 48, threads=2, progress=False) == first
    assert bench.engine_text(files.powerinfer, tokenizer, 48, threads=2, seed=1, progress=False) != first


def test_float32_source_that_cannot_fit_in_memory_is_refused(silu_files, tmp_path, capsys, monkeypatch):
    """--sparsity loads the source model in float32 to calibrate, and the torch peer runs it: where its weights
    exceed the memory available, one line says so (and what to do instead) before anything is built, instead of
    the kernel killing the bench."""
    from powerinfer_tools.stages.profiling import profiling

    model = silu_files[0]
    need = profiling.weight_bytes(arch.for_config(models.load_config(models.resolve(model))), "float32")
    monkeypatch.setattr(models, "load_model", _no_float32_model)
    monkeypatch.setattr(profiling, "available_memory", lambda device: need - 1)
    code, _, err = run_cli(capsys, "bench", "-m", model, "--sparsity", "0.5", "--modes", "dense,gate", "--peers", "",
                           "--work-dir", tmp_path / "work", "-q")
    assert_one_line_error(code, err, "--sparsity and --sweep-sparsity calibrate on", "in float32",
                          "GiB of weights", "GiB of memory available", "--profile DIR")
    assert not (tmp_path / "work").exists()
    code, _, err = run_cli(capsys, "bench", "-m", model, "--modes", "dense", "--peers", "torch",
                           "--work-dir", tmp_path / "work", "-q")
    assert_one_line_error(code, err, "the torch peer runs", "in float32", "--peers llama.cpp")
    assert not (tmp_path / "work").exists()
    monkeypatch.setattr(profiling, "available_memory", lambda device: need)
    bench.check_source_fits(models.resolve(model), True, True)
    monkeypatch.setattr(profiling, "available_memory", lambda device: 0)
    bench.check_source_fits(models.resolve(model), False, False)  # neither loads the source model
