"""Tool calls through `pi-tools serve` and the real `openai` client, on the tiny random model with a chat template
that renders tools: a forced call (a named function, or "required") is drawn under the call's JSON schema, so even
a random model makes a valid one; calls and tool results sent back are rendered; a bad tool_choice is one 400."""
from __future__ import annotations

import json

import gguf
import jsonschema
import openai
import pytest

from engine_helpers import rewrite
from test_serve import Server

# the tiny chat template, with the tools listed in a system turn and an assistant's calls written as JSON
TOOLS_TEMPLATE = ("{% if tools %}<s>system: tools: {% for t in tools %}{{ t['function']['name'] }} {% endfor %}</s>"
                  "{% endif %}{% for m in messages %}<s>{{ m['role'] }}: {% if m['tool_calls'] is defined %}"
                  "{{ m['tool_calls'] | tojson }}{% else %}{{ m['content'] }}{% endif %}</s>{% endfor %}"
                  "{% if add_generation_prompt %}<s>assistant:{% endif %}")
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tiny_chat_file, tmp_path_factory):
    path = rewrite(tiny_chat_file, tmp_path_factory.mktemp("tools") / "tiny-tools.gguf",
                   fields={"tokenizer.chat_template": (TOOLS_TEMPLATE, gguf.GGUFValueType.STRING)})
    s = Server(path, "-c", "256", "-t", "1")
    yield s
    if s.proc.poll() is None:
        s.proc.kill()


def test_a_forced_call_is_valid(server):
    client = server.client()
    for seed in range(3):
        named = client.chat.completions.create(
            model="any", messages=ASK, tools=TOOLS, max_tokens=180, temperature=1.0, seed=seed,
            tool_choice={"type": "function", "function": {"name": "get_weather"}}).choices[0]
        assert named.finish_reason == "tool_calls" and named.message.content is None, named.message.content
        (call,) = named.message.tool_calls
        assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), WEATHER)
        anyone = client.chat.completions.create(model="any", messages=ASK, tools=TOOLS, max_tokens=180,
                                                temperature=1.0, seed=seed, tool_choice="required").choices[0]
        (call,) = anyone.message.tool_calls
        jsonschema.validate(json.loads(call.function.arguments), {"get_weather": WEATHER, "get_time": TIME}
                            [call.function.name])
    chunks = list(client.chat.completions.create(model="any", messages=ASK, tools=TOOLS, max_tokens=180, seed=1,
                                                 tool_choice="required", stream=True))
    calls = [c for chunk in chunks if chunk.choices for c in chunk.choices[0].delta.tool_calls or []]
    assert len(calls) == 1 and calls[0].index == 0 and calls[0].function.name in ("get_weather", "get_time")
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_calls_and_results_go_back_through_the_template(server):
    client = server.client()
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                             "arguments": '{"city": "Paris", "unit": "celsius"}'}}
    conversation = ASK + [{"role": "assistant", "content": None, "tool_calls": [call]},
                          {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees"}]
    r = client.chat.completions.create(model="any", messages=conversation, tools=TOOLS, max_tokens=8,
                                       temperature=0, tool_choice="none")
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason in ("stop", "length")
    # the template wrote the call into the prompt: its tokens are there
    assert r.usage.prompt_tokens > client.chat.completions.create(
        model="any", messages=ASK + [{"role": "tool", "content": "18 degrees"}], tools=TOOLS, max_tokens=1,
        temperature=0).usage.prompt_tokens + 10


@pytest.mark.parametrize("args, param", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools.0.function.name"),
    ({"messages": ASK + [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {
        "name": "get_time", "arguments": "not json"}}]}]}, "messages")])
def test_bad_tool_requests_are_one_400(server, args, param):
    with pytest.raises(openai.BadRequestError) as err:
        server.client().chat.completions.create(**({"model": "any", "messages": ASK, "max_tokens": 4} | args))
    assert err.value.body["param"] == param and "unrecognized" not in err.value.body["message"], err.value.body
