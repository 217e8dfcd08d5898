"""Several sequences in one engine (pi_options.n_seq, docs/engine.md "Sequences"): each its own KV cache, and one
decode step that computes a token of several together. A row of that step must be the bits the sequence's own
single-token eval gives, whatever else is in the step (a request's answer must not depend on its company)."""
from __future__ import annotations

import numpy as np
import pytest
from convert_helpers import write_predictors
from engine_helpers import converted, random_tokens, write_gpuidx  # noqa: F401
from tiny_models import HIDDEN, N_LAYER, make_tiny

import powerinfer_engine as engine
from powerinfer_tools.stages.conversion.conversion import convert_model

PROMPTS = [random_tokens(n, 384, seed=10 + n) for n in (5, 23, 64, 41)]  # 64: exactly one batch, others ragged
N_STEPS = 6
FED = [random_tokens(N_STEPS + 4, 384, seed=50 + i) for i in range(len(PROMPTS))]  # the tokens each sequence decodes
# the step each sequence joins at (its prompt evaluated just before): a step of 1, 2, 3 then 4 sequences
JOINS = [0, 1, 2, 3]


# A ReLU FFN of 2560 neurons with random predictors (threshold 0: about half of them selected per token): a row's
# used down rows span several of the down projection's runs of 256 (backend/down_runs.h), and the union of four
# rows' selections most of the tier (where a step reads every gate in order, CpuTierBackend::submit)
WIDE_FF = 2560


@pytest.fixture(scope="module")
def wide_relu(tmp_path_factory):
    """wide_relu(outtype) -> path of the wide ReLU model with predictors, converted to outtype (built once)."""
    root = tmp_path_factory.mktemp("wide_relu")
    src = make_tiny("llama-relu", root / "src", n_ff=WIDE_FF)
    pred = write_predictors(root / "pred", N_LAYER, HIDDEN, WIDE_FF, rank=32, thresholds=[0.0] * N_LAYER)
    paths = {}

    def get(outtype: str):
        if outtype not in paths:
            paths[outtype] = root / f"wide.{outtype}.gguf"
            convert_model(str(src), paths[outtype], outtype=outtype, predictors_dir=pred, progress=False)
        return paths[outtype]

    return get


def alone(path, prompt, fed, threads, kv_type, **opts) -> list[np.ndarray]:
    """A sequence by itself in a one-sequence engine: its prompt, then each fed token by eval (the decode path)."""
    with engine.Model(path, threads=threads, kv_type=kv_type, **opts) as m:
        m.eval(prompt, all_logits=False)
        return [m.eval([t], all_logits=False) for t in fed]


def check_rows_are_alone(path, threads, kv_type, **opts):
    """Steps of 1, 2, 3 then 4 sequences (each joining between steps): every row the bits of its sequence alone.
    opts: the engines' other options (sparse_mode, a hot tier's)."""
    want = [alone(path, p, f, threads, kv_type, **opts) for p, f in zip(PROMPTS, FED)]
    with engine.Model(path, threads=threads, kv_type=kv_type, n_seq=len(PROMPTS), **opts) as m:
        done = [0] * len(PROMPTS)
        for step in range(N_STEPS):
            for k, join in enumerate(JOINS):
                if join == step:  # joins between steps: its prompt evaluated into its own cache
                    m.select(k)
                    m.eval(PROMPTS[k], all_logits=False)
            active = [k for k, join in enumerate(JOINS) if join <= step]
            logits = m.decode_step(active, [FED[k][done[k]] for k in active])
            for row, k in enumerate(active):
                np.testing.assert_array_equal(logits[row], want[k][done[k]], err_msg=f"sequence {k} step {step}")
                done[k] += 1
        for k in range(len(PROMPTS)):
            m.select(k)
            assert m.n_past == len(PROMPTS[k]) + done[k]


@pytest.mark.parametrize("outtype", ["f32", "q8_0", "q4_0"])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_each_row_of_a_decode_step_is_its_sequence_alone(outtype, threads, converted):
    check_rows_are_alone(converted("llama-silu", outtype), threads, "f16" if outtype == "q4_0" else "f32")


@pytest.mark.parametrize("outtype", ["f32", "q8_0", "q4_0"])
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("sparse_mode", ["predictor", "gate", "oracle"])
def test_sparse_modes_compute_each_row_from_its_own_selection(sparse_mode, outtype, threads, wide_relu):
    """The modes that select neurons per token: a step reads the union of its rows' selections once, and each row
    computes only its own, its down rows summed in its own runs (a row given its company's neurons would differ:
    a neuron the predictor left out but the rule passes adds to the row)."""
    check_rows_are_alone(wide_relu(outtype), threads, "f16" if outtype == "q4_0" else "f32", sparse_mode=sparse_mode)


@pytest.mark.parametrize("outtype", ["f32", "q4_0"])
@pytest.mark.parametrize("hot_backend", ["cpu", "reference"])
@pytest.mark.parametrize("sparse_mode", ["dense", "predictor"])
def test_a_hot_tier_on_the_cpu_sums_each_row_as_alone(sparse_mode, hot_backend, outtype, wide_relu, tmp_path):
    """A .gpuidx's hot neurons kept a tier of their own on the CPU (cpu_hot_tier), computed by the CPU backend or the
    scalar reference one: each row's hot part its own decode step's, added to its cold part as alone."""
    rng = np.random.default_rng(3)
    gpuidx = write_gpuidx(tmp_path / "m.gpuidx", [rng.random(WIDE_FF) < 0.2 for _ in range(N_LAYER)])
    check_rows_are_alone(wide_relu(outtype), 2, "f32", sparse_mode=sparse_mode, gpuidx=gpuidx, cpu_hot_tier=True,
                         hot_backend=hot_backend)


def test_sampling_follows_each_sequences_own_logits_and_seed(converted):
    """pi_sample on a selected sequence draws from its row of the step, with its own generator and history: the
    same tokens as the sequence alone, seeded alike, whatever its company draws."""
    path = converted("llama-silu", "q8_0")

    def draws(m, n):
        out = []
        for _ in range(n):
            out.append(m.sample(temperature=0.9, top_k=0, top_p=1.0, repeat_penalty=1.3))
        return out

    with engine.Model(path, threads=2) as m:
        m.seed(7)
        m.eval(PROMPTS[1], all_logits=False)
        want = []
        for _ in range(5):
            want += draws(m, 1)
            m.eval(want[-1:], all_logits=False)
    with engine.Model(path, threads=2, n_seq=3) as m:
        for k, seed in ((0, 99), (1, 7), (2, 3)):
            m.select(k)
            m.seed(seed)
            m.eval(PROMPTS[k], all_logits=False)
        got, last = [], {}
        for _ in range(5):
            for k in range(3):
                m.select(k)
                last[k] = draws(m, 1)[0]
            got.append(last[1])
            m.decode_step([2, 1, 0], [last[2], last[1], last[0]])
    assert got == want


def test_sequences_keep_their_own_caches_and_truncate_alone(converted):
    path = converted("llama-silu", "q8_0")
    with engine.Model(path, threads=2) as m:
        want = m.eval(PROMPTS[0], all_logits=False)
    with engine.Model(path, threads=2, n_seq=2) as m:
        m.select(1)
        m.eval(PROMPTS[1], all_logits=False)
        m.select(0)
        m.eval(PROMPTS[2], all_logits=False)
        m.reset(0)  # sequence 0 only
        np.testing.assert_array_equal(m.eval(PROMPTS[0], all_logits=False), want)
        m.select(1)
        assert m.n_past == len(PROMPTS[1])
        assert m.info["kv_cache_bytes"] == 2 * engine.Model(path, threads=1).info["kv_cache_bytes"]


def test_decode_step_refusals_name_the_problem(converted):
    path = converted("llama-relu", "q8_0", predictors=True)
    with engine.Model(path, threads=2, n_seq=3, sparse_mode="auto") as m:
        for k in range(3):
            m.select(k)
            m.eval(PROMPTS[k][:4], all_logits=False)
        with pytest.raises(engine.EngineError, match="not computed with auto FFN mode"):
            m.decode_step([0, 1], [5, 6])
        m.decode_step([2], [5])  # one sequence: its own decode step, any mode
        m.sparse_mode = "dense"
        with pytest.raises(engine.EngineError, match="twice in one decode step"):
            m.decode_step([0, 0], [5, 6])
        with pytest.raises(engine.EngineError, match="sequence 3 does not exist"):
            m.decode_step([0, 3], [5, 6])
        with pytest.raises(engine.EngineError, match="outside the vocabulary"):
            m.decode_step([0, 1], [5, 999])
        m.select(1)
        m.reset(0)
        with pytest.raises(engine.EngineError, match="sequence 1 is empty"):
            m.decode_step([0, 1], [5, 6])
        m.select(2)
        assert m.n_past == 5  # the refused steps changed nothing; the selection is kept
        with pytest.raises(engine.EngineError, match="sequence 5 does not exist"):
            m.select(5)


def test_the_memory_check_counts_every_sequences_cache(converted):
    """Each sequence's KV cache at the full context is counted before anything is allocated: a count of sequences
    whose caches exceed the machine's memory is refused in one line that says so."""
    path = converted("llama-silu", "q8_0")
    # 2 layers x 2 (k, v) x 32 floats x 4 bytes = 512 bytes a position: 2^20 positions are 512 MiB a sequence
    with pytest.raises(engine.EngineError, match="64 sequences .a KV cache each.*lower ctx_size or the sequences"):
        engine.Model(path, threads=1, ctx_size=1 << 20, n_seq=64)
