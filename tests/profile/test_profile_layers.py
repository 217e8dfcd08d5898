"""`pi-tools profile --load layer` (one decoder layer in memory at a time) against the whole-model profile: the same
counts, magnitudes, thresholds and rows, bit for bit in float32 on the CPU, for every architecture and for a GGUF
source; one layer's tensors at a time; resumed at a layer boundary; damaged model files refused in one line."""
from __future__ import annotations

import errno
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from cli_helpers import assert_one_line_error, run_cli
from tiny_models import DATA, KINDS

TEXT = DATA / "tinyshakespeare.txt"
# 16 sequences in batches of 3: a short last batch, whose arguments (masks, positions) have another shape
ARGS = ["--calib", str(TEXT), "--tokens", "1024", "--seq-len", "64", "--batch", "3", "--max-samples", "300"]


def profile(capsys, model, out, *extra):
    code, stdout, stderr = run_cli(capsys, "profile", "-m", str(model), "-o", str(out), *ARGS, *extra)
    assert code == 0, stderr
    return stdout


def assert_same_profile(a, b):
    pa, pb = (json.loads((d / "profile.json").read_text()) for d in (a, b))
    assert pa["thresholds"] == pb["thresholds"] and pa["layers"] == pb["layers"]
    for i in range(pa["model"]["n_layer"]):
        for kind in ("activation", "magnitude"):
            x, y = (torch.load(d / kind / f"{kind}_{i}.pt", weights_only=True) for d in (a, b))
            assert torch.equal(x, y), f"layer {i} {kind}"

        def rows(d):
            shards = [load_file(str(p)) for p in sorted((d / "samples" / f"layer_{i}").glob("*.safetensors"))]
            return {k: torch.cat([s[k] for s in shards]) for k in ("x", "mask", "seq", "pos")}
        ra, rb = rows(a), rows(b)
        for k in ra:
            assert torch.equal(ra[k], rb[k]), f"layer {i} rows {k}"


@pytest.mark.parametrize("kind", KINDS)
def test_layer_by_layer_equals_the_whole_model(kind, tiny_model_dir, tmp_path, capsys):
    model = tiny_model_dir(kind)
    profile(capsys, model, tmp_path / "whole", "--load", "whole")
    stdout = profile(capsys, model, tmp_path / "layer", "--load", "layer")
    assert "one layer at a time" in stdout
    meta = json.loads((tmp_path / "layer" / "profile.json").read_text())
    assert meta["load"] == "layer" and meta["tokens_per_second"] > 0
    assert_same_profile(tmp_path / "whole", tmp_path / "layer")
    assert sorted(p.name for p in (tmp_path / "layer").iterdir()) == ["activation", "magnitude", "profile.json",
                                                                       "samples"]   # no hidden-state files left


@pytest.mark.slow
def test_a_gguf_source_layer_by_layer_equals_the_whole_model(tmp_path, capsys):
    """The default SmolLM2 GGUF: gguf-py's map, dequantized per tensor, q/k back in HF order, as transformers reads it."""
    args = ["--calib", str(DATA / "wikitext-2-valid.txt"), "--tokens", "256", "--seq-len", "64", "--max-samples", "64"]
    for load in ("whole", "layer"):
        code, _, stderr = run_cli(capsys, "profile", "-m", "smollm2", "-o", str(tmp_path / load), *args, "--load", load)
        assert code == 0, stderr
    assert_same_profile(tmp_path / "whole", tmp_path / "layer")


class LoadLog:
    """Wraps the weight reader and the layer runner: which tensors were read, and what was real when a layer ran."""

    def __init__(self, monkeypatch):
        from powerinfer_tools.models import layerwise, source_weights

        self.loaded: list[str] = []
        self.real_at_run: list[tuple[int, set[int]]] = []
        real_load, real_run = source_weights.SafetensorsSource.load_as, layerwise.LayerwiseModel.run_layer

        def load(source, name, dtype):
            self.loaded.append(name)
            return real_load(source, name, dtype)

        def run_layer(lw, i, inputs):
            real = {j for j, layer in enumerate(lw.layers) if any(not p.is_meta for p in layer.parameters())}
            self.real_at_run.append((i, real))
            return real_run(lw, i, inputs)

        monkeypatch.setattr(source_weights.SafetensorsSource, "load_as", load)
        monkeypatch.setattr(layerwise.LayerwiseModel, "run_layer", run_layer)


@pytest.mark.parametrize("kind", ["llama-silu", "opt"])
def test_one_layers_tensors_at_a_time(kind, tiny_model_dir, tmp_path, capsys, monkeypatch):
    """Never the whole model: transformers' loader is not called, each tensor is read once, only the layer that runs
    is real, and the output head is never read."""
    from transformers import PreTrainedModel

    def refuse(*a, **k):
        raise AssertionError("the whole model was loaded")

    monkeypatch.setattr(PreTrainedModel, "from_pretrained", classmethod(refuse))
    log = LoadLog(monkeypatch)
    profile(capsys, tiny_model_dir(kind), tmp_path / "p", "--load", "layer")
    assert len(log.loaded) == len(set(log.loaded)), "a tensor was read twice"
    assert not any("lm_head" in name for name in log.loaded)
    assert {i for i, _ in log.real_at_run} == {0, 1}
    assert all(real == {i} for i, real in log.real_at_run), log.real_at_run
    first_layer_1 = next(n for n, name in enumerate(log.loaded) if ".layers.1." in name)
    assert all(".layers.1." not in name for name in log.loaded[:first_layer_1])
    assert not any(".layers.0." in name for name in log.loaded[first_layer_1:]), "layer 0 read again"


def test_resumes_at_a_layer_boundary(tiny_model_dir, tmp_path, capsys, monkeypatch):
    """Ctrl-C inside layer 1 (its dense calibration stream): --resume starts at layer 1, runs layer 0 no more, and
    ends with the uninterrupted profile."""
    from powerinfer_tools.models import layerwise

    model = tiny_model_dir("llama-silu")
    profile(capsys, model, tmp_path / "straight", "--load", "layer")
    real_run, calls, interrupt = layerwise.LayerwiseModel.run_layer, [], [True]

    def interrupted(lw, i, inputs):
        calls.append(i)
        if i == 1 and calls.count(1) == 2 and interrupt.pop():
            raise KeyboardInterrupt
        return real_run(lw, i, inputs)

    monkeypatch.setattr(layerwise.LayerwiseModel, "run_layer", interrupted)
    out = tmp_path / "resumed"
    code, _, stderr = run_cli(capsys, "profile", "-m", str(model), "-o", str(out), *ARGS, "--load", "layer")
    assert code == 130 and not out.exists()
    work = tmp_path / ".resumed.partial"
    assert (work / "layer_checkpoint.pt").is_file() and "--resume continues it" in stderr
    # rows a layer wrote before its interruption (a shard flushed mid-layer) are dropped on resume
    (work / "samples" / "layer_1").mkdir()
    shutil.copy(work / "samples" / "layer_0" / "shard_0000.safetensors", work / "samples" / "layer_1")

    calls.clear()
    interrupt.append(False)
    code, stdout, stderr = run_cli(capsys, "profile", "-m", str(model), "-o", str(out), *ARGS, "--load", "layer",
                                   "--resume")
    assert code == 0, stderr
    assert "at layer 1 of 2" in stdout and set(calls) == {1}
    assert_same_profile(tmp_path / "straight", out)
    assert not work.exists()

    code, _, stderr = run_cli(capsys, "profile", "-m", str(model), "-o", str(tmp_path / "o2"), *ARGS, "--load",
                              "whole", "--resume")
    assert code == 1 and "nothing to resume" in stderr


def test_auto_loads_layer_by_layer_where_the_model_would_not_fit(tiny_model_dir, tmp_path, capsys, monkeypatch):
    from powerinfer_tools.stages.profiling import profiling

    model = tiny_model_dir("llama-relu")
    need = profiling.weight_bytes(profiling.arch_mod.for_config(
        profiling.models.load_config(profiling.models.resolve(str(model)))), "float32")
    monkeypatch.setattr(profiling, "available_memory", lambda device: int(need / profiling.WHOLE_MODEL_SHARE) - 1)
    assert "one layer at a time" in profile(capsys, model, tmp_path / "small")
    assert json.loads((tmp_path / "small" / "profile.json").read_text())["load"] == "layer"
    monkeypatch.setattr(profiling, "available_memory", lambda device: int(need / profiling.WHOLE_MODEL_SHARE) + 1)
    assert "one layer at a time" not in profile(capsys, model, tmp_path / "large")
    assert json.loads((tmp_path / "large" / "profile.json").read_text())["load"] == "whole"


def test_bad_options(tiny_model_dir, tmp_path, capsys):
    model = str(tiny_model_dir("llama-relu"))
    out = tmp_path / "p"
    cases = [(["--load", "layer", "--tokens", "256"], "needs --calib"),
             ([*ARGS, "--load", "layer", "--device", "auto"], "--device auto"),
             ([*ARGS, "--load", "shards"], "--load must be auto, layer or whole")]
    for args, needle in cases:
        code, _, stderr = run_cli(capsys, "profile", "-m", model, "-o", str(out), *args)
        assert_one_line_error(code, stderr, needle)
        assert not out.exists() and not (tmp_path / ".p.partial").exists()


@pytest.fixture
def sharded(tiny_model_dir, tmp_path):
    """The tiny ReLU llama saved in several shards with their index, as large checkpoints are."""
    from transformers import AutoModelForCausalLM

    src = tiny_model_dir("llama-relu")
    out = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(src).save_pretrained(out, max_shard_size="100KB")
    for name in ("tokenizer.model", "tokenizer_config.json"):
        shutil.copy(src / name, out / name)
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index.values())) > 2
    return out, index


def refused(capsys, model, out, *needles):
    code, _, stderr = run_cli(capsys, "profile", "-m", str(model), "-o", str(out), *ARGS, "--load", "layer")
    assert_one_line_error(code, stderr, *needles)
    assert not out.exists()


def test_damaged_model_files_are_refused_in_one_line(sharded, tmp_path, capsys):
    model, index = sharded
    name = "model.layers.1.mlp.up_proj.weight"
    shard = model / index[name]

    # a missing shard: the tensor and the file the index puts it in
    hidden = shard.rename(shard.with_suffix(".away"))
    refused(capsys, model, tmp_path / "a", "model.layers.1.", f"puts it in {shard.name}, which is missing")
    hidden.rename(shard)

    # a shard holding the wrong shape
    tensors = load_file(shard)
    good = dict(tensors)
    tensors[name] = tensors[name][:, :-1].contiguous()
    save_file(tensors, shard, metadata={"format": "pt"})
    refused(capsys, model, tmp_path / "b", name, shard.name, "the config needs [256, 64]")
    save_file(good, shard, metadata={"format": "pt"})

    # the embeddings (outside the layers, read first) of the wrong shape
    embed = "model.embed_tokens.weight"
    embed_shard = model / index[embed]
    kept = load_file(embed_shard)
    save_file({**kept, embed: kept[embed][:-1].contiguous()}, embed_shard, metadata={"format": "pt"})
    refused(capsys, model, tmp_path / "e", embed, "the config needs")
    save_file(kept, embed_shard, metadata={"format": "pt"})

    # a shard cut short
    data = shard.read_bytes()
    shard.write_bytes(data[:len(data) // 2])
    refused(capsys, model, tmp_path / "c", shard.name)
    shard.write_bytes(data)
    profile(capsys, model, tmp_path / "fine", "--load", "layer")


def test_a_gguf_whose_tensor_table_lies_is_refused(tmp_path, capsys):
    """A tensor of the default GGUF moved past the end of the file."""
    import gguf

    from powerinfer_tools.models import default_model

    src = default_model.default_gguf()
    reader = gguf.GGUFReader(src)
    tensor = reader.tensors[-1]
    field = tensor.field
    offset_part = field.parts[-1]   # the tensor's data offset, the last part of its table entry
    position = sum(p.nbytes for p in field.parts[:-1]) + field.offset
    data = bytearray(src.read_bytes())
    assert int.from_bytes(data[position:position + 8], "little") == int(offset_part[0])
    data[position:position + 8] = (len(data) * 2).to_bytes(8, "little")
    bad = tmp_path / "lies.gguf"
    bad.write_bytes(bytes(data))
    code, _, stderr = run_cli(capsys, "profile", "-m", str(bad), "-o", str(tmp_path / "p"), "--calib",
                              str(DATA / "wikitext-2-valid.txt"), "--tokens", "128", "--seq-len", "64", "--load",
                              "layer")
    assert_one_line_error(code, stderr, "lies.gguf")
    assert not (tmp_path / "p").exists()


def test_no_room_for_the_hidden_states(tiny_model_dir, tmp_path, capsys, monkeypatch):
    """ENOSPC when the hidden-state files are made: one line with the size needed, and the work kept for --resume
    (nothing of it is wrong), which then finishes once there is room."""
    model = tiny_model_dir("llama-relu")
    real = os.posix_fallocate

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", full)
    out = tmp_path / "p"
    code, _, stderr = run_cli(capsys, "profile", "-m", str(model), "-o", str(out), *ARGS, "--load", "layer")
    assert_one_line_error(code, stderr, "no room for the hidden states", "GiB", "No space left")
    assert not out.exists() and not list((tmp_path / ".p.partial").glob("*.bin"))
    monkeypatch.setattr(os, "posix_fallocate", real)
    code, _, stderr = run_cli(capsys, "profile", "-m", str(model), "-o", str(out), *ARGS, "--load", "layer",
                              "--resume")
    assert code == 0, stderr
    profile(capsys, model, tmp_path / "straight", "--load", "layer")
    assert_same_profile(tmp_path / "straight", out)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("kind", ["llama-silu", "falcon", "opt"])
def test_layer_by_layer_on_cuda_equals_the_whole_model_there(kind, tiny_model_dir, tmp_path, capsys):
    model = tiny_model_dir(kind)
    profile(capsys, model, tmp_path / "whole", "--load", "whole", "--device", "cuda")
    profile(capsys, model, tmp_path / "layer", "--load", "layer", "--device", "cuda")
    assert_same_profile(tmp_path / "whole", tmp_path / "layer")
