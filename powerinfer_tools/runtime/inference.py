"""Running a converted file with the bundled engine: opening it with one-line errors, perplexity over
non-overlapping windows, incremental detokenization and llama.cpp-style timing lines.

`pi-tools run` and `pi-tools perplexity` are thin layers over this; the caller decides which file
and which GPU index to run (see `resolve_model_file`), so model building and VRAM planning can be
put in front without touching the engine side.
"""
from __future__ import annotations

import contextlib
import math
import os
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from powerinfer_tools.core.errors import UserError
from powerinfer_tools.formats import names
from powerinfer_tools.formats.gguf_io import THRESHOLDED_ACTIVATIONS
from powerinfer_tools.stages.options import (DEFAULT_KV_TYPE, DEVICE_BUDGET_GIB, GPU_MODES, KV_TYPES,
                                             MEMORY_BUDGET_GIB)
from powerinfer_tools.stages.predictors.usefulness import ENOUGH_SPARSITY

SPARSE_MODES = names.FFN_MODES
# --sparse-mode input: dense FFN mode with input sparsity on every matrix, at this share unless --input-sparsity
INPUT_MODE = "input"
DEFAULT_INPUT_SPARSITY = 0.25
CLI_SPARSE_MODES = (*SPARSE_MODES, INPUT_MODE)
NO_GPUIDX = "none"  # --gpuidx none: not even the index beside the model


@dataclass(frozen=True)
class EngineTarget:
    """What the engine opens: a converted model file and, optionally, the GPU index splitting its FFN."""

    model: Path
    gpuidx: Path | None = None


def resolve_model_file(spec: str, gpuidx: str | os.PathLike | None = None, vram_budget_gib: float | None = None,
                       profile: str | os.PathLike | None = None, ctx_size: int | None = None) -> EngineTarget:
    """What --model (+ --gpuidx / --vram-budget) names: a converted file, or `smollm2`, built on first use.

    The GPU index: the one given ("none": no index); else, with a VRAM budget, the plan cached beside the model
    (MODEL.generated.gpuidx, where PowerInfer looks) when it was solved for that budget, otherwise one solved
    from the profile and cached there (none for a mixture of experts: its device experts are MODEL.tiers'); else
    MODEL.generated.gpuidx when it exists, as PowerInfer's main does.
    """
    from powerinfer_tools.models import default_model
    from powerinfer_tools.runtime import default_build as pipeline

    if spec == default_model.NAME:
        path = pipeline.build(spec)
        profile = profile or pipeline.model_dir(spec) / "profile"
    else:
        path = Path(spec).expanduser()
        if path.is_dir():
            raise UserError(f"{spec} is a directory, not a model file: give the .gguf file 'pi-tools convert' wrote "
                            f"(convert -m {spec} -o FILE makes one from a model directory)")
        if not path.is_file():
            raise UserError(f"model file not found: {spec} (give a file written by 'pi-tools convert', "
                            f"or '{default_model.NAME}')")
    if gpuidx is not None and str(gpuidx) == NO_GPUIDX:
        gpuidx = None
    elif gpuidx is not None:
        gpuidx = Path(gpuidx).expanduser()
        if not gpuidx.is_file():
            raise UserError(f"GPU index not found: {gpuidx}")
    elif vram_budget_gib is not None:
        from powerinfer_tools.stages.profiling.expert_profile import mixture_file

        # a mixture's device experts are its three-tier plan's (MODEL.tiers, pi-tools plan --vram-budget
        # --memory-budget), which the engine reads itself: no GPU index
        if mixture_file(str(path)) is None:
            gpuidx = cached_plan(path, vram_budget_gib, profile, ctx_size)
    else:
        from powerinfer_tools.stages.placement import placement

        beside = placement.default_gpuidx_path(path)
        if beside.is_file():  # where PowerInfer's main looks for it too
            print(f"pi-tools: using the GPU index beside the model, {beside} (--gpuidx none: run without it)",
                  file=sys.stderr)
            gpuidx = beside
    return EngineTarget(path, gpuidx)


def cached_plan(model: Path, vram_budget_gib: float, profile: str | os.PathLike | None,
                ctx_size: int | None) -> Path:
    """MODEL.generated.gpuidx for this budget and context (None: the model's default): reused when its summary
    says so, else solved and written."""
    import json

    from powerinfer_tools.stages.placement import placement

    ctx_size = context_size(model, ctx_size)
    placement.check_budget(vram_budget_gib * placement.GIB)
    budget = int(vram_budget_gib * placement.GIB)
    path = placement.default_gpuidx_path(model)
    summary = path.with_name(path.name + ".json")
    saved = {}
    if path.is_file() and summary.is_file():
        try:
            saved = json.loads(summary.read_text())
        except json.JSONDecodeError:
            saved = {}
        # (an index written before plans recorded the neuron order lacks the model's order: solved again)
        if saved.get("vram_budget") == budget and saved.get("ctx_size") == ctx_size and "neuron_order" in saved:
            return path
    if profile is None:
        cached = ""
        if saved.get("vram_budget") is not None:
            cached = (f" (the one cached, {path.name}, was solved for {saved['vram_budget'] / placement.GIB:g} GiB "
                      f"and --ctx-size {saved.get('ctx_size')}; this run asks for --ctx-size {ctx_size})")
        raise UserError(f"--vram-budget: no plan for {vram_budget_gib} GiB is cached beside {model.name}{cached}; "
                        "give --profile DIR (the profile the model was converted from) to solve one")
    plan = placement.plan_for_model(profile, model, budget, ctx_size=ctx_size)
    placement.write_plan(plan, path)
    print(f"pi-tools: solved a placement for {vram_budget_gib} GiB -> {path}", file=sys.stderr)
    return path


def engine_mode(sparse_mode: str, input_sparsity: float | None) -> tuple[str, float]:
    """(the engine's FFN mode, input sparsity's share) of --sparse-mode and --input-sparsity, checked."""
    if sparse_mode not in CLI_SPARSE_MODES:
        raise UserError(f"unknown --sparse-mode {sparse_mode!r} (choose from {', '.join(CLI_SPARSE_MODES)})")
    if input_sparsity is not None and not 0.0 <= input_sparsity < 1.0:
        raise UserError(f"--input-sparsity must be a share in [0, 1), got {input_sparsity:g}")
    if sparse_mode == INPUT_MODE:
        share = DEFAULT_INPUT_SPARSITY if input_sparsity is None else input_sparsity
        if share <= 0:
            raise UserError("--sparse-mode input needs a positive --input-sparsity")
        return "dense", share
    return sparse_mode, input_sparsity or 0.0


def context_size(model: str | os.PathLike, ctx_size: int | None) -> int:
    """The context to run `model` with: ctx_size, or the model's default (options.default_ctx_size), which plans
    are sized and cached by."""
    from powerinfer_tools.formats.gguf_header import read_header
    from powerinfer_tools.stages.placement import placement
    from powerinfer_tools.stages.options import CTX_SIZE

    if ctx_size is not None:
        return CTX_SIZE.check("--ctx-size", ctx_size)
    return placement.model_ctx_size(read_header(model, tensors=False))


def open_engine(target: EngineTarget, threads: int | None = None, sparse_mode: str = "dense",
                ctx_size: int | None = None, recall_check: bool = False, kv_type: str = DEFAULT_KV_TYPE, gpu: str = "auto",
                vram_budget_gib: float | None = None, input_sparsity: float | None = None,
                memory_budget_gib: float | None = None, n_seq: int = 1):
    """engine.Model for the target (n_seq: its sequences, each a KV cache); engine failures become UserError with the engine's message. With a hot tier
    (target.gpuidx) and gpu not off, says on stderr where the hot tier runs, or that the index is ignored where no
    device takes it. sparse_mode may be 'input' (engine_mode)."""
    arguments = _engine_arguments(target, threads, sparse_mode, ctx_size, recall_check, kv_type, gpu, vram_budget_gib,
                                  input_sparsity, memory_budget_gib, n_seq)
    return _say_opened(target, arguments, _open(target, arguments))


def open_with_tokenizer(target: EngineTarget, **options):
    """(tokenizer, engine.Model): open_engine(target, **options) with the tokenizer loaded meanwhile on a thread.
    Each takes much of a fresh process's wait for its first token (docs/bench.md, "Time to the first token") and
    they need different resources: the engine opens in C without the GIL, and tokenizers' from_file holds the GIL
    while it parses. The thread starts once the checks in Python are done, as the engine's C open begins, so the
    caller waits for the longer of the two, not their sum. What the caller sees is what it saw when the tokenizer
    loaded first: the tokenizer's failure, else the engine's, else the engine's lines on stderr."""
    import threading

    import powerinfer_engine  # noqa: F401  (here: an import on the thread would wait for the GIL)

    arguments = _engine_arguments(target, **options)
    loaded: dict = {}

    def load() -> None:
        try:
            loaded["tokenizer"] = load_tokenizer(target.model)
        except BaseException as exc:  # raised on the caller's thread
            loaded["error"] = exc

    thread = threading.Thread(target=load, name="tokenizer", daemon=True)  # daemon: Ctrl-C need not wait for it
    thread.start()
    model = failure = None
    try:
        model = _open(target, arguments)
    except BaseException as exc:
        failure = exc
    try:
        thread.join()
        interrupted = failure is not None and not isinstance(failure, Exception)  # Ctrl-C before any failure
        error = failure if interrupted else loaded.get("error", failure)
        if error is not None:
            raise error
    except BaseException:
        if model is not None:
            model.close()
        raise
    return loaded["tokenizer"], _say_opened(target, arguments, model)


@dataclass(frozen=True)
class _EngineArguments:
    """engine.Model's keywords for a target, checked, and the decode cache it keeps."""

    keywords: dict
    cache: Path
    sparse_mode: str
    gpu: str


def _engine_arguments(target: EngineTarget, threads: int | None = None, sparse_mode: str = "dense",
                      ctx_size: int | None = None, recall_check: bool = False, kv_type: str = DEFAULT_KV_TYPE,
                      gpu: str = "auto", vram_budget_gib: float | None = None, input_sparsity: float | None = None,
                      memory_budget_gib: float | None = None, n_seq: int = 1) -> _EngineArguments:
    if gpu not in GPU_MODES:
        raise UserError(f"unknown --gpu {gpu!r} (choose from {', '.join(GPU_MODES)})")
    DEVICE_BUDGET_GIB.check("--vram-budget", vram_budget_gib)
    MEMORY_BUDGET_GIB.check("--memory-budget", memory_budget_gib)
    sparse_mode, input_share = engine_mode(sparse_mode, input_sparsity)
    if kv_type not in KV_TYPES:
        raise UserError(f"unknown --kv-type {kv_type!r} (choose from {', '.join(KV_TYPES)})")
    if threads is not None and threads < 1:
        raise UserError("--threads must be at least 1")
    ctx_size = context_size(target.model, ctx_size)
    cache = decode_cache_path(target.model)
    keywords = dict(threads=threads, sparse_mode=sparse_mode, ctx_size=ctx_size, gpuidx=target.gpuidx,
                    recall_check=recall_check, kv_type=kv_type, gpu=gpu,
                    vram_budget=vram_budget_gib if gpu != "off" else None, input_sparsity=input_share,
                    decode_cache=cache, memory_budget=memory_budget_gib, n_seq=n_seq)
    return _EngineArguments(keywords, cache, sparse_mode, gpu)


def _open(target: EngineTarget, arguments: _EngineArguments):
    import powerinfer_engine as engine

    with engine_errors():
        return engine.Model(target.model, **arguments.keywords)


def _say_opened(target: EngineTarget, arguments: _EngineArguments, model):
    """The model, once its lines are on stderr: weights decoded at load, where its hot tier runs, useless
    predictors."""
    cache, sparse_mode, gpu = arguments.cache, arguments.sparse_mode, arguments.gpu
    if model.info["decoded"].get("cache") in ("read", "written"):
        trim_decode_cache(cache)
    line = decoded_line(model.info["decoded"], cache)
    if line:
        print(f"pi-tools: {line}", file=sys.stderr)
    if model.info["gpu"]["gpuidx_ignored"]:
        print(f"pi-tools: {ignored_gpuidx_line(model.info['gpu'], sparse_mode)}", file=sys.stderr)
    elif target.gpuidx is not None and gpu != "off":
        print(f"pi-tools: {gpu_line(model.info['gpu'])}", file=sys.stderr)
    useless = [i for i, useful in enumerate(model.info.get("predictor_useful", [])) if not useful]
    if sparse_mode == "predictor" and useless:
        print(f"pi-tools: warning: train-predictor found the predictors of layer(s) {', '.join(map(str, useless))} no "
              "better than chance: predictor mode there computes about every neuron or drops them at random "
              "(auto mode leaves them out)", file=sys.stderr)
    return model


DECODE_CACHE_DIR = "decoded"  # under models.default_model.cache_dir()
DECODE_CACHE_BYTES = 16 * 2**30  # the folder's size past which the least recently used files are removed


def decode_cache_path(model: str | os.PathLike) -> Path:
    """The file the engine keeps `model`'s weights decoded at load in (csrc/model/decode_cache.h), in the cache
    directory, one per model path; the engine checks the model's size and modification time recorded inside and
    writes it anew when they changed."""
    import hashlib

    from powerinfer_tools.models.default_model import cache_dir

    folder = cache_dir() / DECODE_CACHE_DIR
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        pass  # the engine then decodes without keeping the rows (info["decoded"]["cache"]: not written)
    key = hashlib.sha256(os.fsencode(Path(model).resolve())).hexdigest()[:32]
    return folder / f"{key}.decoded"


def trim_decode_cache(used: Path, limit: int = DECODE_CACHE_BYTES) -> None:
    """Marks `used` as just used and removes the decode cache's least recently used files until the folder holds
    at most `limit` bytes (never `used` itself): every model a user ever ran leaves a file there, as large as its
    decoded rows. A process that still reads a removed file keeps it until it closes it (POSIX unlink)."""
    try:
        os.utime(used)
        files = [(f.stat().st_mtime, f.stat().st_size, f) for f in used.parent.glob("*.decoded") if f != used]
        total = used.stat().st_size + sum(size for _, size, _ in files)
        for _, size, f in sorted(files):
            if total <= limit:
                break
            f.unlink(missing_ok=True)
            total -= size
    except OSError:
        pass  # a cache folder another process trims at the same time, or a read-only one: the next run tries again


def decoded_line(decoded: dict, cache: Path | None = None) -> str | None:
    """One line saying what the engine decoded at load into a type it computes with, from its info["decoded"]
    (model/decode.h), and where it kept the rows; None when nothing was decoded, or all came from the cache."""
    if not decoded["kinds"] or decoded.get("cache") == "read":
        return None
    parts = [f"transposed {k['tensors']} {k['from']} ffn_down tensors (llama.cpp's layout) to {k['to']} ffn_down_t"
             if k["transposed"] else f"decoded {k['tensors']} {k['from']} tensors to {k['to']}"
             for k in decoded["kinds"]]
    held = sum(k["bytes"] for k in decoded["kinds"]) / 2**20
    stored = sum(k["file_bytes"] for k in decoded["kinds"]) / 2**20
    line = (f"{', '.join(parts)} at load in {decoded['seconds']:.2f} s (+{held:.1f} MiB in memory, {stored:.1f} MiB "
            "in the file)")
    if decoded.get("cache") == "written":
        line += f"; kept in {cache} for the next load"
    elif decoded.get("cache") == "not written":
        line += f"; could not keep them in {cache}: decoded again at every load"
    return line


def ignored_gpuidx_line(gpu: dict, sparse_mode: str) -> str:
    """Why the engine left a GPU index out, from its info["gpu"]: a placement is for a device, and the CPU computes
    its neurons as it does the rest (a hot tier there would compute them whole, the predictor left out)."""
    predictor = ", the predictor choosing them in every layer" if sparse_mode == "predictor" else ""
    return (f"no GPU for the GPU index ({gpu['reason'] or '--gpu off'}): it is ignored, and --sparse-mode "
            f"{sparse_mode} computes every neuron on the CPU{predictor}")


def gpu_line(gpu: dict) -> str:
    """Where the hot tier and the layers' attention run, from the engine's info["gpu"]."""
    if not gpu["used"]:
        return f"hot tier on the CPU: {gpu['reason']}"
    d = gpu["device"]
    n_layer = len(d["layers"])
    attention = (f"attention and KV cache of {d['attention_layers']} of {n_layer} layers"
                 + (f" ({d['attention_reason']})" if d["attention_reason"] else ""))
    return (f"hot tier on {d['name']} (device {d['device']}): {d['layers_on_device']} of {d['hot_layers']} layers, "
            f"{attention}, {d['device_bytes'] / 2**20:.1f} MiB of a {d['budget_bytes'] / 2**30:.2f} GiB budget"
            + ("" if d["layers_on_device"] == d["hot_layers"] else "; the other layers' hot neurons on the CPU")
            + "; by layer (a: attention and KV cache, h: hot rows; upper case on the device): "
            + " ".join(("A" if x["attention"] == "device" else "a") + ("H" if x["hot_rows"] == "device" else "h")
                       for x in d["layers"]))


class EngineFailure(UserError):
    """An engine error as one line; `callers`: whether the caller's arguments caused it (a token id, a full
    context), not the machine or the file (a failed read, memory): a server answers the one 400, the other 500."""

    def __init__(self, message: str, callers: bool):
        super().__init__(message)
        self.callers = callers


@contextlib.contextmanager
def engine_errors():
    """The engine's refusals (a file, an argument out of range) as EngineFailure: one line from the CLI."""
    import powerinfer_engine as engine

    try:
        yield
    except engine.EngineError as exc:
        raise EngineFailure(str(exc), exc.during_a_run_is_the_callers) from None


def load_tokenizer(path: Path):
    from powerinfer_tools.formats.tokenizer import tokenizer_from_file

    return tokenizer_from_file(path)


def window_nll(logits: np.ndarray, ids: np.ndarray) -> float:
    """Summed negative log-likelihood of ids[1:] under logits[:-1] (float64 log-softmax)."""
    z = logits[:-1].astype(np.float64)
    z -= z.max(axis=1, keepdims=True)
    log_norm = np.log(np.exp(z).sum(axis=1))
    return float((log_norm - z[np.arange(len(ids) - 1), ids[1:]]).sum())


def perplexity(model, windows: np.ndarray, progress: bool = True) -> dict:
    """exp(mean NLL) over windows [n, L], every token but each window's first predicted, each window
    evaluated from an empty cache (as transformers' reference does)."""
    from powerinfer_tools.core.progress import progress_bar

    nll, count = 0.0, 0
    bar = progress_bar(windows, desc="perplexity", unit="window", disable=not progress)
    for ids in bar:
        model.reset()
        nll += window_nll(model.eval(ids.tolist()), ids)
        count += len(ids) - 1
        bar.set_postfix(ppl=f"{math.exp(nll / count):.3f}")
    return {"perplexity": math.exp(nll / count), "tokens": int(count), "windows": int(len(windows))}


class StreamDecoder:
    """Turns generated ids into text pieces as they arrive, decoding a short window each time (a token's text
    can depend on the one before it: SentencePiece's word-boundary spaces), so a token costs the same at any
    length; incomplete UTF-8 sequences are held back until they complete."""

    CONTEXT = 6  # tokens decoded before the new ones, for their boundary

    def __init__(self, tokenizer, prompt_ids: list[int]):
        self.tokenizer = tokenizer
        self.ids = list(prompt_ids)
        self.read = len(self.ids)                          # ids before this are printed
        self.prefix = max(0, self.read - self.CONTEXT)     # the window's start

    def _text(self, end: int | None = None) -> str:
        return self.tokenizer.decode(self.ids[self.prefix:end], skip_special_tokens=True)

    @property
    def holding(self) -> bool:
        """True while part of the text is held back (an unfinished UTF-8 sequence)."""
        return self.read != len(self.ids)

    def push(self, token: int) -> str:
        self.ids.append(token)
        before, text = self._text(self.read), self._text()
        if len(text) <= len(before) or text.endswith("\ufffd"):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return text[len(before):]


def sparsity_note(stats: dict, activation: str | None = None) -> str | None:
    """A plain warning when a sparse mode the user asked for found too few inactive neurons to pay for choosing
    them (a SiLU model run with thresholds, above all), saying what to do instead; None in dense mode or when it
    pays. Auto chooses its kernels itself, so it is told only what its choice costs: on a SiLU/GELU model (`activation`,
    the engine's info) the layers it ran through sparse kernels applied the file's activation thresholds."""
    density = stats.get("density")
    if stats["ffn_mode"] == "dense" or density is None:
        return None
    if stats["ffn_mode"] == "auto":
        kernels = [layer.get("decode_mode") for layer in stats.get("layers", []) if layer.get("decode_mode")]
        dense = sum(1 for k in kernels if k and k.startswith("dense"))
        if activation not in THRESHOLDED_ACTIVATIONS or dense == len(kernels):
            return None
        return (f"note: 'auto' ran {dense} of {len(kernels)} layers dense; the other {len(kernels) - dense} through "
                "sparse kernels, at the file's activation thresholds: not the exact model (--sparse-mode dense is)")
    if density <= 1 - ENOUGH_SPARSITY:
        return None
    return (f"note: {density:.0%} of the FFN neurons were active, too many for the sparse modes to save time: "
            "run --sparse-mode dense, or make the model sparse first (a SiLU model: 'pi-tools sparsify', "
            "docs/sparsify.md)")


def decode_kernels(stats: dict) -> str:
    """'dense 28, gate 2': the kernels each layer's last decode step took (gate and auto choose them per layer by
    cost), most used first; '' before any decode step."""
    kernels = Counter(layer["decode_mode"] for layer in stats.get("layers", []) if layer.get("decode_mode"))
    return ", ".join(f"{name} {n}" for name, n in kernels.most_common())


def timing_line(stats: dict, load_seconds: float) -> str:
    """The one line a run ends with: load, prompt and generation speed, and what the FFN computed
    (timing_lines has the whole account, for -v)."""
    def rate(tokens, seconds):
        return f"{tokens / seconds:.1f} tokens/s" if tokens and seconds else "-"

    kernels = decode_kernels(stats)
    ffn = f"ffn {stats['ffn_mode']}" + (f" ({kernels} layers)" if kernels else "")
    return (f"pi-tools: load {load_seconds:.2f} s, prompt {stats['batch_tokens']} tokens at "
            f"{rate(stats['batch_tokens'], stats['batch_seconds'])}, {stats['decode_tokens']} generated at "
            f"{rate(stats['decode_tokens'], stats['decode_seconds'])}; {ffn}")


def timing_lines(stats: dict, load_seconds: float, info: dict | None = None) -> list[str]:
    """llama.cpp's closing timings, plus the FFN density, where the time went and (given the engine's info)
    what the process holds: the mapped file, the KV cache, the work buffers, weights copied to other layouts."""
    def rate(tokens, seconds, unit):
        ms = 1000 * seconds
        line = f"{ms:10.2f} ms / {int(tokens):5d} {unit}"
        if not (tokens and seconds):  # none generated (-n 0): no rate to give
            return line.rstrip()
        return f"{line} ({ms / tokens:8.2f} ms per token, {tokens / seconds:8.2f} tokens per second)"

    phases = stats["phases"]
    total = sum(phases.values()) or 1.0
    share = ", ".join(f"{k} {100 * v / total:.0f}%" for k, v in phases.items())
    density = stats.get("density")
    ffn = f"ffn: mode {stats['ffn_mode']}"
    if density is not None and stats["ffn_mode"] == "dense":
        ffn += f", every neuron computed ({density:.3f} of them pass the activation rule)"
    elif density is not None:
        ffn += f", density {density:.3f} (neurons passing the activation rule)"
    kernels = decode_kernels(stats)
    if kernels:
        ffn += "; layers' decode kernels: " + kernels
    # a one-token prompt runs as a decode step: the engine counts it with the eval line
    prompt = (rate(stats['batch_tokens'], stats['batch_seconds'], 'tokens') if stats['batch_tokens'] else
              "(a one-token prompt runs as one of the eval runs below)")
    lines = [f"llama_print_timings:        load time = {1000 * load_seconds:10.2f} ms",
             f"llama_print_timings: prompt eval time = {prompt}",
             f"llama_print_timings:        eval time = {rate(stats['decode_tokens'], stats['decode_seconds'], 'runs  ')}",
             ffn, f"time: {share}"]
    if stats.get("recall") is not None:
        lines.append(f"predictor recall: {stats['recall']:.4f}")
    inputs = stats.get("input_sparsity")
    if inputs and inputs["share"] > 0:
        line = (f"input sparsity {inputs['share']:g}: {inputs['zeroed'] / max(inputs['inputs'], 1):.3f} of the "
                "matrices' inputs zeroed")
        if stats["decode_tokens"] and inputs["decode_bytes"]:
            per_token = 1 / stats["decode_tokens"] / 2**20
            line += (f"; per generated token {inputs['decode_bytes_skipped'] * per_token:.2f} MiB of "
                     f"{inputs['decode_bytes'] * per_token:.2f} MiB of the rows they select from skipped "
                     f"({inputs['decode_bytes_skipped'] / inputs['decode_bytes']:.3f})")
        lines.append(line)
        if inputs.get("kernels"):  # per site: gemv_columns or gemm8, and why (the probe's best times of each)
            lines.append("input sparsity's decode kernels: " + ", ".join(
                f"{site} {k['kernel']} ({k['why']}"
                + (f", gemv_columns / gemm8: {k['columns_ms']:.3f} / {k['groups_ms']:.3f} ms)" if k["why"] == "probe"
                   else ")")
                for site, k in inputs["kernels"].items()))
    disk = stats.get("disk")
    if disk and disk["tokens"]:
        looked_up = disk["cache_hits"] + disk["cache_misses"]
        per_token = 1 / disk["tokens"]
        tier = "expert tier" if disk.get("kind") == "experts" else "disk tier"  # hits count experts or neurons
        pinned = (f" ({disk['pinned_hits'] / max(looked_up, 1):.2f} on the plan's pinned experts)"
                  if disk.get("tier_plan") and "pinned_hits" in disk else "")
        lines.append(f"{tier}: {disk['reads'] * per_token:.0f} reads and {disk['bytes'] * per_token / 2**20:.2f} "
                     f"MiB a token, {disk['io_wait_seconds'] * per_token * 1000:.2f} ms a token waited for; cache "
                     f"hits {disk['cache_hits'] / max(looked_up, 1):.2f}{pinned}; "
                     f"{disk['resident_bytes'] / 2**20:.1f} MiB held of a {disk['budget_bytes'] / 2**20:.1f} MiB budget"
                     + ("; attention and head mapped from the file (the budget holds no copy)"
                        if disk.get("dense_mapped") else ""))
    gpu = stats.get("gpu")
    if gpu and gpu["tokens"]:
        per_token = gpu["tokens"] / max(1, gpu["layers_on_device"])
        lines.append(f"gpu: {gpu['name']}, hot tier of {gpu['layers_on_device']} layers: "
                     f"{1000 * gpu['device_seconds'] / per_token:.3f} ms per token on the device, "
                     f"{1000 * gpu['wait_seconds'] / per_token:.3f} ms per token waited for after the CPU's tier"
                     + (f"; attention of {gpu['attention_layers']} layers: "
                        f"{1000 * gpu['attention_seconds'] / per_token:.3f} ms per token" if gpu["attention_jobs"] else "")
                     + (f"; split layers (attention and hot rows there, the cold tier here, one crossing each way): "
                        f"{1000 * gpu['split_seconds'] / per_token:.3f} ms per token" if gpu.get("split_jobs") else "")
                     + f"; {(gpu['h2d_bytes'] + gpu['d2h_bytes']) / per_token / 1024:.1f} KiB per token to and from it")
    if gpu and gpu.get("expert_jobs"):  # a mixture's experts on the device
        n = max(1, stats["batch_tokens"] + stats["decode_tokens"])
        lines.append(f"gpu: {gpu['name']}, {gpu['experts_on_device']} experts on the device: "
                     f"{gpu['expert_pairs'] / n:.2f} (token, expert) pairs a token there, {1000 * gpu['expert_seconds'] / n:.3f} ms "
                     f"per token on the device, {1000 * gpu['expert_wait_seconds'] / n:.3f} ms per token waited for "
                     "after the CPU's experts")
    if info is not None:
        def mib(n):
            return f"{n / 2**20:.1f} MiB"

        copies = sum(stats["weight_copies"].values())
        lines.append(f"memory: file {mib(os.path.getsize(info['path']))} mapped, KV cache {mib(info['kv_cache_bytes'])} "
                     f"({info['kv_type']}), work buffers {mib(info['work_buffer_bytes'])}; {mib(copies)} of the weights "
                     "in 8-row groups or other layouts (their mapped pages handed back)")
    return lines
