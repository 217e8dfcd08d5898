"""Neuron bundles: a converted model's FFN rows again, arranged for reading the cold neurons from disk.

A model larger than the memory it may use keeps a share of its FFN neurons resident and reads the rest when the
predictor selects them (docs/engine.md, "Models larger than memory"). Each neuron's gate, up and down_t rows
are one *bundle*, zero-padded to whole 4 KiB pages, so that a neuron is one aligned read (O_DIRECT-sized) of
bytes the engine computes with as they are; a layer's bundles are stored hottest first by the profile's counts,
so that the neurons a token uses tend to lie side by side and their reads merge.

The bundles live in a sidecar beside the GGUF (model.gguf.neurons, names.NEURON_BUNDLES_SUFFIX), not in it as
extra tensors: the GGUF stays exactly what PowerInfer's binary reads (no second copy of every FFN weight under
names it would have to skip, no change to its size), and a sidecar can be added to, or dropped from, a file
already converted. Each bundle, the header and the index carry a checksum (`checksum`), which the engine checks
on every read. It names the GGUF it was written from: its size and a checksum of its first MiB (another model is
refused at once), and the GGUF's stamp (`stamp`: device, inode, size, modification and change times) when its
bundles were copied. The engine trusts the bundles as the GGUF's FFN rows where that stamp is the GGUF's now, and
otherwise checks every bundle's checksum against the rows the GGUF holds, records the stamp anew where they match
and refuses the sidecar where they do not (csrc/runtime/derived_file.h: touch -r and os.utime set a file's
modification time, never its change time).

Layout (little-endian): a 120-byte header (HEADER, csrc/model/disk_tier.h's BundleHeader), the stamp at
STAMP_OFFSET (STAMP), then the index at INDEX_OFFSET: per layer and file position the neuron stored there (u32,
all layers), its activation frequency (f32: counts / tokens, 0 without a profile) and its bundle's checksum (u64);
then, page-aligned, the bundles, layer after layer, each layer's n_ff in index order.
"""
from __future__ import annotations

import os
import stat
import struct
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from powerinfer_tools.core.errors import UserError
from powerinfer_tools.core.progress import progress_bar
from powerinfer_tools.formats import names
from powerinfer_tools.formats.gguf_header import read_header

VERSION = 2
ALIGN = 4096
IDENTITY_BYTES = 1 << 20  # the GGUF's first MiB: its header and tensor table
# magic, version, gguf_size, gguf_identity, n_layer, n_ff, n_embd, gated, types[3], row_bytes[3], bundle_bytes,
# reserved, index_offset, index_bytes, data_offset, file_size, index_checksum, header_checksum
HEADER = struct.Struct("<4sIQQ4I3I3I2I6Q")
FIELDS = ("magic", "version", "gguf_size", "gguf_identity", "n_layer", "n_ff", "n_embd", "gated", "gate_type",
          "up_type", "down_type", "gate_row_bytes", "up_row_bytes", "down_row_bytes", "bundle_bytes", "reserved",
          "index_offset", "index_bytes", "data_offset", "file_size", "index_checksum", "header_checksum")
STAMP_OFFSET = 128  # disk_tier.h's kStampOffset
STAMP = struct.Struct("<3Q2q")  # dev, ino, size, mtime_ns, ctime_ns: runtime/derived_file.h's SourceStamp
NO_STAMP = (0, 0, 0, 0, 0)
SETTLE_NS = 2_000_000_000  # derived_file.h's kSettleNs: a GGUF changed more recently gets NO_STAMP
INDEX_OFFSET = 192
_GOLDEN = 0x9E3779B97F4A7C15
_MASK = (1 << 64) - 1
assert HEADER.size == 120


def path_for(model: str | os.PathLike) -> Path:
    """The sidecar beside `model`, where the engine looks for it."""
    return Path(str(model) + names.NEURON_BUNDLES_SUFFIX)


def _read_head(path: str | os.PathLike) -> bytes:
    """The header and the stamp (what there is of them), from a regular file only: open(2) of a FIFO would wait."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise UserError(f"{path}: not a regular file")
        return os.pread(fd, STAMP_OFFSET + STAMP.size, 0)
    finally:
        os.close(fd)


def read_layout(path: str | os.PathLike) -> dict:
    """The header's fields by name (FIELDS), unchecked: the engine checks them."""
    raw = _read_head(path)
    if len(raw) < HEADER.size:
        raise UserError(f"{path}: too short for a neuron bundle header")
    return dict(zip(FIELDS, HEADER.unpack(raw[:HEADER.size])))


def current(model: str | os.PathLike) -> bool:
    """Whether the sidecar beside `model` is there, of this version, names it (its size and first MiB) and holds
    its FFN rows, by the engine's rule: the GGUF's stamp as recorded, else every bundle's checksum against the rows
    the GGUF holds now (then the stamp is recorded, where the GGUF has settled). A sidecar that is current may
    still be damaged: the engine finds that out."""
    sidecar = path_for(model)
    if not sidecar.is_file():
        return False
    raw = _read_head(sidecar)
    if len(raw) < STAMP_OFFSET + STAMP.size:
        return False
    layout = dict(zip(FIELDS, HEADER.unpack(raw[:HEADER.size])))
    if (layout["magic"] != names.NEURON_BUNDLES_MAGIC.encode() or layout["version"] != VERSION
            or checksum(raw[:HEADER.size - 8]) != layout["header_checksum"]
            or (layout["gguf_size"], layout["gguf_identity"]) != _identity(model)):
        return False
    source = os.stat(model)  # before its bytes are read, as write() takes it
    recorded = STAMP.unpack(raw[STAMP_OFFSET:])
    if recorded != NO_STAMP and recorded == stamp(source):
        return True
    if not _rows_match(model, sidecar, layout):
        return False
    if _recordable(source) != NO_STAMP:
        try:
            with open(sidecar, "r+b") as f:
                f.seek(STAMP_OFFSET)
                f.write(STAMP.pack(*_recordable(source)))
        except OSError:
            pass  # read-only: the next check reads the rows again
    return True


def stamp(st: os.stat_result) -> tuple[int, int, int, int, int]:
    """A file's stamp as the engine compares it (derived_file.h's SourceStamp)."""
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def _recordable(st: os.stat_result) -> tuple[int, int, int, int, int]:
    """What a sidecar written now records of the GGUF's stamp: none where it changed less than SETTLE_NS ago (a
    change within the same tick of the file system's clock would leave its times as they were)."""
    return stamp(st) if st.st_ctime_ns <= time.time_ns() - SETTLE_NS else NO_STAMP


def _identity(model: str | os.PathLike) -> tuple[int, int]:
    """What a sidecar names its GGUF by: the file's size and the checksum of its first MiB."""
    with open(model, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        return size, checksum(f.read(min(size, IDENTITY_BYTES)))


def checksum(data: bytes | np.ndarray, seed: int = 0) -> int:
    """sum of w_i * (2i + 1) over the little-endian 64-bit words (the last one zero-padded) plus seed times the
    golden ratio's 64-bit fraction, mod 2^64: the engine's bundle_checksum (disk_tier.h)."""
    raw = np.frombuffer(bytes(data) if not isinstance(data, np.ndarray) else data.tobytes(), np.uint8)
    return int(checksum_rows(np.pad(raw, (0, -raw.size % 8))[None, :], np.array([seed], np.uint64))[0])


def checksum_rows(rows: np.ndarray, seeds: np.ndarray) -> np.ndarray:
    """checksum() of each row of a uint8 array whose width is a multiple of 8, with its seed."""
    words = rows.view("<u8")
    weights = 2 * np.arange(words.shape[1], dtype=np.uint64) + np.uint64(1)
    with np.errstate(over="ignore"):
        sums = (words * weights).sum(axis=1, dtype=np.uint64)
        return sums + seeds.astype(np.uint64) * np.uint64(_GOLDEN)


def _ffn_tensors(header, layer: int):
    """gate (up where the FFN is ungated), up (None where ungated) and down_t of a layer, as TensorInfo."""
    by_name = {t.name: t for t in header.tensors}
    get = lambda n: by_name.get(names.layer_tensor(layer, n))  # noqa: E731
    gate, up, down_t = get(names.FFN_GATE), get(names.FFN_UP), get(names.FFN_DOWN_T)
    if up is None or down_t is None:
        missing = names.FFN_UP if up is None else names.FFN_DOWN_T
        raise UserError(f"{header.path}: layer {layer} has no {missing} (neuron bundles need a converted file with "
                        f"{names.FFN_DOWN_T}, one row per neuron)")
    return (gate, up, down_t) if gate is not None else (up, None, down_t)


def _bundles(mapped: np.ndarray, il: int, tensors, row_bytes: Sequence[int], order: np.ndarray,
             bundle: int) -> tuple[np.ndarray, np.ndarray]:
    """Layer il's bundles in `order` from the GGUF's mapped bytes (its FFN tensors, _ffn_tensors), and their
    checksums."""
    block = np.zeros((len(order), bundle), np.uint8)
    at = 0
    for t, rb in zip(tensors, row_bytes):
        if t is None:
            continue
        block[:, at:at + rb] = mapped[t.offset:t.offset + t.n_bytes].reshape(-1, rb)[order]
        at += rb
    seeds = (np.uint64(il) << np.uint64(32)) | np.arange(len(order), dtype=np.uint64)
    return block, checksum_rows(block, seeds)


def _rows_match(model: str | os.PathLike, sidecar: Path, layout: dict) -> bool:
    """Whether every bundle's checksum in the sidecar's index is that of the rows the GGUF holds now (the engine's
    DiskTier::rows_match): that the sidecar was written from these FFN bytes."""
    n_layer, n_ff, bundle = layout["n_layer"], layout["n_ff"], layout["bundle_bytes"]
    types = [layout["gate_type"], layout["up_type"], layout["down_type"]]
    row_bytes = [layout["gate_row_bytes"], layout["up_row_bytes"], layout["down_row_bytes"]]
    if bundle % 8 or bundle < sum(row_bytes) or n_ff == 0:
        return False
    header = read_header(model)
    try:
        layers = [_ffn_tensors(header, i) for i in range(n_layer)]
    except UserError:
        return False
    if any((t is None) != (rb == 0) or (t is not None and (t.type, t.n_bytes) != (ty, n_ff * rb))
           for tensors in layers for t, ty, rb in zip(tensors, types, row_bytes)):
        return False
    count = n_layer * n_ff
    with open(sidecar, "rb") as f:  # a regular file (_read_head)
        f.seek(layout["index_offset"])
        index = f.read(count * 16)
    if len(index) != count * 16:
        return False
    orders = np.frombuffer(index, "<u4", count).reshape(n_layer, n_ff)
    sums = np.frombuffer(index, "<u8", count, offset=count * 8).reshape(n_layer, n_ff)
    if any(not np.array_equal(np.sort(o), np.arange(n_ff)) for o in orders):
        return False
    mapped = np.memmap(model, np.uint8, "r")
    return all(np.array_equal(_bundles(mapped, il, layers[il], row_bytes, orders[il], bundle)[1], sums[il])
               for il in range(n_layer))


def write(model: str | os.PathLike, frequencies: Sequence[np.ndarray] | None = None,
          out: str | os.PathLike | None = None, progress: bool = True,
          orders: Sequence[np.ndarray] | None = None) -> Path:
    """Writes `model`'s neuron bundles beside it (or to `out`): each layer's neurons hottest first by
    `frequencies` (per layer, in the file's neuron order; file order without), or in `orders` (per layer, the
    neurons in the order to store them: scripts/measure_coactivation.py's co-selection order), under a temporary
    name renamed when whole. Returns the path."""
    model = Path(model)
    header = read_header(model)
    arch = header.get(names.KEY_ARCHITECTURE)
    n_layer = header.get(f"{arch}.block_count")
    if not isinstance(n_layer, int) or n_layer <= 0:
        raise UserError(f"{model}: no {arch}.block_count")
    layers = [_ffn_tensors(header, i) for i in range(n_layer)]
    gate0, up0, down0 = layers[0]
    n_ff, n_embd = gate0.shape[0], gate0.shape[1]
    gated = up0 is not None
    kinds = [(t.type, t.n_bytes // n_ff) if t is not None else (0, 0) for t in (gate0, up0, down0)]
    for i, tensors in enumerate(layers):
        if [(t.type, t.n_bytes // n_ff) if t is not None else (0, 0) for t in tensors] != kinds or \
                any(t is not None and (t.shape[0] != n_ff or t.n_bytes % n_ff) for t in tensors):
            raise UserError(f"{model}: layer {i}'s FFN tensors differ in shape or type from layer 0's")
    row_bytes = [rb for _, rb in kinds]
    bundle = -(-sum(row_bytes) // ALIGN) * ALIGN
    if frequencies is not None:
        frequencies = [np.asarray(f, np.float32) for f in frequencies]
        if len(frequencies) != n_layer or any(f.shape != (n_ff,) for f in frequencies):
            raise UserError(f"frequencies for {len(frequencies)} layers do not match {model}'s {n_layer} x {n_ff}")
    else:
        frequencies = [np.zeros(n_ff, np.float32) for _ in range(n_layer)]
    if orders is None:
        orders = [np.argsort(-f, kind="stable") for f in frequencies]
    elif len(orders) != n_layer or any(not np.array_equal(np.sort(o), np.arange(n_ff)) for o in orders):
        raise UserError(f"orders must be {n_layer} permutations of {model}'s {n_ff} neurons")
    orders = [np.asarray(o).astype(np.uint32) for o in orders]

    index_bytes = n_layer * n_ff * 16
    data_offset = -(-(INDEX_OFFSET + index_bytes) // ALIGN) * ALIGN
    file_size = data_offset + n_layer * n_ff * bundle
    source = os.stat(model)  # before its bytes are read: a change after it changes the stamp
    size, identity = _identity(model)

    dest = Path(out) if out is not None else path_for(model)
    tmp = dest.with_name(dest.name + ".tmp")
    sums = np.zeros((n_layer, n_ff), np.uint64)
    try:
        with open(tmp, "wb") as f:
            f.truncate(file_size)
            mapped = np.memmap(model, np.uint8, "r")
            for il in progress_bar(range(n_layer), desc="neuron bundles", unit="layer", disable=not progress):
                block, sums[il] = _bundles(mapped, il, layers[il], row_bytes, orders[il], bundle)
                f.seek(data_offset + il * n_ff * bundle)
                f.write(block.tobytes())
            del mapped
            index = (np.concatenate(orders).astype("<u4").tobytes() +
                     np.concatenate([fr[o] for fr, o in zip(frequencies, orders)]).astype("<f4").tobytes() +
                     sums.astype("<u8").tobytes())
            f.seek(STAMP_OFFSET)
            f.write(STAMP.pack(*_recordable(source)))
            f.seek(INDEX_OFFSET)
            f.write(index)
            fields = [names.NEURON_BUNDLES_MAGIC.encode(), VERSION, size, identity, n_layer, n_ff, n_embd, int(gated),
                      *[int(k) for k, _ in kinds], *row_bytes, bundle, 0, INDEX_OFFSET, index_bytes, data_offset,
                      file_size, checksum(index)]
            head = HEADER.pack(*fields, 0)[:-8]
            f.seek(0)
            f.write(head + struct.pack("<Q", checksum(head)))
        os.replace(tmp, dest)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return dest
