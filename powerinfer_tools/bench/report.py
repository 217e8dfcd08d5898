"""`pi-tools bench`'s record as people read it: the summary table, the full markdown (every table, with the byte
model's and the device's columns), the sweep's plot and the JSON file. harness.py makes the record."""
from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

from powerinfer_tools.core.errors import UserError

def _f(v, fmt="{:.2f}", none="–"):
    return none if v is None or (isinstance(v, float) and math.isnan(v)) else fmt.format(v)


def _speed(s: dict | None) -> str:
    return "–" if not s else f"{s['median']:.1f} ± {s['stdev']:.1f}"


def _mib(b) -> str:
    return _f(b / 2**20 if b is not None else None, "{:.1f}")


def _round_bandwidths(record: dict) -> str:
    """The bandwidth "of limit" divides by: sampled before each round, the median per table."""
    bws = [e["read_bandwidth"] for e in record.get("runs", []) + record.get("sweep", []) if e.get("read_bandwidth")]
    if not bws:
        return ""
    lo, hi = min(bws) / 1e9, max(bws) / 1e9
    span = f"{lo:.1f}" if hi - lo < 0.05 else f"{lo:.1f}–{hi:.1f}"
    return f"; during the timed rounds {span} GB/s ({record['settings']['threads']} threads, median per table)"


def _rows_by_index(m: dict) -> str:
    """The read probe's rates: what a byte of a row picked by index costs here against one read in order."""
    r = m.get("rows_by_index")
    if not r:
        return ""
    rate = dict(zip(r["density"], r["bytes_per_second"]))
    shares = ", ".join(f"{rate[d] / 1e9:.1f} GB/s at {d:.0%} of them" for d in (0.1, 0.5, 0.8) if d in rate)
    return (f"; rows read by index ({r['row_bytes']}-byte rows, {r['threads']} threads, engine.read_rows_rate): "
            f"{shares}, {rate.get(1.0, float('nan')) / 1e9:.1f} GB/s all in order")


def render_summary(record: dict) -> str:
    """The table `pi-tools bench` prints: llama-bench's size, one row per engine and mode (--verbose has the rest)."""
    st, m = record["settings"], record["machine"]
    pp, tg = f"pp{st['n_prompt']}", tg_label(st)
    ppl = record.get("perplexity")
    if "first_token" in record:
        from powerinfer_tools.bench import first_token

        return "\n".join([f"{st['model']} {st['outtype']}, {st['threads']} threads, {m['cpu']}"]
                         + first_token.render(record)) + "\n"
    if "memory_limit" in record:
        from powerinfer_tools.bench import limited

        return "\n".join([f"{st['model']} {st['outtype']}, {st['threads']} threads, {m['cpu']}"]
                         + limited.render(record)) + "\n"
    lines = [f"{st['model']} {st['outtype']}, {st['threads']} threads, {m['cpu']}; medians of {st['repeats']} "
             "interleaved rounds" + (f"; {_ppl_source(ppl)}" if ppl else ""), "",
             f"| engine | FFN mode | FFN sparsity | {pp} t/s | {tg} t/s | {tg} vs llama.cpp |"
             + (" perplexity |" if ppl else ""),
             "|---|---|---:|---:|---:|---:|" + ("---:|" if ppl else "")]
    for e in record.get("runs", []):
        sp = e.get("sparsity")
        engine = "ours" if e["backend"] == "ours" else e["label"]
        lines.append("| " + " | ".join([
            engine, e["mode"] if e["backend"] == "ours" else "dense", _f(sp["ffn_sparsity"] if sp else None),
            _f((e.get("pp") or {}).get("median"), "{:.1f}"), _f(e["tg"]["median"], "{:.1f}"),
            _f(e.get("vs_llamacpp", {}).get("tg"), "{:.2f}x")]
            + ([_f(e.get("perplexity"), "{:.2f}")] if ppl else [])) + " |")
    return "\n".join(lines) + "\n"


def _ppl_source(ppl: dict) -> str:
    return f"perplexity on {Path(ppl['file']).name}, {ppl['windows']} windows of {ppl['ctx']} tokens, each engine " \
           "on its own file"


LEGEND = (
    "Columns: t/s, tokens per second (median ± stdev over the rounds); t/CPU-s, tokens per CPU-second of the "
    "engine's process; vs llama.cpp, our speed over llama.cpp's in the same round (median of the rounds' ratios; "
    "CPU: by CPU time); MiB/token, the bytes a generated token reads (weights, predictors, KV cache); predicted vs "
    "dense, the speedup over our dense mode those bytes predict; achieved / predicted, the speedup measured over "
    "that prediction; of limit, tokens/s x bytes/token over the machine's read bandwidth; achieved / at the probed "
    "rates, the speedup measured over the one predicted when rows read by index cost what the read probe "
    "measured; gate rows read, the share of gate rows a step reads.")


def render_markdown(record: dict) -> str:
    """Every table and measurement of a run (`pi-tools bench --verbose`, `--markdown`)."""
    st, m = record["settings"], record["machine"]
    if "first_token" in record:  # no tokens, no bandwidth: fresh processes, each timed to its first token
        from powerinfer_tools.bench import first_token

        load = ", ".join(f"{x:.1f}" for x in m["load_average"]) if m.get("load_average") else "unknown"
        return "\n".join([f"`{record['command']}`" if record.get("command") else "", "",
                          f"Machine: {m['cpu']}, {m['cores']} cores ({', '.join(m['simd'])}); load average {load}",
                          f"Model: {st['model']} {st['outtype']}, {st['threads']} threads", ""]
                         + first_token.render(record)).strip() + "\n"
    bw = m.get("read_bandwidth", {})
    lines = [f"`{record['command']}`" if record.get("command") else "", "",
             f"Machine: {m['cpu']}, {m['cores']} cores ({', '.join(m['simd'])}); read bandwidth "
             + ", ".join(f"{_f(v / 1e9, '{:.1f}')} GB/s ({k} thread{'s' if k != '1' else ''})" for k, v in bw.items())
             + _round_bandwidths(record)
             + (f"; load average {', '.join(f'{x:.1f}' for x in m['load_average'])}" if m.get("load_average") else "")
             + _rows_by_index(m),
             f"Model: {st['model']} {st['outtype']}, {st['threads']} threads, {st['repeats']} interleaved repeats "
             f"(median ± stdev; t/CPU-s: tokens per CPU-second of the engine's process); "
             f"text: {record['tokens']['text']}; our kernels: {record.get('engine', {}).get('isa')}, "
             f"KV cache {st.get('kv_type', 'f32')}",
             ""]
    if "llamacpp" in record:
        lc = record["llamacpp"]
        lines.append(f"llama.cpp: llama-cpp-python {lc.get('llama_cpp_python')}, OMP_WAIT_POLICY "
                     f"{lc.get('omp_wait_policy')} (runs won: {lc.get('omp_wait_wins')}); "
                     f"{lc.get('system_info', '').splitlines()[0] if lc.get('system_info') else ''}")
        if "agreement" in record:
            lines.append(f"Same weights check: greedy top-1 of ours dense vs llama.cpp over "
                         f"{record['agreement']['tokens']} tokens: {record['agreement']['top1_ours_dense_vs_llamacpp']:.3f}")
    if record.get("perplexity"):
        lines.append(f"Quality: {_ppl_source(record['perplexity'])}: " + ", ".join(
            f"{e['label']} {_f(e.get('perplexity'), '{:.3f}')}" for e in record.get("runs", [])))
    eng = record.get("engine", {})
    if "peak_rss_bytes" in eng:
        lines.append(f"Peak RSS of the worker processes (Python included): ours {_mib(eng['peak_rss_bytes'])} MiB "
                     f"(file {_mib(record['files']['powerinfer_bytes'])} MiB + KV cache {_mib(eng['kv_cache_bytes'])} "
                     f"MiB)" + (f", llama.cpp {_mib(record['llamacpp']['peak_rss_bytes'])} MiB"
                                if "peak_rss_bytes" in record.get("llamacpp", {}) else ""))
    if eng.get("memory_by_mode"):
        mem = eng["memory_by_mode"]
        lines.append("Peak RSS with one mode per process, less the worker before the model opened: " + ", ".join(
            f"{mode} {_mib(m['peak_rss_bytes'] - m['rss_before_model_bytes'])} MiB" for mode, m in mem.items()
            if m["peak_rss_bytes"] and m["rss_before_model_bytes"] is not None) +
            f" (file {_mib(record['files']['powerinfer_bytes'])} + KV cache {_mib(eng['kv_cache_bytes'])} + work "
            f"buffers {_mib(eng['work_buffer_bytes'])} MiB)")
    lines.append("")
    pp_n, tg = st["n_prompt"], tg_label(st)
    if "memory_limit" in record:
        from powerinfer_tools.bench import limited

        lines += limited.render(record)
        lines += [f"\nNote: {note}" for note in record.get("notes", [])]
        return "\n".join(lines).strip() + "\n"
    lines += [f"| engine | FFN sparsity | pp{pp_n} t/s | {tg} t/s | {tg} t/CPU-s | pp vs llama.cpp | "
              "tg vs llama.cpp | tg vs llama.cpp, CPU | MiB/token | predicted vs dense | achieved / predicted | "
              "same, CPU | of limit | achieved / at the probed rates |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for e in record.get("runs", []):
        sp = e.get("sparsity")
        vs = e.get("vs_llamacpp", {})
        lines.append("| " + " | ".join([
            e["label"], _f(sp["ffn_sparsity"] if sp else None), _speed(e.get("pp")), _speed(e["tg"]),
            _f(e["tg"].get("cpu_median"), "{:.1f}"), _f(vs.get("pp"), "{:.2f}x"), _f(vs.get("tg"), "{:.2f}x"),
            _f(vs.get("tg_cpu"), "{:.2f}x"),
            _mib(e["bytes_per_token"]["total"]) if "bytes_per_token" in e else "–",
            _f(e.get("predicted_speedup"), "{:.2f}x"), _f(e.get("achieved_over_predicted"), "{:.0%}"),
            _f(e.get("achieved_over_predicted_cpu"), "{:.0%}"), _f(e.get("of_limit"), "{:.0%}"),
            _f(e.get("achieved_over_machine_predicted"), "{:.0%}")]) + " |")
    lines += _phase_table(record.get("runs", []), tg)
    lines += _device_table(record.get("runs", []), tg)
    if record.get("sweep"):
        lines += ["", f"Sparsity sweep ({tg}, thresholds recalibrated per level):", "",
                  "| target | engine | FFN sparsity | gate rows read | tg t/s | tg t/CPU-s | vs llama.cpp | "
                  "vs llama.cpp, CPU | vs ours dense | vs ours dense, CPU | predicted | achieved / predicted | "
                  "same, CPU | of limit | achieved / at the probed rates |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for e in record["sweep"]:
            if e["backend"] != "ours":
                continue
            sp = e.get("sparsity") or {}
            vs = e.get("vs_llamacpp", {})
            lines.append("| " + " | ".join([
                _f(e["target_sparsity"]), e["label"], _f(sp.get("ffn_sparsity")), _f(sp.get("gate_rows_read")),
                _speed(e["tg"]), _f(e["tg"].get("cpu_median"), "{:.1f}"), _f(vs.get("tg"), "{:.2f}x"),
                _f(vs.get("tg_cpu"), "{:.2f}x"), _f(e.get("achieved_speedup"), "{:.2f}x"),
                _f(e.get("achieved_speedup_cpu"), "{:.2f}x"), _f(e.get("predicted_speedup"), "{:.2f}x"),
                _f(e.get("achieved_over_predicted"), "{:.0%}"), _f(e.get("achieved_over_predicted_cpu"), "{:.0%}"),
                _f(e.get("of_limit"), "{:.0%}"), _f(e.get("achieved_over_machine_predicted"), "{:.0%}")]) + " |")
    for note in record.get("notes", []):
        lines.append(f"\nNote: {note}")
    lines += ["", LEGEND]
    return "\n".join(lines).strip() + "\n"


PHASES = ("attention", "predictor", "gate_up", "down", "output")


def tg_label(settings: dict) -> str:
    """llama-bench's name of the generation test: tg128, or tg128 @ d2048 after 2048 cached tokens."""
    depth = settings.get("depth", 0)
    return f"tg{settings['n_gen']}" + (f" @ d{depth}" if depth else "")


def _phase_table(entries: list[dict], tg: str) -> list[str]:
    """Where a generated token's time goes in each of our modes: the engine's own phase timers over the last
    round's tg run, µs per token (the byte model prices bytes; this shows which stage misses it)."""
    rows = []
    for e in entries:
        s = e.get("stats") or {}
        n, phases = s.get("decode_tokens"), s.get("phases") or {}
        if e["backend"] != "ours" or not n or not all(k in phases for k in PHASES):
            continue
        rest = s["decode_seconds"] - sum(phases[k] for k in PHASES)  # embedding, sampling, the rest of a step
        rows.append("| " + " | ".join([e["label"]] + [f"{1e6 * phases[k] / n:.0f}" for k in PHASES]
                                      + [f"{1e6 * rest / n:.0f}", f"{1e6 * s['decode_seconds'] / n:.0f}"]) + " |")
    if not rows:
        return []
    return ["", f"Where a generated token's time goes (µs per token, the engine's phase timers over the last round's "
                f"{tg}; gate_up: gates, rule and ups; down: the down projection):", "",
            "| engine | attention | predictor | gate_up | down | output head | other | total |",
            "|---|---|---|---|---|---|---|---|"] + rows


LAUNCH_SECONDS = 5e-6  # what a kernel launch is allowed beside its bytes, in the device's floor


def device_per_token(stats: dict) -> dict | None:
    """A run's device work per generated token (the engine's counters over the last round's generation): time on
    the device (its events), kernels launched, bytes read there and over the bus, and the floor those bytes
    imply at the device's own copy rate plus LAUNCH_SECONDS a launch. A split layer's time runs from the previous
    layer's end to its own on the device: the host's cold tier between its halves is in it."""
    gpu, n = stats.get("gpu"), stats.get("decode_tokens")
    if not gpu or not n or not gpu.get("copy_rate"):
        return None
    seconds = (gpu["device_seconds"] + gpu["attention_seconds"] + gpu["head_seconds"] + gpu.get("layer_seconds", 0.0)
               + gpu.get("split_seconds", 0.0))
    floor = gpu["device_read_bytes"] / gpu["copy_rate"] + LAUNCH_SECONDS * gpu["launches"]
    return {"device_us": 1e6 * seconds / n, "launches": gpu["launches"] / n,
            "device_mb": gpu["device_read_bytes"] / n / 1e6, "h2d_kib": gpu["h2d_bytes"] / n / 1024,
            "d2h_kib": gpu["d2h_bytes"] / n / 1024, "floor_us": 1e6 * floor / n,
            "of_floor": floor / seconds if seconds else None, "copy_gbs": gpu["copy_rate"] / 1e9}


def _device_table(entries: list[dict], tg: str) -> list[str]:
    """Where the device's share of a generated token goes, against the floor of its bytes (device_per_token)."""
    rows = []
    for e in entries:
        d = device_per_token(e.get("stats") or {}) if e["backend"] == "ours" else None
        if d:
            rows.append("| " + " | ".join([e["label"], f"{d['device_us']:.0f}", f"{d['launches']:.0f}",
                                           f"{d['device_mb']:.1f}", f"{d['h2d_kib']:.1f} / {d['d2h_kib']:.1f}",
                                           f"{d['floor_us']:.0f}", _f(d["of_floor"], "{:.0%}")]) + " |")
    if not rows:
        return []
    copy = device_per_token(next(e["stats"] for e in entries if device_per_token(e.get("stats") or {})))["copy_gbs"]
    return ["", f"The device per generated token ({tg}; its copy probe: {copy:.0f} GB/s read + written; floor: its "
                f"bytes at that rate plus {LAUNCH_SECONDS * 1e6:.0f} µs a launch):", "",
            "| engine | device µs | launches | device MB read | bus KiB up / down | floor µs | of floor |",
            "|---|---|---|---|---|---|---|"] + rows


def plot_sweep(record: dict, png: Path) -> None:
    """Generation speed against FFN sparsity per sparse mode, by wall time and by CPU time, with the dense
    runs as lines and the byte model's prediction (our dense speed x predicted speedup) dotted."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from powerinfer_tools.core.atomic import atomic_file

    sweep = record.get("sweep") or []
    if not sweep:
        raise UserError("--png draws the sparsity sweep: add --sweep-sparsity")
    by_label: dict[str, list[dict]] = {}
    for e in sweep:
        by_label.setdefault(e["label"], []).append(e)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, key, ylabel in ((axes[0], "median", "tokens/s (wall)"), (axes[1], "cpu_median", "tokens per CPU-second")):
        dense = [d["tg"][key] for d in by_label.get("ours dense", []) if d["tg"].get(key) is not None]
        for label, entries in by_label.items():
            ys = [e["tg"].get(key) for e in entries]
            if None in ys:
                continue
            if entries[0]["mode"] == "dense":
                ax.axhline(statistics.median(ys), ls="--", color="grey" if entries[0]["backend"] == "ours" else "black",
                           label=f"{label} (median)")
                continue
            xs = [e["target_sparsity"] for e in entries]
            line, = ax.plot(xs, ys, marker="o", label=label)
            if dense and all(e.get("predicted_speedup") for e in entries):
                base = statistics.median(dense)
                ax.plot(xs, [base * e["predicted_speedup"] for e in entries], ls=":", color=line.get_color(),
                        label=f"{label}: byte model")
        ax.set_xlabel("FFN sparsity (target level)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=7)
    st = record["settings"]
    fig.suptitle(f"{Path(st['model']).name} {st['outtype']}, {st['threads']} threads, {tg_label(st)}")
    fig.tight_layout()
    png = Path(png)
    with atomic_file(png) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)


def write_json(record: dict, path: Path) -> None:
    from powerinfer_tools.core.atomic import atomic_file

    with atomic_file(path) as tmp:
        tmp.write_text(json.dumps(record, indent=1))
