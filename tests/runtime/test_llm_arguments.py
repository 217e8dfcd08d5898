"""LLM arguments of the wrong type are the API's own RequestError, one line naming the argument, never a bare
TypeError, AttributeError or OverflowError from below (nor True taken for 1); stop takes a string or None."""
from __future__ import annotations

import numpy as np
import pytest

from powerinfer_tools import LLM
from powerinfer_tools.runtime.llm import RequestError, Sampling

PROMPT = "ROMEO: But soft"


@pytest.fixture(scope="module")
def llm(tiny_chat_file):
    with LLM(tiny_chat_file, threads=1, ctx_size=256) as model:
        yield model


@pytest.mark.parametrize("call, message", [
    (lambda m: m.complete(PROMPT, temperature="hot"), "temperature must be a number, not 'hot'"),
    (lambda m: m.complete(PROMPT, top_p=None), "top_p must be a number, not None"),
    (lambda m: m.complete(PROMPT, temperature=True), "temperature must be a number, not True"),
    (lambda m: m.complete(PROMPT, seed="x"), r"seed must be None or an integer in \[0, 2\^64\), not 'x'"),
    (lambda m: m.complete(PROMPT, seed=1.5), "seed must be None or an integer"),
    (lambda m: m.complete(PROMPT, top_k=2**40), r"top_k must be an integer in \[0, 2\^31\), not 1099511627776"),
    (lambda m: m.complete(PROMPT, repeat_last_n="64"), "repeat_last_n must be an integer"),
    (lambda m: m.complete(PROMPT, stop=5), "stop must be a string or a list of strings, not 5"),
    (lambda m: m.complete(PROMPT, stop=["ok", 1]), "stop must be a string or a list of strings"),
    (lambda m: m.complete(PROMPT, stop=b"x"), "stop must be a string or a list of strings"),
    (lambda m: m.complete(PROMPT, sampling="greedy"), "sampling must be a Sampling record .* not 'greedy'"),
    (lambda m: m.complete(PROMPT, sampling=Sampling(), temperature=0), "not both"),
    (lambda m: m.complete(PROMPT, temp=0), "unknown option 'temp': the sampling options are temperature"),
    (lambda m: m.complete(PROMPT, max_tokens=True), "max_tokens must be None or a non-negative integer, not True"),
    (lambda m: m.chat([{"role": "user", "content": "hi"}], max_tokens=2.5), "max_tokens must be"),
    (lambda m: m.complete(PROMPT, sampling=Sampling(temperature="hot")), "temperature must be a number"),
    (lambda m: m.detokenize([-1]), r"token ids must be integers in \[0, 384\), not -1"),
    (lambda m: m.detokenize([2**70]), r"token ids must be integers in \[0, 384\)"),
    (lambda m: m.detokenize([1.0]), "token ids must be integers"),
    (lambda m: m.detokenize("abc"), "detokenize takes a list of token ids, not str"),
    (lambda m: m.detokenize(None), "detokenize takes a list of token ids, not NoneType"),
])
def test_wrong_types_are_one_request_error(llm, call, message):
    with pytest.raises(RequestError, match=message) as caught:
        call(llm)
    assert "\n" not in str(caught.value)
    assert llm.complete(PROMPT, max_tokens=2, temperature=0).usage.completion_tokens == 2  # still serving


def test_the_field_is_named_for_the_server(llm):
    with pytest.raises(RequestError) as caught:
        llm.complete(PROMPT, seed="x")
    assert caught.value.param == "seed"


def test_stop_takes_one_string_or_none(llm):
    whole = llm.complete(PROMPT, max_tokens=12, temperature=0).text
    stop = whole[3:6]
    assert len(stop) == 3 and whole.index(stop) == 3
    assert llm.complete(PROMPT, max_tokens=12, temperature=0, stop=stop).text == whole[:3]  # not each character
    assert llm.complete(PROMPT, max_tokens=12, temperature=0, stop=None).text == whole
    assert llm.complete(PROMPT, max_tokens=12, temperature=0, stop=iter([stop])).text == whole[:3]


def test_numpy_numbers_are_numbers(llm):
    ids = llm.tokenize(PROMPT)
    assert llm.detokenize(np.array(ids)) == llm.detokenize(ids)
    c = llm.complete(PROMPT, max_tokens=np.int64(3), temperature=np.float32(0), seed=np.uint64(5))
    assert c.usage.completion_tokens == 3
