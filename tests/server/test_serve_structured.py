"""Structured output, logprobs and /tokenize, /detokenize of `pi-tools serve`, with the real SmolLM2 and the real
`openai` client: objects drawn under a JSON schema validate against it (jsonschema), json_object gives JSON, a
GBNF grammar gives only its strings; logprobs are the log-softmax of the engine's own logits for the same tokens;
tokenize and detokenize agree with LLM.tokenize."""
from __future__ import annotations

import json

import jsonschema
import numpy as np
import openai
import pytest


pytestmark = pytest.mark.slow

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
SCHEMAS = {
    "person": PERSON,
    "weather": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 24}, "celsius": {"type": "number", "minimum": -60, "maximum": 60},
        "sky": {"enum": ["sunny", "cloudy", "rain", "snow"]}}, "required": ["city", "celsius", "sky"],
        "additionalProperties": False},
    "todo": {"type": "object", "properties": {
        "tasks": {"type": "array", "minItems": 1, "maxItems": 3,
                  "items": {"type": "string", "minLength": 1, "maxLength": 20}},
        "done": {"type": "boolean"}}, "required": ["tasks", "done"], "additionalProperties": False},
    "book": {"type": "object", "properties": {
        "title": {"type": "string", "maxLength": 30}, "year": {"type": "integer", "minimum": 1450, "maximum": 2030},
        "isbn": {"type": "string", "pattern": "^[0-9]{10}$"}}, "required": ["title", "year", "isbn"],
        "additionalProperties": False},
    "team": {"type": "object", "properties": {
        "lead": PERSON, "size": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["lead", "size"], "additionalProperties": False},
    "color": {"type": "object", "properties": {
        "rgb": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 255}, "minItems": 3,
                "maxItems": 3},
        "name": {"anyOf": [{"type": "string", "maxLength": 16}, {"type": "null"}]}},
        "required": ["rgb", "name"], "additionalProperties": False},
}
OBJECTS = 4  # per schema, each at its own seed


def test_json_schema_objects_validate(server):
    client, valid = server.client(), 0
    for name, schema in SCHEMAS.items():
        for seed in range(OBJECTS):
            r = client.chat.completions.create(
                model="any", max_tokens=200, temperature=0.8, seed=seed,
                messages=[{"role": "user", "content": f"Describe a {name} as JSON."}],
                response_format={"type": "json_schema", "json_schema": {"name": name, "schema": schema,
                                                                        "strict": True}})
            assert r.choices[0].finish_reason == "stop", (name, r.choices[0].message.content)
            jsonschema.validate(json.loads(r.choices[0].message.content), schema)
            valid += 1
    assert valid == len(SCHEMAS) * OBJECTS


def test_json_object_mode_and_a_grammar(server):
    client = server.client()
    for stream in (False, True):
        r = client.chat.completions.create(model="any", max_tokens=200, temperature=0.8, seed=5, stream=stream,
                                           messages=[{"role": "user", "content": "A city, as JSON."}],
                                           response_format={"type": "json_object"})
        text = "".join(c.choices[0].delta.content or "" for c in r if c.choices) if stream else \
            r.choices[0].message.content
        assert isinstance(json.loads(text), dict)
    answers = set()
    for seed in range(6):
        r = client.completions.create(model="any", prompt="Is the sea wet? Answer:", max_tokens=8, temperature=1.5,
                                      seed=seed, extra_body={"grammar": 'root ::= " yes" | " no"'})
        answers.add(r.choices[0].text)
        assert r.choices[0].finish_reason == "stop"
    assert answers <= {" yes", " no"}


def test_bad_constraints_are_one_400_naming_the_field(server):
    client = server.client()
    cases = [({"extra_body": {"grammar": "root ::= (("}}, "grammar"),
             ({"response_format": {"type": "json_schema"}}, "response_format"),
             ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
              "response_format"),
             ({"response_format": {"type": "json_object"}, "extra_body": {"grammar": 'root ::= "a"'}}, "grammar"),
             ({"top_logprobs": 3}, "top_logprobs"),
             ({"logprobs": True, "top_logprobs": 21}, "top_logprobs")]
    for args, param in cases:
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model="any", max_tokens=4, messages=[{"role": "user", "content": "Hi"}],
                                           **args)
        assert err.value.body["param"] == param and "unrecognized" not in err.value.body["message"], err.value.body


def log_softmax(logits: np.ndarray) -> np.ndarray:
    z = logits.astype(np.float64) - logits.max()
    return z - np.log(np.exp(z).sum())


def test_logprobs_are_the_engines_log_softmax(server, smollm2_file):
    """Greedy completions with logprobs: each token's logprob is the log-softmax of the engine's logits at its step
    (evaluated here as a fresh call evaluates: the prompt in a batch, each generated token alone), the top ones are
    sorted, as many as asked, and the chosen token is the first of them."""
    from powerinfer_engine import Model
    from powerinfer_tools.stages.options import DEFAULT_KV_TYPE

    client, prompt = server.client(), "The capital of France is"
    r = client.completions.create(model="any", prompt=prompt, max_tokens=8, temperature=0, logprobs=5)
    lp = r.choices[0].logprobs
    assert "".join(lp.tokens) == r.choices[0].text and len(lp.tokens) == 8
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(8)]
    body = json.dumps({"content": prompt, "add_special": True}).encode()
    ids = server.request("POST", "/tokenize", body)[1]["tokens"]
    with Model(smollm2_file("q8_0"), threads=2, ctx_size=1024, kv_type=DEFAULT_KV_TYPE) as engine:  # the server's
        logits = engine.eval(ids, all_logits=False)
        for i in range(8):
            expected = log_softmax(logits)
            token = int(np.argmax(expected))
            assert lp.token_logprobs[i] == pytest.approx(expected[token], abs=1e-4)
            assert lp.token_logprobs[i] == pytest.approx(expected.max(), abs=1e-9)
            top = list(lp.top_logprobs[i].values())
            assert len(top) == 5 and top == sorted(top, reverse=True) and top[0] == lp.token_logprobs[i]
            assert top == pytest.approx(np.sort(expected)[::-1][:5], abs=1e-4)
            logits = engine.eval([token], all_logits=False)

    chat = dict(model="any", max_tokens=10, temperature=0, logprobs=True, top_logprobs=3,
                messages=[{"role": "user", "content": "Name a fruit."}])
    whole = client.chat.completions.create(**chat).choices[0]
    content = whole.logprobs.content
    assert "".join(c.token for c in content) == whole.message.content
    for c in content:
        assert bytes(c.bytes).decode() == c.token and len(c.top_logprobs) == 3
        assert c.logprob == c.top_logprobs[0].logprob == max(t.logprob for t in c.top_logprobs)
    streamed = [e for chunk in client.chat.completions.create(stream=True, **chat) if chunk.choices
                and chunk.choices[0].logprobs for e in chunk.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(c.token, c.logprob) for c in content]
    plain = client.chat.completions.create(**{k: v for k, v in chat.items() if "logprobs" not in k}).choices[0]
    assert plain.logprobs is None and plain.message.content == whole.message.content


def test_tokenize_and_detokenize(server, smollm2_file):
    from powerinfer_tools import LLM

    text = "Hello, wörld! 1234 <|im_start|>"
    answers = {}
    for add_special in (False, True):
        status, body = server.request("POST", "/tokenize",
                                      json.dumps({"content": text, "add_special": add_special}).encode())
        assert status == 200
        answers[add_special] = body["tokens"]
        status, body = server.request("POST", "/detokenize", json.dumps({"tokens": body["tokens"]}).encode())
        assert status == 200 and body["content"] == text.replace("<|im_start|>", "")  # specials left out
    with LLM(smollm2_file("q8_0"), threads=1, ctx_size=256) as llm:
        assert answers == {a: llm.tokenize(text, add_special=a) for a in (False, True)}
    status, body = server.request("POST", "/detokenize", json.dumps({"tokens": [10**9]}).encode())
    assert status == 400 and "token ids" in body["error"]["message"]
    status, body = server.request("POST", "/tokenize", json.dumps({"content": "x", "with_pieces": True}).encode())
    assert status == 400 and body["error"]["param"] == "with_pieces"


def test_tools_on_a_template_without_them_are_a_400(server):
    tool = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
    with pytest.raises(openai.BadRequestError) as err:
        server.client().chat.completions.create(model="any", max_tokens=4, tools=[tool],
                                                messages=[{"role": "user", "content": "Hi"}])
    assert err.value.body["param"] == "tools" and "no place for tools" in err.value.body["message"]
