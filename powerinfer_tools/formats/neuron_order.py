"""The order a converted file keeps each layer's FFN neurons in: hottest-first blocks, spread over the layer.

An FFN computes the same function whatever the order of its neurons, so the converter may choose one. A sparse
decode step reads the rows of the neurons it uses by index; on a CPU a row read by index costs more than a
streamed one (docs/engine.md), unless its neighbours are read too. Neurons that fire about as often sit
side by side here, so the rows one token uses come in runs: the profile's counts sorted hottest first, cut into
blocks of BLOCK_ROWS neurons. The blocks are then laid out in bit-reversed order of their rank (hottest, median,
quartiles, ...), so that any contiguous share of the layer, which is what one thread of the engine takes, holds
hot and cold blocks alike: all the hot ones at the front would give one thread most of the work. The layout
and what it holds: docs/formats.md, "Neuron order".

The file records the order (ORDER_KEY: for every layer, the source neuron at each position), so that anything
indexed by source neuron (a profile's activation counts) can be mapped to the file's positions
(`in_file_order`); the engine needs nothing from it.
"""
from __future__ import annotations

import base64
from collections.abc import Sequence

import numpy as np

from powerinfer_tools.core.errors import UserError
from powerinfer_tools.formats import names

BLOCK_ROWS = 16
# The order in the file: a string, base64 of little-endian int32 (layer 0's n_ff source indices, then layer
# 1's, ...). A GGUF array would do, but gguf-py parses an array element by element (seconds for a 70B model's
# millions of neurons, on every open); a string is one part.
ORDER_KEY = names.KEY_NEURON_ORDER
# Tensors whose leading axis is the layer's neurons (file layout), and so follow the order.
NEURON_TENSORS = (names.weight(names.FFN_GATE), names.bias(names.FFN_GATE), names.weight(names.FFN_UP),
                  names.bias(names.FFN_UP), names.weight(names.FFN_DOWN_T), names.weight(names.PREDICTOR_FC2))

# Tensors whose columns are the layer's neurons (input sparsity's transposed gate and up: row i = input i).
NEURON_COLUMN_TENSORS = (names.weight(names.FFN_GATE_T), names.weight(names.FFN_UP_T))


def bit_reversed_ranks(n: int) -> np.ndarray:
    """0..n-1 sorted by the binary fraction of each number's reversed bits (0, 1/2, 1/4, 3/4, ...): every
    stretch of the sequence samples the whole range."""
    bits = max(1, (n - 1).bit_length())
    ranks = np.arange(n)
    reversed_bits = np.zeros(n, np.int64)
    for b in range(bits):
        reversed_bits |= ((ranks >> b) & 1) << (bits - 1 - b)
    return ranks[np.argsort(reversed_bits, kind="stable")]


def layer_order(counts: np.ndarray, block_rows: int = BLOCK_ROWS) -> np.ndarray:
    """Source neuron at each file position for one layer: hottest-first blocks in bit-reversed rank order."""
    hottest_first = np.argsort(-np.asarray(counts, np.float64), kind="stable")
    blocks = [hottest_first[i:i + block_rows] for i in range(0, len(hottest_first), block_rows)]
    return np.concatenate([blocks[k] for k in bit_reversed_ranks(len(blocks))]).astype(np.int32)


def orders_from_counts(counts: Sequence[np.ndarray]) -> list[np.ndarray]:
    return [layer_order(c) for c in counts]


def apply(name: str, data: np.ndarray, orders: Sequence[np.ndarray] | None) -> np.ndarray:
    """`data` of file tensor `name` with its neurons in the file's order (unchanged when not neuron-indexed)."""
    if orders is None or not name.startswith("blk."):
        return data
    layer, _, rest = name[4:].partition(".")
    if rest in NEURON_COLUMN_TENSORS:
        return data[:, orders[int(layer)]]
    if rest not in NEURON_TENSORS:
        return data
    return data[orders[int(layer)]]


def encode(orders: Sequence[np.ndarray]) -> str:
    """The value of ORDER_KEY."""
    return base64.b64encode(np.concatenate(orders).astype("<i4").tobytes()).decode("ascii")


def read(path, n_ff: Sequence[int], reader=None) -> list[np.ndarray] | None:
    """The order per layer of model file `path` (None when it keeps the source order), checked to be an order
    of each layer's neurons. `reader`: the file already open (parsing a header again costs seconds)."""
    from powerinfer_tools.formats.gguf_io import field, open_reader

    return decode(path, field(reader if reader is not None else open_reader(path), ORDER_KEY), n_ff)


def decode(path, text: str | None, n_ff: Sequence[int]) -> list[np.ndarray] | None:
    """The order per layer from the value of ORDER_KEY in file `path` (None: the source order), checked."""
    if text is None:
        return None
    try:
        flat = np.frombuffer(base64.b64decode(str(text), validate=True), "<i4").astype(np.int64)
    except (ValueError, TypeError):
        raise UserError(f"{path}: {ORDER_KEY} is not base64 of int32 neuron indices") from None
    if flat.size != int(np.sum(n_ff)):
        raise UserError(f"{path}: {ORDER_KEY} lists {flat.size} neurons, but the model has {int(np.sum(n_ff))}")
    orders, at = [], 0
    for i, n in enumerate(n_ff):
        order = flat[at:at + int(n)]
        if not np.array_equal(np.sort(order), np.arange(int(n))):
            raise UserError(f"{path}: {ORDER_KEY}: layer {i} is not an order of its {int(n)} neurons")
        orders.append(order)
        at += int(n)
    return orders


def in_file_order(values: Sequence[np.ndarray], orders: Sequence[np.ndarray] | None) -> list[np.ndarray]:
    """Per-neuron values indexed by source neuron (a profile's counts), indexed by file position instead."""
    if orders is None:
        return list(values)
    return [np.asarray(v)[o] for v, o in zip(values, orders)]
