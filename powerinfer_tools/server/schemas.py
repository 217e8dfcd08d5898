"""The request bodies `pi-tools serve` accepts: the OpenAI API's fields for /v1/chat/completions and
/v1/completions (https://platform.openai.com/docs/api-reference/chat/create), plus llama-server's sampling
extensions (top_k, repeat_penalty, repeat_last_n). Unknown fields are refused, as the OpenAI API refuses them;
NaN and infinities are refused in every number."""
from __future__ import annotations

from typing import Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

from powerinfer_tools.runtime.llm import Sampling


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)  # "8" or true is no max_tokens


class StreamOptions(_Strict):
    include_usage: bool = False


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class Message(_Strict):
    role: Literal["system", "user", "assistant", "developer"]
    content: Union[str, list[TextPart], None] = None
    name: Optional[str] = None

    def text(self) -> str:
        """The content as one string (the API also allows a list of text parts)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


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

    @field_validator("stop")
    @classmethod
    def _at_most_four(cls, v):
        if isinstance(v, list) and len(v) > 4:
            raise ValueError("at most 4 stop sequences")
        return v

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def sampling(self) -> Sampling:
        return Sampling(self.temperature, self.top_k, self.top_p, self.repeat_penalty, self.repeat_last_n,
                        self.frequency_penalty, self.presence_penalty, self.seed)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatRequest(_Generation):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=0)  # the newer name of max_tokens

    def limit(self) -> Optional[int]:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def chat_messages(self) -> list[dict]:
        # "developer" is the newer name of "system"; templates know only the latter
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in self.messages]


class CompletionRequest(_Generation):
    prompt: Union[str, list[str]]
    echo: bool = False
    max_tokens: Optional[int] = Field(16, ge=0)  # the completions API's own default

    def limit(self) -> Optional[int]:
        return self.max_tokens

    def text(self) -> str:
        if isinstance(self.prompt, str):
            return self.prompt
        if len(self.prompt) != 1:
            raise ValueError("prompt: one prompt per request")
        return self.prompt[0]
