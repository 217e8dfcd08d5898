"""Structured output: a request's response_format (OpenAI's json_object, json_schema) or grammar (llama.cpp's GBNF,
or Lark) compiled by llguidance, whose matcher says at each step which tokens may come next; the engine then draws
only among them (engine.Model.sample(allowed=...)), with the request's own sampling settings."""
from __future__ import annotations

import json
from dataclasses import dataclass

import llguidance
from llguidance import LLMatcher, LLTokenizer

from powerinfer_tools.core.errors import RequestError

# JSON without optional whitespace: a small model given room for it can spend its tokens on blank lines
_JSON_OPTIONS = {"whitespace_flexible": False}


@dataclass(frozen=True)
class Constraint:
    """What a generation's text must match: llguidance's grammar text, and the request field it came from (the one
    an error names)."""

    grammar: str
    param: str

    def matcher(self, vocabulary: LLTokenizer) -> LLMatcher:
        """A fresh matcher for one generation; a RequestError naming the field where the grammar does not compile."""
        try:
            matcher = LLMatcher(vocabulary, self.grammar, log_level=0)
            error = matcher.get_error()
        except (ValueError, RuntimeError) as exc:
            error = str(exc)
        if error:
            raise RequestError(f"{self.param}: {error.splitlines()[0]}", param=self.param)
        return matcher


def constraint(response_format: dict | None = None, grammar: str | None = None) -> Constraint | None:
    """The Constraint a call asks for (None: free text), its shape checked; the grammar compiles at the call."""
    if grammar is not None:
        if response_format not in (None, {"type": "text"}):
            raise RequestError("give response_format or grammar, not both", param="grammar")
        if not isinstance(grammar, str):
            raise RequestError(f"grammar must be a string (GBNF or Lark), not {type(grammar).__name__}",
                               param="grammar")
        try:
            return Constraint(llguidance.grammar_from("grammar", grammar), "grammar")
        except ValueError as exc:
            raise RequestError(f"grammar: {str(exc).splitlines()[0]}", param="grammar") from None
    if response_format is None:
        return None
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        schema = {"type": "object"}
    elif kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema", {}) if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise RequestError("response_format.json_schema needs a 'schema' object", param="response_format")
    else:
        raise RequestError('response_format must be {"type": "text"}, {"type": "json_object"} or {"type": '
                           f'"json_schema", "json_schema": {{...}}}}, not {json.dumps(response_format)[:200]}',
                           param="response_format")
    return Constraint(LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS), "response_format")
