"""`pi-tools bench`: llama-bench-style prompt (pp) and generation (tg) speed of our engine in each FFN
mode, side by side with llama.cpp and transformers/PyTorch on the same weights and thread count.

Method. Every contestant is timed on the same token ids (real text, so that sparse modes see real
activations), and the repeats are interleaved: round r times every contestant once before round r+1
starts. On a shared machine the load drifts; interleaving lets ratios be taken within a round
(paired), and the reported ratio is the median of the per-round ratios. Speeds are medians with the
sample standard deviation beside them.

Sparse modes are measured at fixed FFN sparsity levels by rewriting the per-layer thresholds of a
working copy of the file (sparsity_levels.py), and each run is set against the byte model
(byte_model.py): predicted speedup over our dense mode, achieved / predicted, and achieved / the
physical limit of the memory read bandwidth, sampled before every round. The byte model prices a byte of a
row read by index like a streamed one; the engine's read probe measures what such rows cost on this
machine, and "achieved / at the probed rates" sets each run against the speedup its bytes allow at them.
"""
from __future__ import annotations

import shutil
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path


from powerinfer_tools.core.progress import progress_bar
from powerinfer_tools.bench import files as files_mod
from powerinfer_tools.bench import byte_model
from powerinfer_tools.bench import machine
from powerinfer_tools import models
from powerinfer_tools.bench import sparsity_levels
from powerinfer_tools.bench.runners import Runner, Worker, llamacpp_runner
from powerinfer_tools.bench.worker import mode_parts
from powerinfer_tools.core.errors import UserError
from powerinfer_tools.formats import names
from powerinfer_tools.stages.options import DEFAULT_KV_TYPE
from powerinfer_tools.runtime.inference import DEFAULT_INPUT_SPARSITY, INPUT_MODE
from powerinfer_tools.stages.options import SPARSITY_LEVEL

FFN_MODES = tuple(m for m in names.FFN_MODES if m != "oracle")   # oracle is a test mode: nothing to time
SPARSE_MODES = tuple(m for m in FFN_MODES if m != "dense")
# input: dense mode with input sparsity at --input-sparsity; MODE+input: that FFN mode with it (on attention)
MODES = (*FFN_MODES, INPUT_MODE, *(f"{m}+{INPUT_MODE}" for m in SPARSE_MODES))
PEERS = ("llama.cpp", "torch")
SWEEP_LEVELS = (0.3, 0.5, 0.7, 0.8, 0.9, 0.95)
CALIBRATION_SEQS, CALIBRATION_LEN = 4, 256
AGREEMENT_TOKENS = 64
# "of limit" divides by the read bandwidth sampled before every timed round (median), not once per run:
# on a shared machine it moved between 40 and 69 GB/s from one run to the next.
BANDWIDTH_PROBE_BYTES = 256 << 20  # far beyond any last-level cache
BANDWIDTH_PASSES = 2
# Perplexity beside the speeds (--ppl-file): a few windows of `pi-tools perplexity`'s default length, enough to see
# what a mode or a file costs in quality, not to rank models.
PPL_CTX, PPL_CHUNKS = 512, 4

@dataclass
class BenchOptions:
    model: str
    outtype: str = "q4_0"
    threads: int = 2
    repeats: int = 5
    modes: tuple[str, ...] = FFN_MODES
    peers: tuple[str, ...] = PEERS
    sparsity: float | None = None          # main table at this FFN sparsity (None: the file's thresholds)
    input_sparsity: float = DEFAULT_INPUT_SPARSITY   # the input mode's share (the --profile's input thresholds)
    sweep: bool = False
    sweep_levels: tuple[float, ...] = SWEEP_LEVELS
    sweep_repeats: int = 3
    n_prompt: int = 512
    n_gen: int = 128
    depth: int = 0                         # tokens already cached when tg starts (llama-bench's -d)
    batch: int = 512                       # our engine's prompt batch (llama.cpp's n_ubatch is 512)
    kv_type: str = DEFAULT_KV_TYPE         # our engine's KV cache type (llama.cpp's is f16 too)
    gpu: str = "auto"                      # where our hot tier runs (engine.Model's gpu)
    gpu_attention: bool = True             # the layers' attention and KV cache on the device first (engine.Model's)
    gpuidx: Path | None = None             # our hot tier's neurons; None: solved for vram_budget, or none
    vram_budget: float | None = None       # GiB: the plan's budget (from --profile) and the device's
    predictors: Path | None = None
    profile: Path | None = None
    text: Path | None = None
    ppl_file: Path | None = None           # text every row's perplexity is measured on (None: none measured)
    ppl_chunks: int = PPL_CHUNKS           # its windows
    ppl_ctx: int = PPL_CTX                 # tokens a window
    work_dir: Path | None = None
    peer_python: str | None = None
    llamacpp_wait: str | None = None       # OMP_WAIT_POLICY of the llama.cpp peer; None: the faster of both per run
    memory_limit: float | None = None      # GiB: each engine alone in a memory cgroup of this size (limited.py)
    memory_budget: float | None = None     # GiB: a row of ours with this disk-tier budget under memory_limit
    first_token: bool = False              # only the time to the first token of fresh processes (first_token.py)
    progress: bool = True
    command: str = ""
    log: list[str] = field(default_factory=list)


def _ours_worker(opts: BenchOptions, model_file: Path, n_ctx: int):
    """Our engine's worker on model_file."""
    return Worker("ours", model_file, opts.threads, n_ctx, opts.batch, opts.kv_type,
                  engine_options=_ours_options(opts, model_file, n_ctx))


def _ours_options(opts: BenchOptions, model_file: Path, n_ctx: int) -> dict:
    """Our worker's engine options: its hot tier where opts put it (a plan for --vram-budget solved from
    --profile for this file and cached beside it, as `pi-tools run` does)."""
    gpuidx = opts.gpuidx
    if gpuidx is None and opts.vram_budget is not None:
        from powerinfer_tools.runtime.inference import cached_plan

        gpuidx = cached_plan(Path(model_file), opts.vram_budget, opts.profile, n_ctx)
    engine_options = {"gpu": opts.gpu}
    if gpuidx is not None:
        engine_options["gpuidx"] = str(gpuidx)
    if opts.vram_budget is not None and opts.gpu != "off":
        engine_options["vram_budget"] = opts.vram_budget
    if not opts.gpu_attention:
        engine_options["gpu_attention"] = False
    engine_options["input_share"] = opts.input_sparsity  # the input mode's (the worker's, not engine.Model's)
    return engine_options


def default_work_dir() -> Path:
    from powerinfer_tools.models.default_model import cache_dir

    return cache_dir() / "bench"


# ---- statistics ---------------------------------------------------------------------------------

def summarize(tokens: int, times: dict) -> dict:
    """Speeds from per-round wall and CPU seconds: tokens/s, and tokens per CPU-second (the worker
    process's CPU time, all threads: what the run cost, whatever share of the machine it got)."""
    tps = [tokens / s for s in times["wall"]]
    cpu = [tokens / s for s in times["cpu"]]
    return {"tokens": tokens, "seconds": times["wall"], "cpu_seconds": times["cpu"], "tps": tps,
            "median": statistics.median(tps), "stdev": statistics.stdev(tps) if len(tps) > 1 else 0.0,
            "cpu_tps": cpu, "cpu_median": statistics.median(cpu)}


def paired_ratio(a: list[float], b: list[float]) -> float | None:
    """Median over rounds of speed(a) / speed(b), from per-round seconds (b's time / a's time)."""
    pairs = [tb / ta for ta, tb in zip(a, b) if ta > 0 and tb > 0]
    return statistics.median(pairs) if pairs else None


# ---- the measurement loop -----------------------------------------------------------------------

def _time_rounds(runners: list, tests: dict[str, dict], rounds: int, desc: str, progress: bool,
                 probe: machine.BandwidthProbe | None = None) -> tuple[dict, float | None]:
    """({label: {test: {"wall": [...], "cpu": [...]}}}, read bandwidth), every runner once per round, in a fixed
    order; tests: {"pp": {"tokens": ...}, "tg": {"tokens": ..., "context": ...}}, the runners' arguments. The
    bandwidth (with `probe`) is the median of one sample per round, taken while every contestant is stopped: the
    memory system the round had, not a snapshot from the start of the run."""
    for r in runners:  # warm-up: page in weights, spin up thread pools
        r.pp(tests.get("pp", tests["tg"])["tokens"][:32])
        r.tg(tests["tg"]["tokens"][:8])
    times = {r.label: {t: {"wall": [], "cpu": []} for t in tests} for r in runners}
    samples = []
    with progress_bar(total=rounds * len(runners) * len(tests), desc=desc, unit="run", disable=not progress) as bar:
        for _ in range(rounds):
            if probe is not None:
                samples.append(probe.measure(BANDWIDTH_PASSES))
            for r in runners:
                for test, args in tests.items():
                    wall, cpu = getattr(r, test)(**args)
                    times[r.label][test]["wall"].append(wall)
                    times[r.label][test]["cpu"].append(cpu)
                    bar.update()
    return times, (statistics.median(samples) if samples else None)


def _layer_sparsity(stats: dict | None) -> dict | None:
    if not stats:
        return None
    layers = [l for l in stats["layers"] if l["tokens"]]
    if not layers:  # the input mode's FFN runs outside the tiers, which count these
        return None
    computed = sum(l["computed_density"] for l in layers) / len(layers)
    predicted = [l["predicted_density"] for l in layers if l.get("predicted_density") is not None]
    return {"ffn_sparsity": 1.0 - computed, "rule_density": stats.get("density"),
            "gate_rows_read": sum(predicted) / len(predicted) if predicted else 1.0}


def _entry(runner, times: dict, n_prompt: int, n_gen: int, target: float | None) -> dict:
    entry = {"label": runner.label, "backend": runner.backend, "mode": runner.mode, "target_sparsity": target}
    if "pp" in times:
        entry["pp"] = summarize(n_prompt, times["pp"])
    entry["tg"] = summarize(n_gen, times["tg"])
    if runner.backend == "ours":
        entry["stats"] = runner.last_stats
        entry["sparsity"] = _layer_sparsity(runner.last_stats)
    return entry


def _ratios(mine: dict, other: dict) -> dict:
    """Paired speed ratios per test, by wall time and by CPU time."""
    out = {}
    for t in mine:
        if t in other:
            out[t] = paired_ratio(mine[t]["wall"], other[t]["wall"])
            out[f"{t}_cpu"] = paired_ratio(mine[t]["cpu"], other[t]["cpu"])
    return out


def _add_derived(entries: list[dict], times: dict, mb: byte_model.ModelBytes, bandwidth: float, n_gen: int,
                 depth: int, rates: dict | None = None) -> None:
    """Ratios to llama.cpp and to our dense mode (paired by round), and the byte model's view; with the machine's
    read rates (machine.rows_by_index), the speedup over dense those bytes allow at them."""
    llama = times.get("llama.cpp")
    dense = times.get("ours dense")
    position = depth + (n_gen - 1) / 2  # mean cache position over the generated tokens
    dense_bytes = byte_model.token_bytes(mb, None, position)["total"]
    dense_seconds = byte_model.machine_seconds(mb, None, position, rates) if rates else None
    for e in entries:
        mine = times[e["label"]]
        if llama is not None and e["backend"] != "llama.cpp":
            e["vs_llamacpp"] = _ratios(mine, llama)
        if e["backend"] != "ours":
            continue
        layers = e["stats"]["layers"] if e.get("stats") else None
        ffn, with_input = mode_parts(e["mode"])
        parts = byte_model.token_bytes(mb, layers, position)
        if with_input:  # the FFN mode's bytes less the rows of zeroed inputs the engine counted skipped
            parts = byte_model.token_bytes(mb, None if ffn == "dense" else layers, position)
            inputs, tokens = e["stats"]["input_sparsity"], max(e["stats"]["decode_tokens"], 1)
            parts["input_skipped"] = inputs["decode_bytes_skipped"] / tokens
            parts["total"] -= parts["input_skipped"]
        e["bytes_per_token"] = parts
        e["read_bandwidth"] = bandwidth
        e["limit_tps"] = bandwidth / parts["total"]
        e["of_limit"] = e["tg"]["median"] / e["limit_tps"]
        if dense is not None:
            e["predicted_speedup"] = dense_bytes / parts["total"]
            e["achieved_speedup"] = paired_ratio(mine["tg"]["wall"], dense["tg"]["wall"])
            e["achieved_over_predicted"] = e["achieved_speedup"] / e["predicted_speedup"]
            e["achieved_speedup_cpu"] = paired_ratio(mine["tg"]["cpu"], dense["tg"]["cpu"])
            e["achieved_over_predicted_cpu"] = e["achieved_speedup_cpu"] / e["predicted_speedup"]
            if dense_seconds and not with_input:  # the machine's rates price FFN rows, not input rows
                e["machine_predicted_speedup"] = dense_seconds / byte_model.machine_seconds(mb, layers, position, rates)
                e["achieved_over_machine_predicted"] = e["achieved_speedup"] / e["machine_predicted_speedup"]


# ---- orchestration ------------------------------------------------------------------------------

TEXT_SEED = 0   # the seed of the text our engine writes when no --text is given: every run times the same tokens
SELF_GENERATED = f"self-generated (engine, dense, seed {TEXT_SEED})"


def engine_text(model_file: Path, tokenizer, n_tokens: int, threads: int, seed: int = TEXT_SEED,
                progress: bool = True) -> list[int]:
    """n_tokens token ids our engine writes itself from model_file in dense mode: BOS where the tokenizer has one,
    calibration's first neutral prompt, then tokens sampled at temperature 1 and top-p 0.95 from `seed`, EOS not a
    stop (the text only has to be the model's own, so that sparse modes see real activations).

    The engine, not transformers: it reads the q4_0/q8_0 file the bench built, where the source model in float32
    takes 4 bytes a weight (a 7B, 27 GB, got the bench killed for memory before it timed a token). The engine is
    closed on return, before the timed workers start."""
    import powerinfer_engine as engine

    from powerinfer_tools.runtime.inference import engine_errors
    from powerinfer_tools.stages.profiling.calibration import NEUTRAL_PROMPTS

    bos = tokenizer.bos_token_id
    prompt = ([bos] if bos is not None else []) + tokenizer(NEUTRAL_PROMPTS[0], add_special_tokens=False)["input_ids"]
    ids = list(prompt)
    with engine_errors(), engine.Model(model_file, threads=threads, sparse_mode="dense", ctx_size=n_tokens,
                                       gpu="off") as model:
        with progress_bar(total=n_tokens - len(prompt), desc="generating the bench's text", unit="tok", leave=False,
                  disable=not progress) as bar:
            for token in model.generate(prompt, n_tokens - len(prompt), temperature=1.0, top_k=0, top_p=0.95,
                                        seed=seed):
                ids.append(token)
                bar.update()
    return ids


def _bench_tokens(opts: BenchOptions, tokenizer, text: str | None,
                 model_file: Path) -> tuple[list[int], list[int], list[int]]:
    """Prompt, context (cached before tg: --depth tokens) and generation token ids: consecutive stretches of the
    text (or of text our engine writes from model_file); the first token tg's cache sees is BOS where the model has
    one."""
    from powerinfer_tools.stages.profiling import calibration

    need = opts.n_prompt + opts.depth + opts.n_gen
    if text is not None:
        ids = calibration.sequences_from_text(tokenizer, [text], need, need)[0].tolist()
    else:
        ids = engine_text(model_file, tokenizer, need, opts.threads, progress=opts.progress)
    if len(ids) < need:
        raise UserError(f"the benchmark text gives {len(ids)} tokens, {need} are needed")
    bos = ids[:1] if tokenizer.bos_token_id is not None else []
    rest = bos + ids[opts.n_prompt:need - len(bos)]
    return ids[:opts.n_prompt], rest[:opts.depth], rest[opts.depth:]


def check_source_fits(source: models.ModelSource, calibrates: bool, torch_peer: bool) -> None:
    """Refuse in one line, before anything is built, to load a source model that cannot fit in memory in float32
    (--sparsity and --sweep-sparsity calibrate on it; the torch peer runs it): the kernel would kill the process
    without a word."""
    from powerinfer_tools.models import arch
    from powerinfer_tools.stages.profiling import profiling

    if not (calibrates or torch_peer):
        return
    need = profiling.weight_bytes(arch.for_config(models.load_config(source)), "float32")
    have = profiling.available_memory("cpu")
    if need <= have:
        return
    sizes = f"{need / 2**30:.1f} GiB of weights, {have / 2**30:.1f} GiB of memory available"
    if calibrates:
        raise UserError(f"--sparsity and --sweep-sparsity calibrate on {source.spec} in float32: {sizes}; drop them "
                        "and give --profile DIR of a `pi-tools profile --target-sparsity S --calib TEXT` (one layer "
                        "at a time) to time the sparse modes at that profile's thresholds")
    raise UserError(f"the torch peer runs {source.spec} in float32: {sizes}; leave it out (--peers llama.cpp)")


def _calibrate(source: models.ModelSource, tokenizer, text: str | None):
    """(activation sample, calibration tokens) of the source model in float32, what --sparsity and --sweep-sparsity
    set thresholds from. The model lives only in here: it is freed before the timed workers start."""
    from powerinfer_tools.stages.profiling.calibration import self_generated, sequences_from_text

    hf_model, adapter = models.load_model(source)
    n_tokens = CALIBRATION_SEQS * CALIBRATION_LEN
    seqs = (sequences_from_text(tokenizer, [text[len(text) // 2:]], CALIBRATION_LEN, n_tokens) if text is not None
            else self_generated(hf_model, tokenizer, CALIBRATION_LEN, n_tokens))
    return sparsity_levels.collect(hf_model, adapter, seqs), int(seqs.numel())


def _check_options(opts: BenchOptions) -> None:
    for m in opts.modes:
        if m not in MODES:
            raise UserError(f"unknown mode {m!r} in --modes (choose from {', '.join(MODES)})")
    for p in opts.peers:
        if p not in PEERS:
            raise UserError(f"unknown peer {p!r} in --peers (choose from {', '.join(PEERS)})")
    if opts.threads < 1 or opts.repeats < 1 or opts.sweep_repeats < 1:
        raise UserError("--threads and --repeats must be at least 1")
    if opts.n_prompt < 2 or opts.n_gen < 2:
        raise UserError("--n-prompt and --n-gen must be at least 2")
    if opts.depth < 0:
        raise UserError("--depth must be at least 0")
    if opts.ppl_chunks < 1 or opts.ppl_ctx < 2:
        raise UserError(f"--ppl-chunks must be at least 1 and --ppl-ctx at least 2, got {opts.ppl_chunks} and "
                        f"{opts.ppl_ctx}")
    SPARSITY_LEVEL.check("--sparsity", opts.sparsity)
    SPARSITY_LEVEL.check("--sweep-levels", list(opts.sweep_levels if opts.sweep else []))
    if not 0 < opts.input_sparsity < 1:
        raise UserError(f"--input-sparsity must be a share in (0, 1), got {opts.input_sparsity:g}")
    if opts.sweep and not set(opts.modes) & set(SPARSE_MODES):
        raise UserError("--sweep-sparsity needs a sparse mode in --modes (gate, predictor or auto)")
    if opts.peer_python and "llama.cpp" in opts.peers and shutil.which(opts.peer_python) is None:
        raise UserError(f"--peer-python {opts.peer_python}: no such executable (a Python with llama-cpp-python)")
    if opts.first_token and (opts.memory_limit is not None or opts.sweep or opts.ppl_file is not None
                             or opts.peers != ("llama.cpp",)):
        raise UserError("--first-token times our `run` against llama.cpp alone: give --peers llama.cpp and drop "
                        "--memory-limit, --sweep-sparsity and --ppl-file")
    if opts.memory_limit is not None:
        if opts.memory_limit <= 0 or (opts.memory_budget is not None and opts.memory_budget <= 0):
            raise UserError("--memory-limit and --memory-budget are GiB, above 0")
        if opts.sweep or opts.ppl_file is not None or "torch" in opts.peers:
            raise UserError("--memory-limit times llama.cpp and our modes only: drop --sweep-sparsity, --ppl-file "
                            "and the torch peer (--peers llama.cpp or '')")
        from powerinfer_tools.bench import limited

        limited.check_can_run()


def _ppl_windows(opts: BenchOptions, tokenizer, text: str | None) -> list[list[int]]:
    """The windows of --ppl-file's `text` every row's perplexity is measured on; none without it."""
    if text is None:
        return []
    from powerinfer_tools.stages.profiling.calibration import sequences_from_text

    try:
        return sequences_from_text(tokenizer, [text], opts.ppl_ctx, opts.ppl_ctx * opts.ppl_chunks).tolist()
    except UserError:
        raise UserError(f"--ppl-file {opts.ppl_file} is shorter than one window of {opts.ppl_ctx} tokens; give a "
                        "longer text or a smaller --ppl-ctx") from None


def _thresholds_at(sample, logits, level: float) -> dict:
    return {"activation": sparsity_levels.activation_thresholds(sample, level) if sample.thresholded else None,
            "predictor": sparsity_levels.predictor_thresholds(logits, level) if logits is not None else None}


def run_bench(opts: BenchOptions) -> dict:
    """Build the files, measure, and return the whole record (JSON-ready)."""
    _check_options(opts)
    ppl_text = None
    if opts.ppl_file is not None:  # read before anything is built: a wrong path fails at once
        from powerinfer_tools.stages.profiling.calibration import read_text

        ppl_text = read_text(opts.ppl_file, role="--ppl-file")
    work_dir = Path(opts.work_dir or default_work_dir())
    started = time.time()
    record: dict = {"format": "powerinfer-tools.bench/1", "command": opts.command,
                    "settings": {"model": opts.model, "outtype": opts.outtype, "threads": opts.threads,
                                 "repeats": opts.repeats, "n_prompt": opts.n_prompt, "n_gen": opts.n_gen, "depth": opts.depth,
                                 "batch": opts.batch, "kv_type": opts.kv_type, "modes": list(opts.modes),
                                 "peers": list(opts.peers),
                                 "sparsity": opts.sparsity, "input_sparsity": opts.input_sparsity}}
    source = models.resolve(opts.model)
    need_calibration = opts.sparsity is not None or opts.sweep
    check_source_fits(source, need_calibration, "torch" in opts.peers)
    record["machine"] = machine.machine_record(opts.threads, measure_bandwidth=not opts.first_token)
    bandwidth_probe = machine.BandwidthProbe(opts.threads, BANDWIDTH_PROBE_BYTES)

    files = files_mod.bench_files(opts.model, opts.outtype, work_dir, opts.predictors, opts.profile, opts.progress,
                                  input_sparsity=any(mode_parts(m)[1] for m in opts.modes))
    record["files"] = {"powerinfer": str(files.powerinfer), "llamacpp": str(files.llamacpp),
                       "powerinfer_bytes": files.powerinfer.stat().st_size,
                       "llamacpp_bytes": files.llamacpp.stat().st_size, "built": files.manifest}
    if opts.first_token:
        from powerinfer_tools.bench import first_token

        rows = first_token.contestants(files.powerinfer, files.llamacpp, opts.threads, opts.peer_python,
                                       opts.llamacpp_wait)
        record["first_token"] = first_token.measure(rows, opts.repeats, opts.progress)
        record["notes"] = opts.log
        record["seconds"] = round(time.time() - started, 1)
        return record
    mb = byte_model.model_bytes(files.powerinfer, kv_type=opts.kv_type)
    record["machine"]["rows_by_index"] = machine.rows_by_index(mb.layers[0].gate_row, opts.threads)
    has_predictor = any(l.predictor for l in mb.layers)

    tokenizer = models.load_tokenizer(source)
    text = None
    if opts.text is not None:
        from powerinfer_tools.stages.profiling.calibration import read_text
        text = read_text(opts.text)
    prompt, context, gen = _bench_tokens(opts, tokenizer, text, files.powerinfer)
    tg = {"tokens": gen, "context": context}
    record["tokens"] = {"text": str(opts.text) if text is not None else SELF_GENERATED,
                        "prompt": len(prompt), "context": len(context), "generated": len(gen)}

    sample = logits = None
    if need_calibration:
        sample, record["calibration_tokens"] = _calibrate(source, tokenizer, text)
        if has_predictor:
            logits = sparsity_levels.predictor_logits(sample, sparsity_levels.predictor_weights(files.powerinfer))

    has_inputs = bool(mb.input_levels)
    modes = [m for m in opts.modes
             if (mode_parts(m)[0] != "predictor" or has_predictor) and (not mode_parts(m)[1] or has_inputs)]
    if any(mode_parts(m)[0] == "predictor" for m in opts.modes) and not has_predictor:
        opts.log.append("predictor modes skipped: the file has no predictors (give --predictors DIR)")
    if any(mode_parts(m)[1] for m in opts.modes) and not has_inputs:
        opts.log.append("input modes skipped: the file has no input thresholds (give --profile DIR of a profile with "
                        "them)")
    ppl_windows = _ppl_windows(opts, tokenizer, ppl_text)
    n_ctx = max(opts.n_prompt, opts.depth + opts.n_gen, opts.ppl_ctx if ppl_windows else 0) + 8
    if opts.memory_limit is not None:
        record["memory_limit"] = _memory_limited(opts, files, modes, prompt, tg, n_ctx)
        record["engine"] = {"isa": next((r["isa"] for r in record["memory_limit"]["rows"] if r.get("isa")), None)}
        record["notes"] = opts.log
        record["seconds"] = round(time.time() - started, 1)
        return record
    workers: list[Worker] = []
    try:
        llama = []
        if "llama.cpp" in opts.peers:
            runner, llama_workers = llamacpp_runner(files.llamacpp, opts.threads, n_ctx, opts.peer_python,
                                                    opts.llamacpp_wait)
            workers.extend(llama_workers)
            llama = [runner]
            record["llamacpp"] = llama_workers[0].ask(op="info")
        torch_runner = []
        if "torch" in opts.peers:
            workers.append(Worker("torch", opts.model, opts.threads, n_ctx))
            torch_runner = [Runner(workers[-1], f"torch {workers[-1].ask(op='info')['torch']} f32")]

        # main table
        model_file = files.powerinfer
        if opts.sparsity is not None:
            model_file = files_mod.working_copy(files.powerinfer, work_dir)
            files_mod.set_thresholds(model_file, **_thresholds_at(sample, logits, opts.sparsity))
        ours_worker = _ours_worker(opts, model_file, n_ctx)
        workers.append(ours_worker)
        info = ours_worker.ask(op="info")
        record["engine"] = {k: info[k] for k in ("isa", "threads", "n_batch", "weight_type", "kv_type", "gpu")}
        record["thresholds"] = {"activation": info["activation_thresholds"], "predictor": info["predictor_thresholds"]}
        ours = [Runner(ours_worker, f"ours {m}", m) for m in modes]
        if llama and "dense" in modes:
            tokens = gen[:AGREEMENT_TOKENS]
            a, b = ours[modes.index("dense")].argmax(tokens), llama[0].argmax(tokens)
            record["agreement"] = {"tokens": len(tokens), "top1_ours_dense_vs_llamacpp":
                                   sum(x == y for x, y in zip(a, b)) / len(tokens)}
        runners = llama + ours + torch_runner
        times, bandwidth = _time_rounds(runners, {"pp": {"tokens": prompt}, "tg": tg}, opts.repeats, "bench", opts.progress,
                                        bandwidth_probe)
        entries = [_entry(r, times[r.label], len(prompt), len(gen), opts.sparsity) for r in runners]
        if ppl_windows:  # after the timed rounds: it times nothing, and the main table's files and modes are set
            record["perplexity"] = {"file": str(opts.ppl_file), "windows": len(ppl_windows), "ctx": opts.ppl_ctx}
            for r, e in zip(progress_bar(runners, desc="perplexity", unit="run", disable=not opts.progress), entries):
                e["perplexity"] = r.perplexity(ppl_windows)
        record["engine"]["peak_rss_bytes"] = ours_worker.ask(op="info")["peak_rss_bytes"]
        record["engine"]["kv_cache_bytes"] = info["kv_cache_bytes"]
        record["engine"]["work_buffer_bytes"] = info["work_buffer_bytes"]
        ours_worker.close()
        record["engine"]["memory_by_mode"] = _memory_by_mode(model_file, opts, n_ctx, modes, prompt, tg)
        _add_derived(entries, times, mb, bandwidth, len(gen), opts.depth, record["machine"]["rows_by_index"])
        record["runs"] = entries

        if opts.sweep:
            record["sweep"] = _sweep(opts, files, work_dir, sample, logits, llama, modes, tg, mb, bandwidth_probe,
                                     record["machine"]["rows_by_index"])
        if llama:
            record["llamacpp"]["peak_rss_bytes"] = max(r.worker.ask(op="info")["peak_rss_bytes"]
                                                       for r in llama[0].runners.values())
            record["llamacpp"]["omp_wait_policy"] = "faster of " + " / ".join(llama[0].runners)
            record["llamacpp"]["omp_wait_wins"] = llama[0].wins
    finally:
        for w in workers:
            w.close()
    record["notes"] = opts.log
    record["seconds"] = round(time.time() - started, 1)
    return record


def _memory_limited(opts: BenchOptions, files, modes, prompt: list[int], tg: dict, n_ctx: int) -> dict:
    """Every engine alone under --memory-limit (limited.py); ours at its defaults, and with --memory-budget."""
    from powerinfer_tools.bench import cgroup, limited
    from powerinfer_tools.formats import names, neuron_bundles
    from powerinfer_tools.formats.gguf_header import read_header

    budget = opts.memory_budget  # None: the engine's own rule alone (its rows at their defaults)
    header = read_header(files.powerinfer, tensors=False)
    experts = bool(header.get(f"{header.get(names.KEY_ARCHITECTURE)}.expert_count"))  # read from the file itself
    if not experts and not neuron_bundles.current(files.powerinfer):  # what the disk tier reads
        from powerinfer_tools.stages.placement.placement import profile_frequencies

        frequencies = profile_frequencies(opts.profile, files.powerinfer) if opts.profile is not None else None
        neuron_bundles.write(files.powerinfer, frequencies, progress=opts.progress)
    rows = limited.contestants(modes, _ours_options(opts, files.powerinfer, n_ctx), budget, "llama.cpp" in opts.peers,
                               experts)
    return {"limit_gib": opts.memory_limit, "budget_gib": budget, "cgroup_version": cgroup.find_hierarchy().version,
            "file_gib": files.powerinfer.stat().st_size / 2**30, "peer_file_gib": files.llamacpp.stat().st_size / 2**30,
            "rows": limited.run(rows, int(opts.memory_limit * 2**30), limited.start_worker(opts, files, n_ctx),
                                prompt, tg, opts.repeats, opts.progress)}


def _memory_by_mode(model_file, opts: BenchOptions, n_ctx: int, modes, prompt: list[int], tg: dict) -> dict:
    """Each mode's peak RSS in a process of its own (the prompt, then the generation), and the worker's RSS
    before the model opened: what a user running that mode holds. The timed worker runs every mode in one
    process, so its peak is the union of what the modes touch."""
    memory = {}
    for mode in progress_bar(modes, desc="memory", unit="mode", disable=not opts.progress):
        worker = _ours_worker(opts, model_file, n_ctx)
        try:
            worker.ask(op="mode", mode=mode)
            worker.ask(op="pp", tokens=prompt)
            worker.ask(op="tg", **tg)
            info = worker.ask(op="info")
        finally:
            worker.close()
        memory[mode] = {"peak_rss_bytes": info["peak_rss_bytes"], "rss_before_model_bytes": info["rss_before_model_bytes"]}
    return memory


def _sweep(opts, files, work_dir, sample, logits, llama, modes, tg, mb, probe, rates) -> list[dict]:
    """tg of every sparse mode at each sparsity level, paired per round with our dense and llama.cpp dense."""
    copy = files_mod.working_copy(files.powerinfer, work_dir)
    sparse = [m for m in modes if m in SPARSE_MODES and (m != "gate" or sample.thresholded)]
    if "gate" in modes and not sample.thresholded:
        opts.log.append("gate mode not swept: a ReLU-family model's gate sparsity is fixed by the model")
    n_gen = len(tg["tokens"])
    n_ctx = opts.depth + n_gen + 8
    out = []
    for level in opts.sweep_levels:
        files_mod.set_thresholds(copy, **_thresholds_at(sample, logits, level))
        worker = _ours_worker(opts, copy, n_ctx)
        try:
            runners = llama + [Runner(worker, f"ours {m}", m) for m in ["dense"] + sparse]
            times, bandwidth = _time_rounds(runners, {"tg": tg}, opts.sweep_repeats, f"sweep {level:.2f}",
                                            opts.progress, probe)
            entries = [_entry(r, times[r.label], 0, n_gen, level) for r in runners]
        finally:
            worker.close()
        _add_derived(entries, times, mb, bandwidth, n_gen, opts.depth, rates)
        out.extend(entries)
    return out
