"""Expert profiles (stages/expert_profile.py, issue 67 item 2): the engine's expert trace against transformers' own
router on the same tokens, the recorder's reuse and stack distances against a direct computation (a dictionary of last
uses, an LRU cache simulated), and `profile` and `report` on a tiny random Qwen3-MoE's GGUF; what stays refused."""
from __future__ import annotations

from collections import OrderedDict

import numpy as np
import pytest
import torch
from cli_helpers import assert_one_line_error, run_cli
from engine_helpers import hf_model
from test_moe import family, tokens_for  # noqa: F401 (the module's fixture)
from tiny_models import N_EXPERT, N_LAYER

import powerinfer_engine as engine
from powerinfer_tools.stages.profiling.expert_profile import REUSE_BINS, ExpertProfile, ExpertRecorder



def transformers_routing(src, tokens) -> tuple[np.ndarray, np.ndarray]:
    """transformers' router on the tokens: its chosen experts [n, n_layer, k] (its own top-k, most probable first) and
    each token's gap between the k-th and (k+1)-th probabilities [n, n_layer], from hooks on each layer's mlp.gate."""
    model, _ = hf_model(src)
    chosen, gaps, handles = {}, {}, []
    k = model.config.num_experts_per_tok
    for i, layer in enumerate(model.model.layers):
        def hook(_mod, _args, out, i=i):
            logits, _, idx = out
            probs = torch.softmax(logits.double(), dim=-1)
            top = torch.topk(probs, k + 1, dim=-1).values
            chosen[i], gaps[i] = idx.numpy(), (top[:, k - 1] - top[:, k]).numpy()
        handles.append(layer.mlp.gate.register_forward_hook(hook))
    with torch.no_grad():
        model(torch.tensor([tokens]))
    for h in handles:
        h.remove()
    n = len(model.model.layers)
    return np.stack([chosen[i] for i in range(n)], axis=1), np.stack([gaps[i] for i in range(n)], axis=1)


def test_engine_trace_is_transformers_routing(family):
    """The experts the engine records are those transformers' router picks on the same tokens, in its order, wherever
    the k-th and (k+1)-th probabilities differ by more than 1e-5 (the engine computes the hidden states within 1e-4
    relative error of transformers'); a prompt's
    batch records what its decode steps record."""
    src, path, _ = family("qwen3-moe")
    tokens = tokens_for(src, 120)
    theirs, gap = transformers_routing(src, tokens)
    with engine.Model(path, threads=2, ctx_size=256) as m:
        m.set_expert_trace(True)
        m.eval(tokens)
        batch = m.expert_choices(len(tokens))
        m.reset()
        steps = []
        for t in tokens:
            m.eval([t])
            steps.append(m.expert_choices(1))
    np.testing.assert_array_equal(batch, np.concatenate(steps))
    clear = gap > 1e-5
    assert clear.mean() > 0.9
    assert batch.shape == theirs.shape
    np.testing.assert_array_equal(batch[clear], theirs[clear])


def test_trace_is_refused_where_there_is_nothing_to_record(family, tmp_path):
    src, path, _ = family("qwen3-moe")
    with engine.Model(path, threads=1, ctx_size=64) as m:
        m.eval([1, 2, 3])
        with pytest.raises(engine.EngineError, match="the expert trace is off"):
            m.expert_choices(3)
        m.set_expert_trace(True)
        m.eval([4, 5])
        with pytest.raises(engine.EngineError, match="the last eval ran 2 tokens, not 3"):
            m.expert_choices(3)


def direct_profile(choices: np.ndarray, n_expert: int, sizes) -> tuple[np.ndarray, np.ndarray, dict]:
    """The reuse histogram, the counts and each LRU size's hits, computed the plain way: a dictionary of the token that
    last chose each expert, and an OrderedDict cache of `size` experts per layer fed the selections in order."""
    n_tok, n_layer, k = choices.shape
    reuse = np.zeros((n_layer, REUSE_BINS + 1), np.int64)
    counts = np.zeros((n_layer, n_expert), np.int64)
    hits = {c: np.zeros(n_layer, np.int64) for c in sizes}
    for il in range(n_layer):
        last = {}
        caches = {c: OrderedDict() for c in sizes}
        for t in range(n_tok):
            for e in choices[t, il]:
                e = int(e)
                reuse[il, min(t - last[e], REUSE_BINS) if e in last else 0] += 1
                last[e] = t
                counts[il, e] += 1
                for c, cache in caches.items():
                    if e in cache:
                        hits[c][il] += 1
                        cache.move_to_end(e)
                    else:
                        cache[e] = True
                        if len(cache) > c:
                            cache.popitem(last=False)
    return reuse, counts, hits


def skewed_choices(rng, n_tok, n_layer, n_expert, k) -> np.ndarray:
    """Selections with locality: each token's experts drawn without repeats, mostly from a slowly drifting window."""
    out = np.empty((n_tok, n_layer, k), np.int32)
    for t in range(n_tok):
        for il in range(n_layer):
            weights = np.exp(-((np.arange(n_expert) - (t // 7 + 5 * il) % n_expert) % n_expert) / 6.0) + 0.01
            out[t, il] = rng.choice(n_expert, size=k, replace=False, p=weights / weights.sum())
    return out


@pytest.mark.parametrize("n_expert,k", [(16, 2), (64, 8)])
def test_recorder_matches_a_direct_computation(n_expert, k):
    """Counts, token reuse distances and the LRU hit rates from the stack distances equal the plain computation's,
    fed in several batches; the counts sum to tokens * k per layer."""
    rng = np.random.default_rng(3)
    choices = skewed_choices(rng, 1500, 3, n_expert, k)
    rec = ExpertRecorder(3, n_expert, k)
    for a, b in ((0, 1), (1, 700), (700, 701), (701, 1500)):
        rec.add(choices[a:b])
    p = rec.profile
    sizes = sorted({k, 2 * k, n_expert // 2, n_expert - 1})
    reuse, counts, hits = direct_profile(choices, n_expert, sizes)
    np.testing.assert_array_equal(p.counts, counts)
    np.testing.assert_array_equal(p.counts.sum(axis=1), 1500 * k)
    np.testing.assert_array_equal(p.reuse, reuse)
    for c in sizes:
        np.testing.assert_allclose(p.lru_hit_rate(c), hits[c] / (1500 * k), rtol=0, atol=0)
    assert (p.lru_hit_rate(2 * k) > p.hot_set_share(2 * k)).all()  # a drifting window: the cache wins


def test_far_reuse_goes_to_the_last_bin():
    """Expert 1 chosen at tokens 0, 1500 and 1501, expert 0 at every other token (top-1): distances 1500 (past the
    histogram: its last bin) and 1; expert 0's gaps of 1, and 3 across tokens 1500 and 1501, and the LRU of 1 hits what repeats."""
    choices = np.zeros((1600, 1, 1), np.int32)
    choices[[0, 1500, 1501], 0, 0] = 1
    rec = ExpertRecorder(1, 2, 1)
    rec.add(choices)
    reuse, _, hits = direct_profile(choices, 2, [1])
    np.testing.assert_array_equal(rec.profile.reuse, reuse)
    assert rec.profile.reuse[0, REUSE_BINS] == 1 and rec.profile.reuse[0, 0] == 2 and rec.profile.reuse[0, 3] == 1
    assert rec.profile.lru_hit_rate(1)[0] == hits[1][0] / 1600 == (1600 - 4) / 1600


def test_a_damaged_file_is_refused(tmp_path):
    p = ExpertProfile.empty(2, 8, 2)
    p.save(tmp_path / "e.npz")
    ExpertProfile.load(tmp_path / "e.npz")
    p.counts[0, 0] = 5  # counts no longer agree with the histograms
    p.save(tmp_path / "e.npz")
    with pytest.raises(Exception, match="is not an expert profile of this version"):
        ExpertProfile.load(tmp_path / "e.npz")
    rec = ExpertRecorder(2, 8, 2)
    rec.add(np.array([[[0, 1], [2, 3]], [[0, 4], [2, 5]]], np.int32))
    rec.profile.save(tmp_path / "e.npz")
    assert ExpertProfile.load(tmp_path / "e.npz").trace.shape == (2, 2, 2)
    rec.profile.trace[1, 0, 1] = 6  # the trace no longer gives the counts
    rec.profile.save(tmp_path / "e.npz")
    with pytest.raises(Exception, match="is not an expert profile of this version"):
        ExpertProfile.load(tmp_path / "e.npz")
    rec.profile.trace = None  # a profile made before the trace was recorded: read, without one
    rec.profile.save(tmp_path / "e.npz")
    assert ExpertProfile.load(tmp_path / "e.npz").trace is None


@pytest.fixture(scope="module")
def expert_profile_dir(family, tmp_path_factory):
    """`pi-tools profile` on the tiny Qwen3-MoE's GGUF: (its directory, the file, the calibration text)."""
    from powerinfer_tools.cli.app import app
    from typer.testing import CliRunner

    src, path, _ = family("qwen3-moe")
    root = tmp_path_factory.mktemp("expert-profile")
    calib = root / "calib.txt"
    calib.write_text("To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer. " * 60)
    out = root / "prof"
    result = CliRunner().invoke(app, ["profile", "-m", str(path), "--calib", str(calib), "--tokens", "256",
                                      "--seq-len", "64", "--threads", "2", "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert "verdict: With" in result.output and "lru" in result.output
    return out, path, calib


def test_profile_records_the_engines_routing(expert_profile_dir):
    """The profile's counts sum to tokens * top_k in every layer and are the engine's trace of the same sequences."""
    import json

    from powerinfer_tools.runtime.inference import load_tokenizer
    from powerinfer_tools.stages.profiling import calibration, expert_profile

    out, path, calib = expert_profile_dir
    meta = json.loads((out / "profile.json").read_text())
    p = expert_profile.load(out, meta)
    assert meta["tokens"] == 256 and p.n_expert == N_EXPERT
    np.testing.assert_array_equal(p.selections(), 256 * p.top_k)
    seqs = calibration.sequences_from_text(load_tokenizer(path), [calib.read_text()], 64, 256).numpy()
    rec = ExpertRecorder(p.n_layer, p.n_expert, p.top_k)
    with engine.Model(path, threads=2, ctx_size=64) as m:
        m.set_expert_trace(True)
        for seq in seqs:
            m.reset()
            m.eval(seq)
            rec.add(m.expert_choices(len(seq)))
    np.testing.assert_array_equal(p.counts, rec.profile.counts)
    np.testing.assert_array_equal(p.stack, rec.profile.stack)
    np.testing.assert_array_equal(p.trace, rec.profile.trace)  # the choices in order, for plan
    assert p.trace.shape == (256, p.n_layer, p.top_k)


def test_report_renders_expert_locality(expert_profile_dir, tmp_path, capsys):
    out, _, _ = expert_profile_dir
    code, stdout, err = run_cli(capsys, "report", out, "-o", tmp_path / "r.html")
    assert code == 0, err
    page = (tmp_path / "r.html").read_text()
    assert 'id="tbl-experts"' in page and 'id="fig-experts"' in page and "LRU of" in page
    assert page.count("<tr>") == N_LAYER + 1
    code, _, err = run_cli(capsys, "report", out, "-o", tmp_path / "r2.html", "--predictors", tmp_path)
    assert_one_line_error(code, err, "is an expert profile: --predictors and --plan are for the neurons")


def test_neuron_options_stay_refused(family, expert_profile_dir, tmp_path, capsys):
    """An expert profile refuses what applies to neurons; the stages that read neuron counts refuse its directory."""
    src, path, _ = family("qwen3-moe")
    out, _, calib = expert_profile_dir
    for flags, needle in ((["--target-sparsity", "0.3"], "--target-sparsity applies to the neurons of dense FFNs"),
                          (["--resume"], "--resume applies to the neurons"), ([], "needs --calib text")):
        base = ["--calib", calib] if flags != [] else []
        code, _, err = run_cli(capsys, "profile", "-m", path, *base, *flags, "-o", tmp_path / "p")
        assert_one_line_error(code, err, needle)
    code, _, err = run_cli(capsys, "convert", "-m", src, "-o", tmp_path / "m.gguf", "--profile", out)
    assert_one_line_error(code, err, "qwen3-moe is a mixture of experts")
