"""Neuron bundles: a converted model's FFN rows again, arranged for reading the cold neurons from disk.

A model larger than the memory it may use keeps a share of its FFN neurons resident and reads the rest when the
predictor selects them (docs/engine.md, "Models larger than memory"). Each neuron's gate, up and down_t rows
are one *bundle*, zero-padded to whole 4 KiB pages, so that a neuron is one aligned read (O_DIRECT-sized) of
bytes the engine computes with as they are; a layer's bundles are stored hottest first by the profile's counts,
so that the neurons a token uses tend to lie side by side and their reads merge.

The bundles live in a sidecar beside the GGUF (model.gguf.neurons, names.NEURON_BUNDLES_SUFFIX), not in it as
extra tensors: the GGUF stays exactly what PowerInfer's binary reads (no second copy of every FFN weight under
names it would have to skip, no change to its size), and a sidecar can be added to, or dropped from, a file
already converted. It names the GGUF it was written from (its size and a checksum of its first MiB), and each
bundle, the header and the index carry a checksum (`checksum`), which the engine checks on every read.

Layout (little-endian): a 120-byte header (HEADER, csrc/model/disk_tier.h's BundleHeader), then the index at
INDEX_OFFSET: per layer and file position the neuron stored there (u32, all layers), its activation frequency
(f32: counts / tokens, 0 without a profile) and its bundle's checksum (u64); then, page-aligned, the bundles,
layer after layer, each layer's n_ff in index order.
"""
from __future__ import annotations

import os
import struct
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from powerinfer_tools.core.errors import UserError
from powerinfer_tools.core.progress import progress_bar
from powerinfer_tools.formats import names
from powerinfer_tools.formats.gguf_header import read_header

VERSION = 1
ALIGN = 4096
IDENTITY_BYTES = 1 << 20  # the GGUF's first MiB: its header and tensor table
# magic, version, gguf_size, gguf_identity, n_layer, n_ff, n_embd, gated, types[3], row_bytes[3], bundle_bytes,
# reserved, index_offset, index_bytes, data_offset, file_size, index_checksum, header_checksum
HEADER = struct.Struct("<4sIQQ4I3I3I2I6Q")
FIELDS = ("magic", "version", "gguf_size", "gguf_identity", "n_layer", "n_ff", "n_embd", "gated", "gate_type",
          "up_type", "down_type", "gate_row_bytes", "up_row_bytes", "down_row_bytes", "bundle_bytes", "reserved",
          "index_offset", "index_bytes", "data_offset", "file_size", "index_checksum", "header_checksum")
INDEX_OFFSET = 128
_GOLDEN = 0x9E3779B97F4A7C15
_MASK = (1 << 64) - 1
assert HEADER.size == 120


def path_for(model: str | os.PathLike) -> Path:
    """The sidecar beside `model`, where the engine looks for it."""
    return Path(str(model) + names.NEURON_BUNDLES_SUFFIX)


def read_layout(path: str | os.PathLike) -> dict:
    """The header's fields by name (FIELDS), unchecked: the engine checks them."""
    with open(path, "rb") as f:
        raw = f.read(HEADER.size)
    if len(raw) < HEADER.size:
        raise UserError(f"{path}: too short for a neuron bundle header")
    return dict(zip(FIELDS, HEADER.unpack(raw)))


def current(model: str | os.PathLike) -> bool:
    """Whether the sidecar beside `model` is there and names it (its size and first MiB): what the engine checks
    first. A sidecar that is current by this test may still be damaged; the engine finds that out."""
    sidecar = path_for(model)
    if not sidecar.is_file() or sidecar.stat().st_size < HEADER.size:
        return False
    layout = read_layout(sidecar)
    return (layout["magic"] == names.NEURON_BUNDLES_MAGIC.encode()
            and (layout["gguf_size"], layout["gguf_identity"]) == _identity(model))


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
    size, identity = _identity(model)

    dest = Path(out) if out is not None else path_for(model)
    tmp = dest.with_name(dest.name + ".tmp")
    sums = np.zeros((n_layer, n_ff), np.uint64)
    try:
        with open(tmp, "wb") as f:
            f.truncate(file_size)
            mapped = np.memmap(model, np.uint8, "r")
            for il in progress_bar(range(n_layer), desc="neuron bundles", unit="layer", disable=not progress):
                block = np.zeros((n_ff, bundle), np.uint8)
                at = 0
                for t, rb in zip(layers[il], row_bytes):
                    if t is None:
                        continue
                    rows = mapped[t.offset:t.offset + t.n_bytes].reshape(n_ff, rb)
                    block[:, at:at + rb] = rows[orders[il]]
                    at += rb
                seeds = (np.uint64(il) << np.uint64(32)) | np.arange(n_ff, dtype=np.uint64)
                sums[il] = checksum_rows(block, seeds)
                f.seek(data_offset + il * n_ff * bundle)
                f.write(block.tobytes())
            del mapped
            index = (np.concatenate(orders).astype("<u4").tobytes() +
                     np.concatenate([fr[o] for fr, o in zip(frequencies, orders)]).astype("<f4").tobytes() +
                     sums.astype("<u8").tobytes())
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
