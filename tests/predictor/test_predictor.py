"""Predictor training, calibration, metrics and file round trips on synthetic profiles."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from predictor_data import write_profile
from sklearn.metrics import recall_score

from cli_helpers import assert_one_line_error
from cli_helpers import run_cli as run_pi_tools

from powerinfer_tools.stages.predictors import predictor_training as tp
from powerinfer_tools.cli import main
from powerinfer_tools.stages.predictors.predictor import (Predictor, read_predictor_dir, recall_at_density, threshold_for_recall)


def run_cli(capsys, *args) -> tuple[int, str, str]:
    return run_pi_tools(capsys, "train-predictor", *args)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Small matrices on a shared 2-core machine: a second thread only adds contention (as the CLI's --threads)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def learnable(tmp_path_factory):
    return write_profile(tmp_path_factory.mktemp("learnable") / "prof", seed=1)


@pytest.fixture(scope="module")
def trained(learnable, tmp_path_factory):
    """Predictors trained by the CLI on the learnable profile (rank auto)."""
    out = tmp_path_factory.mktemp("trained") / "pred"
    main(["train-predictor", str(learnable), "--out", str(out), "--threads", "1", "--max-predictor-fraction", "0.2"])
    return out


def test_learnable_signal_reaches_target_recall_at_low_density(trained, tmp_path, capsys):
    """The recall is measured on rows of the same 'model' (same weights) that neither training nor the threshold's
    calibration saw (--evaluate on fresh rows): the training report's own recall is the calibration's target, met
    on the rows it was calibrated on by construction."""
    report = json.loads((trained / "report.json").read_text())
    assert report["settings"]["split"] == "by calibration sequence"
    for layer in report["layers"]:
        assert layer["density_ratio"] <= 1.3, layer          # not bought by predicting everything
        assert layer["auc"] > 0.98
        assert layer["rank"] <= 12      # the signal has rank 4: relu pairs make 8 enough; ranks tried: 4, 6, 8, 12
    assert report["predictor_fraction"] <= 0.2 + 1e-9
    fresh = write_profile(tmp_path / "fresh", seed=1, data_seed=7)
    code, out, err = run_cli(capsys, fresh, "--out", trained, "--evaluate", "--report", tmp_path / "eval.json")
    assert code == 0, err
    held_out = json.loads((tmp_path / "eval.json").read_text())
    assert held_out["mode"] == "evaluate"
    for layer in held_out["layers"]:
        assert layer["recall"] >= 0.98 and layer["density_ratio"] <= 1.35, layer  # the target, less sampling noise
    table = out.splitlines()
    mean = next(i for i, line in enumerate(table) if line.lstrip().startswith("mean"))
    assert "rec@bud, recall when" in " ".join(table[mean + 1:])  # the legend follows the table


def test_shuffled_labels_stay_near_chance(tmp_path):
    """Control: masks permuted across rows keep each neuron's firing rate but carry no signal; reaching
    the target recall then takes predicting nearly every neuron, and the AUC stays near 0.5."""
    profile = tp.read_profile(write_profile(tmp_path / "shuffled", seed=1, shuffled=True))
    results = tp.train_layers(profile, [0, 1], None, tp.TrainSettings(target_recall=0.99), 0.1, tmp_path)
    for r in results:  # at the target recall (met on the rows calibrated on, by construction)
        assert r.metrics["predicted_density"] > 0.9
        assert r.metrics["density_ratio"] > 2.0
        assert r.metrics["auc"] < 0.65


def test_written_files_round_trip_through_weights_only_load(trained, learnable):
    config = json.loads((trained / "config.json").read_text())
    assert config["format"] == "powerinfer-tools.predictors/1"
    assert config["sparse_threshold"] == min(e["threshold"] for e in config["layers"])
    profile = tp.read_profile(learnable)
    x = tp.load_samples(profile, 0).x[:50]
    for entry in config["layers"]:
        state = torch.load(trained / f"model_{entry['layer']}.pt", weights_only=True)
        assert set(state) == {"fc1.weight", "fc2.weight"}
        assert state["fc1.weight"].shape == (entry["rank"], 32) and state["fc2.weight"].shape == (128, entry["rank"])
        assert all(v.dtype == torch.float32 for v in state.values())
        # PowerInfer's converter builds fc1 -> ReLU -> fc2 without biases and loads the dict strictly
        reference = torch.nn.Sequential()
        reference.add_module("fc1", torch.nn.Linear(32, entry["rank"], bias=False))
        reference.add_module("relu", torch.nn.ReLU())
        reference.add_module("fc2", torch.nn.Linear(entry["rank"], 128, bias=False))
        reference.load_state_dict(state, strict=True)
        ours = read_predictor_dir(trained)
        assert ours.thresholds[entry["layer"]] == entry["threshold"]
        torch.testing.assert_close(ours.models[entry["layer"]](x), reference(x))


def test_powerinfer_style_directory_is_evaluated_with_its_sparse_threshold(trained, learnable, tmp_path, capsys):
    """A published PowerInfer dir: model_{i}.pt plus a config.json holding only sparse_threshold."""
    published = tmp_path / "published"
    published.mkdir()
    for i in (0, 1):
        (published / f"model_{i}.pt").write_bytes((trained / f"model_{i}.pt").read_bytes())
    (published / "config.json").write_text(json.dumps({"sparse_threshold": 0.0}))
    assert read_predictor_dir(published).thresholds == {0: 0.0, 1: 0.0}
    code, out, err = run_cli(capsys, learnable, "--out", published, "--evaluate")
    assert code == 0, err
    assert len([line for line in out.splitlines() if line.split()[0] in ("0", "1")]) == 2


def test_calibrated_threshold_is_the_tightest_meeting_the_target():
    gen = torch.Generator().manual_seed(0)
    labels = torch.rand(400, 50, generator=gen) < 0.3
    logits = labels.float() * 1.5 + torch.randn(400, 50, generator=gen)
    for target in (0.9, 0.95, 0.99):
        t = threshold_for_recall(logits, labels, target)
        recall = recall_score(labels.numpy().ravel(), (logits > t).numpy().ravel())
        assert recall >= target
        above = logits[labels & (logits > t)].min()   # the next threshold up misses one more active pair
        assert recall_score(labels.numpy().ravel(), (logits > above).numpy().ravel()) < target
    density = 0.4
    t_recall = recall_at_density(logits, labels, density)
    flat = logits.flatten()
    top = torch.zeros_like(flat, dtype=torch.bool)
    top[flat.argsort(descending=True)[:int(density * flat.numel())]] = True
    assert t_recall == pytest.approx(recall_score(labels.numpy().ravel(), top.numpy()), abs=1e-3)


def test_split_keeps_whole_sequences_apart():
    seq = torch.arange(40).repeat_interleave(16)
    train, held = tp.split_by_sequence(seq, 0.2, seed=3)
    assert set(seq[train].tolist()).isdisjoint(seq[held].tolist())
    assert len(set(seq[held].tolist())) == 8 and len(train) + len(held) == len(seq)


def test_weighted_recall_uses_mean_magnitude_per_neuron(learnable):
    profile = tp.read_profile(learnable)
    weights = profile.neuron_weights(0)
    counts = torch.load(learnable / "activation" / "activation_0.pt", weights_only=True).numpy()
    sums = torch.load(learnable / "magnitude" / "magnitude_0.pt", weights_only=True).numpy()
    np.testing.assert_allclose(weights[counts > 0], sums[counts > 0] / counts[counts > 0], rtol=1e-6)
    assert (weights[counts == 0] == 0).all()


def test_leftover_budget_goes_to_the_layer_that_needs_it(tmp_path):
    """Layer 0's signal has rank 2, layer 1's rank 8: under a cap of 7 rank units a layer, layer 0
    needs less than its share and layer 1 grows past its share into what layer 0 left."""
    profile = tp.read_profile(write_profile(tmp_path / "prof", seed=3, signal_rank=[2, 8]))
    share = tp.budget_rank(profile, 0.1)
    grown = []
    results = tp.train_layers(profile, [0, 1], None, tp.TrainSettings(target_recall=0.99), 0.1, tmp_path,
                              progress=lambda layer, chosen, tried, growing: grown.append(growing))
    easy, hard = results
    assert share == 7 and easy.rank < share < hard.rank
    assert any(grown)
    assert (easy.rank + hard.rank) * (32 + 128) <= 0.1 * 2 * 3 * 32 * 128
    assert easy.metrics["density_ratio"] < 1.3


def test_rank_ladder_and_budget():
    assert tp.rank_ladder(576, 1536, 250)[:6] == [4, 6, 8, 12, 16, 24]
    assert tp.rank_ladder(576, 1536, 3) == [3]
    assert tp.rank_ladder(576, 1536, 250)[-1] == 250
    assert tp.rank_ladder(64, 256, 1000)[-1] == 64
    predictor = Predictor(32, 8, 128)
    assert predictor.params() == 8 * (32 + 128)


# ---- bad input: one-line error, non-zero exit, nothing written ------------------------------------------

def assert_clean_failure(code, err, out_dir, fragment):
    # tqdm's bar may precede the error line when the failure comes mid-run
    assert_one_line_error(code, "\n".join(line for line in err.splitlines() if "|" not in line), fragment)
    assert not out_dir.exists()
    # nothing half-written beside it (the empty lock file that takes turns on the output stays, as profile's)
    assert not [p for p in out_dir.parent.iterdir()
                if p.name.startswith(f".{out_dir.name}") and p.name != f".{out_dir.name}.lock"]


def test_rank_larger_than_n_embd(learnable, tmp_path, capsys):
    code, _, err = run_cli(capsys, learnable, "--out", tmp_path / "p", "--rank", "33")
    assert_clean_failure(code, err, tmp_path / "p", "n_embd=32")


def test_layers_out_of_range(learnable, tmp_path, capsys):
    code, _, err = run_cli(capsys, learnable, "--out", tmp_path / "p", "--layers", "0-2")
    assert_clean_failure(code, err, tmp_path / "p", "out of range")


def test_missing_shard(tmp_path, capsys):
    profile = write_profile(tmp_path / "prof", seed=2)
    (profile / "samples" / "layer_1" / "shard_0001.safetensors").unlink()
    code, _, err = run_cli(capsys, profile, "--out", tmp_path / "p", "--rank", "8")
    assert_clean_failure(code, err, tmp_path / "p", "missing shard_0001")


def test_missing_last_shard_is_caught_by_the_row_count(tmp_path, capsys):
    profile = write_profile(tmp_path / "prof", seed=2)
    (profile / "samples" / "layer_0" / "shard_0003.safetensors").unlink()
    code, _, err = run_cli(capsys, profile, "--out", tmp_path / "p", "--rank", "8")
    assert_clean_failure(code, err, tmp_path / "p", "missing or truncated shards")


def test_predictors_of_another_model(trained, tmp_path, capsys):
    same_shape_other_model = write_profile(tmp_path / "other", seed=5, config_hash="synthetic-b")
    code, _, err = run_cli(capsys, same_shape_other_model, "--out", trained, "--evaluate",
                           "--report", tmp_path / "r.json")
    assert_clean_failure(code, err, tmp_path / "r.json", "config hash")
    other_shape = write_profile(tmp_path / "wide", seed=5, n_embd=48, config_hash="")
    code, _, err = run_cli(capsys, other_shape, "--out", trained, "--evaluate", "--report", tmp_path / "r.json")
    assert_clean_failure(code, err, tmp_path / "r.json", "n_embd=48")


def test_existing_output_is_not_replaced_without_force(learnable, trained, capsys):
    before = (trained / "model_0.pt").read_bytes()
    code, _, err = run_cli(capsys, learnable, "--out", trained, "--rank", "8")
    assert code == 1 and "--force" in err
    assert (trained / "model_0.pt").read_bytes() == before


def test_a_second_run_on_one_output_is_refused_before_training(learnable, tmp_path, capsys):
    """While another run holds the output's lock (as `profile` and `sparsify` take it), the second is refused at
    once: it used to train every layer and lose only at the end."""
    from powerinfer_tools.core.atomic import output_lock

    out = tmp_path / "pred"
    with output_lock(out, wait=False):
        code, _, err = run_cli(capsys, learnable, "--out", out, "--threads", "1")
    assert_one_line_error(code, err, "another pi-tools run is writing", str(out))
    assert not out.exists()


@pytest.mark.parametrize("args, fragment", [(("--rank", "big"), "'auto' or a positive integer"),
                                            (("--rank", "0"), "out of range"),
                                            (("--target-recall", "1.5"), "--target-recall"),
                                            (("--device", "tpu"), "not available")])
def test_bad_options(learnable, tmp_path, capsys, args, fragment):
    code, _, err = run_cli(capsys, learnable, "--out", tmp_path / "p", *args)
    assert_clean_failure(code, err, tmp_path / "p", fragment)


def test_not_a_profile_directory(tmp_path, capsys):
    code, _, err = run_cli(capsys, tmp_path, "--out", tmp_path / "p")
    assert_clean_failure(code, err, tmp_path / "p", "not a profile directory")


def test_a_layers_predictors_leave_memory_once_chosen(tmp_path):
    """Memory holds one layer's work: when a layer is done, its choice is in the output directory and no trained
    model of it stays referenced (a 70B's predictors would not fit)."""
    profile = tp.read_profile(write_profile(tmp_path / "prof", seed=3, signal_rank=[2, 8]))
    store = tmp_path / "store"
    store.mkdir()
    seen = []

    def progress(layer, chosen, tried, growing):
        assert (store / f"model_{layer}.pt").is_file()
        assert all(t.model is None for t in tried.values()) and chosen.model is None
        seen.append(layer)

    results = tp.train_layers(profile, [0, 1], None, tp.TrainSettings(target_recall=0.99), 0.1, store,
                              progress=progress)
    assert seen[:2] == [0, 1]
    for r in results:
        saved = torch.load(store / f"model_{r.layer}.pt", weights_only=True)
        assert saved["fc1.weight"].shape[0] == r.rank and r.seconds > 0
