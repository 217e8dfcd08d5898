"""The request bodies `pi-tools serve` accepts: the OpenAI API's fields for /v1/chat/completions and
/v1/completions (https://platform.openai.com/docs/api-reference/chat/create), plus llama-server's sampling
extensions (top_k, repeat_penalty, repeat_last_n). Unknown fields are refused, as the OpenAI API refuses them;
NaN and infinities are refused in every number."""
from __future__ import annotations

import json
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

from powerinfer_tools.core.errors import RequestError
from powerinfer_tools.runtime.llm import Sampling


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)  # "8" or true is no max_tokens


class StreamOptions(_Strict):
    include_usage: bool = False


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class CalledFunction(_Strict):
    name: str
    arguments: str  # JSON text


class ToolCall(_Strict):
    """A call an assistant message made, sent back with the conversation."""

    id: str
    type: Literal["function"]
    function: CalledFunction


class Function(_Strict):
    name: str
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None


class Tool(_Strict):
    type: Literal["function"]
    function: Function


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


class Message(_Strict):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Union[str, list[TextPart], None] = None
    name: Optional[str] = None
    tool_calls: Optional[list[ToolCall]] = None
    tool_call_id: Optional[str] = None

    def text(self) -> str:
        """The content as one string (the API also allows a list of text parts)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class JsonSchema(_Strict):
    """OpenAI's response_format.json_schema. The schema is enforced whole whatever `strict` says."""

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    name: str
    description: Optional[str] = None
    schema_: Optional[dict[str, Any]] = Field(None, alias="schema")
    strict: Optional[bool] = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchema] = None


class Tokenize(_Strict):
    """llama-server's POST /tokenize."""

    content: str
    add_special: bool = False


class EmbeddingRequest(_Strict):
    """POST /v1/embeddings (https://platform.openai.com/docs/api-reference/embeddings/create)."""

    input: Union[str, list[str], list[int], list[list[int]]]
    model: Optional[str] = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Optional[int] = None  # only the model's own width: a shortened vector is not computed
    user: Optional[str] = None


class Detokenize(_Strict):
    """llama-server's POST /detokenize."""

    tokens: list[int]


class _Generation(_Strict):
    """What both endpoints share: the sampling and the stopping of one generation."""

    model: Optional[str] = None  # one model is served: any name (or none) selects it, as llama-server does
    max_tokens: Optional[int] = Field(None, ge=0)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    repeat_penalty: float = Field(1.0, gt=0)
    repeat_last_n: int = Field(64, ge=0)
    seed: Optional[int] = Field(None, ge=0, lt=2**64)
    stop: Union[str, list[str], None] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    n: int = Field(1, ge=1, le=1)  # one choice per request
    user: Optional[str] = None
    response_format: Optional[ResponseFormat] = None
    grammar: Optional[str] = None  # llama-server's: GBNF (or Lark, as llguidance reads it)

    @field_validator("stop")
    @classmethod
    def _at_most_four(cls, v):
        if isinstance(v, list) and len(v) > 4:
            raise ValueError("at most 4 stop sequences")
        return v

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def format(self) -> Optional[dict]:
        return self.response_format.model_dump(by_alias=True, exclude_none=True) if self.response_format else None

    def sampling(self) -> Sampling:
        return Sampling(self.temperature, self.top_k, self.top_p, self.repeat_penalty, self.repeat_last_n,
                        self.frequency_penalty, self.presence_penalty, self.seed)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatRequest(_Generation):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=0)  # the newer name of max_tokens
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=20)

    def logprob_count(self) -> Optional[int]:
        """LLM's logprobs argument: None for none, else the count of top alternatives."""
        if self.top_logprobs is not None and not self.logprobs:
            raise RequestError("top_logprobs needs logprobs: true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None

    def limit(self) -> Optional[int]:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    tools: Optional[list[Tool]] = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice] = "auto"
    parallel_tool_calls: Optional[bool] = None  # every call the answer makes is read, one or several

    def tool_list(self) -> Optional[list[dict]]:
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None

    def choice(self) -> Union[str, dict]:
        return self.tool_choice if isinstance(self.tool_choice, str) else self.tool_choice.model_dump()

    def chat_messages(self) -> list[dict]:
        """The messages as templates take them: "developer" is the newer name of "system", which templates know;
        a call's arguments are an object (JSON text in the API)."""
        out = []
        for i, m in enumerate(self.messages):
            message = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
            if m.tool_calls:
                message["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                    "name": c.function.name, "arguments": _arguments(c.function.arguments, i)}} for c in m.tool_calls]
            if m.tool_call_id is not None:
                message["tool_call_id"] = m.tool_call_id
            out.append(message)
        return out


def _arguments(text: str, index: int) -> dict:
    try:
        arguments = json.loads(text)
    except ValueError:
        arguments = None
    if not isinstance(arguments, dict):
        raise RequestError(f"messages.{index}.tool_calls: arguments must be a JSON object", param="messages")
    return arguments


class CompletionRequest(_Generation):
    prompt: Union[str, list[str]]
    echo: bool = False
    max_tokens: Optional[int] = Field(16, ge=0)  # the completions API's own default
    logprobs: Optional[int] = Field(None, ge=0, le=20)

    def logprob_count(self) -> Optional[int]:
        if self.logprobs is not None and self.echo:
            raise RequestError("echo with logprobs (the prompt's logprobs) is not supported", param="echo")
        return self.logprobs

    def limit(self) -> Optional[int]:
        return self.max_tokens

    def text(self) -> str:
        if isinstance(self.prompt, str):
            return self.prompt
        if len(self.prompt) != 1:
            raise ValueError("prompt: one prompt per request")
        return self.prompt[0]
