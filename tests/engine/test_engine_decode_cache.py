"""The weights decoded at load (a llama.cpp file's K-quants, q4_1, q5_x, bf16, its ffn_down layout) kept in a
cache file (csrc/model/decode_cache.h): a second open copies them instead of decoding, with the same logits bit
for bit; a cache that is damaged, truncated, or made from another version of the model file (whatever its size and
times say) is never used, and is written anew; a path that is not a regular file is neither read nor replaced."""
from __future__ import annotations

import os
import shutil
import stat
import time

import numpy as np
import pytest
from engine_helpers import converted, replace_keeping_size_and_time, run_with_timeout  # noqa: F401
from test_engine_gguf_types import logits, random_matrices, write_llama

from kquants import Q

N_DECODED = 8  # the embedding, 7 matrices (ffn_down transposed)


SETTLE_SECONDS = 2  # runtime/derived_file.h's kSettleNs: a source changed more recently is checked by its bytes


def write_kquant(path, seed: int) -> str:
    matrices = random_matrices(Q.Q4_K, np.random.default_rng(seed))
    matrices["ffn_down"] = random_matrices(Q.Q6_K, np.random.default_rng(seed + 1))["ffn_down"]
    return write_llama(path, matrices)


@pytest.fixture
def kquant_file(tmp_path):
    return write_kquant(tmp_path / "m.Q4_K_M.gguf", 7)


def test_the_second_open_reads_what_the_first_decoded(kquant_file, tmp_path):
    cache = tmp_path / "m.decoded"
    want, info = logits(kquant_file)
    assert info["decoded"]["cache"] == "off" and not cache.exists()
    first, info = logits(kquant_file, decode_cache=cache)
    assert info["decoded"]["cache"] == "written" and info["decoded"]["from_cache"] == 0 and cache.is_file()
    assert not [p for p in tmp_path.iterdir() if ".tmp." in p.name]  # written under a temporary name, renamed
    written = cache.stat().st_ino
    second, info = logits(kquant_file, decode_cache=cache)
    assert info["decoded"]["cache"] == "read" and info["decoded"]["from_cache"] == N_DECODED
    assert sum(k["tensors"] for k in info["decoded"]["kinds"]) == N_DECODED
    assert cache.stat().st_ino == written  # read, not rewritten (a new file would be renamed into place)
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


@pytest.mark.parametrize("how", ["in place", "renamed over"])
def test_a_model_file_changed_under_the_same_size_and_time_is_decoded_anew(kquant_file, tmp_path, how):
    """Other weights of the same types and shapes (a file of the same size) given the old file's modification time:
    the cache is not the new file's, whatever its size and times say."""
    cache = tmp_path / "m.decoded"
    old, _ = logits(kquant_file, decode_cache=cache)
    replace_keeping_size_and_time(kquant_file, write_kquant(tmp_path / "other.gguf", 11), how)
    want, _ = logits(kquant_file)
    assert not np.array_equal(want, old)
    got, info = logits(kquant_file, decode_cache=cache)
    assert info["decoded"]["cache"] == "written" and info["decoded"]["from_cache"] == 0
    np.testing.assert_array_equal(got, want)
    again, info = logits(kquant_file, decode_cache=cache)
    assert info["decoded"]["cache"] == "read"
    np.testing.assert_array_equal(again, want)


def test_the_same_bytes_under_another_inode_and_times_are_read(kquant_file, tmp_path):
    """A copy of the same file renamed over it (a restore, a second download): its bytes decide, and they match."""
    cache = tmp_path / "m.decoded"
    want, _ = logits(kquant_file, decode_cache=cache)
    shutil.copy(kquant_file, tmp_path / "copy.gguf")
    os.replace(tmp_path / "copy.gguf", kquant_file)
    got, info = logits(kquant_file, decode_cache=cache)
    assert info["decoded"]["cache"] == "read" and info["decoded"]["from_cache"] == N_DECODED
    np.testing.assert_array_equal(got, want)


def test_a_cache_checked_by_its_bytes_records_the_files_stamp_once(kquant_file, tmp_path):
    """A cache written within SETTLE_SECONDS of the model file's last change records no stamp (a change in the same
    tick of the file system's clock would keep its times), so the next load checks the bytes; once the file has
    settled, that check records its stamp in the cache, and later loads trust the stamp and leave the cache as is."""
    cache = tmp_path / "m.decoded"
    os.utime(kquant_file)  # changed now (its change time): the cache written next cannot trust its stamp
    want, _ = logits(kquant_file, decode_cache=cache)
    written = cache.stat().st_mtime_ns
    time.sleep(SETTLE_SECONDS + 0.2)
    got, info = logits(kquant_file, decode_cache=cache)
    assert info["decoded"]["cache"] == "read" and cache.stat().st_mtime_ns != written  # the stamp recorded
    recorded = cache.stat().st_mtime_ns
    again, info = logits(kquant_file, decode_cache=cache)
    assert info["decoded"]["cache"] == "read" and cache.stat().st_mtime_ns == recorded
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(again, want)


OPEN_WITH_CACHE = """
import sys
import powerinfer_engine as engine
with engine.Model(sys.argv[1], threads=1, decode_cache=sys.argv[2]) as m:
    print(m.info["decoded"]["cache"])
"""


def test_a_fifo_at_the_cache_path_is_neither_read_nor_replaced(kquant_file, tmp_path):
    """open(2) of a FIFO waits for a writer: the load must not (a child process, killed if it hangs)."""
    fifo = tmp_path / "m.decoded"
    os.mkfifo(fifo)
    done = run_with_timeout(OPEN_WITH_CACHE, kquant_file, fifo, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "not written"
    assert stat.S_ISFIFO(os.stat(fifo).st_mode) and sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [fifo.name, os.path.basename(kquant_file)])


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
