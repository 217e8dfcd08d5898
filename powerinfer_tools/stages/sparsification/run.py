"""The sparsify run: check the request, read the text, make the ReLU or dReLU student (the source's family with ReLU:
Llama, Mistral, Qwen2, Qwen3, Phi-3, Gemma 3; dReLU: Bamboo, from a Llama), train it (layer_local, then
end_to_end, resumable from a checkpoint), shift its threshold, measure it on held-out text and write it."""
from __future__ import annotations

import contextlib
import copy
import functools
import json
import os
import shutil
from dataclasses import asdict
from pathlib import Path

import torch

from powerinfer_tools import models
from powerinfer_tools.core.atomic import atomic_dir, check_output_dir, output_lock
from powerinfer_tools.core.errors import UserError
from powerinfer_tools.formats.gguf_io import THRESHOLDED_ACTIVATIONS
from powerinfer_tools.models import arch as arch_mod
from powerinfer_tools.models.arch.base import rope_theta
from powerinfer_tools.models.arch.llama_family import LlamaFamily
from powerinfer_tools.runtime import evaluate
from powerinfer_tools.stages.profiling import calibration
from powerinfer_tools.stages.sparsification import data_parallel, threshold_shift
from powerinfer_tools.stages import options as limits
from powerinfer_tools.stages.options import SparsifyOptions
from powerinfer_tools.stages.sparsification import end_to_end, layer_local
from powerinfer_tools.stages.sparsification.student import ACTIVATIONS, StudentForm
from powerinfer_tools.stages.sparsification.state import (Checkpointer, Interrupts, TrainState, check_student,
                                                         load_checkpoint)

FORMAT = "powerinfer-tools.sparsify/1"
REPORT_NAME = "sparsify.json"


def partial_dir(out: Path) -> Path:
    """Where an unfinished sparsify run of `out` keeps its checkpoint until the model is written."""
    return out.parent / f".{out.name}.sparsify.partial"


def _check_options(opts: SparsifyOptions) -> None:
    if opts.self_tokens < 0:
        raise UserError(f"--self-tokens must be >= 0, not {opts.self_tokens}")
    if opts.self_tokens and not opts.calib:
        raise UserError("--self-tokens adds the model's own text to --calib files; without --calib all the text is "
                        "the model's own (give --tokens)")
    if opts.activation not in ACTIVATIONS:
        raise UserError(f"--activation must be {' or '.join(ACTIVATIONS)}, got {opts.activation!r}")
    limits.SHARE.check("--target-sparsity", opts.target_sparsity)
    for name in ("tokens", "local_tokens", "eval_tokens", "batch"):
        if getattr(opts, name) < 0 or (name == "batch" and opts.batch == 0):
            raise UserError(f"--{name.replace('_', '-')} must be positive, got {getattr(opts, name)}")
    limits.SHIFT_BUDGET.check("--shift-budget", opts.shift_budget)
    if opts.seq_len < 2:
        raise UserError(f"--seq-len must be at least 2, got {opts.seq_len}")
    if opts.local_epochs < 0:
        raise UserError(f"--local-epochs must be non-negative, got {opts.local_epochs}")
    limits.LEARNING_RATE.check("--lr", opts.lr)
    limits.LEARNING_RATE.check("--local-lr", opts.local_lr)
    limits.POSITIVE.check("--checkpoint-minutes", opts.checkpoint_minutes)
    if opts.device not in ("auto", "cpu", "cuda"):
        raise UserError(f"--device must be auto, cpu or cuda, got {opts.device!r}")
    if opts.dtype not in ("auto", "float32", "bfloat16"):
        raise UserError(f"--dtype must be auto, float32 or bfloat16, got {opts.dtype!r}")
    if opts.device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda: no CUDA device is available")


def _device_and_dtype(opts: SparsifyOptions) -> tuple[str, torch.dtype]:
    """`auto`: the GPU when there is one; bf16 compute where the GPU has it, f32 on the CPU (weights stay f32)."""
    device = ("cuda" if torch.cuda.is_available() else "cpu") if opts.device == "auto" else opts.device
    if opts.dtype == "auto":
        bf16 = device == "cuda" and torch.cuda.is_bf16_supported()
        return device, torch.bfloat16 if bf16 else torch.float32
    return device, {"float32": torch.float32, "bfloat16": torch.bfloat16}[opts.dtype]


def _check_writable(out: Path) -> None:
    """Refuse an OUT_DIR we could not create before any slow work starts."""
    parent = out.parent if out.parent != Path("") else Path(".")
    probe = parent
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir() or not os.access(probe, os.W_OK | os.X_OK):
        raise UserError(f"cannot write {out}: {probe} is not a writable directory")


def _relu_form(adapter) -> arch_mod.Arch | None:
    """The adapter that reads `adapter`'s model with ReLU in place of its SiLU or GELU (what sparsify writes): its
    family's ReLU variant, or None where the family has none or the model is no gated Llama-family one."""
    if not isinstance(adapter, LlamaFamily) or not adapter.gated or adapter.activation not in THRESHOLDED_ACTIVATIONS:
        return None
    config = copy.deepcopy(adapter.config)
    setattr(config, adapter.act_key, "relu")
    try:
        relu = arch_mod.for_config(config)
    except UserError:
        return None
    return relu if relu.activation == "relu" and relu.powerinfer_arch == adapter.powerinfer_arch else None


def _check_source(adapter, spec: str, activation: str) -> None:
    if adapter.activation in arch_mod.base.ACTIVE_IF_NONZERO:
        raise UserError(f"{spec} is already a {adapter.activation} model ({adapter.description}): its activations "
                        "are sparse as they are; profile it directly")
    if _relu_form(adapter) is None:
        raise UserError(f"sparsify makes ReLU models from gated SiLU or GELU ones of the Llama family (Llama, "
                        f"Mistral, Qwen2, Qwen3, Phi-3, Gemma 3); {spec} is {adapter.description}")
    if activation == "drelu" and adapter.powerinfer_arch != "llama":
        raise UserError(f"--activation drelu writes a Bamboo model, a Llama's layout; {spec} is {adapter.description}: "
                        "use --activation relu")


def _split_data(seqs: torch.Tensor, opts: SparsifyOptions, step_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(training rows, held-out rows): the held-out tail is never trained on; it measures the result."""
    n = len(seqs)
    n_eval = max(1, min(opts.eval_tokens // opts.seq_len, n // 10))
    if n - n_eval < step_rows:
        raise UserError(f"the calibration text gives {n} sequences of {opts.seq_len} tokens; sparsify needs at "
                        f"least {step_rows + 1} (a step's sequences, --batch times the processes, and one held "
                        "out): give more text, or a smaller --seq-len or --batch")
    return seqs[:n - n_eval], seqs[n - n_eval:]


def _calibration_text(tokenizer, opts: SparsifyOptions) -> torch.Tensor | None:
    """The calibration files cut into sequences (None without files: the model will write its own)."""
    if not opts.calib:
        return None
    texts = [calibration.read_text(p) for p in opts.calib]
    return calibration.sequences_from_text(tokenizer, texts, opts.seq_len,
                                           opts.local_tokens + opts.tokens + opts.eval_tokens)


def _self_generated(teacher, tokenizer, opts: SparsifyOptions) -> torch.Tensor:
    print("pi-tools sparsify: no --calib: generating calibration text with the model itself (slow on a CPU)")
    return calibration.self_generated(teacher, tokenizer, opts.seq_len,
                                      opts.local_tokens + opts.tokens + opts.eval_tokens, opts.seed)


def _identity(opts: SparsifyOptions, source, config, processes: int) -> dict:
    # what a resumed run may change: where and how it computes, and the shift that follows the training; not
    # the number of processes, which splits every step's sequences
    keep = {k: v for k, v in asdict(opts).items() if k not in ("out", "force", "resume", "checkpoint_minutes",
                                                               "device", "dtype", "grad_checkpointing",
                                                               "shift_budget")}
    keep["calib"] = [str(Path(p).resolve()) for p in opts.calib]
    keep["model"] = "smollm2" if opts.model == "smollm2" else str(source.path)
    keep["config_hash"] = models.config_hash(config)
    keep["processes"] = processes
    return keep


def _write_config(config_path: Path, config, fields: dict, for_powerinfer: bool) -> None:
    """config.json in the student's form (`fields`), and, for a family PowerInfer knows, the top-level `rope_theta`
    its converters read, which transformers 5 writes under `rope_parameters` only: its convert.py then writes no RoPE
    base (its engine runs 10000 whatever the model's) and its convert-hf-to-powerinfer-gguf.py stops on a KeyError
    (transformers reads `rope_parameters` first)."""
    data = json.loads(config_path.read_text())
    if for_powerinfer:
        data.setdefault("rope_theta", rope_theta(config))
    data.update(fields)
    config_path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def _write_model(student, tokenizer, form: StudentForm, report: dict, out: Path, force: bool) -> None:
    with atomic_dir(out, force) as tmp:
        student.save_pretrained(tmp, safe_serialization=True)
        _write_config(tmp / "config.json", student.config, form.config_fields(report["threshold_shift"]["threshold"]),
                      form.adapter.in_powerinfer)
        tokenizer.save_pretrained(tmp)
        (tmp / REPORT_NAME).write_text(json.dumps(report, indent=2))


def _with_own_text(teacher, tokenizer, split: tuple[torch.Tensor, torch.Tensor] | None, opts: SparsifyOptions,
                   step_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(training rows, held-out rows) with the text the model writes itself: all of it without files (split
    None), else --self-tokens of it added to the files' training rows."""
    if split is None:
        torch.manual_seed(opts.seed)
        return _split_data(_self_generated(teacher, tokenizer, opts), opts, step_rows)
    # text of another kind than the files, in the training rows only: the held-out rows stay the files' tail
    print(f"pi-tools sparsify: generating {opts.self_tokens} tokens of training text with the model itself")
    torch.manual_seed(opts.seed)
    own = calibration.self_generated(teacher, tokenizer, opts.seq_len, opts.self_tokens, opts.seed)
    return torch.cat([split[0], own]), split[1]


def _main_process_state(procs: data_parallel.Processes, state: TrainState, interrupts: Interrupts) -> TrainState:
    """The main process's state after its layer-local phase, on every process. If it stopped there instead (a
    launcher stops all its processes at once), the others' wait ends in a broken connection: the same stop."""
    try:
        return procs.share(state)
    except RuntimeError:
        if interrupts.requested:
            raise KeyboardInterrupt from None
        raise


def _shift(student, adapter, form: StudentForm, rows: torch.Tensor, opts: SparsifyOptions) -> threshold_shift.Shift:
    """The threshold shift, calibrated on training rows (the held-out ones measure the result); for dReLU, whose
    Bamboo form carries no threshold, and for a family whose FATReLU form no stage reads, the unshifted model
    measured on them. `adapter`: the student's."""
    if form.shifts:
        print(f"pi-tools sparsify: shifting the activation threshold (perplexity budget {opts.shift_budget:.1%})",
              flush=True)
        return threshold_shift.calibrate(student, adapter, rows, opts.shift_budget, opts.batch)
    print(f"pi-tools sparsify: no threshold shift ({form.unshifted})", flush=True)
    ppl, sparsity = evaluate.perplexity_and_sparsity(student, adapter, rows, opts.batch)
    mean = sum(sparsity) / len(sparsity)
    return threshold_shift.Shift(threshold=0.0, perplexity_relu=ppl, perplexity_shifted=ppl, sparsity_relu=mean,
                                 sparsity_shifted=mean, tried=[])


def run_sparsify(opts: SparsifyOptions) -> dict | None:
    """Sparsify opts.model into opts.out (a Hugging Face directory); returns what sparsify.json holds. Under
    `accelerate launch` (data_parallel.py) the main process returns it, the others None once they have trained."""
    _check_options(opts)
    check_output_dir(opts.out, opts.force)
    _check_writable(opts.out)
    for p in opts.calib:
        calibration.read_text(p)  # a missing or binary file is refused before the slow load
    source = models.resolve(opts.model)
    config = models.load_config(source)
    _check_source(arch_mod.for_neurons(config), opts.model, opts.activation)
    context = getattr(config, "max_position_embeddings", None)
    if context and opts.seq_len > context:
        raise UserError(f"--seq-len {opts.seq_len} is larger than the model's context length {context}")
    device, compute_dtype = _device_and_dtype(opts)
    procs = data_parallel.Processes(device)
    # one run per output: a second would delete the first's checkpoint (the main process holds it for the run)
    with output_lock(opts.out, wait=False) if procs.is_main else contextlib.nullcontext():
        report = _train_and_write(opts, source, config, procs, compute_dtype)
    procs.finish()
    return report


def _train_and_write(opts: SparsifyOptions, source, config, procs: data_parallel.Processes,
                     compute_dtype: torch.dtype) -> dict | None:
    device, step_rows = procs.device, opts.batch * procs.count
    identity = _identity(opts, source, config, procs.count)
    work = partial_dir(opts.out)
    n_layer = arch_mod.for_config(config).dims().n_layer
    resumed = load_checkpoint(work, identity, n_layer) if opts.resume else None
    tokenizer = models.load_tokenizer(source)
    seqs = _calibration_text(tokenizer, opts)   # a text too short is refused before the slow load
    split = _split_data(seqs, opts, step_rows) if seqs is not None else None
    teacher, adapter = models.load_model(source, device=device)
    for p in teacher.parameters():
        p.requires_grad_(False)
    if split is None or opts.self_tokens:   # sampled once, by the main process
        split = procs.share(_with_own_text(teacher, tokenizer, split, opts, step_rows) if procs.is_main else None)
    train, held_out = split

    form = StudentForm(opts.activation, adapter)
    student, student_adapter = form.make(teacher)
    if resumed is not None:
        check_student(resumed["student"], student, work / "checkpoint.pt")
        student.load_state_dict(resumed["student"])
        state = resumed["state"]
        if procs.is_main:
            print(f"pi-tools sparsify: resuming {opts.out} (phase {state.phase}, layer {state.layer}, "
                  f"step {state.step})")
    else:
        if procs.is_main:
            shutil.rmtree(work, ignore_errors=True)
            work.mkdir(parents=True)
        state = TrainState(lam=[1e-2] * n_layer, scales=[1.0] * n_layer, start_sparsity=[0.0] * n_layer)
    autocast = (functools.partial(torch.autocast, torch.device(device).type, dtype=compute_dtype)
                if compute_dtype != torch.float32 else contextlib.nullcontext)

    with Interrupts(quiet=not procs.is_main) as interrupts:
        checkpointer = Checkpointer(work, identity, opts.checkpoint_minutes, interrupts, state, procs.is_main)
        if state.phase == 1:
            if procs.is_main:   # the others wait; phase 2 then starts them from the main process's weights
                layer_local.train(teacher, student, adapter, form, train, state, resumed, opts, step_rows, device,
                                  autocast, checkpointer)
                checkpointer.save(state, student, None, None)
            state = _main_process_state(procs, state, interrupts)
            resumed = None
        if state.phase == 2:
            end_to_end.train(teacher, student, student_adapter, train, state, resumed, opts, procs, autocast,
                             checkpointer)
        checkpointer.clock(state)
    if not procs.is_main:
        return None

    shift = _shift(student, student_adapter, form, train[:len(held_out)], opts)
    print("pi-tools sparsify: measuring the result on the held-out text", flush=True)
    before = evaluate.perplexity(teacher, adapter, held_out, batch=opts.batch)
    after, sparsity = evaluate.perplexity_and_sparsity(student, student_adapter, held_out, opts.batch)
    report = {
        "format": FORMAT,
        "source": identity["model"],
        "activation": opts.activation,
        "target_sparsity": opts.target_sparsity,
        "sparsity": sum(sparsity) / n_layer,
        "layer_sparsity": sparsity,
        "held_out": {"sequences": len(held_out), "tokens": int(held_out.numel()),
                     "perplexity_original": before, "perplexity_sparsified": after,
                     "perplexity_ratio": after / before},
        "threshold_shift": {"threshold": shift.threshold, "budget": opts.shift_budget if form.shifts else 0.0,
                            "calibration_rows": min(len(train), len(held_out)),
                            "perplexity_relu": shift.perplexity_relu, "perplexity_shifted": shift.perplexity_shifted,
                            "sparsity_relu": shift.sparsity_relu, "sparsity_shifted": shift.sparsity_shifted,
                            "tried": [{"threshold": t, "perplexity": p, "sparsity": z} for t, p, z in shift.tried]},
        "tokens_seen": {"layer_local": min(len(train), opts.local_tokens // opts.seq_len) * opts.seq_len
                        * opts.local_epochs, "end_to_end": state.tokens_seen},
        "train_seconds": state.elapsed,
        "options": {k: v for k, v in identity.items() if k != "config_hash"},
        "device": torch.device(device).type, "compute_dtype": str(compute_dtype).removeprefix("torch."),
        "history": state.history,   # "seconds": training time when the entry was made
    }
    if torch.device(device).type == "cuda":   # this process's, from its start (the others' is the same)
        report["device_memory_peak_bytes"] = torch.cuda.max_memory_allocated(device)
    _write_model(student, tokenizer, form, report, opts.out, opts.force)
    shutil.rmtree(work, ignore_errors=True)
    return report
