"""A model's chat template rendered as transformers' `apply_chat_template` renders it, with jinja2 alone (importing
transformers takes about a second, most of a run's start).

The environment is transformers' (transformers/utils/chat_template_utils.py): a sandbox that cannot change its
inputs, trim_blocks and lstrip_blocks, the loopcontrols extension, `{% generation %}` blocks (transformers uses them to
mark the assistant's text; here they render their body), a `tojson` that does not escape HTML, the globals
`raise_exception`, `strftime_now`, a `dict` without attribute access and a `namespace` that refuses underscored
names. The inputs are prepared as there: keys of a message whose value is None dropped, everything the template sees
rebuilt from plain JSON types, a message's reasoning also given under the names templates read it by.
"""
from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache

# the names a message's reasoning comes under; templates read the first (transformers' _REASONING_FIELDS)
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def render_chat(template: str, messages: Sequence[Mapping], tools: Sequence[Mapping] | None = None,
                add_generation_prompt: bool = False, variables: Mapping[str, str] | None = None) -> str:
    """The text of `messages` (and `tools`, OpenAI's function definitions) under `template`; `variables` are given
    to it as well (the tokenizer's named special tokens: bos_token, eos_token, ...). A template's own refusal raises
    jinja2's TemplateError, a message that is not a mapping TypeError, an empty conversation ValueError."""
    if not messages:
        raise ValueError("Cannot apply chat template to an empty conversation. Provide at least one message.")
    chat = []
    for message in messages:
        if not isinstance(message, Mapping):
            raise TypeError(f"Chat messages should be dicts, but got {message!r}.")
        chat.append(_with_reasoning_aliases(_plain({k: v for k, v in message.items() if v is not None})))
    if tools is not None:
        for tool in tools:
            if not isinstance(tool, Mapping):
                raise ValueError("Tools should be JSON schemas (dicts).")
    return _compiled(template).render(messages=chat, tools=_plain(None if tools is None else list(tools)),
                                      documents=None, add_generation_prompt=add_generation_prompt,
                                      **_plain(dict(variables or {})))


def _plain(value):
    """value rebuilt from JSON's types (subclasses back to their base type), anything else a placeholder naming its
    type, so that a template reaches no method of a caller's object."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    return f"<{type(value).__name__}>"


def _with_reasoning_aliases(message: dict) -> dict:
    reasoning = next((message[key] for key in REASONING_FIELDS if message.get(key) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


@lru_cache
def _compiled(template: str):
    import jinja2
    import jinja2.ext
    from jinja2 import nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    class TemplateDict:
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        def __init__(*args, **kwargs):  # jinja's own signature trick: `namespace(self=...)` still works
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace.check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace.check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def check_name(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"Chat templates cannot store underscore-prefixed attributes on a namespace, but got {name!r}. "
                    "Please rename the attribute.")

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals["dict"] = TemplateDict()
    env.globals["namespace"] = TemplateNamespace
    return env.from_string(template)
