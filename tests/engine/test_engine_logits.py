"""The engine against transformers on tiny random models (f32): dense logits, every sparse mode
against the rule it defines (applied to transformers' FFN activations), exactness of the oracle and
gate modes, hot/cold tiers, statistics, quantized types, sampling."""
from __future__ import annotations

import numpy as np
import pytest
import scipy.stats
import torch
from convert_helpers import read_tensors, write_predictors
from engine_helpers import (converted, engine_prompt_then_decode, hf_logits, max_rel_err,  # noqa: F401
                            predictor_rule, random_tokens, rewrite, write_gpuidx)
from tiny_models import HIDDEN, N_FF, N_HEAD, N_KV, N_LAYER, PROSPARSE_THRESHOLD, make_tiny

import powerinfer_engine as engine
from powerinfer_engine import kernels
from powerinfer_tools.stages.conversion.conversion import convert_model

N_PROMPT, N_DECODE = 64, 16
PREDICTOR_SPARSE_THRESHOLD = 6.0  # random predictors (write_predictors) select 5-25 % of the neurons above it
TOKENS = random_tokens(N_PROMPT + N_DECODE, 384, seed=1)
ISAS = ["scalar"] + [i for i in ("avx2", "avx512") if kernels.available(i)]


def run(path, mode="dense", tokens=TOKENS, **kw):
    with engine.Model(path, threads=2, sparse_mode=mode, **kw) as m:
        logits = engine_prompt_then_decode(m, tokens, N_PROMPT)
        return logits, m.stats()


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    cache = {}

    def get(kind):
        if kind not in cache:
            cache[kind] = hf_logits(tiny_model_dir(kind), TOKENS)
        return cache[kind]

    return get


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("kind", ["llama-relu", "llama-silu", "prosparse", "bamboo"])
def test_dense_matches_transformers(kind, isa, converted, reference):
    logits, stats = run(converted(kind), isa=isa)
    assert logits.shape == (N_PROMPT + N_DECODE, 384)
    assert max_rel_err(logits, reference(kind)) <= 1e-4
    assert stats["batch_tokens"] == N_PROMPT and stats["decode_tokens"] == N_DECODE


@pytest.mark.parametrize("outtype", ["f32", "q8_0", "q4_0"])
@pytest.mark.parametrize("kind", ["llama-relu", "prosparse", "bamboo"])
def test_oracle_and_gate_equal_dense_on_relu_models(kind, outtype, converted):
    """Bit for bit, quantized files too: a neuron's gate and up values are the same whichever path computed
    them (dense mode's 8-row groups, gate mode's gathered rows), and skipped neurons contribute exact zeros."""
    path = converted(kind, outtype, predictors=True)
    dense, dense_stats = run(path, "dense")
    for mode in ("oracle", "gate"):
        logits, stats = run(path, mode)
        assert np.array_equal(logits, dense), mode  # bit for bit: the skipped neurons contribute exact zeros
        for a, b in zip(stats["layers"], dense_stats["layers"]):
            assert a["density"] == pytest.approx(b["density"])
            assert a["computed_density"] <= b["computed_density"]
    oracle = run(path, "oracle")[1]
    assert all(l["recall"] == 1.0 for l in oracle["layers"])
    assert oracle["density"] < 0.9  # the sparse paths did skip neurons


def silu_rule(thresholds):
    return lambda i, x, a: a * (a.abs() > thresholds[i])


def test_gate_mode_applies_silu_thresholds(tiny_model_dir, converted):
    thresholds = (0.05, 0.08)
    path = converted("llama-silu", thresholds=thresholds)
    ref = hf_logits(tiny_model_dir("llama-silu"), TOKENS, mask_fn=silu_rule(thresholds))
    dense = hf_logits(tiny_model_dir("llama-silu"), TOKENS)
    logits, stats = run(path, "gate")
    assert max_rel_err(logits, ref) <= 1e-4
    assert max_rel_err(logits, dense) > 1e-3  # the thresholds did change the model
    assert 0.05 < stats["density"] < 0.95
    # dense mode ignores the thresholds
    assert max_rel_err(run(path, "dense")[0], dense) <= 1e-4


def test_gate_mode_batches_take_the_cheaper_kernels(converted):
    """A gate-mode batch applies the gate rule through the dense rule's kernels (every up by gemm8) while its
    layer's measured density is high (the first batch: nothing measured yet) and through gate mode's own
    (each token's passing ups) once it is low. The values are the same: a prompt in 5 batches of 16 (the
    first by the dense rule's kernels, the rest by gate mode's) equals it in one batch (the dense rule's)."""
    path = converted("llama-silu", "q8_0", thresholds=(0.3, 0.3))
    logits, layers = {}, {}
    for batch in (16, 80):
        with engine.Model(path, threads=2, sparse_mode="gate", batch_size=batch) as m:
            logits[batch] = m.eval(TOKENS)
            layers[batch] = m.stats()["layers"]
    np.testing.assert_array_equal(logits[16], logits[80])
    for layer in layers[16]:
        assert layer["density"] < 0.35  # sparse enough for the gate kernels to win (2.5 x 0.35 < 1)
        assert layer["modes"] == {"dense_rule": 16, "gate": len(TOKENS) - 16}, layer["modes"]
    assert all(layer["modes"] == {"dense_rule": len(TOKENS)} for layer in layers[80])


@pytest.mark.parametrize("kind", ["llama-relu", "bamboo"])
def test_predictor_mode_matches_its_rule(kind, tiny_model_dir, converted):
    path = converted(kind, predictors=True)
    ref = hf_logits(tiny_model_dir(kind), TOKENS, mask_fn=predictor_rule(path))
    with engine.Model(path, threads=2, sparse_mode="predictor", recall_check=True) as m:
        logits = engine_prompt_then_decode(m, TOKENS, N_PROMPT)
        stats = m.stats()
    assert max_rel_err(logits, ref) <= 1e-4
    for layer in stats["layers"]:  # random predictors: about half selected, recall about a half
        assert 0.2 < layer["predicted_density"] < 0.8
        assert 0.2 < layer["recall"] < 0.8
    assert stats["phases"]["predictor"] > 0


@pytest.mark.parametrize("kind", ["llama-relu", "bamboo"])
def test_predictor_batches_stream_or_gather_to_the_same_bits(kind, tmp_path, converted):
    """A predictor-mode batch whose tokens together select most neurons reads every gate in order (8-row groups)
    and keeps each token's selection; one that selects few reads its rows by index. A prompt in one batch of
    64 tokens (together they select nearly all) and in batches of 2 (under half) gives the same bits."""
    import gguf

    path = rewrite(converted(kind, "q8_0", predictors=True), tmp_path / "sparse.gguf", fields={
        "powerinfer.predictor_thresholds": ([PREDICTOR_SPARSE_THRESHOLD] * N_LAYER, gguf.GGUFValueType.ARRAY)})
    logits = {}
    for batch in (N_PROMPT, 2):
        with engine.Model(path, threads=2, sparse_mode="predictor", batch_size=batch) as m:
            logits[batch] = m.eval(TOKENS[:N_PROMPT])
            densities = [l["predicted_density"] for l in m.stats()["layers"]]
        assert all(0.03 < d < 0.29 for d in densities), densities  # per token: 2 tokens select under half
    np.testing.assert_array_equal(logits[N_PROMPT], logits[2])


def test_predictor_batch_reads_its_coefficients_in_place(converted):
    """A streamed predictor batch settles every neuron of every token (0 where the predictor or the rule leaves
    it out), so when its tokens together use nearly every down row, the down projection reads their
    coefficients in place instead of gathering them per panel: the same bits as batches of 2 (which use
    about half of the rows and gather)."""
    path = converted("llama-relu", "q8_0", predictors=True)  # thresholds 0: each token selects about half
    logits = {}
    for batch in (N_PROMPT, 2):
        with engine.Model(path, threads=2, sparse_mode="predictor", batch_size=batch) as m:
            logits[batch] = m.eval(TOKENS[:N_PROMPT])
            densities = [l["density"] for l in m.stats()["layers"]]
        assert all(0.1 < d < 0.5 for d in densities), densities
    np.testing.assert_array_equal(logits[N_PROMPT], logits[2])


@pytest.mark.parametrize("pred_type", ["Q8_0", "Q4_0"])
def test_quantized_predictors_follow_their_rule(pred_type, tmp_path, tiny_model_dir, converted):
    """Quantized predictors (fc1 packed, the cold tier's fc2 rows in 8-row groups scored by gemm8), with and
    without a hot tier taking neurons out of the groups, follow the rule of the file's own (dequantized)
    predictor with q8_0 inputs: a q8_0 file as convert writes it, and q4_0 predictors (PowerInfer's
    quantizer's choice) in an f32 file, so that the model's own rounding does not move the predictor's
    input. The thresholds are moved off 0: q4_0 logits are integer sums times scales, and a sum of exactly
    0 against a threshold of 0 is a tie that float rounding in the reference breaks either way."""
    import gguf

    if pred_type == "Q8_0":
        src = converted("llama-relu", "q8_0", predictors=True)
        quantized = {}
    else:
        src = converted("llama-relu", predictors=True)
        qtype, tensors = gguf.GGMLQuantizationType.Q4_0, read_tensors(src)
        quantized = {name: (gguf.quants.quantize(w, qtype), qtype) for name, (_, w) in tensors.items()
                     if name.endswith((".fc1.weight", ".fc2.weight"))}
    path = rewrite(src, tmp_path / "pred.gguf", tensors=quantized, fields={
        "powerinfer.predictor_thresholds": ([0.1234] * N_LAYER, gguf.GGUFValueType.ARRAY)})
    types = read_tensors(path)
    assert {types[f"blk.{i}.{k}.weight"][0] for i in range(N_LAYER) for k in ("fc1", "fc2")} == {pred_type}
    rule = predictor_rule(path)
    rng = np.random.default_rng(7)
    hot = [rng.random(N_FF) < 0.3 for _ in range(N_LAYER)]
    no_hot = [np.zeros(N_FF, bool)] * N_LAYER
    for gpuidx, is_hot in ((None, no_hot), (write_gpuidx(tmp_path / "m.gpuidx", hot), hot)):
        hot_t = [torch.from_numpy(h) for h in is_hot]
        ref = hf_logits(tiny_model_dir("llama-relu"), TOKENS, weights_from=path if pred_type == "Q8_0" else None,
                        q8_inputs=pred_type == "Q8_0", mask_fn=lambda i, x, a: torch.where(hot_t[i], a, rule(i, x, a)))
        # the q8_0 model token by token: a batch's down projection rounds its input and weights to q8_0 (the
        # reference computes it in floats), which moves predictor logits across the threshold
        logits, stats = run(path, "predictor", gpuidx=gpuidx, cpu_hot_tier=True,
                            batch_size=1 if pred_type == "Q8_0" else 512)
        # measured: 7e-7 (q4_0 predictors, f32 model), 4e-3 to 6e-3 (q8_0 model: its rounding moves a few
        # logits across the threshold); the wrong neuron's fc2 row (a slot/id mix-up in the groups) gives ~1
        assert max_rel_err(logits, ref) <= (1e-4 if pred_type == "Q4_0" else 2e-2), gpuidx
        assert all(0.2 < l["predicted_density"] < 0.8 for l in stats["layers"])


@pytest.mark.parametrize("outtype", ["f32", "q8_0"])  # fc2 transposed in tiles / quantized in 8-row groups
@pytest.mark.parametrize("hot_share", [0.0, 0.3])
def test_decode_steps_do_not_depend_on_threads_or_staging(hot_share, outtype, tmp_path, converted):
    """A predictor-mode decode step's chunks score, list and compute the neurons of their range in one job
    and list the down_t rows they used; the lists are joined in slot order: logits and statistics are the
    same bits for any thread count in every mode, and the fused predictor step equals the staged one (the
    recall check takes the staged path)."""
    path = converted("llama-relu", outtype, predictors=True)
    rng = np.random.default_rng(11)
    gpuidx = write_gpuidx(tmp_path / "m.gpuidx", [rng.random(N_FF) < hot_share for _ in range(N_LAYER)]) if hot_share else None
    for mode in ("dense", "gate", "predictor", "auto"):
        runs = [dict(threads=t) for t in (1, 2, 3)] + ([dict(threads=2, recall_check=True)] if mode == "predictor" else [])
        results = []
        for kw in runs:
            with engine.Model(path, sparse_mode=mode, gpuidx=gpuidx, cpu_hot_tier=True, **kw) as m:
                logits = engine_prompt_then_decode(m, TOKENS, N_PROMPT)
                layers = m.stats()["layers"]
            results.append((logits, np.array([[l[k] for k in ("density", "computed_density", "predicted_density")]
                                              for l in layers], dtype=float)))
        for kw, (logits, densities) in zip(runs[1:], results[1:]):
            np.testing.assert_array_equal(logits, results[0][0], err_msg=f"{mode} {kw}")
            np.testing.assert_array_equal(densities, results[0][1], err_msg=f"{mode} {kw}")  # NaN where none


# FFN matrices of the cold tier that a decode step's kernels read whole (gate, up), by the layer's decode mode
WHOLE_MATRICES = {"dense": 2, "dense_rule": 2, "gate": 1}


def layer_group_bytes(outtype: str) -> tuple[int, int]:
    """Bytes of one neuron's row and of one FFN matrix of one layer in 8-row groups."""
    block = {"q8_0": (34, 16 + 8 * 32), "q4_0": (18, 16 + 8 * 16)}[outtype]  # bytes: a row's block, a group-block
    return HIDDEN // 32 * block[0], N_FF // 8 * HIDDEN // 32 * block[1]


def check_groups_follow_decode_modes(stats, layer_groups, label):
    """Each layer's cold gate/up groups are exactly the matrices its last decode step read whole."""
    held = [layer["cold_groups"] for layer in stats["layers"]]
    assert held == [layer_groups * WHOLE_MATRICES.get(layer["decode_mode"], 0) for layer in stats["layers"]], label
    assert stats["weight_copies"]["cold_groups"] == sum(held), label


@pytest.mark.parametrize("outtype", ["q8_0", "q4_0"])
def test_each_weight_held_once(outtype, tmp_path, converted):
    """Issue 7's memory target: a weight is on the heap in the 8-row layout only where the layer's decode steps
    read the whole matrix; rows read by index come from the mapped file alone. Dense mode keeps the cold gate
    and up groups, gate mode the gates (and the ups of a layer whose steps take the dense rule's kernels), the
    modes that read rows by index (predictor, oracle) none, so a prompt packs each pass's groups as it goes. A
    hot tier holds its gate and up as groups only, its down_t as rows."""
    path = converted("llama-relu", outtype, predictors=True)
    row_bytes, layer_groups = layer_group_bytes(outtype)
    decode_modes = {"dense": {"dense"}, "gate": {"gate", "dense_rule"}, "predictor": {"predictor"},
                    "auto": {"gate", "dense_rule", "predictor"}, "oracle": {"oracle"}}
    for mode, allowed in decode_modes.items():
        _, stats = run(path, mode)
        assert {layer["decode_mode"] for layer in stats["layers"]} <= allowed, mode
        check_groups_follow_decode_modes(stats, layer_groups, mode)
        assert stats["weight_copies"]["hot"] == 0
    assert run(path, "dense")[1]["weight_copies"]["cold_groups"] == 2 * N_LAYER * layer_groups
    rng = np.random.default_rng(5)
    hot = [rng.random(N_FF) < 0.3 for _ in range(N_LAYER)]
    _, stats = run(path, "predictor", gpuidx=write_gpuidx(tmp_path / "m.gpuidx", hot), cpu_hot_tier=True)
    n_hot = [int(h.sum()) for h in hot]
    group_bytes = layer_groups // (N_FF // 8)
    assert stats["weight_copies"]["hot"] == sum(n * row_bytes + 2 * -(-n // 8) * group_bytes for n in n_hot)
    assert stats["weight_copies"]["cold_groups"] == 0


def test_first_prompt_leaves_the_layout_to_the_first_decode_step(converted):
    """Issue 65: a fresh engine's first prompt does not arrange the cold tier (every layer's gate/up groups and down
    quads built one after another, before the first token is sampled); it packs each pass's groups in its scratch,
    as a predictor batch does, and the first decode step arranges the layer. The values are the same either way:
    the same prompt again, on the arranged tier, gives the same logits bit for bit."""
    path = converted("llama-silu", "q8_0")
    _, layer_groups = layer_group_bytes("q8_0")
    with engine.Model(path, threads=2, sparse_mode="dense") as m:
        first = m.eval(TOKENS[:N_PROMPT])
        copies = m.stats()["weight_copies"]
        assert (copies["cold_groups"], copies["down_quads"]) == (0, 0)
        m.eval(TOKENS[N_PROMPT:N_PROMPT + 1])
        assert m.stats()["weight_copies"]["cold_groups"] == 2 * N_LAYER * layer_groups
        m.reset()
        np.testing.assert_array_equal(m.eval(TOKENS[:N_PROMPT]), first)


def test_switching_modes_holds_one_copy(converted):
    """A process that changes FFN mode frees the groups the new mode reads by index (dense -> predictor: all of
    them) and groups again what it reads whole, when it switches, with the values a fresh engine gives in each
    mode."""
    path = converted("llama-relu", "q8_0", predictors=True)
    _, layer_groups = layer_group_bytes("q8_0")
    with engine.Model(path, threads=2) as m:
        for mode in ("dense", "predictor", "gate", "dense", "predictor"):
            m.sparse_mode = mode  # arranges the layers at once: the first token after it does not pay for that
            switched = m.stats()["weight_copies"]["cold_groups"]
            m.reset()
            logits = engine_prompt_then_decode(m, TOKENS, N_PROMPT)
            np.testing.assert_array_equal(logits, run(path, mode)[0], err_msg=mode)
            stats = m.stats()
            check_groups_follow_decode_modes(stats, layer_groups, mode)
            expected = {"dense": 2 * N_LAYER * layer_groups, "predictor": 0}
            if mode in expected:
                assert stats["weight_copies"]["cold_groups"] == expected[mode] == switched, mode


def test_gate_mode_decode_steps_take_the_cheaper_kernels(tiny_model_dir, converted):
    """A gate-mode decode step applies the gate rule through the dense rule's kernels (every up in order, from
    groups it then holds) where its layer's measured density is high, and through gate mode's own (the passing
    ups by index) where it is low; either way the values are the rule's (transformers with the same
    thresholds), and the layer holds the ups in groups only while it reads them whole."""
    for thresholds, kernels_taken, dense_enough in (((0.001, 0.001), "dense_rule", 0.95), ((0.3, 0.3), "gate", 0.0)):
        ref = hf_logits(tiny_model_dir("llama-silu"), TOKENS, mask_fn=silu_rule(thresholds))
        logits, stats = run(converted("llama-silu", thresholds=thresholds), "gate")
        assert max_rel_err(logits, ref) <= 1e-4, thresholds
        assert all(layer["decode_mode"] == kernels_taken for layer in stats["layers"]), thresholds
        assert all(layer["density"] > dense_enough for layer in stats["layers"])
        _, stats = run(converted("llama-silu", "q8_0", thresholds=thresholds), "gate")
        assert all(layer["decode_mode"] == kernels_taken for layer in stats["layers"]), thresholds
        check_groups_follow_decode_modes(stats, layer_group_bytes("q8_0")[1], thresholds)


def test_decode_kernels_change_when_it_pays(converted):
    """A layer's decode steps change kernels only when what the kept ones cost beyond the cheapest's would pay for
    the regrouping (rent or buy): with densities hovering at the break-even of the dense rule's kernels and gate
    mode's (~0.55) they keep them, where a change on every swing took 19-43 changes in 242 steps; with densities
    settling below it after the prompt, each layer changes once, to gate mode's kernels."""
    tokens = random_tokens(250, 384, seed=3)
    for thresholds, most, final in (((0.18, 0.18), 1, None), ((0.2, 0.2), 1, "gate")):
        with engine.Model(converted("llama-silu", "q8_0", thresholds=thresholds), threads=2, sparse_mode="gate") as m:
            m.eval(tokens[:8], all_logits=False)
            for t in tokens[8:]:
                m.eval([t], all_logits=False)
            layers = m.stats()["layers"]
        assert all(layer["kernel_changes"] <= most for layer in layers), thresholds
        if final:
            assert all(layer["kernel_changes"] == 1 and layer["decode_mode"] == final for layer in layers), thresholds


def test_predictor_recall_equals_independent_count(tiny_model_dir, converted):
    path = converted("llama-relu", predictors=True)
    tensors = read_tensors(path)
    hits, positives, selected = np.zeros(N_LAYER), np.zeros(N_LAYER), np.zeros(N_LAYER)

    def count(i, x, a):
        fc1 = torch.from_numpy(tensors[f"blk.{i}.fc1.weight"][1])
        fc2 = torch.from_numpy(tensors[f"blk.{i}.fc2.weight"][1])
        sel = (torch.relu(x @ fc1.T) @ fc2.T) > 0
        true = a > 0
        hits[i] += (sel & true).sum().item()
        positives[i] += true.sum().item()
        selected[i] += sel.sum().item()
        return a * sel  # the predictor mode's model, so later layers see what the engine sees

    hf_logits(tiny_model_dir("llama-relu"), TOKENS, mask_fn=count)
    _, stats = run(path, "predictor", recall_check=True)
    for i, layer in enumerate(stats["layers"]):
        assert layer["recall"] == pytest.approx(hits[i] / positives[i], abs=2e-3)
        assert layer["predicted_density"] == pytest.approx(selected[i] / len(TOKENS) / N_FF, abs=2e-3)


def test_auto_on_a_silu_file_is_dense_where_it_reads_every_gate_and_the_rule_elsewhere(converted):
    """auto on a SiLU file with activation thresholds (issue 56): where it reads every gate and up it computes
    every neuron, dense's values (the exact model), not the rule's; where gate mode's kernels cost less, the rule's
    (the thresholded model). Here the prompt's batch reads every row, and the decode steps are sparse enough for
    gate mode's kernels: the values of a prompt in dense mode followed by decode steps in gate mode."""
    path = converted("llama-silu", thresholds=(0.05, 0.08))
    dense, _ = run(path, "dense")
    gate, _ = run(path, "gate")
    auto, stats = run(path, "auto")
    assert not np.array_equal(gate[:N_PROMPT], dense[:N_PROMPT])  # the thresholds change the model
    assert [layer["modes"] for layer in stats["layers"]] == [{"dense": N_PROMPT, "gate": N_DECODE}] * N_LAYER
    with engine.Model(path, threads=2, sparse_mode="dense") as m:
        mixed = [m.eval(TOKENS[:N_PROMPT])]
        m.sparse_mode = "gate"
        mixed += [m.eval([t])[None, 0] for t in TOKENS[N_PROMPT:]]
    np.testing.assert_array_equal(auto, np.concatenate(mixed))


@pytest.mark.parametrize("threshold, first", [(PREDICTOR_SPARSE_THRESHOLD, "predictor"), (-1e9, "gate")])
def test_auto_prices_the_predictor_it_measured_on_the_prompt(threshold, first, tmp_path, converted):
    """auto mode scores the predictor for a prompt's last tokens (the prompt itself runs without it), so that its
    first decode step prices predictor mode at the densities measured there. A predictor selecting 5-25 % of the
    neurons where ~48 % are active takes every layer from the first step (priced on a guess from the activation
    density alone, ~60 % selected, it was never tried); one selecting every neuron is priced out."""
    import gguf

    path = rewrite(converted("llama-relu", "q8_0", predictors=True), tmp_path / "p.gguf", fields={
        "powerinfer.predictor_thresholds": ([threshold] * N_LAYER, gguf.GGUFValueType.ARRAY)})
    with engine.Model(path, threads=2, sparse_mode="auto") as m:
        m.eval(TOKENS[:16], all_logits=False)
        m.eval(TOKENS[16:17], all_logits=False)
        layers = m.stats()["layers"]
    assert [layer["decode_mode"] for layer in layers] == [first] * N_LAYER
    assert all(layer["density"] > 0.4 for layer in layers)  # the prompt's, through gate mode's kernels
    if first == "predictor":  # 5-25 % per token on average; the prompt's last few tokens spread a little wider
        assert all(0.03 < layer["predicted_density"] < 0.32 for layer in layers)


def test_hot_cold_tiers(tmp_path, tiny_model_dir, converted):
    path = converted("llama-relu", predictors=True)
    rng = np.random.default_rng(3)
    hot = [rng.random(N_FF) < 0.3 for _ in range(N_LAYER)]
    gpuidx = write_gpuidx(tmp_path / "m.gpuidx", hot)
    dense, _ = run(path, "dense")
    oracle, stats = run(path, "oracle", gpuidx=gpuidx, cpu_hot_tier=True)
    assert max_rel_err(oracle, dense) <= 1e-5  # two partial sums instead of one: rounding only
    for i, layer in enumerate(stats["layers"]):
        assert layer["hot_neurons"] == hot[i].sum()
    check_predictor_with_hot_tier(path, tiny_model_dir("llama-relu"), hot, gpuidx)


def check_predictor_with_hot_tier(path, model_dir, hot, gpuidx, tol=1e-4):
    """Predictor mode with a hot tier: hot neurons always computed, cold ones as the file's predictor says."""
    rule = predictor_rule(path)
    hot_t = [torch.from_numpy(h) for h in hot]
    ref = hf_logits(model_dir, TOKENS, mask_fn=lambda i, x, a: torch.where(hot_t[i], a, rule(i, x, a)))
    with engine.Model(path, threads=2, sparse_mode="predictor", gpuidx=gpuidx, cpu_hot_tier=True) as m:
        assert m.info["hot_neurons"] == sum(h.sum() for h in hot)
        logits = engine_prompt_then_decode(m, TOKENS, N_PROMPT)
    assert max_rel_err(logits, ref) <= tol
    assert (logits.argmax(1) == ref.argmax(1)).mean() >= 0.95


def test_predictor_over_several_fc2_tiles(tmp_path):
    """The cold tier's fc2 is kept transposed in tiles of 256 neurons (a thread's share is one stream): a
    640-neuron FFN whose hot tier leaves two full tiles and a partial one follows the same rule."""
    n_ff = 640
    src = make_tiny("llama-relu", tmp_path / "wide", n_ff=n_ff)
    pred = write_predictors(tmp_path / "pred", N_LAYER, HIDDEN, n_ff, rank=32, thresholds=[0.0] * N_LAYER)
    path = tmp_path / "wide.gguf"
    convert_model(str(src), path, predictors_dir=pred, progress=False)
    rng = np.random.default_rng(5)
    hot = [rng.random(n_ff) < 0.1 for _ in range(N_LAYER)]
    assert all(2 * 256 < n_ff - h.sum() < 3 * 256 for h in hot)
    # 640 x 80 decisions per layer: a logit within rounding of the threshold may flip with the summation order
    # (measured: 0.05 relative error); weights read with the wrong tile width give 0.8
    gpuidx = write_gpuidx(tmp_path / "m.gpuidx", hot)
    check_predictor_with_hot_tier(path, src, hot, gpuidx, tol=0.2)
    # a decode step scores, lists and computes each thread's tiles in one job: the same bits as the staged path
    fused, staged = (run(path, "predictor", gpuidx=gpuidx, cpu_hot_tier=True, recall_check=check)[0] for check in (False, True))
    np.testing.assert_array_equal(fused, staged)


def test_dense_density_is_the_fraction_of_active_neurons(tiny_model_dir, converted):
    active = np.zeros(N_LAYER)

    def count(i, x, a):
        active[i] += (a > 0).float().mean().item()
        return a

    hf_logits(tiny_model_dir("llama-relu"), TOKENS, mask_fn=count)
    _, stats = run(converted("llama-relu"), "dense")
    for i, layer in enumerate(stats["layers"]):
        assert layer["density"] == pytest.approx(active[i], abs=1e-3)
        assert layer["computed_density"] == 1.0
    assert stats["decode_tokens_per_second"] > 0 and stats["prompt_tokens_per_second"] > 0
    # the FFN's two stages timed apart: gate and up (with the rule), then the down projection
    assert set(stats["phases"]) == {"embed", "attention", "predictor", "gate_up", "down", "output"}
    assert stats["phases"]["gate_up"] > 0 and stats["phases"]["down"] > 0


@pytest.mark.parametrize("outtype", ["f16", "q8_0", "q4_0"])
def test_quantized_files_match_their_dequantized_weights(outtype, tiny_model_dir, converted):
    """Against transformers running the file's own (dequantized) weights. f16 is exact up to rounding. q8_0/q4_0:
    token by token (decode steps) against the reference with the projection inputs rounded through q8_0 as the
    engine's integer dot products do (llama.cpp's way; with 8-bit inputs, float rounding differences flip a few of
    the roundings, so the bound is looser). A prompt's batch also multiplies its down projection in integers (its
    input and the transposed weights in q8_0), which the reference does not: the batch and the decode steps are
    each bounded against float64, the batch about as close as the decode steps, and against each other."""
    path = converted("llama-silu", outtype)
    ref = hf_logits(tiny_model_dir("llama-silu"), TOKENS, weights_from=path, q8_inputs=outtype != "f16")
    if outtype == "f16":
        for isa in ISAS:
            assert max_rel_err(run(path, isa=isa)[0], ref) <= 1e-4, isa
        return
    ref64 = hf_logits(tiny_model_dir("llama-silu"), TOKENS, weights_from=path, float64=True)
    for isa in ISAS:
        decode, _ = run(path, isa=isa, batch_size=1)
        batch, _ = run(path, isa=isa)  # N_PROMPT tokens in one batch, then decode steps
        assert max_rel_err(decode, ref) <= 2e-2, isa
        assert (decode.argmax(1) == ref.argmax(1)).mean() >= 0.95, isa
        # measured (q8_0, q4_0): the batch 1.7e-2 / 1.8e-2 from float64, decode 1.3e-2 / 1.4e-2, each other 1.6e-2
        err_decode, err_batch = max_rel_err(decode, ref64), max_rel_err(batch, ref64)
        assert err_decode <= 2.5e-2 and err_batch <= 2.5e-2, isa
        assert err_batch <= 1.5 * err_decode, isa
        assert max_rel_err(batch, decode) <= 2.5e-2, isa
        assert (batch.argmax(1) == ref64.argmax(1)).mean() >= 0.9, isa


@pytest.mark.parametrize("isa", [i for i in ("avx2", "avx512") if kernels.available(i)])
def test_dense_down_projection_over_quads_gives_the_rows_bits(isa, converted):
    """A SiLU model's dense mode holds each layer's q4_0 down_t rows in quads (every decode step uses every row)
    and its decode steps read them there: the same logits, bit for bit, as the scalar set (no axpy_quads) reading
    the rows; gate mode, whose steps leave rows out, holds none. Input sparsity's own FFN gives them back."""
    path = converted("llama-silu", "q4_0")
    with_quads, stats = run(path, isa=isa)
    assert all(l["down_quads"] > 0 for l in stats["layers"])
    assert stats["weight_copies"]["down_quads"] == sum(l["down_quads"] for l in stats["layers"])
    rows, stats = run(path, isa="scalar")
    assert all(l["down_quads"] == 0 for l in stats["layers"])
    np.testing.assert_array_equal(with_quads, rows)
    _, stats = run(path, "gate", isa=isa)
    assert all(l["down_quads"] == 0 for l in stats["layers"])


@pytest.mark.parametrize("kv_type", ["f32", "f16"])
@pytest.mark.parametrize("kind", ["llama-relu", "falcon7b"])
def test_long_context_matches_transformers(kind, kv_type, tiny_model_dir, converted):
    """Past the training context's 256 positions and across several tiles of cached keys: prompt batches and
    decode steps (whose heads share their kv head's reads: 2 query heads a kv head here, 4 in falcon7b's
    multi-query layout) against transformers, and decode steps that do not depend on the thread count. An f16
    cache against transformers reading its keys and values rounded to f16."""
    n_prompt, tokens = 200, random_tokens(300, 300, seed=4)
    ref = hf_logits(tiny_model_dir(kind), tokens, kv_f16=kv_type == "f16")
    logits = {}
    for threads in (1, 2, 3):
        with engine.Model(converted(kind), threads=threads, ctx_size=320, batch_size=48, kv_type=kv_type) as m:
            logits[threads] = engine_prompt_then_decode(m, tokens, n_prompt)
            assert m.info["kv_type"] == kv_type
    # measured: 4e-7 to 8e-7 (f32), 2e-6 to 3e-6 (f16 against the rounded reference; 1e-4 to 3e-4 unrounded)
    assert max_rel_err(logits[2], ref) <= (1e-4 if kv_type == "f32" else 2e-5)
    assert np.array_equal(logits[1][n_prompt:], logits[2][n_prompt:])
    assert np.array_equal(logits[3][n_prompt:], logits[2][n_prompt:])


def test_f16_kv_cache_halves_the_cache(converted, tiny_model_dir):
    """The cache's bytes halve; the logits move by the rounding of the cached keys and values (against f32
    transformers) while the greedy tokens stay."""
    path = converted("llama-silu")
    sizes, logits = {}, {}
    for kv_type in ("f32", "f16"):
        with engine.Model(path, threads=2, ctx_size=200, kv_type=kv_type) as m:
            sizes[kv_type] = m.info["kv_cache_bytes"]
            logits[kv_type] = engine_prompt_then_decode(m, TOKENS, N_PROMPT)
    assert sizes["f32"] == N_LAYER * N_KV * (HIDDEN // N_HEAD) * (256 + 256) * 4  # keys and values in whole tiles of 64
    assert sizes["f16"] * 2 == sizes["f32"]
    ref = hf_logits(tiny_model_dir("llama-silu"), TOKENS)
    assert 1e-5 < max_rel_err(logits["f16"], ref) <= 1e-2
    assert (logits["f16"].argmax(1) == ref.argmax(1)).mean() >= 0.97
    with pytest.raises(engine.EngineError, match="unknown KV cache type"):
        engine.Model(path, kv_type="q4_0")


def test_eval_cache_semantics(converted):
    path = converted("llama-relu")
    with engine.Model(path, threads=1, ctx_size=80, batch_size=7) as m:  # batches of 7: chunking
        full = m.eval(TOKENS)
        assert m.n_past == 80
        with pytest.raises(engine.EngineError, match="context full"):
            m.eval([5])
        m.reset(10)
        np.testing.assert_allclose(m.eval(TOKENS[10:20]), full[10:20], rtol=0, atol=1e-5)
        last = m.eval(TOKENS[20:30], all_logits=False)
        np.testing.assert_allclose(last, full[29], rtol=0, atol=1e-5)
        with pytest.raises(engine.EngineError, match="outside the vocabulary"):
            m.eval([384])
        with pytest.raises(engine.EngineError, match="keep"):
            m.reset(31)
        with pytest.raises(engine.EngineError, match="unknown sparse mode"):
            m.sparse_mode = "fast"
        with pytest.raises(engine.EngineError, match="no predictors"):
            m.sparse_mode = "predictor"
    with pytest.raises(engine.EngineError, match="closed"):
        m.eval([1])


def test_greedy_generation_follows_the_logits(converted):
    path = converted("llama-silu")
    with engine.Model(path, threads=2) as m:
        out = list(m.generate(TOKENS[:8], 12))
    with engine.Model(path, threads=2) as m:
        expect, seq = [], list(TOKENS[:8])
        for _ in range(12):
            tok = int(m.eval(seq)[-1].argmax())
            m.reset()
            expect.append(tok)
            seq.append(tok)
    assert out == expect


def test_sampling_distribution_and_cuts(converted):
    with engine.Model(converted("llama-silu"), threads=1) as m:
        logits = m.eval(TOKENS[:5], all_logits=False).astype(np.float64)
        m.seed(11)
        draws = np.array([m.sample(temperature=1.5, top_k=0, top_p=1.0) for _ in range(20000)])
        counts = np.bincount(draws, minlength=logits.size)

        def chi2_pvalue(temperature):
            p = np.exp((logits - logits.max()) / temperature)
            expected = p / p.sum() * draws.size
            return scipy.stats.chisquare(counts, expected).pvalue

        assert chi2_pvalue(1.5) > 1e-3  # the draws follow softmax(logits / T) ...
        assert chi2_pvalue(1.2) < 1e-6  # ... and the test tells a different temperature apart
        order = np.argsort(-logits)
        top5 = {m.sample(temperature=1.0, top_k=5, top_p=1.0) for _ in range(500)}
        assert top5 <= set(order[:5].tolist()) and len(top5) > 1
        ps = np.exp(logits - logits.max())
        ps = ps[order] / ps.sum()
        nucleus = set(order[:np.searchsorted(np.cumsum(ps), 0.5) + 1].tolist())
        assert {m.sample(temperature=1.0, top_k=0, top_p=0.5) for _ in range(500)} <= nucleus
        assert m.sample(temperature=1.0, top_k=1) == int(logits.argmax())


def test_seeded_generation_is_reproducible_and_penalty_applies(converted):
    path = converted("llama-silu")

    def gen(seed, **kw):
        with engine.Model(path, threads=2) as m:
            return list(m.generate(TOKENS[:4], 24, temperature=0.9, seed=seed, **kw))

    assert gen(5) == gen(5)
    assert gen(5) != gen(6)
    with engine.Model(path, threads=2) as m:  # a huge penalty forbids repeats within the window
        out = list(m.generate(TOKENS[:4], 30, temperature=0.0, repeat_penalty=1e6, repeat_last_n=64))
    window = TOKENS[:4] + out
    assert len(set(out)) == len(out) and not set(out) & set(TOKENS[:4]), window


def test_modes_switch_on_one_engine(converted):
    """A tier's gate/up groups are built on first use by the mode that needs them (gate mode: gate only,
    dense: up as well): switching modes on one engine gives each mode the logits of a fresh engine."""
    path = converted("llama-silu", "q8_0")
    fresh = {}
    for mode in ("dense", "gate"):
        with engine.Model(path, threads=2, sparse_mode=mode) as m:
            fresh[mode] = m.eval(TOKENS[:12])
    with engine.Model(path, threads=2, sparse_mode="gate") as m:
        for mode in ("gate", "dense", "gate"):
            m.reset()
            m.sparse_mode = mode
            np.testing.assert_array_equal(m.eval(TOKENS[:12]), fresh[mode], err_msg=mode)


def test_prosparse_applies_its_fatrelu_threshold(tiny_model_dir, converted):
    """The ProSparse file against transformers' Llama with FATReLU written out here (the gate where it exceeds
    the config's threshold), not through our adapter; the same weights as plain ReLU are measurably another
    model, so a threshold dropped anywhere (convert, loader, any FFN path) fails."""
    from transformers import LlamaConfig, LlamaForCausalLM

    src = tiny_model_dir("prosparse")
    config = LlamaConfig.from_pretrained(src)
    assert config.hidden_act == "fatrelu" and config.hidden_act_param == PROSPARSE_THRESHOLD
    config.hidden_act = "relu"
    model = LlamaForCausalLM.from_pretrained(src, config=config, dtype=torch.float32).eval()
    with torch.no_grad():
        relu = model(torch.tensor([TOKENS])).logits[0].numpy()

        class FatRelu(torch.nn.Module):
            def forward(self, x):
                return torch.where(x > PROSPARSE_THRESHOLD, x, torch.zeros_like(x))

        for layer in model.model.layers:
            layer.mlp.act_fn = FatRelu()
        want = model(torch.tensor([TOKENS])).logits[0].numpy()
    assert max_rel_err(relu, want) > 1e-2
    path = converted("prosparse", predictors=True)
    for mode in ("dense", "gate", "oracle"):
        logits, _ = run(path, mode)
        assert max_rel_err(logits, want) <= 1e-4, mode
    with engine.Model(path, threads=1) as m:
        assert m.info["activation"] == "fatrelu" and m.info["activation_thresholds"] == pytest.approx([PROSPARSE_THRESHOLD] * N_LAYER)
