"""The disk tier (docs/engine.md, "Models larger than memory"): under a memory budget the cold neurons come from the
neuron bundles beside the file, and the logits are the same bits as with every row mapped (a decode step computes
each read's neurons as it arrives, and its down projection after, in the mapped run's order; reads merged across
short gaps bring more bytes, not other results); a damaged, truncated or foreign sidecar and a budget below what the
engine must hold are refused in one line, as is the sidecar of a GGUF whose FFN rows changed since (whatever its
size and times say) and a sidecar path that is not a regular file."""
from __future__ import annotations

import os
import shutil
import time

import numpy as np
import pytest
from cli_helpers import assert_one_line_error, run_cli
from convert_helpers import write_predictors
from engine_helpers import converted, random_tokens, replace_keeping_size_and_time, run_with_timeout  # noqa: F401
from tiny_models import HIDDEN, N_FF, N_LAYER, RELU_FAMILY_KINDS, make_tiny

import powerinfer_engine as engine
from powerinfer_tools.core.errors import UserError
from powerinfer_tools.formats import neuron_bundles
from powerinfer_tools.formats.gguf_header import read_header
from powerinfer_tools.stages.conversion.conversion import convert_model

MERGE_GAP_BYTES = 4 << 10  # csrc/model/disk_tier.cpp's kMergeGapBytes
KEYS = {"tokens", "bytes", "reads", "cache_hits", "cache_misses", "io_wait_seconds", "resident_bytes", "budget_bytes",
        "resident_room_bytes", "resident_neurons", "tier_plan", "dense_mapped"}


@pytest.fixture(params=["q4_0", "f32"])
def bundled(request, converted, tmp_path):  # noqa: F811
    """A copy of the tiny ReLU llama with predictors, its bundles written beside it (random frequencies: the resident
    share is some of each layer), and the engine's fixed bytes at these options (what the budget holds besides the
    bundles), measured from a budget large enough to cache every bundle."""
    model = tmp_path / "m.gguf"
    shutil.copy(converted("llama-relu", request.param, predictors=True), model)
    rng = np.random.default_rng(0)
    sidecar = neuron_bundles.write(model, frequencies=[rng.random(N_FF) for _ in range(N_LAYER)])
    with engine.Model(model, threads=2, sparse_mode="predictor", ctx_size=128, memory_budget=64) as m:
        disk = m.stats()["disk"]
    bundle = neuron_bundles.read_layout(sidecar)["bundle_bytes"]
    return model, sidecar, disk["resident_bytes"] - N_LAYER * N_FF * bundle, bundle


def decode(model, mode: str, budget_bytes: float | None = None, threads: int = 2):
    """Logits of a 7-token prompt, then of 20 decode steps; and the stats."""
    tokens = random_tokens(27, 384, seed=3)
    kwargs = {} if budget_bytes is None else {"memory_budget": budget_bytes / 2**30}
    with engine.Model(model, threads=threads, sparse_mode=mode, ctx_size=128, **kwargs) as m:
        rows = [m.eval(tokens[:7])[-1]] + [m.eval([t])[-1] for t in tokens[7:]]
        return np.array(rows), m.stats()


@pytest.mark.parametrize("mode", ["predictor", "dense", "gate", "oracle", "auto"])
@pytest.mark.parametrize("layers_resident", [0.0, 0.5])
def test_decode_from_disk_equals_decode_with_every_row_mapped(bundled, mode, layers_resident):
    model, _, fixed, bundle = bundled
    mapped, stats = decode(model, mode)
    assert stats["disk"] is None
    # a cache of one layer (the least the tier takes), and a resident share of half a layer or none: every decode
    # step reads some neurons, and the cache evicts (it holds half the model)
    budget = fixed + (1 + layers_resident) * N_FF * bundle + 1024
    tiered, stats = decode(model, mode, budget)
    assert np.array_equal(tiered, mapped)
    disk = stats["disk"]
    assert set(disk) == KEYS and disk["tokens"] == 20 and disk["budget_bytes"] <= budget
    assert disk["resident_bytes"] == pytest.approx(fixed + (1 + layers_resident) * N_FF * bundle, abs=bundle)
    assert 0 < disk["reads"] <= disk["cache_misses"] and disk["io_wait_seconds"] > 0
    assert_merged_bytes(disk, bundle)


def assert_merged_bytes(disk: dict, bundle: int) -> None:
    """Every missing bundle is read once, and each read saved by merging two across a gap brings at most the gap."""
    merges = disk["cache_misses"] - disk["reads"]
    most = disk["cache_misses"] + MERGE_GAP_BYTES // bundle * merges
    assert disk["cache_misses"] * bundle <= disk["bytes"] <= most * bundle


def test_reads_merged_across_gaps_change_the_bytes_not_the_logits(bundled):
    """With half a layer resident at random frequencies the missing neurons are scattered: some reads span a gap
    (bundles in memory read again and dropped, or missing ones read into the cache), and the logits stay the same."""
    model, _, fixed, bundle = bundled
    mapped, _ = decode(model, "predictor")
    tiered, stats = decode(model, "predictor", fixed + 1.5 * N_FF * bundle + 1024)
    disk = stats["disk"]
    assert np.array_equal(tiered, mapped)
    assert disk["bytes"] > disk["cache_misses"] * bundle and disk["reads"] < disk["cache_misses"]
    assert_merged_bytes(disk, bundle)


def test_the_same_bits_on_one_thread(bundled):
    model, _, fixed, bundle = bundled
    assert np.array_equal(decode(model, "predictor", fixed + N_FF * bundle + 1024, threads=1)[0],
                          decode(model, "predictor", threads=1)[0])


def packed_bytes(model) -> int:
    """The packed copy of the matrices every token reads whole (attention's, the head, fc1), without a disk tier."""
    with engine.Model(model, threads=2, sparse_mode="predictor", ctx_size=128) as m:
        return m.stats()["weight_copies"]["packed"]


def test_a_budget_that_cannot_hold_the_packed_matrices_keeps_them_mapped(bundled):
    model, _, fixed, bundle = bundled
    packed = packed_bytes(model)
    if not packed:
        pytest.skip("f32 matrices are read as rows: nothing is packed")
    mapped, stats = decode(model, "predictor")
    assert stats["weight_copies"]["packed"] == packed
    # room for one layer's cache beside everything but the packed copy: the tier keeps attention and head mapped
    budget = fixed - packed + N_FF * bundle + 1024
    tiered, stats = decode(model, "predictor", budget)
    disk = stats["disk"]
    assert disk["dense_mapped"] and stats["weight_copies"]["packed"] == 0
    assert disk["resident_bytes"] <= disk["budget_bytes"] <= budget
    # the matrices' rows read one at a time rather than in groups: the same products, summed in another order
    np.testing.assert_allclose(tiered, mapped, rtol=1e-4, atol=1e-4 * np.abs(mapped).max())
    assert np.array_equal(tiered.argmax(-1), mapped.argmax(-1))
    # with room for the copy, it is made
    assert not decode(model, "predictor", fixed + N_FF * bundle + 1024)[1]["disk"]["dense_mapped"]


def test_a_budget_below_what_the_engine_holds_names_the_sizes(bundled):
    model, _, fixed, bundle = bundled
    with pytest.raises(engine.EngineError) as e:  # below the cache and what the engine holds with nothing packed
        decode(model, "predictor", fixed - packed_bytes(model) + N_FF * bundle // 2)
    msg = str(e.value)
    assert "\n" not in msg and "memory budget of" in msg and "MiB" in msg and "neuron bundles" in msg


def _flip(path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x10
    path.write_bytes(bytes(data))


def test_a_damaged_bundle_is_one_line_at_the_read(bundled):
    model, sidecar, fixed, bundle = bundled
    data_offset = neuron_bundles.read_layout(sidecar)["data_offset"]
    _flip(sidecar, data_offset + 5 * bundle + 7)  # layer 0's sixth bundle
    with pytest.raises(engine.EngineError) as e:
        decode(model, "predictor", fixed + N_FF * bundle + 1024)
    assert "\n" not in str(e.value) and "layer 0" in str(e.value) and "damaged" in str(e.value)


def test_bundles_in_another_order_decode_the_same_bits(bundled):
    """An order of the caller's (scripts/measure_coactivation.py's co-selection order) moves bundles on disk, and with
    them which neurons share a read, not the logits; an order that is not a permutation is refused."""
    model, sidecar, fixed, bundle = bundled
    mapped, _ = decode(model, "predictor")
    rng = np.random.default_rng(1)
    neuron_bundles.write(model, orders=[rng.permutation(N_FF) for _ in range(N_LAYER)], progress=False)
    tiered, stats = decode(model, "predictor", fixed + 1.5 * N_FF * bundle + 1024)
    assert np.array_equal(tiered, mapped) and stats["disk"]["cache_misses"] > 0
    with pytest.raises(UserError, match="permutations"):
        neuron_bundles.write(model, orders=[np.zeros(N_FF, int)] * N_LAYER, progress=False)


def test_a_damaged_bundle_read_by_a_decode_step_is_one_line(bundled):
    """Decode steps only (no prompt batch reads the layer whole first): the last layer's selected neurons are read
    and computed as they arrive, and a damaged one fails the step in one line."""
    model, sidecar, fixed, bundle = bundled
    data_offset = neuron_bundles.read_layout(sidecar)["data_offset"]
    data = bytearray(sidecar.read_bytes())
    for j in range(N_FF):
        data[data_offset + ((N_LAYER - 1) * N_FF + j) * bundle + 7] ^= 0x10
    sidecar.write_bytes(bytes(data))
    with engine.Model(model, threads=2, sparse_mode="predictor", ctx_size=128,
                      memory_budget=(fixed + N_FF * bundle + 1024) / 2**30) as m:
        with pytest.raises(engine.EngineError) as e:
            for t in random_tokens(8, 384, seed=5):
                m.eval([t])
    msg = str(e.value)
    assert "\n" not in msg and f"layer {N_LAYER - 1}" in msg and "damaged" in msg


@pytest.mark.parametrize("damage,message", [
    ("truncate", "truncated"),
    ("header", "header is damaged"),
    ("index", "index is damaged"),
    ("magic", "not a neuron bundle file"),
])
def test_a_damaged_or_truncated_sidecar_is_one_line_at_open(bundled, damage, message):
    model, sidecar, fixed, bundle = bundled
    if damage == "truncate":
        with open(sidecar, "r+b") as f:
            f.truncate(sidecar.stat().st_size - bundle)
    elif damage == "header":
        _flip(sidecar, 30)
    elif damage == "index":
        _flip(sidecar, neuron_bundles.INDEX_OFFSET + 3)
    else:
        _flip(sidecar, 0)
    with pytest.raises(engine.EngineError, match=message) as e:
        decode(model, "predictor", fixed + N_FF * bundle + 1024)
    assert "\n" not in str(e.value)


def test_another_models_sidecar_is_refused(bundled, converted, tmp_path):  # noqa: F811
    model, sidecar, fixed, bundle = bundled
    other = tmp_path / "other.gguf"
    shutil.copy(converted("llama-relu", "q8_0", predictors=True), other)
    shutil.copy(sidecar, neuron_bundles.path_for(other))
    with pytest.raises(engine.EngineError, match="written from another model file"):
        decode(other, "predictor", fixed + N_FF * bundle + 1024)


ALL_CACHED = 64 * 2**30  # a budget that holds every bundle: the tier opens the sidecar and caches all of it
SETTLE_SECONDS = 2  # runtime/derived_file.h's kSettleNs


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory):
    """A ReLU llama of 1,024 neurons in f32 with predictors: past 2 MiB, its last layer's FFN beyond the first MiB
    (all that a sidecar's identity covered of the GGUF before it recorded the bytes its bundles copy)."""
    root = tmp_path_factory.mktemp("wide")
    n_ff = 1024
    pred = write_predictors(root / "pred", N_LAYER, HIDDEN, n_ff, rank=32, thresholds=[0.0] * N_LAYER)
    out = root / "wide.gguf"
    convert_model(str(make_tiny("llama-relu", root / "src", n_ff=n_ff)), out, outtype="f32", predictors_dir=pred,
                  progress=False, powerinfer_compatible=False)
    return out


def _negated_last_down_t(model, out):
    """A copy of `model` (f32) with its last layer's ffn_down_t negated: the same size, other FFN rows, all past the
    first MiB."""
    t = {t.name: t for t in read_header(model).tensors}[f"blk.{N_LAYER - 1}.ffn_down_t.weight"]
    assert t.offset >= 1 << 20 and t.type == 0  # f32
    data = bytearray(model.read_bytes())
    np.frombuffer(data, np.float32, count=t.n_bytes // 4, offset=t.offset)[:] *= -1
    out.write_bytes(bytes(data))
    return out


@pytest.mark.parametrize("how", ["in place", "renamed over"])
def test_the_sidecar_of_a_model_changed_under_the_same_size_and_time_is_refused(wide_model, tmp_path, how):
    model = tmp_path / "m.gguf"
    shutil.copy(wide_model, model)
    neuron_bundles.write(model, progress=False)
    old, _ = decode(model, "predictor", ALL_CACHED)
    replace_keeping_size_and_time(model, _negated_last_down_t(model, tmp_path / "changed.gguf"), how)
    want, _ = decode(model, "predictor")  # a fresh open of the new file, every row mapped
    assert not np.array_equal(want, old)
    with pytest.raises(engine.EngineError, match="FFN rows differ") as e:
        decode(model, "predictor", ALL_CACHED)
    assert "\n" not in str(e.value) and "--neuron-bundles" in str(e.value)
    assert not neuron_bundles.current(model)
    neuron_bundles.write(model, progress=False)
    got, _ = decode(model, "predictor", ALL_CACHED)
    assert np.array_equal(got, want)


def _recorded_stamp(sidecar) -> tuple:
    with open(sidecar, "rb") as f:
        f.seek(neuron_bundles.STAMP_OFFSET)
        return neuron_bundles.STAMP.unpack(f.read(neuron_bundles.STAMP.size))


def test_a_sidecar_checked_by_the_bytes_records_the_models_stamp(bundled, tmp_path):
    """Bundles written within SETTLE_SECONDS of the GGUF's last change record no stamp, and the engine checks them
    against the GGUF's rows; once it has settled, that check records the GGUF's stamp. A copy of the same bytes
    renamed over the GGUF (another inode and change time) is checked by its rows, and accepted."""
    model, sidecar, fixed, bundle = bundled
    os.utime(model)  # changed now: bundles written next cannot trust its stamp
    neuron_bundles.write(model, progress=False)
    assert _recorded_stamp(sidecar) == neuron_bundles.NO_STAMP and neuron_bundles.current(model)
    assert _recorded_stamp(sidecar) == neuron_bundles.NO_STAMP
    want, _ = decode(model, "predictor")
    time.sleep(SETTLE_SECONDS + 0.2)
    got, _ = decode(model, "predictor", fixed + N_FF * bundle + 1024)
    assert np.array_equal(got, want) and _recorded_stamp(sidecar) == neuron_bundles.stamp(os.stat(model))
    shutil.copy(model, tmp_path / "copy.gguf")
    os.replace(tmp_path / "copy.gguf", model)
    assert _recorded_stamp(sidecar) != neuron_bundles.stamp(os.stat(model)) and neuron_bundles.current(model)
    got, _ = decode(model, "predictor", fixed + N_FF * bundle + 1024)
    assert np.array_equal(got, want)


def test_current_records_the_stamp_as_the_engine_does(bundled):
    model, sidecar, _, _ = bundled
    time.sleep(SETTLE_SECONDS + 0.2)
    with open(sidecar, "r+b") as f:  # no stamp: the rows decide
        f.seek(neuron_bundles.STAMP_OFFSET)
        f.write(neuron_bundles.STAMP.pack(*neuron_bundles.NO_STAMP))
    assert neuron_bundles.current(model) and _recorded_stamp(sidecar) == neuron_bundles.stamp(os.stat(model))


OPEN_TIERED = """
import sys
import powerinfer_engine as engine
try:
    engine.Model(sys.argv[1], threads=1, sparse_mode="predictor", ctx_size=32, memory_budget=64).close()
except engine.EngineError as e:
    sys.exit(str(e))
"""


def test_a_fifo_at_the_sidecar_path_is_one_line(bundled):
    """open(2) of a FIFO waits for a writer: the engine must not (a child process, killed if it hangs)."""
    model, sidecar, _, _ = bundled
    sidecar.unlink()
    os.mkfifo(sidecar)
    assert not neuron_bundles.current(model)
    done = run_with_timeout(OPEN_TIERED, model, timeout=60)
    assert done.returncode != 0 and done.stderr.strip() == f"{sidecar}: not a regular file"
    with pytest.raises(UserError, match="not a regular file"):
        neuron_bundles.read_layout(sidecar)


def test_a_budget_without_bundles_says_how_to_write_them(converted, tmp_path):  # noqa: F811
    model = tmp_path / "m.gguf"
    shutil.copy(converted("llama-relu", "q4_0", predictors=True), model)
    with pytest.raises(engine.EngineError, match="--neuron-bundles"):
        decode(model, "predictor", 1 << 30)


def test_the_checksum_is_the_engines():
    """A header the writer checksummed is read by the engine (above); here the definition itself: odd weights per
    word, so one flipped bit or two words swapped change it."""
    words = np.arange(1, 9, dtype="<u8")
    base = neuron_bundles.checksum(words.tobytes())
    assert base == sum(int(w) * (2 * i + 1) for i, w in enumerate(words)) % 2**64
    swapped = words.copy()
    swapped[[2, 5]] = swapped[[5, 2]]
    assert neuron_bundles.checksum(swapped.tobytes()) != base
    assert neuron_bundles.checksum(words.tobytes(), seed=1) != base
    assert neuron_bundles.checksum(b"\x01\x02\x03") == (0x030201 * 1) % 2**64


def test_run_with_a_memory_budget_prints_the_same_text(bundled, capsys):
    model, _, fixed, bundle = bundled
    args = ("run", "-m", model, "-p", "Once upon a time", "-n", "12", "--temp", "0", "-t", "2", "-c", "128",
            "--sparse-mode", "predictor")
    code, mapped, _ = run_cli(capsys, *args)
    assert code == 0
    code, tiered, _ = run_cli(capsys, *args, "--memory-budget", str((fixed + N_FF * bundle + 1024) / 2**30))
    assert code == 0 and tiered == mapped
    code, _, err = run_cli(capsys, *args, "--memory-budget", str(fixed / 2**30))
    assert_one_line_error(code, err, "memory budget of", "MiB")


@pytest.mark.parametrize("kind", ["falcon", "falcon7b", "opt", "bamboo", "prosparse", *RELU_FAMILY_KINDS])
def test_ungated_and_other_architectures_decode_the_same_bits(converted, tmp_path, kind):  # noqa: F811
    """Ungated FFNs bundle two rows (up, down_t); falcon 7B shares a norm between attention and the FFN, which the
    copied vectors keep shared; the ReLU variants of Qwen2, Qwen3, Phi-3 and Gemma 3 (`pi-tools sparsify`'s)."""
    model = tmp_path / "m.gguf"
    shutil.copy(converted(kind, "q4_0", predictors=True), model)
    neuron_bundles.write(model, progress=False)
    with engine.Model(model, threads=2, sparse_mode="predictor", ctx_size=128, memory_budget=64) as m:
        n_ff, n_layer = m.info["n_ff"], m.info["n_layer"]
        bundle = neuron_bundles.read_layout(neuron_bundles.path_for(model))["bundle_bytes"]
        fixed = m.stats()["disk"]["resident_bytes"] - n_layer * n_ff * bundle
    mapped, _ = decode(model, "predictor")
    tiered, stats = decode(model, "predictor", fixed + n_ff * bundle + 1024)
    assert np.array_equal(tiered, mapped) and stats["disk"]["cache_misses"] > 0


def test_convert_writes_the_bundles_beside_the_file(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "c.gguf"
    code, stdout, _ = run_cli(capsys, "convert", "-m", tiny_model_dir("llama-relu"), "--outtype", "q8_0", "-o", out,
                              "--neuron-bundles", "-q")
    sidecar = neuron_bundles.path_for(out)
    assert code == 0 and f"wrote {sidecar}" in stdout and not sidecar.with_name(sidecar.name + ".tmp").exists()
    assert neuron_bundles.current(out)
    layout = neuron_bundles.read_layout(sidecar)
    assert (layout["n_ff"], layout["n_layer"], layout["bundle_bytes"] % neuron_bundles.ALIGN) == (N_FF, N_LAYER, 0)
    with engine.Model(out, threads=1, sparse_mode="dense", ctx_size=32, memory_budget=64) as m:
        m.eval([3, 4, 5])
        assert m.stats()["disk"]["budget_bytes"] == 64 * 2**30


def test_a_sidecar_names_its_model(bundled, converted, tmp_path):  # noqa: F811
    model, sidecar, _, _ = bundled
    assert neuron_bundles.current(model)
    other = tmp_path / "other.gguf"
    shutil.copy(converted("llama-relu", "q8_0", predictors=True), other)
    assert not neuron_bundles.current(other)
    shutil.copy(sidecar, neuron_bundles.path_for(other))
    assert not neuron_bundles.current(other)
