"""pi-tools profile against an independent recomputation from plain forward passes."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from powerinfer_tools import models
from cli_helpers import assert_one_line_error, interrupt_profile_at_forward, run_cli
from tiny_models import DATA, KINDS, PROSPARSE_THRESHOLD

TEXT = DATA / "tinyshakespeare.txt"
SEQ_LEN, TOKENS = 64, 1024


def reference_activations(kind: str, model, seqs: torch.Tensor, thresholds: list[float]):
    """Per layer: (activation mask [N, n_ff], predictor input [N, n_embd]) from hooks on the plain
    projections and decoder layers (not the profiler's taps), sparsifying SiLU layers the same way."""
    layers = {"falcon": lambda m: m.transformer.h, "falcon7b": lambda m: m.transformer.h,
              "opt": lambda m: m.model.decoder.layers}.get(kind, lambda m: m.model.layers)(model)
    masks, inputs, handles = {}, {}, []
    for i, layer in enumerate(layers):
        if kind in ("falcon", "falcon7b"):
            handles.append(layer.register_forward_pre_hook(
                lambda mod, args, kw, i=i: inputs.__setitem__(i, (args[0] if args else kw["hidden_states"])),
                with_kwargs=True))
            handles.append(layer.mlp.dense_h_to_4h.register_forward_hook(
                lambda mod, a, out, i=i: masks.__setitem__(i, out > 0)))
            continue
        if kind == "opt":
            fc2_out = {}
            handles.append(layer.fc1.register_forward_hook(lambda mod, a, out, i=i: masks.__setitem__(i, out > 0)))
            handles.append(layer.fc2.register_forward_hook(lambda mod, a, out, i=i, s=fc2_out: s.__setitem__(i, out)))
            handles.append(layer.register_forward_hook(
                lambda mod, a, out, i=i, s=fc2_out: inputs.__setitem__(
                    i, (out[0] if isinstance(out, tuple) else out).reshape(-1, out.shape[-1]) - s[i])))
            continue
        mlp, state = layer.mlp, {}
        handles.append(mlp.gate_proj.register_forward_hook(lambda mod, a, out, s=state: s.__setitem__("g", out)))
        handles.append(mlp.up_proj.register_forward_hook(lambda mod, a, out, s=state: s.__setitem__("u", out)))
        handles.append(mlp.register_forward_hook(lambda mod, a, out, s=state: s.__setitem__("mlp", out)))

        def after_layer(mod, a, out, i=i, s=state):
            h = out[0] if isinstance(out, tuple) else out
            inputs[i] = h - s["mlp"]
            if kind == "llama-relu":
                masks[i] = s["g"] > 0
            elif kind == "prosparse":
                masks[i] = s["g"] > PROSPARSE_THRESHOLD
            elif kind == "bamboo":
                masks[i] = (s["g"] > 0) & (s["u"] > 0)
            else:
                masks[i] = torch.nn.functional.silu(s["g"]).abs() > thresholds[i]
        handles.append(layer.register_forward_hook(after_layer))
        if kind == "llama-silu":  # the profiler runs the thresholded model; do the same from outside
            def sparsify(mod, a, out, i=i):
                return out * (out.abs() > thresholds[i])
            handles.append(mlp.act_fn.register_forward_hook(sparsify))
    with torch.no_grad():
        model(input_ids=seqs, use_cache=False)
    for h in handles:
        h.remove()
    n_embd = inputs[0].shape[-1]
    return ([masks[i].reshape(-1, masks[i].shape[-1]) for i in range(len(layers))],
            [inputs[i].reshape(-1, n_embd) for i in range(len(layers))])


def test_every_calibration_text_is_in_the_sequences(tiny_model_dir):
    """Several texts give rows of each in turn: a first text long enough alone does not crowd out the others; one
    text gives its rows in order, as before."""
    from powerinfer_tools.stages.profiling import calibration

    tokenizer = models.load_tokenizer(models.resolve(str(tiny_model_dir("llama-relu"))))
    shakespeare = TEXT.read_text()[:40_000]
    other = " ".join(f"item {i} of a list of numbered things" for i in range(2000))
    alone = calibration.sequences_from_text(tokenizer, [shakespeare], SEQ_LEN, 8 * SEQ_LEN)
    second = calibration.sequences_from_text(tokenizer, [other], SEQ_LEN, 8 * SEQ_LEN)
    both = calibration.sequences_from_text(tokenizer, [shakespeare, other], SEQ_LEN, 8 * SEQ_LEN)
    assert alone.shape == both.shape == (8, SEQ_LEN)
    assert torch.equal(both[0::2], alone[:4]) and torch.equal(both[1::2], second[:4])


@pytest.mark.parametrize("kind", KINDS)
def test_profile_matches_independent_recomputation(kind, tiny_model_dir, tmp_path, capsys):
    model_dir = tiny_model_dir(kind)
    out = tmp_path / "prof"
    code, stdout, stderr = run_cli(capsys, *["profile", "-m", str(model_dir), "--calib", str(TEXT), "--tokens", str(TOKENS),
                                    "--seq-len", str(SEQ_LEN), "--max-samples", "300", "-o", str(out)])
    assert code == 0, stderr
    assert "hot10%" in stdout
    profile = json.loads((out / "profile.json").read_text())
    n_layer, n_ff = profile["model"]["n_layer"], profile["model"]["n_ff"]
    # input sparsity's thresholds only when asked (--input-allocation)
    assert profile["input_sparsity"] is None and not (out / "input_sparsity.json").exists()

    source = models.resolve(str(model_dir))
    model, _ = models.load_model(source)
    from powerinfer_tools.stages.profiling import calibration
    seqs = calibration.sequences_from_text(models.load_tokenizer(source), [TEXT.read_text()], SEQ_LEN, TOKENS)
    assert profile["tokens"] == seqs.numel()
    masks, inputs = reference_activations(kind, model, seqs, profile["thresholds"])

    for i in range(n_layer):
        counts = torch.load(out / "activation" / f"activation_{i}.pt", weights_only=True)
        assert counts.dtype == torch.int64 and counts.shape == (n_ff,)
        assert torch.equal(counts, masks[i].sum(0)), f"layer {i} counts differ"
        magnitude = torch.load(out / "magnitude" / f"magnitude_{i}.pt", weights_only=True)
        assert magnitude.shape == (n_ff,) and bool((magnitude[counts == 0] == 0).all())

        shards = sorted((out / "samples" / f"layer_{i}").glob("shard_*.safetensors"))
        rows = [load_file(str(s)) for s in shards]
        seq = torch.cat([r["seq"] for r in rows])
        pos = torch.cat([r["pos"] for r in rows])
        flat = seq * SEQ_LEN + pos
        assert len(flat) == 300 and len(set(flat.tolist())) == 300
        mask = np.unpackbits(torch.cat([r["mask"] for r in rows]).numpy(), axis=1, bitorder="little")[:, :n_ff]
        assert np.array_equal(mask.astype(bool), masks[i][flat].numpy())
        x = torch.cat([r["x"] for r in rows])
        assert x.dtype == torch.float16
        torch.testing.assert_close(x.float(), inputs[i][flat].float(), rtol=2e-3, atol=2e-3)

    if profile["rule"] == "threshold":
        for layer, target in zip(profile["layers"], profile["target_sparsity"]):
            assert abs(layer["sparsity"] - target) <= 0.01
    else:
        assert profile["thresholds"] == [0.0] * n_layer


def test_per_layer_targets_and_data_free(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "prof"
    code, stdout, stderr = run_cli(capsys, *["profile", "-m", str(tiny_model_dir("llama-silu")), "--tokens", "256",
                                    "--seq-len", "64", "--target-sparsity", "0.2,0.6", "-o", str(out)])
    assert code == 0, stderr
    assert "data-free" in stdout
    assert "generating calibration text" in stderr   # the generation phase shows its progress
    profile = json.loads((out / "profile.json").read_text())
    assert profile["calibration"] == "self-generated"
    assert profile["target_sparsity"] == [0.2, 0.6]
    assert profile["thresholds"][1] > profile["thresholds"][0]


def _bad(args, capsys, expect):
    assert_one_line_error(*run_cli(capsys, *args)[::2], expect)


def test_bad_input(tiny_model_dir, tmp_path, capsys):
    model = str(tiny_model_dir("llama-relu"))
    out = tmp_path / "out"
    _bad(["profile", "-m", str(tmp_path / "missing"), "-o", str(out)], capsys, "model not found")
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    _bad(["profile", "-m", model, "--calib", str(empty), "-o", str(out)], capsys, "is empty")
    binary = tmp_path / "blob.bin"
    binary.write_bytes(bytes(range(256)) * 10)
    _bad(["profile", "-m", model, "--calib", str(binary), "-o", str(out)], capsys, "binary")
    _bad(["profile", "-m", model, "--calib", str(TEXT), "--seq-len", "100000", "-o", str(out)], capsys,
         "context length")
    assert not out.exists()

    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "keep.txt").write_text("other content")
    _bad(["profile", "-m", model, "--calib", str(TEXT), "-o", str(taken)], capsys, "--force")
    assert (taken / "keep.txt").read_text() == "other content"

    from transformers import GPT2Config, GPT2LMHeadModel
    gpt2 = tmp_path / "gpt2"
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)).save_pretrained(gpt2)
    _bad(["profile", "-m", str(gpt2), "--calib", str(TEXT), "-o", str(out)], capsys, "unsupported architecture")
    assert not out.exists()


@pytest.mark.slow
def test_smollm2_profile_on_wikitext(tmp_path, capsys):
    """The real default model on real calibration text (a slice, to keep CI short)."""
    calib = DATA / "wikitext-2-valid.txt"
    if not calib.is_file():
        pytest.skip("shared data not present")
    out = tmp_path / "smol"
    code, stdout, stderr = run_cli(capsys, *["profile", "-m", "smollm2", "--calib", str(calib), "--tokens", "2048",
                                    "--seq-len", "256", "--max-samples", "512", "-o", str(out)])
    assert code == 0, stderr
    profile = json.loads((out / "profile.json").read_text())
    assert profile["model"]["n_layer"] == 30 and profile["model"]["n_ff"] == 1536
    assert len(list((out / "activation").glob("activation_*.pt"))) == 30
    for layer in profile["layers"]:
        assert abs(layer["sparsity"] - 0.2) < 0.05


def test_interrupted_profile_resumes_without_double_counting(tiny_model_dir, tmp_path, capsys, monkeypatch):
    from powerinfer_tools.stages.profiling import profiling as profile_mod

    model = str(tiny_model_dir("llama-silu"))
    args = ["profile", "-m", model, "--calib", str(TEXT), "--tokens", "1024", "--seq-len", "64", "--batch", "1",
            "--max-samples", "200"]
    code, _, stderr = run_cli(capsys, *args, "-o", str(tmp_path / "whole"))
    assert code == 0, stderr

    monkeypatch.setattr(profile_mod, "CHECKPOINT_BATCHES", 3)
    restore = interrupt_profile_at_forward(monkeypatch, 8)  # Ctrl-C during the 8th forward pass
    out = tmp_path / "resumed"
    code, _, stderr = run_cli(capsys, *args, "-o", str(out))
    assert code == 130 and not out.exists()
    assert (tmp_path / ".resumed.partial" / "checkpoint.pt").is_file()
    restore()

    code, stdout, stderr = run_cli(capsys, *args, "-o", str(out), "--resume")
    assert code == 0, stderr
    assert "resuming" in stdout and "from sequence 6" in stdout
    assert not (tmp_path / ".resumed.partial").exists()
    whole, resumed = json.loads((tmp_path / "whole" / "profile.json").read_text()), json.loads(
        (out / "profile.json").read_text())
    assert whole["layers"] == resumed["layers"] and whole["thresholds"] == resumed["thresholds"]
    for i in range(2):
        a = torch.load(tmp_path / "whole" / "activation" / f"activation_{i}.pt", weights_only=True)
        b = torch.load(out / "activation" / f"activation_{i}.pt", weights_only=True)
        assert torch.equal(a, b)

        def rows(d):
            shards = [load_file(str(p)) for p in sorted((d / "samples" / f"layer_{i}").glob("*.safetensors"))]
            return {k: torch.cat([s[k] for s in shards]) for k in ("x", "mask", "seq", "pos")}
        ra, rb = rows(tmp_path / "whole"), rows(out)
        for k in ra:
            assert torch.equal(ra[k], rb[k]), k

    code, _, stderr = run_cli(capsys, *args, "-o", str(tmp_path / "never"), "--resume")
    assert code == 1 and "nothing to resume" in stderr


def test_a_short_interrupted_profile_keeps_its_work_and_says_how_to_resume(tiny_model_dir, tmp_path, capsys,
                                                                            monkeypatch):
    """A profile of 4 batches (as 8192 tokens of 512 in batches of 4) checkpoints; Ctrl-C says --resume continues
    it; a rerun without --resume refuses to delete the kept work unless --force."""
    model = str(tiny_model_dir("llama-silu"))
    out = tmp_path / "prof"
    args = ["profile", "-m", model, "--calib", str(TEXT), "--tokens", "1024", "--seq-len", "64", "--batch", "4",
            "--max-samples", "200", "-o", str(out)]
    restore = interrupt_profile_at_forward(monkeypatch, 3)
    code, _, stderr = run_cli(capsys, *args)
    restore()
    work = tmp_path / ".prof.partial"
    assert code == 130 and (work / "checkpoint.pt").is_file()
    assert f"kept in {work}: the same command with --resume continues it" in stderr

    code, _, stderr = run_cli(capsys, *args)
    assert_one_line_error(code, stderr, "interrupted profile", "--resume", "--force")
    assert (work / "checkpoint.pt").is_file()
    code, stdout, stderr = run_cli(capsys, *args, "--resume")
    assert code == 0 and "from sequence 8 of 16" in stdout, stderr

    restore = interrupt_profile_at_forward(monkeypatch, 2)
    code, _, _ = run_cli(capsys, *args[:-2], "-o", str(tmp_path / "again2"))
    restore()
    assert code == 130
    code, _, stderr = run_cli(capsys, *args[:-2], "-o", str(tmp_path / "again2"), "--force")
    assert code == 0 and not (tmp_path / ".again2.partial").exists(), stderr
