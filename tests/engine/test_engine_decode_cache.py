"""The weights decoded at load (a llama.cpp file's K-quants, q4_1, q5_x, bf16, its ffn_down layout) kept in a
cache file (csrc/model/decode_cache.h): a second open copies them instead of decoding, with the same logits bit
for bit; a cache that is damaged, truncated, or made from another version of the model file is never used, and is
written anew."""
from __future__ import annotations

import os

import numpy as np
import pytest
from engine_helpers import converted  # noqa: F401
from test_engine_gguf_types import logits, random_matrices, write_llama

from kquants import Q

N_DECODED = 8  # the embedding, 7 matrices (ffn_down transposed)


@pytest.fixture
def kquant_file(tmp_path):
    matrices = random_matrices(Q.Q4_K, np.random.default_rng(7))
    matrices["ffn_down"] = random_matrices(Q.Q6_K, np.random.default_rng(8))["ffn_down"]
    return write_llama(tmp_path / "m.Q4_K_M.gguf", matrices)


def test_the_second_open_reads_what_the_first_decoded(kquant_file, tmp_path):
    cache = tmp_path / "m.decoded"
    want, info = logits(kquant_file)
    assert info["decoded"]["cache"] == "off" and not cache.exists()
    first, info = logits(kquant_file, decode_cache=cache)
    assert info["decoded"]["cache"] == "written" and info["decoded"]["from_cache"] == 0 and cache.is_file()
    assert not [p for p in tmp_path.iterdir() if ".tmp." in p.name]  # written under a temporary name, renamed
    written = cache.stat().st_mtime_ns
    second, info = logits(kquant_file, decode_cache=cache)
    assert info["decoded"]["cache"] == "read" and info["decoded"]["from_cache"] == N_DECODED
    assert sum(k["tensors"] for k in info["decoded"]["kinds"]) == N_DECODED
    assert cache.stat().st_mtime_ns == written  # read, not rewritten
    np.testing.assert_array_equal(first, want)
    np.testing.assert_array_equal(second, want)


def _flip(at):
    def damage(cache):
        data = bytearray(cache.read_bytes())
        data[at(len(data))] ^= 0x10
        cache.write_bytes(bytes(data))
    return damage


@pytest.mark.parametrize("damage", [
    _flip(lambda n: 100),             # a weight byte: its tensor's checksum
    _flip(lambda n: n - 3),           # the index's offset
    _flip(lambda n: 2),               # the magic
    lambda c: c.write_bytes(c.read_bytes()[: c.stat().st_size // 2]),  # truncated
    lambda c: c.write_bytes(b""),
], ids=["weight byte", "index offset", "magic", "truncated", "empty"])
def test_a_damaged_cache_is_never_used_and_is_rebuilt(kquant_file, tmp_path, damage):
    cache = tmp_path / "m.decoded"
    want, _ = logits(kquant_file, decode_cache=cache)
    damage(cache)
    got, info = logits(kquant_file, decode_cache=cache)
    assert info["decoded"]["cache"] == "written" and info["decoded"]["from_cache"] == 0
    np.testing.assert_array_equal(got, want)
    _, info = logits(kquant_file, decode_cache=cache)
    assert info["decoded"]["cache"] == "read"


def test_a_cache_of_another_version_of_the_file_is_rebuilt(kquant_file, tmp_path):
    cache = tmp_path / "m.decoded"
    logits(kquant_file, decode_cache=cache)
    # the model file replaced by another at the same path: its size and modification time are not the cache's
    other = write_llama(tmp_path / "other.gguf", random_matrices(Q.Q4_K, np.random.default_rng(9)))
    os.replace(other, kquant_file)
    want, _ = logits(kquant_file)
    got, info = logits(kquant_file, decode_cache=cache)
    assert info["decoded"]["cache"] == "written"
    np.testing.assert_array_equal(got, want)


def test_an_unwritable_cache_costs_only_the_caching(kquant_file, tmp_path):
    cache = tmp_path / "no such folder" / "m.decoded"
    want, _ = logits(kquant_file)
    got, info = logits(kquant_file, decode_cache=cache)
    assert info["decoded"]["cache"] == "not written" and not cache.parent.exists()
    np.testing.assert_array_equal(got, want)


def test_a_file_that_decodes_nothing_leaves_no_cache(converted, tmp_path):  # noqa: F811
    cache = tmp_path / "m.decoded"
    _, info = logits(converted("llama-silu"), decode_cache=cache)
    assert info["decoded"]["cache"] == "off" and not cache.exists() and list(tmp_path.iterdir()) == []
