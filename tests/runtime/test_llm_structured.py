"""The token mask in the engine's sampler, and grammars and logprobs through the text API, on the tiny random chat
model: a random model draws only what the grammar allows, whatever its sampling settings."""
from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest

from powerinfer_engine import EngineError, Model
from powerinfer_tools import LLM
from powerinfer_tools.runtime.llm import RequestError

ALLOWED = (5, 17, 40)


def mask(n_vocab: int, tokens) -> np.ndarray:
    words = np.zeros((n_vocab + 31) // 32, dtype=np.uint32)
    for t in tokens:
        words[t // 32] |= np.uint32(1 << (t % 32))
    return words


def test_the_engine_draws_only_masked_in_tokens(tiny_chat_file):
    with Model(tiny_chat_file, threads=1, ctx_size=64) as m:
        logits = m.eval([1, 7, 9])
        allowed = mask(m.n_vocab, ALLOWED)
        drawn = set()
        for seed in range(40):
            m.seed(seed)
            drawn.add(m.sample(temperature=2.0, top_k=0, top_p=1.0, repeat_penalty=1.3, allowed=allowed))
        assert drawn <= set(ALLOWED) and len(drawn) > 1
        best = max(ALLOWED, key=lambda t: logits[-1][t])
        assert m.sample(temperature=0, allowed=allowed) == best
        assert m.sample(temperature=0.7, top_k=1, allowed=allowed) == best
        with pytest.raises(EngineError, match="allows no token"):
            m.sample(allowed=mask(m.n_vocab, ()))
        with pytest.raises(EngineError, match="words"):
            m.sample(allowed=allowed[:-1])


@pytest.fixture(scope="module")
def llm(tiny_chat_file):
    with LLM(tiny_chat_file, threads=1, ctx_size=256) as model:
        yield model


def test_a_random_model_follows_the_grammar(llm):
    said = {llm.complete("Q: yes or no?", max_tokens=8, temperature=1.0, seed=s, grammar='root ::= "yes" | "no"').text
            for s in range(8)}
    assert said <= {"yes", "no"}
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
              "required": ["ok", "n"], "additionalProperties": False}
    for s in range(4):
        c = llm.chat([{"role": "user", "content": "JSON"}], max_tokens=40, temperature=1.0, seed=s,
                     response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.text), schema)
    again = [llm.complete("Q:", max_tokens=6, temperature=1.0, seed=3, grammar="root ::= [a-z]+").text
             for _ in range(2)]
    assert again[0] == again[1] and again[0].isalpha()


def test_logprobs_streamed_are_the_whole_ones(llm):
    whole = llm.complete("ROMEO: But soft", max_tokens=10, temperature=0, logprobs=4)
    assert len(whole.logprobs) == whole.usage.completion_tokens - (whole.finish_reason == "stop")
    for e in whole.logprobs:
        assert len(e.top) == 4 and e.top[0].logprob == e.logprob
        assert [t.logprob for t in e.top] == sorted((t.logprob for t in e.top), reverse=True)
    chunks = list(llm.complete("ROMEO: But soft", max_tokens=10, temperature=0, logprobs=4, stream=True))
    assert tuple(e for c in chunks for e in c.logprobs) == whole.logprobs == chunks[-1].completion.logprobs
    assert llm.complete("ROMEO: But soft", max_tokens=3, temperature=0).logprobs is None


@pytest.mark.parametrize("args, param", [({"grammar": "root ::= (("}, "grammar"),
                                         ({"grammar": 'root ::= "a"', "response_format": {"type": "json_object"}},
                                          "grammar"),
                                         ({"response_format": {"type": "xml"}}, "response_format"),
                                         ({"logprobs": 21}, "logprobs")])
def test_bad_constraints_are_one_error(llm, args, param):
    assert llm.complete("Q:", max_tokens=1, grammar='root ::= "a"', logprobs=0).text == "a"  # the fields exist
    with pytest.raises(RequestError) as err:
        llm.complete("Q:", max_tokens=2, **args)
    assert err.value.param == param


def test_an_answers_tool_calls_are_read_in_the_usual_forms():
    from powerinfer_tools.runtime.tools import parse_calls

    names = {"get_time", "get_weather"}
    hermes = parse_calls('<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>\n'
                         '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>', names)
    assert [(c.name, json.loads(c.arguments)) for c in hermes] == [("get_time", {"zone": "UTC"}),
                                                                   ("get_weather", {"city": "Oslo"})]
    assert len({c.id for c in hermes}) == 2
    (bare,) = parse_calls(' {"name": "get_time", "parameters": {"zone": "CET"}}', names)
    assert (bare.name, json.loads(bare.arguments)) == ("get_time", {"zone": "CET"})
    for text in ("It is noon.", '{"name": "rm_rf", "arguments": {}}', '{"name": "get_time"}', "[1, 2]",
                 '<tool_call>{"name": "get_time", "arguments": {}}</tool_call><tool_call>oops</tool_call>'):
        assert parse_calls(text, names) == ()


def test_tools_need_a_template_that_renders_them(llm):
    tool = {"type": "function", "function": {"name": "get_time"}}
    assert not llm.supports_tools  # the tiny chat template knows no tools
    with pytest.raises(RequestError) as err:
        llm.chat([{"role": "user", "content": "Hi"}], max_tokens=2, tools=[tool])
    assert err.value.param == "tools"


def test_a_grammar_compiles_once_for_its_requests_each_with_a_fresh_matcher(tiny_chat_file, monkeypatch):
    """The check at the call compiles the constraint and every generation of it takes a copy of that fresh matcher:
    a repeated schema is not compiled again, and no request starts where the one before stopped."""
    from powerinfer_tools.runtime import structured

    compiled = []
    real = structured.Constraint.matcher
    monkeypatch.setattr(structured.Constraint, "matcher", lambda c, vocab: compiled.append(c) or real(c, vocab))
    grammar = 'root ::= "yes" | "no"'
    with LLM(tiny_chat_file, threads=1, ctx_size=128) as llm:
        said = [llm.complete("Q: yes or no?", max_tokens=4, temperature=1.0, seed=s, grammar=grammar).text
                for s in range(4)]
        assert set(said) <= {"yes", "no"}
        assert len(compiled) == 1
        llm.complete("Q:", max_tokens=4, grammar="root ::= [a-z]+")
        assert len(compiled) == 2
