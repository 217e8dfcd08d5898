"""Input sparsity in the engine against transformers with the same inputs zeroed (f32 files, every architecture's
tiny random model): prompt batches and decode steps, with the FFN modes it combines with, quantized files, what
the statistics count, and bad values refused in one line."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from cli_helpers import assert_one_line_error, run_cli
from engine_helpers import converted, engine_prompt_then_decode, hf_model, max_rel_err, random_tokens  # noqa: F401
from tiny_models import FAMILY_KINDS, KINDS, QWEN_KINDS, make_tiny

import powerinfer_engine as engine
from powerinfer_engine import kernels
from powerinfer_tools.formats import names
from powerinfer_tools.formats.gguf_io import open_reader
from powerinfer_tools.stages.profiling import input_sparsity
from powerinfer_tools.stages.conversion.conversion import convert_model

N_PROMPT, N_DECODE = 48, 16
TOKENS = random_tokens(N_PROMPT + N_DECODE, 384, seed=3)
SHARE = 0.25
N_SITES = len(names.INPUT_SITES)


@pytest.fixture(autouse=True)
def column_kernels(monkeypatch):
    """The column layout for every test here but those of the choice: they count the bytes its kernel skips."""
    monkeypatch.setenv("PI_INPUT_KERNEL", "columns")


def calibrate_thresholds(model_dir, root):
    """Input thresholds of the model at model_dir calibrated (greedy) on random tokens, saved as a profile in root."""
    model, adapter = hf_model(model_dir)
    seqs = torch.randint(0, 384, (4, 128), generator=torch.Generator().manual_seed(0))
    table = input_sparsity.calibrate(model, adapter, seqs, "greedy", 2, 0)
    (root / "profile.json").write_text(json.dumps({"thresholds": [0.0] * adapter.dims().n_layer}))
    table.save(root)
    return table


def convert_with_thresholds(model_dir, root, outtype):
    path = root / f"{outtype}.gguf"
    convert_model(str(model_dir), path, outtype=outtype, profile_dir=root, progress=False,
                  powerinfer_compatible=False, input_sparsity=True)
    return path


@pytest.fixture(scope="module")
def input_files(tiny_model_dir, tmp_path_factory):
    """input_files(kind, outtype) -> (file, InputThresholds): the tiny model converted with input thresholds
    calibrated (greedy) on random tokens."""
    cache = {}

    def get(kind: str, outtype: str = "f32"):
        if kind not in cache:
            root = tmp_path_factory.mktemp(f"input_{kind}")
            cache[kind] = (root, calibrate_thresholds(tiny_model_dir(kind), root), {})
        root, table, files = cache[kind]
        if outtype not in files:
            files[outtype] = convert_with_thresholds(tiny_model_dir(kind), root, outtype)
        return files[outtype], table

    return get


def hf_zeroed(model_dir, thresholds) -> np.ndarray:
    model, adapter = hf_model(model_dir)
    with input_sparsity.zeroed_inputs(adapter, model, thresholds), torch.no_grad():
        return model(torch.tensor([TOKENS])).logits[0].float().numpy()


def run(path, mode="dense", share=SHARE):
    with engine.Model(path, threads=2, sparse_mode=mode, input_sparsity=share) as m:
        return engine_prompt_then_decode(m, TOKENS, N_PROMPT), m.stats()


@pytest.mark.parametrize("kind", KINDS + QWEN_KINDS + FAMILY_KINDS)
def test_logits_equal_transformers_with_the_same_inputs_zeroed(kind, tiny_model_dir, input_files):
    """Prompt and decode steps alike. Only llama-silu's dense logits agree with transformers' to float rounding
    (1e-6); the others' differ by ~2e-4, enough to move the odd input across its threshold, and each such input
    moves the logits by up to a few 1e-2: there the engine must still be far nearer the zeroed model than the dense
    one."""
    path, table = input_files(kind)
    zeroed = hf_zeroed(tiny_model_dir(kind), table.at(SHARE))
    dense = hf_zeroed(tiny_model_dir(kind), [[-1.0] * N_SITES for _ in table.thresholds[0]])
    logits, stats = run(path)
    err = max_rel_err(logits, zeroed)
    assert err <= (1e-4 if kind == "llama-silu" else 5e-2), err
    assert err < 0.25 * max_rel_err(logits, dense)
    assert 0.2 < stats["input_sparsity"]["zeroed"] / stats["input_sparsity"]["inputs"] < 0.6
    skipped = stats["input_sparsity"]["decode_bytes_skipped"] / stats["input_sparsity"]["decode_bytes"]
    assert skipped == pytest.approx(SHARE, abs=0.06)


def test_input_sparsity_off_is_the_dense_engine_bit_for_bit(input_files, converted):
    path, _ = input_files("llama-silu")
    with engine.Model(converted("llama-silu"), threads=2, sparse_mode="dense") as m:
        plain = engine_prompt_then_decode(m, TOKENS, N_PROMPT)
    logits, stats = run(path, share=0.0)
    assert np.array_equal(logits, plain)
    assert stats["input_sparsity"]["inputs"] == 0


@pytest.mark.parametrize("kind", ["llama-relu", "bamboo"])
def test_gate_mode_keeps_its_ffn_and_takes_input_sparsity_on_attention(kind, tiny_model_dir, input_files):
    """A ReLU model's gate mode is exact: with input sparsity, its attention's inputs are zeroed and its FFN's not."""
    path, table = input_files(kind)
    attention_only = [[t if j < 2 else -1.0 for j, t in enumerate(row)] for row in table.at(SHARE)]
    logits, _ = run(path, "gate")
    err = max_rel_err(logits, hf_zeroed(tiny_model_dir(kind), attention_only))
    assert err <= 5e-2
    assert err < 0.25 * max_rel_err(logits, hf_zeroed(tiny_model_dir(kind), table.at(SHARE)))


@pytest.mark.parametrize("outtype", ["q8_0", "q4_0"])
def test_quantized_files_skip_the_rows_of_zeroed_inputs(outtype, input_files):
    """Their logits move from the f32 file's by about what quantization moves the dense model's."""
    path, _ = input_files("llama-silu", outtype)
    f32, _ = run(input_files("llama-silu")[0])
    logits, stats = run(path)
    quantization = max_rel_err(run(path, share=0.0)[0], run(input_files("llama-silu")[0], share=0.0)[0])
    assert max_rel_err(logits, f32) < 3 * quantization + 0.05   # and the inputs it moves across their thresholds
    inputs = stats["input_sparsity"]
    assert inputs["decode_bytes_skipped"] / inputs["decode_bytes"] == pytest.approx(SHARE, abs=0.06)


def column_copy_bytes(path, outtype: str, ffn: bool) -> int:
    """Bytes of the column copies (kernels/packed.h) of every layer's q/k/v (stacked; falcon's fused), o and, with
    `ffn`, up and gate (an ungated FFN: up alone) and, q8_0, down (from down_t): per 32 inputs, 2 + 32 (q8_0) or
    2 + 16 (q4_0) bytes an output, the stacked outputs rounded up to 64 (q4_0: 128)."""
    shapes = {t.name: [int(d) for d in t.shape] for t in open_reader(path).tensors}
    sites = [("attn_qkv", "attn_q", "attn_k", "attn_v"), ("attn_output",)] + ([("ffn_up", "ffn_gate")] if ffn else [])
    per_output = 2 + (16 if outtype == "q4_0" else 32)
    total, il = 0, 0
    while f"blk.{il}.attn_output.weight" in shapes:
        for site in sites:
            mats = [shapes[f"blk.{il}.{n}.weight"] for n in site if f"blk.{il}.{n}.weight" in shapes]
            span = 128 if outtype == "q4_0" else 64
            total += mats[0][0] // 32 * -(-sum(s[1] for s in mats) // span) * span * per_output
        if ffn and outtype == "q8_0":
            n_out, n_in = shapes[f"blk.{il}.ffn_down_t.weight"]
            total += n_in // 32 * -(-n_out // 64) * 64 * per_output
        il += 1
    return total


@pytest.mark.parametrize("kind,outtype", [("llama-silu", "q4_0"), ("llama-relu", "q8_0"), ("falcon", "q8_0"),
                                          ("opt", "q4_0")])
def test_quantized_decode_steps_read_column_copies(kind, outtype, input_files):
    """A q4_0/q8_0 file's decode steps read q/k/v, o and gate/up from column copies of the matrices' own blocks
    (falcon's fused q/k/v, an ungated FFN's up alone), and q8_0 down from a copy of down_t requantized, made when input sparsity turns on and counted in the
    statistics: dense mode holds the three sites, gate mode attention's two, share 0 none. The logits move from the
    f32 file's by about what quantization moves the dense model's."""
    path, _ = input_files(kind, outtype)
    f32 = input_files(kind)[0]
    quantization = max_rel_err(run(path, share=0.0)[0], run(f32, share=0.0)[0])
    with engine.Model(path, threads=2, sparse_mode="dense") as m:
        assert m.stats()["weight_copies"]["input_columns"] == 0
        m.input_sparsity = SHARE
        assert m.stats()["weight_copies"]["input_columns"] == column_copy_bytes(path, outtype, ffn=True)
        logits = engine_prompt_then_decode(m, TOKENS, N_PROMPT)
        assert max_rel_err(logits, run(f32)[0]) < 3 * quantization + 0.05
        if kind == "llama-relu":
            m.sparse_mode = "gate"
            assert m.stats()["weight_copies"]["input_columns"] == column_copy_bytes(path, outtype, ffn=False)
        m.input_sparsity = 0.0
        assert m.stats()["weight_copies"]["input_columns"] == 0


def mapped_rss_bytes(path) -> int:
    """Resident bytes of this process's mappings of the file at path (/proc/self/smaps)."""
    total, ours = 0, False
    for line in open("/proc/self/smaps"):
        head = line.split()
        if head and "-" in head[0] and len(head) >= 5:  # a mapping's first line: range, perms, offset, dev, inode[, path]
            ours = len(head) >= 6 and head[5] == str(path)
        elif ours and head[0] == "Rss:":
            total += int(head[1]) * 1024
    return total


def test_column_copies_hand_back_the_pages_they_were_read_from(tmp_path):
    """Making the column copies reads the mapped matrices: their pages are handed back afterwards, as packing does,
    so a weight is resident once (a decode step reads the copies alone). A tiny model's matrices are smaller than
    a page, so this one has 8,192 neurons: its gate, up and down_t are hundreds of pages each."""
    model_dir = make_tiny("llama-silu", tmp_path / "wide", n_ff=8192)
    calibrate_thresholds(model_dir, tmp_path)
    path = convert_with_thresholds(model_dir, tmp_path, "q8_0")
    sources = sum(int(t.n_bytes) for t in open_reader(path).tensors
                  if t.name.endswith(("ffn_gate.weight", "ffn_up.weight", "ffn_down_t.weight")))
    with engine.Model(path, threads=2, sparse_mode="dense", input_sparsity=SHARE) as m:
        m.eval([TOKENS[0]])  # one decode step
        assert m.stats()["weight_copies"]["input_columns"] == column_copy_bytes(path, "q8_0", ffn=True)
        assert mapped_rss_bytes(path) < sources / 4


@pytest.mark.parametrize("outtype", ["q8_0", "q4_0"])
def test_column_copies_give_the_same_logits_whatever_the_threads(outtype, input_files):
    """Threads split a step's tiles and the tile width follows the thread count, but each output is gemm8's
    arithmetic whatever its tile: the same bits with 1, 2 and 3 threads."""
    path, _ = input_files("llama-silu", outtype)
    logits = []
    for threads in (1, 2, 3):
        with engine.Model(path, threads=threads, sparse_mode="dense", input_sparsity=SHARE) as m:
            logits.append(engine_prompt_then_decode(m, TOKENS, N_PROMPT))
    assert np.array_equal(logits[0], logits[1]) and np.array_equal(logits[0], logits[2])


def test_bad_values_are_refused_in_one_line(input_files, converted, capsys):
    path, table = input_files("llama-silu")
    for bad in (-0.1, 1.0, float("nan"), table.levels[-1] + 0.05):
        with pytest.raises(engine.EngineError, match="input_sparsity"):
            engine.Model(path, threads=1, input_sparsity=bad)
    with pytest.raises(engine.EngineError, match="has no input thresholds"):
        engine.Model(converted("llama-silu"), threads=1, input_sparsity=SHARE)
    code, _, err = run_cli(capsys, "run", "-m", str(path), "-p", "hi", "-n", "2", "--input-sparsity", "1.5")
    assert_one_line_error(code, err, "--input-sparsity")
    code, _, err = run_cli(capsys, "run", "-m", str(converted("llama-silu")), "-p", "hi", "-n", "2", "--sparse-mode",
                           "input")
    assert_one_line_error(code, err, "no input thresholds")


def test_run_reports_the_bytes_skipped(input_files, capsys):
    path, _ = input_files("llama-silu")
    code, _, err = run_cli(capsys, "run", "-m", str(path), "-p", "hi there", "-n", "8", "-t", "2", "--sparse-mode",
                           "input", "--temp", "0", "-v")
    assert code == 0, err
    line = next(line for line in err.splitlines() if line.startswith("input sparsity 0.25"))
    assert "MiB" in line and "skipped" in line


def test_the_share_set_on_an_open_model_is_the_share_opened_with(input_files):
    path, table = input_files("llama-silu")
    opened, _ = run(path)
    with engine.Model(path, threads=2, sparse_mode="dense") as m:
        m.input_sparsity = SHARE
        assert m.input_sparsity == SHARE
        assert np.array_equal(engine_prompt_then_decode(m, TOKENS, N_PROMPT), opened)
        with pytest.raises(engine.EngineError, match="above the largest share calibrated"):
            m.input_sparsity = table.levels[-1] + 0.05
        assert m.input_sparsity == SHARE


@pytest.mark.parametrize("isa", [i for i in ("avx2", "avx512") if kernels.available(i)])  # the sets with axpy_quads
def test_input_sparsity_set_after_dense_steps_gives_the_down_quads_back(isa, input_files):
    """Dense decode steps on a SiLU q4_0 model hold down_t in quads; input sparsity's own FFN reads down_t's rows,
    so turning it on gives the quads back (the rows are the file's again), and its logits are the ones of a model
    opened with it."""
    path, _ = input_files("llama-silu", "q4_0")
    opened, _ = run(path)
    with engine.Model(path, threads=2, sparse_mode="dense", isa=isa) as m:
        engine_prompt_then_decode(m, TOKENS[:N_PROMPT + 2], N_PROMPT)
        assert all(l["down_quads"] > 0 for l in m.stats()["layers"])
        m.reset()
        m.input_sparsity = SHARE
        assert all(l["down_quads"] == 0 for l in m.stats()["layers"])
        assert np.array_equal(engine_prompt_then_decode(m, TOKENS, N_PROMPT), opened)


@pytest.mark.parametrize("kind,outtype", [("llama-silu", "q8_0"), ("llama-silu", "q4_0"), ("falcon", "q8_0")])
def test_either_decode_kernel_gives_the_same_bits(kind, outtype, input_files, monkeypatch):
    """A decode step reads each site's copy by gemv_columns (the column layout, the kept inputs' pieces) or by gemm8
    (8-row groups of the same blocks, every weight): gemm8's arithmetic on the same zeroed operand either way, so
    the logits are the same bits; the statistics say which kernel each site used and why, and only gemv_columns
    skips bytes."""
    path, _ = input_files(kind, outtype)
    runs = {}
    for layout, kernel in (("columns", "gemv_columns"), ("groups", "gemm8")):
        monkeypatch.setenv("PI_INPUT_KERNEL", layout)
        logits, stats = run(path)
        sites = stats["input_sparsity"]["kernels"]
        assert set(sites) == ({"qkv", "o", "gate_up", "down"} if outtype == "q8_0" else {"qkv", "o", "gate_up"})
        assert all(s["kernel"] == kernel and s["why"] == f"PI_INPUT_KERNEL={layout}" for s in sites.values())
        assert stats["weight_copies"]["input_columns"] == column_copy_bytes(path, outtype, ffn=True)
        runs[layout] = logits, stats["input_sparsity"]
    assert np.array_equal(runs["columns"][0], runs["groups"][0])
    # a q4_0 down projection reads down_t's kept rows either way
    skipped = {layout: inputs["decode_bytes_skipped"] for layout, (_, inputs) in runs.items()}
    assert skipped["groups"] < skipped["columns"] and (skipped["groups"] == 0) == (outtype == "q8_0")
    assert runs["columns"][1]["decode_bytes"] == runs["groups"][1]["decode_bytes"]


def test_the_probe_chooses_each_sites_kernel_and_says_so(input_files, monkeypatch, capsys):
    """Unset, each site's kernel is the faster of the two as timed when its copies are first made, the times
    reported beside the verdict; the logits are those of either kernel; pi-tools run -v prints the verdicts."""
    monkeypatch.delenv("PI_INPUT_KERNEL")
    path, _ = input_files("llama-silu", "q8_0")
    logits, stats = run(path)
    sites = stats["input_sparsity"]["kernels"]
    assert set(sites) == {"qkv", "o", "gate_up", "down"}
    for s in sites.values():
        assert s["why"] == "probe" and s["columns_ms"] > 0 and s["groups_ms"] > 0
        assert s["kernel"] == ("gemv_columns" if s["columns_ms"] < s["groups_ms"] else "gemm8")
    monkeypatch.setenv("PI_INPUT_KERNEL", "groups")
    assert np.array_equal(logits, run(path)[0])
    monkeypatch.setenv("PI_INPUT_KERNEL", "sideways")
    with pytest.raises(engine.EngineError, match="PI_INPUT_KERNEL must be columns or groups"):
        run(path)
    monkeypatch.delenv("PI_INPUT_KERNEL")
    code, _, err = run_cli(capsys, "run", "-m", str(path), "-p", "hi there", "-n", "4", "-t", "2", "--sparse-mode",
                           "input", "--temp", "0", "-v")
    assert code == 0, err
    line = next(line for line in err.splitlines() if line.startswith("input sparsity's decode kernels"))
    assert all(f"{site} " in line for site in ("qkv", "o", "gate_up", "down")) and "probe" in line


@pytest.mark.parametrize("outtype", ["f32", "q8_0"])
def test_a_batch_runs_the_dense_ffn_on_the_zeroed_inputs(outtype, input_files):
    """A prompt batch in dense mode runs the FFN tier's batch kernels over the zeroed inputs (gate/up's and h at
    the down site): it counts every site's inputs as a decode step does, and its logits are the decode steps' within
    the rounding of the two paths (f32: float sums in another order; q8_0: the batch's down projection in integers,
    h in q8_0 blocks)."""
    path, _ = input_files("llama-silu", outtype)
    with engine.Model(path, threads=2, sparse_mode="dense", input_sparsity=SHARE) as m:
        E, F, L = m.info["n_embd"], m.info["n_ff"], m.info["n_layer"]  # llama-silu: n_head * head_dim = n_embd
        batch = m.eval(TOKENS[:N_PROMPT], all_logits=True)
        inputs = m.stats()["input_sparsity"]
        assert inputs["inputs"] == N_PROMPT * L * (3 * E + F)
        assert 0.2 < inputs["zeroed"] / inputs["inputs"] < 0.6
        assert all(layer["tokens"] == N_PROMPT for layer in m.stats()["layers"])
        m.reset()
        steps = np.stack([m.eval([t], all_logits=False) for t in TOKENS[:N_PROMPT]])
    assert max_rel_err(batch, steps) < (1e-4 if outtype == "f32" else 0.05)
