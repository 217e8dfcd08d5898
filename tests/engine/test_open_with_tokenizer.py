"""inference.open_with_tokenizer, what `run`, `chat` and `serve` start with: the tokenizer loads on a thread while
the engine opens (issue 65: a fresh process's first token waits for the longer of the two, not their sum), and
either one's failure reaches the caller as before, with nothing left open."""
from __future__ import annotations

import threading

import pytest
from engine_helpers import converted  # noqa: F401

import powerinfer_engine as engine
from powerinfer_tools.core.errors import UserError
from powerinfer_tools.runtime import inference

WAIT_S = 60  # only a serial start waits this long: then the tokenizer never began while the engine opened


def test_the_tokenizer_loads_while_the_engine_opens(converted, monkeypatch):
    path = converted("llama-relu")
    loading, opening = threading.Event(), threading.Event()
    load, model = inference.load_tokenizer, engine.Model

    def load_meeting(p):  # each waits until the other has begun: one after the other, the first waits in vain
        loading.set()
        assert opening.wait(WAIT_S), "the engine did not start opening while the tokenizer loaded"
        return load(p)

    def model_meeting(*args, **kwargs):
        opening.set()
        assert loading.wait(WAIT_S), "the tokenizer did not start loading while the engine opened"
        return model(*args, **kwargs)

    monkeypatch.setattr(inference, "load_tokenizer", load_meeting)
    monkeypatch.setattr(engine, "Model", model_meeting)
    tokenizer, llm = inference.open_with_tokenizer(inference.EngineTarget(path), threads=1, ctx_size=64)
    with llm:
        assert tokenizer("Hello world")["input_ids"] == load(path)("Hello world")["input_ids"]
        assert llm.n_ctx == 64


def test_a_tokenizer_failure_is_raised_and_the_engine_closed(converted, monkeypatch):
    path = converted("llama-relu")
    opened = []
    model = engine.Model

    def model_kept(*args, **kwargs):
        opened.append(model(*args, **kwargs))
        return opened[-1]

    def broken(p):
        raise UserError(f"{p} stores no vocabulary")

    monkeypatch.setattr(engine, "Model", model_kept)
    monkeypatch.setattr(inference, "load_tokenizer", broken)
    with pytest.raises(UserError, match="stores no vocabulary"):
        inference.open_with_tokenizer(inference.EngineTarget(path), threads=1, ctx_size=64)
    assert len(opened) == 1 and opened[0]._handle is None  # closed


def test_the_tokenizers_failure_comes_first_as_before(tmp_path):
    """A file neither can read: the tokenizer's line, as when the tokenizer loaded before the engine opened."""
    path = tmp_path / "m.gguf"
    path.write_bytes(b"_BD!" + bytes(300))
    with pytest.raises(UserError, match=r"not a GGUF/PowerInfer file \(magic b'_BD!'\)"):
        inference.open_with_tokenizer(inference.EngineTarget(path), threads=1, ctx_size=64)


def test_the_engines_failure_is_raised(converted):
    with pytest.raises(UserError, match="has no predictors"):
        inference.open_with_tokenizer(inference.EngineTarget(converted("llama-relu")), threads=1, ctx_size=64,
                                      sparse_mode="predictor")


def test_ctrl_c_during_the_open_comes_before_the_tokenizers_failure(converted, monkeypatch):
    """Ctrl-C raised as the engine's open returns ends the start as an interruption, even where the tokenizer
    failed meanwhile: the one line the CLI prints is "interrupted", not the tokenizer's."""
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    def broken(p):
        raise UserError(f"{p} stores no vocabulary")

    monkeypatch.setattr(engine, "Model", interrupted)
    monkeypatch.setattr(inference, "load_tokenizer", broken)
    with pytest.raises(KeyboardInterrupt):
        inference.open_with_tokenizer(inference.EngineTarget(converted("llama-relu")), threads=1, ctx_size=64)
