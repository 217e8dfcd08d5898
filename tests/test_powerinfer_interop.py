"""Files both ways between this toolkit and PowerInfer's engine (SJTU-IPADS/PowerInfer d3ebd7c), checked
against fixtures written as PowerInfer's code writes and reads them (powerinfer_fixtures.py), without
PowerInfer itself."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
from convert_helpers import read_fields
from engine_helpers import converted, hf_logits, max_rel_err, random_tokens, rewrite  # noqa: F401
from tiny_models import N_LAYER

import engine
from powerinfer_tools import inspect as pi_inspect
from powerinfer_tools.gguf_io import open_reader

TOKENS = random_tokens(24, 384, seed=3)
STR = gguf.GGUFValueType.STRING


def logits(path, **kw):
    with engine.Model(path, threads=1, **kw) as m:
        return m.eval(TOKENS), m.info, m.stats()


def under_arch(src, dst, new_arch: str, fields: dict | None = None):
    """A copy of `src` whose general.architecture and hyperparameter keys are named `new_arch`."""
    reader = open_reader(src)
    old_arch = reader.fields["general.architecture"].contents()
    renamed = {"general.architecture": (new_arch, STR)}
    for key, f in reader.fields.items():
        if key.startswith(f"{old_arch}."):
            renamed[key] = None
            renamed[new_arch + key[len(old_arch):]] = (f.contents(), f.types[0])
    return rewrite(src, dst, fields=renamed | (fields or {}))


# ---- a PWRI file without powerinfer.ffn_activation is ReLU (PowerInfer's converters never write the key) ----

def test_powerinfer_llama_file_without_activation_key_is_relu(converted, tmp_path):
    ours = converted("llama-relu")
    assert read_fields(ours)["powerinfer.ffn_activation"] == "relu"
    theirs = rewrite(ours, tmp_path / "theirs.gguf", fields={"powerinfer.ffn_activation": None,
                                                             "powerinfer.activation_thresholds": None})
    want, _, _ = logits(ours)
    got, info, _ = logits(theirs)
    assert info["activation"] == "relu"
    np.testing.assert_array_equal(got, want)


def test_plain_gguf_llama_without_activation_key_stays_silu(converted, tmp_path):
    """llama.cpp's own files (magic GGUF) are SiLU models."""
    silu = converted("llama-silu")
    plain = under_arch(silu, tmp_path / "plain.gguf", "llama", {"powerinfer.ffn_activation": None})
    data = bytearray(plain.read_bytes())
    data[:4] = b"GGUF"
    plain.write_bytes(bytes(data))
    want, _, _ = logits(silu)
    got, info, _ = logits(plain)
    assert info["activation"] == "silu"
    np.testing.assert_array_equal(got, want)


# ---- a SiLU model's file names an architecture PowerInfer refuses; the old name still reads here ----

def test_silu_file_is_named_so_that_powerinfer_refuses_it(converted, tiny_model_dir):
    path = converted("llama-silu")
    fields = read_fields(path)
    # PowerInfer's llama.cpp (LLM_ARCH_NAMES) knows llama, falcon, opt, bamboo, ...: llama-silu is
    # "unknown model architecture" there, where llama would run the ReLU-only sparse FFN.
    assert fields["general.architecture"] == "llama-silu"
    assert fields["powerinfer.ffn_activation"] == "silu"
    assert fields["llama-silu.block_count"] == N_LAYER and "llama.block_count" not in fields
    got, info, _ = logits(path)
    assert (info["arch"], info["activation"]) == ("llama", "silu")
    assert max_rel_err(got, hf_logits(tiny_model_dir("llama-silu"), TOKENS)) <= 1e-4
    assert pi_inspect.describe(path)["metadata"]["general.architecture"] == "llama-silu"
    from powerinfer_tools.tokenizer import tokenizer_from_file

    assert tokenizer_from_file(path).encode("to be or not")  # the vocabulary reads as llama's


def test_silu_file_written_before_the_rename_still_runs_as_silu(converted, tmp_path):
    new = converted("llama-silu")
    old = under_arch(new, tmp_path / "old.gguf", "llama")
    assert read_fields(old)["general.architecture"] == "llama"
    want, _, _ = logits(new)
    got, info, _ = logits(old)
    assert info["activation"] == "silu"
    np.testing.assert_array_equal(got, want)


def test_llama_silu_with_another_activation_is_refused(converted, tmp_path):
    bad = rewrite(converted("llama-silu"), tmp_path / "bad.gguf", fields={"powerinfer.ffn_activation": ("relu", STR)})
    with pytest.raises(engine.EngineError, match="llama-silu with FFN activation 'relu'"):
        engine.Model(bad, threads=1)
