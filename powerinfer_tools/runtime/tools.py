"""Tool calls: a chat's tools rendered by the model's own chat template (which tells the model how to call them),
and its answer read back as calls. A call is a JSON object {"name": ..., "arguments": {...}} ("parameters" also
read, as Llama 3.1 writes it), alone or in <tool_call>...</tool_call> blocks (Hermes, Qwen). Where the request
forces a call (tool_choice "required" or a named function), the answer is drawn under a JSON schema of the call,
so even a model that was never taught to call tools writes a valid one."""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from powerinfer_tools.core.errors import RequestError

_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)
_CHOICES = ("none", "auto", "required")


@dataclass(frozen=True)
class ToolCall:
    """One call the model made: an id for the tool's answer to name, the function, its arguments as JSON text (as
    the OpenAI API carries them)."""

    id: str
    name: str
    arguments: str


def checked(tools, tool_choice) -> tuple[dict[str, dict], str | None]:
    """The tools by name, each its parameters' schema, and the name a call is forced to (None: any; "" any of the
    tools, for "required"), or a RequestError naming the field."""
    if not isinstance(tools, (list, tuple)) or not tools:
        raise RequestError("tools must be a non-empty list of {\"type\": \"function\", \"function\": {...}}",
                           param="tools")
    schemas = {}
    for tool in tools:
        function = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise RequestError("each tool must be {\"type\": \"function\", \"function\": {\"name\": ...}}",
                               param="tools")
        schemas[function["name"]] = function.get("parameters") or {"type": "object"}
    if tool_choice in ("none", "auto"):
        return schemas, None
    if tool_choice == "required":
        return schemas, ""
    name = tool_choice.get("function", {}).get("name") if isinstance(tool_choice, dict) else None
    if name not in schemas:
        raise RequestError(f"tool_choice must be one of {', '.join(_CHOICES)} or {{\"type\": \"function\", "
                           f"\"function\": {{\"name\": ...}}}} naming one of the tools, not {tool_choice!r}",
                           param="tool_choice")
    return schemas, name


def call_format(schemas: dict[str, dict], forced: str) -> dict:
    """The response_format of a forced call: the named tool's (forced), or any tool's ("")."""
    def one(name: str) -> dict:
        return {"type": "object", "properties": {"name": {"const": name}, "arguments": schemas[name]},
                "required": ["name", "arguments"], "additionalProperties": False}

    schema = one(forced) if forced else {"anyOf": [one(name) for name in schemas]}
    return {"type": "json_schema", "json_schema": {"name": "tool_call", "schema": schema}}


def parse_calls(text: str, names) -> tuple[ToolCall, ...]:
    """The calls of an answer: its <tool_call> blocks, or else the whole of it, each a JSON call of one of the
    named tools; none where any of them is not (the answer is then text)."""
    calls = []
    for part in _BLOCK.findall(text) or [text]:
        try:
            call = json.loads(part)
        except ValueError:
            return ()
        if not isinstance(call, dict):
            return ()
        arguments = call.get("arguments", call.get("parameters"))
        if call.get("name") not in names or not isinstance(arguments, dict):
            return ()
        calls.append(ToolCall(f"call_{uuid.uuid4().hex[:24]}", call["name"], json.dumps(arguments)))
    return tuple(calls)
