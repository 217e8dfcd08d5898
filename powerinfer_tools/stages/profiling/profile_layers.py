"""The profile's pass one decoder layer at a time (`pi-tools profile --load layer`; docs/profile.md, "Large models:
layer by layer").

The calibration tokens go through layer 0 in every batch, then through layer 1, and so on: each layer's weights
are read from disk once, and memory holds one layer plus a batch, whatever the model's size. The hidden states
between layers live in files of the profile's work directory (two, written in turn, so the last finished layer's
outputs survive an interrupted one: `--resume` continues at that layer boundary). A thresholded (SiLU/GELU) model
carries a second, dense stream of the first CALIBRATION_TOKENS tokens beside the sparsified one, which places each
layer's threshold exactly where the whole-model profile's dense calibration pass places it.
"""
from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from powerinfer_tools.core.progress import progress_bar
from powerinfer_tools.core.digests import check_file, file_sha256
from powerinfer_tools.core.errors import UserError
from powerinfer_tools.models import arch as arch_mod
from powerinfer_tools.models.layerwise import LayerInputs, LayerwiseModel
from powerinfer_tools.stages.profiling.profile_files import (RESTART, checked_checkpoint, checked_shards, is_position,
                                                   is_thresholds, save_checkpoint)

CHECKPOINT = "layer_checkpoint.pt"


class HiddenFile:
    """Hidden states [n_seq, seq_len, n_embd] in a file, read and written a batch of sequences at a time with
    pread/pwrite: the page cache holds them, not the process, and a file larger than memory works."""

    def __init__(self, path: Path, n_seq: int, seq_len: int, n_embd: int, dtype: torch.dtype):
        self.path, self.shape, self.dtype = path, (n_seq, seq_len, n_embd), dtype
        self.row_bytes = seq_len * n_embd * torch.empty((), dtype=dtype).element_size()
        size = n_seq * self.row_bytes
        if path.exists() and not path.is_file():  # a directory, a FIFO: nothing a profile wrote
            raise UserError(f"{path} is not a regular file: {RESTART}")
        fresh = not path.is_file() or path.stat().st_size != size
        try:
            self.fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise UserError(f"cannot open {path} ({exc.strerror}): {RESTART}") from None
        if fresh:
            try:   # all the disk it needs now, not a failure hours in (macOS has no fallocate: a sparse file)
                getattr(os, "posix_fallocate", lambda fd, _, n: os.ftruncate(fd, n))(self.fd, 0, size)
            except OSError as exc:
                os.close(self.fd)
                path.unlink(missing_ok=True)
                raise UserError(f"no room for the hidden states: {path} needs {size / 2**30:.2f} GiB "
                                f"({exc.strerror})") from None

    def write(self, start: int, hidden: torch.Tensor) -> None:
        data = hidden.detach().to("cpu", self.dtype).contiguous().view(torch.uint8).numpy()
        view, offset = memoryview(data).cast("B"), start * self.row_bytes
        while view:
            done = os.pwrite(self.fd, view, offset)
            view, offset = view[done:], offset + done

    def read(self, start: int, n: int) -> torch.Tensor:
        out = torch.empty((n, *self.shape[1:]), dtype=self.dtype)
        view, offset = memoryview(out.view(torch.uint8).numpy()).cast("B"), start * self.row_bytes
        while view:
            done = os.preadv(self.fd, [view], offset)
            if done == 0:
                raise UserError(f"{self.path} is shorter than its hidden states: delete the profile's work "
                                "directory and start over")
            view, offset = view[done:], offset + done
        return out

    def sync(self) -> None:
        os.fsync(self.fd)

    def close(self) -> None:
        os.close(self.fd)


@dataclass
class Stream:
    """Sequences seqs[:n_seq] going through the layers: their hidden states, the input of layer i in files[i % 2]."""

    n_seq: int
    files: tuple[HiddenFile, HiddenFile]

    def input_of(self, layer: int) -> HiddenFile:
        return self.files[layer % 2]

    def output_of(self, layer: int) -> HiddenFile:
        return self.files[(layer + 1) % 2]


def _open_stream(work: Path, name: str, n_seq: int, seq_len: int, n_embd: int, dtype: torch.dtype) -> Stream:
    first = HiddenFile(work / f"{name}_0.bin", n_seq, seq_len, n_embd, dtype)
    try:
        return Stream(n_seq, (first, HiddenFile(work / f"{name}_1.bin", n_seq, seq_len, n_embd, dtype)))
    except BaseException:
        first.close()
        raise


def _batches(n_seq: int, batch: int) -> list[tuple[int, int]]:
    return [(start, min(batch, n_seq - start)) for start in range(0, n_seq, batch)]


def _capture(lw: LayerwiseModel, seqs: torch.Tensor, batch: int, streams: list[Stream],
             write: bool) -> dict[int, LayerInputs]:
    """The first layer's arguments per batch size (they depend on the shape only: positions, masks, rotary tables);
    with `write`, the embeddings of every sequence into each stream's layer-0 file."""
    kwargs: dict[int, LayerInputs] = {}
    spans = _batches(len(seqs), batch)
    if not write:   # a resumed run: the arguments of each batch size, not the hidden states
        spans = list({n: (start, n) for start, n in spans}.values())
    for (start, n), caught in zip(spans, lw.capture(seqs[start:start + n] for start, n in spans)):
        kwargs.setdefault(n, LayerInputs(torch.empty(0), caught.args, caught.kwargs))
        if write:
            for stream in streams:
                if start < stream.n_seq:
                    stream.input_of(0).write(start, caught.hidden[:stream.n_seq - start])
    return kwargs


def _run_stream(lw: LayerwiseModel, i: int, stream: Stream, batch: int, arguments: dict[int, LayerInputs],
                before=None, write: bool = True, bar=None) -> None:
    """Layer i over every batch of the stream: inputs from its file, outputs to the other (unless `write` is off:
    the last layer's outputs feed nothing)."""
    for n_batch, (start, n) in enumerate(_batches(stream.n_seq, batch)):
        if before is not None:
            before(n_batch, start, n)
        shape_args = arguments[n]
        hidden = stream.input_of(i).read(start, n).to(lw.device)
        out = lw.run_layer(i, LayerInputs(hidden, shape_args.args, shape_args.kwargs))
        if write:
            stream.output_of(i).write(start, out)
        if bar is not None:
            bar.update(n * hidden.shape[1])


def resume_point(path: Path, n_layer: int, n_ff: int) -> dict:
    """The checkpoint at `path` (written after a layer), checked, with every file the next layer continues from:
    the shards of the layers done and the next layer's input hidden states, each against its digest. Returns
    next_layer, the thresholds placed so far and the recorder's state."""
    state = checked_checkpoint(path, n_layer, n_ff, ("next_layer", "thresholds", "hidden"))
    next_layer, thresholds, hidden = state.pop("next_layer"), state.pop("thresholds"), state.pop("hidden")
    if not is_position(next_layer, 1, n_layer) or not is_thresholds(thresholds, n_layer) \
            or not isinstance(hidden, dict) or not all(isinstance(v, str) for v in hidden.values()):
        raise UserError(f"{path} does not hold a layer and finite thresholds of this model: {RESTART}")
    next_layer = int(next_layer)
    checked_shards(path, state, range(next_layer))
    if next_layer < n_layer:   # the inputs of the next layer: the last one finished wrote them
        names = [f"{stream}_{next_layer % 2}.bin" for stream in ("hidden", "dense")]
        if names[0] not in hidden:
            raise UserError(f"{path} records no checksum for {names[0]}: {RESTART}")
        for name in names:
            if name in hidden:
                check_file(path.parent / name, hidden[name], RESTART)
    return {"next_layer": next_layer, "thresholds": thresholds.tolist(), "state": state}


def streamed_pass(lw: LayerwiseModel, adapter, seqs: torch.Tensor, targets: list[float] | None, batch: int,
                  chosen: np.ndarray, work: Path, rec, sampler, next_layer: int,
                  thresholds: list[float]) -> tuple[list[float], float, int]:
    """Every layer from `next_layer` on over all sequences, recording into `rec` (profiling._Recorder) and, for a
    thresholded model, placing each layer's threshold with `sampler` (profiling.ThresholdSampler) on the dense stream
    first; `thresholds` are those of the layers before.

    Returns (thresholds, seconds, layers run now). A checkpoint after each layer (resume_point) lets a resumed run
    start at the next."""
    n_seq, seq_len = seqs.shape
    n_layer, n_embd = adapter.dims().n_layer, adapter.dims().n_embd
    thresholds = list(thresholds)
    for j in range(next_layer, n_layer):   # rows a layer wrote after the last checkpoint
        shutil.rmtree(work / "samples" / f"layer_{j}", ignore_errors=True)
    rec.thresholds = thresholds
    streams: list[Stream] = []
    t0 = time.perf_counter()
    try:
        streams.append(_open_stream(work, "hidden", n_seq, seq_len, n_embd, lw.dtype))
        if targets is not None:
            streams.append(_open_stream(work, "dense", sampler.n_seq, seq_len, n_embd, lw.dtype))
        main, dense = streams[0], (streams[1] if targets is not None else None)
        arguments = _capture(lw, seqs, batch, streams, write=next_layer == 0)
        with progress_bar(total=n_layer, initial=next_layer, desc="profiling layers", unit="layer") as layer_bar:
            for i in range(next_layer, n_layer):
                _profile_layer(lw, i, main, dense, seqs, batch, chosen, arguments, rec, sampler, targets,
                               last=i == n_layer - 1)
                hidden = {}
                for stream in streams:
                    stream.output_of(i).sync()
                    if i + 1 < n_layer:
                        hidden[stream.output_of(i).path.name] = file_sha256(stream.output_of(i).path)
                save_checkpoint(work / CHECKPOINT, {**rec.state(), "next_layer": torch.tensor(i + 1),
                                                    "thresholds": torch.tensor(rec.thresholds, dtype=torch.float64),
                                                    "hidden": hidden})
                layer_bar.update(1)
    finally:
        for stream in streams:
            for f in stream.files:
                f.close()
    elapsed = time.perf_counter() - t0
    return rec.thresholds, elapsed, n_layer - next_layer


def _profile_layer(lw: LayerwiseModel, i: int, main: Stream, dense: Stream | None, seqs: torch.Tensor, batch: int,
                   chosen: np.ndarray, arguments: dict[int, LayerInputs], rec, sampler, targets, last: bool) -> None:
    """Load layer i, place its threshold on the dense stream (thresholded models), run the sparsified stream through
    it recording counts and rows, free it."""
    seq_len = seqs.shape[1]
    layer = lw.load_layer(i)
    try:
        with progress_bar(total=(main.n_seq + (dense.n_seq if dense else 0)) * seq_len, desc=f"layer {i}", unit="tok",
                          unit_scale=True, leave=False) as bar:
            if dense is not None:
                current = {"batch": 0}

                def sample(_, a):
                    sampler.add(i, current["batch"], a)

                def set_batch(n_batch, start, n):
                    current["batch"] = n_batch

                handles = _taps(lw.adapter, layer, on_activation=sample)
                try:
                    _run_stream(lw, i, dense, batch, arguments, before=set_batch, write=not last, bar=bar)
                finally:
                    for h in handles:
                        h.remove()
                rec.thresholds[i] = sampler.threshold(i, targets[i])

            def pick(n_batch, start, n):
                rec.select_rows(chosen, start, n, seq_len)

            handles = _taps(lw.adapter, layer, on_input=lambda _, x: rec.on_input(i, x),
                            on_activation=lambda _, a: rec.on_activation(i, a))
            try:
                _run_stream(lw, i, main, batch, arguments, before=pick, write=not last, bar=bar)
            finally:
                for h in handles:
                    h.remove()
            rec.flush(i)
    finally:
        lw.free_layer(i)


def _taps(adapter, layer, on_input=None, on_activation=None) -> list:
    """arch.install_taps on one layer alone (the others are meta tensors and never run)."""
    return arch_mod.install_taps(_OneLayer(adapter, layer), None, on_input=on_input, on_activation=on_activation)


class _OneLayer:
    """The adapter's hook points for a model of exactly one layer."""

    def __init__(self, adapter, layer):
        self.adapter, self.layer = adapter, layer

    def layers(self, model):
        return [self.layer]

    def activation_module(self, layer):
        return self.adapter.activation_module(layer)

    def predictor_input_module(self, layer):
        return self.adapter.predictor_input_module(layer)
