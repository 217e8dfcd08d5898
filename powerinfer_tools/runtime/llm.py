"""Text in, text out: a converted model with its tokenizer, in the style of llama-cpp-python's `Llama`.

    from powerinfer_tools import LLM

    llm = LLM("smollm2", sparse_mode="dense")
    print(llm.complete("The capital of France is", max_tokens=16, temperature=0).text)
    for chunk in llm.chat([{"role": "user", "content": "Hi!"}], stream=True):
        print(chunk.text, end="", flush=True)

The KV cache is kept between calls: a prompt that shares a start with an earlier call's prompt (a chat's next
turn, a fixed system prompt) evaluates only the rest. What is reused is only what a fresh call would have computed
the same way, so a call's answer never depends on the calls before it (see _Cache). `pi-tools chat` and `pi-tools serve` are
built on this class. One LLM may be shared by threads: its calls run one at a time (a streaming call holds it
until its stream is exhausted, closed or dropped), and a call made in the thread that holds an open stream ends
that stream.
"""
from __future__ import annotations

import functools
import math
import numbers
import os
import queue
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from powerinfer_tools.core.errors import RequestError
from powerinfer_tools.stages.options import DEFAULT_KV_TYPE

if TYPE_CHECKING:
    from llguidance import LLMatcher, LLTokenizer

    from powerinfer_tools.runtime.structured import Constraint
    from powerinfer_tools.runtime.tools import ToolCall

# A prompt longer than this many characters a token of the context is first tokenized in part (LLM.prompt_ids):
# ordinary text runs three to five.
PROBE_CHARS_PER_TOKEN = 16


@dataclass(frozen=True)
class Sampling:
    """How the next token is drawn: greedy when temperature is 0. The penalties look at the last
    repeat_last_n tokens of the cache (prompt included, as llama.cpp does)."""

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None  # None: a fresh random seed each call

    def check(self) -> None:
        """One line naming the first value of the wrong type or out of range (NaN included)."""
        finite = {"temperature": self.temperature, "top_p": self.top_p, "repeat_penalty": self.repeat_penalty,
                  "frequency_penalty": self.frequency_penalty, "presence_penalty": self.presence_penalty}
        for name, value in finite.items():
            if not _is_number(value):
                raise RequestError(f"{name} must be a number, not {value!r}", param=name)
            if not math.isfinite(value):
                raise RequestError(f"{name} must be a finite number, not {value}", param=name)
        for name, value in {"top_k": self.top_k, "repeat_last_n": self.repeat_last_n}.items():
            if not _is_integer(value) or not 0 <= value < 2**31:  # the engine's int32
                raise RequestError(f"{name} must be an integer in [0, 2^31), not {value!r}", param=name)
        if self.seed is not None and (not _is_integer(self.seed) or not 0 <= self.seed < 2**64):
            raise RequestError(f"seed must be None or an integer in [0, 2^64), not {self.seed!r}", param="seed")
        if self.temperature < 0:
            raise RequestError(f"temperature must be >= 0, not {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise RequestError(f"top_p must be in (0, 1], not {self.top_p}")
        if self.repeat_penalty <= 0:
            raise RequestError(f"repeat_penalty must be > 0, not {self.repeat_penalty}")


@dataclass(frozen=True)
class Usage:
    """Token counts of one call: prompt_tokens were given, cached_tokens of them came from the KV cache."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class Embeddings:
    """LLM.embed's answer: one float32 vector of n_embd per input, in order; prompt_tokens over all of them."""

    vectors: tuple[np.ndarray, ...]
    prompt_tokens: int


POOLINGS = ("mean", "last")  # llama-server's --pooling values that a causal model's embedding takes


@dataclass(frozen=True)
class Timings:
    """The engine's own account of one call: the prompt tokens it evaluated (the uncached ones) and the
    generated ones, with their seconds, and the share of FFN neurons that passed the activation rule."""

    prompt_tokens: int
    prompt_seconds: float
    generated_tokens: int
    generated_seconds: float
    ffn_density: float | None

    @property
    def prompt_tokens_per_second(self) -> float | None:
        return self.prompt_tokens / self.prompt_seconds if self.prompt_seconds else None

    @property
    def generated_tokens_per_second(self) -> float | None:
        return self.generated_tokens / self.generated_seconds if self.generated_seconds else None


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token (its text, its bytes) with its log-probability under the model's own distribution at its
    step (the log-softmax of the logits, before the penalties, the temperature and any grammar's mask), and the
    `top` most likely tokens of that step, most likely first (empty in the entries of `top`)."""

    token: str
    bytes: bytes
    logprob: float
    top: tuple["TokenLogprob", ...] = ()


MAX_TOP_LOGPROBS = 20  # the OpenAI API's bound


@dataclass(frozen=True)
class Completion:
    """A finished generation: finish_reason is "stop" (an end token or a stop string) or "length"; logprobs (when
    asked for) has one entry per generated token but the end token, a stop string's tokens included."""

    text: str
    finish_reason: str
    usage: Usage
    timings: Timings
    logprobs: tuple[TokenLogprob, ...] | None = None
    tool_calls: tuple["ToolCall", ...] = ()  # a chat given tools: the calls its answer made ("tool_calls")


@dataclass(frozen=True)
class Chunk:
    """A piece of a streamed generation; the last one carries the finish reason and the whole Completion.
    logprobs: the tokens generated since the chunk before (when asked for)."""

    text: str
    completion: Completion | None = None
    logprobs: tuple[TokenLogprob, ...] = ()

    @property
    def finish_reason(self) -> str | None:
        return self.completion.finish_reason if self.completion else None


@dataclass(frozen=True)
class _Request:
    """A generation's checked arguments: max_tokens (None: what the context leaves), the stop strings, the grammar
    the text must match (None: free), the logprobs asked for (None: none; else the count of top alternatives)."""

    max_tokens: int | None
    stop: tuple[str, ...]
    sampling: Sampling
    constraint: "Constraint | None" = None
    logprobs: int | None = None
    tools: frozenset[str] = frozenset()  # the tools whose calls the answer is read for


@dataclass
class Counters:
    """What an LLM has done since it opened, summed over its calls (a server's /metrics): each counted as it
    happens, so a call that was ended early counts the tokens it did generate."""

    calls: int = 0
    prompt_tokens: int = 0      # given, cached or not
    cached_tokens: int = 0      # of them, reused from the KV cache
    prompt_seconds: float = 0.0
    generated_tokens: int = 0
    generated_seconds: float = 0.0


@dataclass
class _Cache:
    """What the KV cache holds, as the tokens evaluated or about to be (the one sampled last is evaluated when the
    next step needs it: the engine's n_past says how many are in), and how many of them, from the start, the
    engine's batch path computed.

    The engine evaluates a prompt in batches and a generated token alone, on its decode path, and the two round
    differently (each at its own fastest arithmetic). A fresh call takes every prompt token through a batch but a
    last one left alone when the prompt's length is one past a whole number of batches; so a later call may reuse
    only batch-computed tokens, and must leave itself a rest whose last batch is alone exactly where a fresh
    call's would be (LLM._reuse)."""

    tokens: list[int] = field(default_factory=list)
    batch_tokens: int = 0


class _Gate:
    """One call at a time: a call waits while another thread holds the LLM, a streaming call from its start until
    its stream is exhausted, closed or dropped. The holding thread never waits on itself: a generation there takes
    the hold over (the stream it had ends), other calls run within the hold."""

    def __init__(self):
        self._changed = threading.Condition()
        self._holder: object | None = None  # the current hold's token
        self._thread: int | None = None     # the thread that took it

    def enter(self, generation: bool) -> object | None:
        """Wait for the LLM; the token that leave() takes, None for a call within its own thread's hold."""
        me = threading.get_ident()
        with self._changed:
            while self._holder is not None and self._thread != me:
                self._changed.wait()
            if self._holder is not None and not generation:
                return None
            self._holder, self._thread = object(), me
            return self._holder

    def held(self) -> bool:
        return self._holder is not None

    def leave(self, token: object | None) -> None:
        """End the hold `token` took, unless a later generation of its thread took it over."""
        with self._changed:
            if token is not None and self._holder is token:
                self._holder = self._thread = None
                self._changed.notify()


class _Stream(Iterator[Chunk]):
    """The Chunks of a streamed generation, holding the LLM until they are exhausted, or closed (close(), a with
    block) or dropped: a stream left open keeps every other thread's call waiting. The hold lives in a generator
    started at once, whose finally releases it: a stream that ended has nothing left to run when it is dropped (no
    __del__, where a Ctrl-C could land and print a traceback)."""

    def __init__(self, chunks: Iterator[Chunk], step: threading.Lock, release: Callable[[], None]):
        self._held = self._hold(chunks, step, release)
        next(self._held)  # inside its try: from here on, closing or dropping it releases the LLM

    @staticmethod
    def _hold(chunks: Iterator[Chunk], step: threading.Lock, release: Callable[[], None]) -> Iterator[Chunk | None]:
        try:
            yield None
            while True:
                with step:  # a token's work is never interleaved with another call's
                    chunk = next(chunks, None)
                if chunk is None:
                    return
                yield chunk
        finally:  # the end, an error, Ctrl-C, close() or the stream dropped: the LLM is free again
            try:
                chunks.close()
            finally:
                release()

    def __next__(self) -> Chunk:
        return next(self._held)

    def close(self) -> None:
        self._held.close()

    def __enter__(self) -> "_Stream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class LLM:
    """A model file (or "smollm2", the embedded default, built on first use) with its tokenizer.

    The engine options are those of `pi-tools run`: threads, sparse_mode (dense | gate | predictor | auto | input),
    ctx_size (default: the model's trained context, at most options.CTX_CAP), kv_type (f16 | f32 | q8_0), gpu (auto | on | off),
    gpuidx (a .gpuidx plan; default: MODEL.generated.gpuidx when it sits beside the model, "none" for none),
    vram_budget (GiB for the hot tier, solved with `profile`), input_sparsity (the share of every matrix's inputs
    zeroed, from the file's input thresholds; docs/engine.md, "Input sparsity"), memory_budget (GiB of RAM the engine
    may hold; the cold FFN neurons past it are read from MODEL.neurons: docs/engine.md, "Models larger than memory").

    Threads may share one LLM: complete and chat run one at a time (see _Gate); tokenize, detokenize, count_tokens,
    prompt_ids and chat_prompt use only the tokenizer and never wait.
    """

    def __init__(self, model: str | os.PathLike = "smollm2", *, threads: int | None = None,
                 sparse_mode: str = "dense", ctx_size: int | None = None, kv_type: str = DEFAULT_KV_TYPE, gpu: str = "auto",
                 gpuidx: str | os.PathLike | None = None, vram_budget: float | None = None,
                 profile: str | os.PathLike | None = None, input_sparsity: float | None = None,
                 memory_budget: float | None = None, parallel: int = 1):
        from powerinfer_tools.runtime import inference

        if not _is_integer(parallel) or not 1 <= parallel <= MAX_PARALLEL:
            raise RequestError(f"parallel must be an integer in [1, {MAX_PARALLEL}], not {parallel!r}", param="parallel")
        if parallel > 1 and (sparse_mode not in PARALLEL_MODES or input_sparsity):
            raise RequestError(f"parallel {parallel} decodes its requests together in {', '.join(PARALLEL_MODES)} mode "
                               f"only (each token the bits it gets alone): sparse mode {sparse_mode!r}"
                               f"{' with input sparsity' if input_sparsity else ''} is refused", param="parallel")
        self.target = inference.resolve_model_file(str(model), gpuidx, vram_budget, profile, ctx_size)
        # parallel > 1: a sequence per slot, and one more for embeddings (they never wait for a slot)
        self.tokenizer, self.model = inference.open_with_tokenizer(
            self.target, threads=threads, sparse_mode=sparse_mode, ctx_size=ctx_size, kv_type=kv_type, gpu=gpu,
            vram_budget_gib=vram_budget, input_sparsity=input_sparsity, memory_budget_gib=memory_budget,
            n_seq=parallel + 1 if parallel > 1 else 1)
        self.parallel = parallel
        self.n_ctx: int = self.model.n_ctx
        self.name = Path(self.target.model).name if str(model) != "smollm2" else "smollm2"
        self.stop_tokens = frozenset(t for t in (self.tokenizer.eos_token_id, self.model.info["eos"])
                                     if t is not None and t >= 0)
        self._cache = _Cache()
        self._n_batch: int = self.model.info["n_batch"]
        self.counters = Counters()
        self._gate = _Gate()
        self._step = threading.Lock()  # held while a call works on the engine and the cache
        self._generation = 0  # bumped by every call: an older stream (taken over in its own thread) sees it and ends
        self._vocab: "LLTokenizer | None" = None  # llguidance's view of the tokenizer (LLM.vocabulary)
        self._vocab_lock = threading.Lock()
        # a constraint compiled once (checked at the call), each generation its own copy of the fresh matcher; the
        # last few kept, as an app repeats its schema from request to request
        self._compiled = functools.lru_cache(maxsize=COMPILED_CONSTRAINTS)(
            lambda c: c.matcher(self.vocabulary()))
        self._side = parallel if parallel > 1 else 0  # the sequence embeddings evaluate in
        self._scheduler = _Scheduler(self, parallel) if parallel > 1 else None

    # ---- lifetime -----------------------------------------------------------------------------------
    def close(self) -> None:
        if self._scheduler is not None:
            self._scheduler.close()
        self.model.close()

    def slots(self) -> tuple[int, int]:
        """(busy, all) slots: requests generating now and the most that may (parallel)."""
        return (self._scheduler.busy_count() if self._scheduler else int(self._gate.held()), self.parallel)

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- text <-> tokens ----------------------------------------------------------------------------
    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        """The text's token ids (with the model's BOS where it adds one, when add_special)."""
        _check_text(text)
        return list(self.tokenizer(text, add_special_tokens=add_special)["input_ids"])

    def detokenize(self, ids: Iterable[int]) -> str:
        """The text of token ids (special tokens left out); an id outside the vocabulary is a RequestError."""
        if isinstance(ids, (str, bytes)) or not isinstance(ids, Iterable):
            raise RequestError(f"detokenize takes a list of token ids, not {type(ids).__name__}")
        ids = list(ids)
        for i in ids:
            if not _is_integer(i) or not 0 <= i < self.model.n_vocab:
                raise RequestError(f"token ids must be integers in [0, {self.model.n_vocab}), not {i!r}")
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)

    def vocabulary(self) -> "LLTokenizer":
        """llguidance's tokenizer over this model's vocabulary: the grammars' masks and each token's bytes. Built on
        first use (a second or so), then kept."""
        with self._vocab_lock:
            if self._vocab is None:
                from llguidance import LLTokenizer

                # what llguidance.hf.from_tokenizer gives for transformers' tokenizer, whose backend this is (without
                # padding or truncation, as from_tokenizer sets them)
                self._vocab = LLTokenizer(self.tokenizer.backend.to_str(), n_vocab=self.model.n_vocab,
                                          eos_token=sorted(self.stop_tokens))
            return self._vocab

    def constraint(self, response_format: dict | None = None, grammar: str | None = None) -> "Constraint | None":
        """The Constraint that response_format or grammar asks for, compiled against this model's vocabulary once
        to check it: a RequestError naming the field where it does not compile."""
        from powerinfer_tools.runtime.structured import constraint

        found = constraint(response_format, grammar)
        if found is not None:
            self._compiled(found)
        return found

    def _matcher(self, request: "_Request") -> "LLMatcher | None":
        """A fresh matcher for one generation of request (None: free text), from its constraint compiled once."""
        return self._compiled(request.constraint).deep_copy() if request.constraint else None

    @functools.cached_property
    def supports_tools(self) -> bool:
        """Whether the chat template renders tools (a tool given to it shows in its text), as llama.cpp probes."""
        probe = {"type": "function", "function": {"name": "pi_tools_probe", "parameters": {"type": "object"}}}
        try:
            return "pi_tools_probe" in self.tokenizer.apply_chat_template(
                [{"role": "user", "content": "x"}], tools=[probe], add_generation_prompt=True, tokenize=False)
        except Exception:  # a template that cannot take them at all
            return False

    @property
    def chat_template(self) -> str | None:
        return getattr(self.tokenizer, "chat_template", None) or None

    def chat_prompt(self, messages: Sequence[dict], tools: Sequence[dict] | None = None) -> str:
        """The model's chat template applied to messages ({"role", "content"} each; an assistant's may carry
        "tool_calls" instead of content, a "tool" message "tool_call_id") and tools (OpenAI's function
        definitions), ready for the reply."""
        if not self.chat_template:
            raise RequestError(f"{self.name} stores no chat template: use complete() with a prompt of your own")
        if not messages:
            raise RequestError("messages is empty")
        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise RequestError("each message needs a string 'role' and a string 'content'")
            _check_text(m["content"])
        if tools and not self.supports_tools:
            raise RequestError(f"the chat template of {self.name} has no place for tools", param="tools")
        try:
            return self.tokenizer.apply_chat_template(list(messages), tools=list(tools) if tools else None,
                                                      add_generation_prompt=True, tokenize=False)
        except Exception as exc:  # the template's own refusal (jinja's TemplateError, a raise_exception in it)
            raise RequestError(f"the chat template refused the messages: {str(exc).splitlines()[0]}") from None

    # ---- embeddings ---------------------------------------------------------------------------------
    def embed(self, inputs: str | Sequence[str] | Sequence[Sequence[int]], pooling: str = "mean",
              normalize: bool = True) -> Embeddings:
        """Each input's embedding, as llama-server's --embeddings computes it: the model's last hidden states
        (through the output norm, what the head reads) over the input's tokens, pooled ("mean" of all, or the
        "last" token's), of unit length where normalize. inputs: a string, strings (tokenized with the model's
        BOS), a list of token ids or lists of them. Each input is evaluated from an empty cache, so its vector never
        depends on what was evaluated before; the cache is left empty."""
        if pooling not in POOLINGS:
            raise RequestError(f"pooling must be one of {', '.join(POOLINGS)}, not {pooling!r}")
        items = [inputs] if isinstance(inputs, str) else list(inputs) if isinstance(inputs, Sequence) else None
        if items and all(_is_integer(i) for i in items):  # one input given as its token ids
            items = [items]
        if not items:
            raise RequestError("input must be a string, a list of strings or a list of token id lists, not empty",
                               param="input")
        ids = [self._embedding_ids(item) for item in items]  # before the LLM is taken: tokenizing waits for nothing
        from powerinfer_tools.runtime.inference import engine_errors

        token = self._gate.enter(generation=True)
        try:
            with self._step:
                self.model.select(self._side)
                if self._scheduler is None:
                    self._generation += 1  # a stream this thread still holds ends: the cache is about to change
                    self._cache = _Cache()
                vectors = []
                for one in ids:
                    with engine_errors():
                        self.model.reset(0)
                        hidden = self.model.eval_hidden(one).astype(np.float64)
                    v = hidden.mean(axis=0) if pooling == "mean" else hidden[-1]
                    norm = float(np.linalg.norm(v))
                    vectors.append((v / norm if normalize and norm > 0 else v).astype(np.float32))
                self.model.reset(0)
        finally:
            self._gate.leave(token)
        n_tokens = sum(map(len, ids))
        self.counters.calls += 1
        self.counters.prompt_tokens += n_tokens
        return Embeddings(tuple(vectors), n_tokens)

    def _embedding_ids(self, item) -> list[int]:
        """One input's token ids, checked: text (a prompt's, BOS included) or ids inside the vocabulary and the
        context."""
        if isinstance(item, str):
            ids = self.prompt_ids(item, True, param="input")
        elif isinstance(item, Sequence) and item and all(_is_integer(i) for i in item):
            if not all(0 <= i < self.model.n_vocab for i in item):
                raise RequestError(f"token ids must be in [0, {self.model.n_vocab})", param="input")
            ids = [int(i) for i in item]
        else:
            raise RequestError("each input must be a non-empty string or a non-empty list of token ids",
                               param="input")
        if len(ids) > self.n_ctx:
            raise RequestError(f"an input has {len(ids)} tokens and the context holds {self.n_ctx}", param="input",
                               code="context_length_exceeded")
        return ids

    # ---- generation ---------------------------------------------------------------------------------
    def complete(self, prompt: str, max_tokens: int | None = 128, stop: str | Sequence[str] | None = (),
                 stream: bool = False, sampling: Sampling | None = None, fit: bool = True,
                 response_format: dict | None = None, grammar: str | None = None, logprobs: int | None = None,
                 **options) -> Completion | Iterator[Chunk]:
        """Continue `prompt`. max_tokens: at most this many (None: what the context leaves; more than it leaves is
        cut to that, or with fit=False refused, as the OpenAI API refuses it); stop: a string or strings that end
        the text (not included); sampling (or its fields as keyword arguments: temperature, top_k, ...).
        response_format (OpenAI's: {"type": "json_object"}, {"type": "json_schema", "json_schema": {"schema": ...}})
        or grammar (GBNF or Lark): the text is drawn to match it, token by token. logprobs: None, or N for each
        token's logprob with the N (0 to 20) most likely at its step (Completion.logprobs, Chunk.logprobs).
        stream=True gives an iterator of Chunks instead of a Completion (it holds the LLM until exhausted or
        closed)."""
        request = _request(max_tokens, stop, _sampling(sampling, options), self.constraint(response_format, grammar),
                           logprobs)
        _check_text(prompt)
        return self._run(prompt, True, request, fit, stream)

    def chat(self, messages: Sequence[dict], max_tokens: int | None = 512, stop: str | Sequence[str] | None = (),
             stream: bool = False, sampling: Sampling | None = None, fit: bool = True,
             response_format: dict | None = None, grammar: str | None = None, logprobs: int | None = None,
             tools: Sequence[dict] | None = None, tool_choice: str | dict = "auto",
             **options) -> Completion | Iterator[Chunk]:
        """The assistant's reply to messages, through the model's chat template (as complete() otherwise). tools
        (OpenAI's function definitions) go through the template; the answer's calls come back in
        Completion.tool_calls. tool_choice: "auto", "none" (the answer is not read for calls), "required" or
        {"type": "function", "function": {"name": ...}}: a call is forced, drawn under its JSON schema."""
        names: frozenset[str] = frozenset()
        if tools:
            from powerinfer_tools.runtime.tools import call_format, checked

            schemas, forced = checked(tools, tool_choice)
            if forced is not None:
                if response_format is not None or grammar is not None:
                    raise RequestError("a forced tool call takes no response_format or grammar", param="tool_choice")
                response_format = call_format(schemas, forced)
            names = frozenset(schemas) if tool_choice != "none" else frozenset()
        request = _request(max_tokens, stop, _sampling(sampling, options), self.constraint(response_format, grammar),
                           logprobs, names)
        prompt = self.chat_prompt(messages, tools)
        return self._run(prompt, False, request, fit, stream)  # the template writes its own BOS where it has one

    def count_tokens(self, prompt: str, chat: bool = False) -> int:
        """What the prompt costs a call (chat: a prompt chat_prompt wrote, which carries its own BOS)."""
        return len(self.tokenize(prompt, add_special=not chat))

    def prompt_ids(self, prompt: str, add_special: bool = True, param: str | None = None) -> list[int]:
        """The prompt's ids as a call tokenizes them, or a RequestError (param: the argument to name) where they
        leave the context no room. A prompt far longer than the context is refused from a tokenized head of it:
        the tokenizer's peak for a whole prompt of megabytes would stay in the process's heap after the refusal."""
        _check_text(prompt)
        probe = self.n_ctx * PROBE_CHARS_PER_TOKEN
        cut = prompt.rfind(" ", 0, probe) if len(prompt) > probe else -1
        if cut > 0:  # a word boundary: the head's tokens are the whole prompt's first ones
            n_head = len(self.tokenize(prompt[:cut], add_special=add_special))
            if n_head > self.n_ctx:
                raise RequestError(f"the prompt has more than {self.n_ctx} tokens and the context holds {self.n_ctx}: no "
                                   "room to generate (shorten it, or open the model with a larger ctx_size)", param=param,
                                   code="context_length_exceeded")
        ids = self.tokenize(prompt, add_special=add_special)
        if not ids:
            raise RequestError("the prompt is empty and the model has no BOS token to start from", param=param)
        return ids

    def _run(self, prompt: str, add_special: bool, request: _Request, fit: bool, stream: bool):
        """Take the LLM (waiting for another thread's call), then generate: the stream releases it at its end. With
        parallel slots, the request joins the scheduler's steps instead (it waits only for a free slot)."""
        if self._scheduler is not None:
            ids = self.prompt_ids(prompt, add_special)
            limit = self.token_limit(len(ids), request.max_tokens, fit)
            matcher = self._matcher(request)
            chunks = self._scheduler.submit(_Generation(self, ids, limit, request, matcher))
            if stream:
                return chunks
            last = None
            for last in chunks:
                pass
            return last.completion
        token = self._gate.enter(generation=True)
        try:
            with self._step:
                ids = self.prompt_ids(prompt, add_special)  # as a fresh call's: never the cache's ids
                chunks = _Stream(self._generate(ids, request, fit), self._step,
                                 lambda: self._gate.leave(token))
        except BaseException:
            self._gate.leave(token)
            raise
        if stream:
            return chunks
        with chunks:
            last = None
            for last in chunks:
                pass
        return last.completion

    def _generate(self, ids: list[int], request: _Request, fit: bool) -> Iterator[Chunk]:
        """Checks now (a bad request fails at the call, not at the first next()), then the generator."""
        limit = self.token_limit(len(ids), request.max_tokens, fit)
        self._generation += 1
        matcher = self._matcher(request)
        return self._tokens(ids, limit, request, matcher, self._generation)

    def token_limit(self, n_prompt: int, max_tokens: int | None, fit: bool = True, param: str | None = None) -> int:
        """How many tokens may follow a prompt of n_prompt tokens: max_tokens (None: all the context leaves), cut
        to what it leaves or, with fit=False, refused where it asks more. A RequestError (param: the argument to
        name) where the prompt leaves no room."""
        room = self.n_ctx - n_prompt
        if room < 1:
            raise RequestError(f"the prompt has {n_prompt} tokens and the context holds {self.n_ctx}: no room to "
                               "generate (shorten it, or open the model with a larger ctx_size)", param=param,
                               code="context_length_exceeded")
        if max_tokens is not None and max_tokens > room and not fit:
            raise RequestError(f"this model's context holds {self.n_ctx} tokens: {n_prompt} in the prompt and "
                               f"{max_tokens} asked for the completion; lower max_tokens", param="max_tokens",
                               code="context_length_exceeded")
        return room if max_tokens is None else min(max_tokens, room)

    def _tokens(self, ids, max_tokens, request: _Request, matcher, generation) -> Iterator[Chunk]:
        """The serial path: one request on sequence 0, each sampled token evaluated alone (pi_eval)."""
        from powerinfer_tools.runtime.inference import engine_errors

        def current() -> None:
            """A later call (in the thread holding the LLM) ended this stream: not one more step in its engine."""
            if generation != self._generation:
                raise RuntimeError("this stream was ended by a later call on the same LLM")

        m, gen = self.model, _Generation(self, ids, max_tokens, request, matcher)
        current()
        with engine_errors():
            m.reset_stats()
            previous, self._cache = self._cache, _Cache()  # empty until the prompt is in
            logits = gen.prefill(previous)
        self._cache = gen.cache
        while True:
            current()
            with engine_errors():
                if gen.pending is not None:
                    logits = m.eval([gen.pending], all_logits=False)
                chunks = gen.advance(logits)
            yield from chunks
            if gen.done:
                return

    def _logprob(self, logits: np.ndarray, token: int, n_top: int) -> TokenLogprob:
        """The token's entry: log-softmax of its step's logits (float64), the n_top largest (ties: the lower id
        first, as greedy sampling picks)."""
        z = logits.astype(np.float64)
        z -= z.max()
        z -= np.log(np.exp(z).sum())
        top = np.argpartition(-z, n_top - 1)[:n_top] if 0 < n_top < z.size else np.arange(z.size)[:n_top]
        top = top[np.lexsort((top, -z[top]))]
        return TokenLogprob(*self._piece(token), float(z[token]),
                            tuple(TokenLogprob(*self._piece(int(t)), float(z[t])) for t in top))

    def _piece(self, token: int) -> tuple[str, bytes]:
        """A token's own text and bytes (a piece of a multi-byte character reads as U+FFFD in the text)."""
        raw = self.vocabulary().decode_bytes([token])
        return raw.decode("utf-8", errors="replace"), raw

    def _batch_computed(self, n_tokens: int) -> int:
        """How many of a fresh prompt's n_tokens the batch path computes: all but a last one alone in its batch."""
        return n_tokens - 1 if self._n_batch == 1 or n_tokens % self._n_batch == 1 else n_tokens

    def _reuse(self, cache: _Cache, ids: list[int]) -> int:
        """Truncate the selected sequence, which holds `cache`, to the longest prefix shared with ids that the batch
        path computed, leaving a rest that the engine then evaluates the way a fresh call would: at least one token
        (its logits are sampled from), alone in its last batch exactly where a fresh call's is. The count of reused
        tokens."""
        m = self.model
        n = shared_prefix(cache.tokens, ids, min(cache.batch_tokens, m.n_past, len(ids) - 1))
        fresh_alone = self._batch_computed(len(ids)) < len(ids)
        while n > 0 and (self._batch_computed(len(ids) - n) < len(ids) - n) != fresh_alone:
            n -= 1
        m.reset(n)
        return n


def shared_prefix(a: list[int], b: list[int], limit: int | None = None) -> int:
    """How many leading tokens a and b share (at most limit)."""
    n, end = 0, min(len(a), len(b), len(b) if limit is None else limit)
    while n < end and a[n] == b[n]:
        n += 1
    return n


COMPILED_CONSTRAINTS = 8  # constraints an LLM keeps compiled
MAX_PARALLEL = 32  # slots LLM(parallel=...) takes: each a KV cache of the whole context
# the FFN modes whose engine decodes several sequences in one step, each row the bits it gets alone (docs/engine.md,
# "Sequences"): auto's kernels follow what its steps measured, input sparsity's read each row's own inputs
PARALLEL_MODES = ("dense", "gate", "predictor", "oracle")


class _Generation:
    """One request's generation, a token at a time: its prompt evaluated into the selected sequence (prefill), then
    each next token drawn from the logits of the one before (advance), with its sampling settings, seed, grammar,
    stop strings, logprobs and token limit. The serial path evaluates each drawn token alone (pi_eval), the
    scheduler with the other slots' in one decode step (pi_decode_step): the same bits, so its text does not depend
    on what runs beside it."""

    def __init__(self, llm: "LLM", ids: list[int], limit: int, request: _Request, matcher):
        from powerinfer_tools.runtime.inference import StreamDecoder

        self.llm, self.ids, self.limit, self.request, self.matcher = llm, ids, limit, request, matcher
        n_vocab = llm.model.n_vocab
        self.allowed = np.zeros((n_vocab + 31) // 32, dtype=np.uint32) if matcher else None
        self.cache = _Cache(list(ids), llm._batch_computed(len(ids)))  # what the sequence holds once it is in
        self.decoder, self.held = StreamDecoder(llm.tokenizer, ids), _StopFilter(request.stop)
        self.logprobs: list[TokenLogprob] = []
        self.sent = 0  # logprobs already in a chunk
        self.generated, self.finish, self.done = 0, "length", False
        self.cached, self.prompt_seconds, self.started = 0, 0.0, 0.0

    @property
    def pending(self) -> int | None:
        """The token drawn last, which the next step evaluates (None before the first draw)."""
        return self.cache.tokens[-1] if len(self.cache.tokens) > len(self.ids) else None

    def prefill(self, previous: _Cache) -> np.ndarray:
        """The prompt into the selected sequence (which holds `previous`), reusing what it shares; its last logits."""
        m, sampling = self.llm.model, self.request.sampling
        self.cached = self.llm._reuse(previous, self.ids)
        m.seed(sampling.seed if sampling.seed is not None else random.SystemRandom().randrange(2**64))
        started = time.perf_counter()
        logits = m.eval(self.ids[m.n_past:], all_logits=False)
        self.prompt_seconds = time.perf_counter() - started
        counted = self.llm.counters
        counted.calls += 1
        counted.prompt_tokens += len(self.ids)
        counted.cached_tokens += self.cached
        counted.prompt_seconds += self.prompt_seconds
        self.started = time.perf_counter()
        return logits

    def advance(self, logits: np.ndarray) -> list[Chunk]:
        """The next token drawn from the selected sequence (whose last logits are `logits`), and the chunks it
        makes: a piece of text where one is ready, the last one (the Completion's) where the generation ends."""
        if self.generated >= self.limit:
            return [self._last()]
        m, sampling, step = self.llm.model, self.request.sampling, time.perf_counter()
        if self.matcher:
            self.matcher.unsafe_compute_mask_ptr(self.allowed.ctypes.data, self.allowed.nbytes)
        token = m.sample(sampling.temperature, sampling.top_k, sampling.top_p, sampling.repeat_penalty,
                         sampling.repeat_last_n, sampling.frequency_penalty, sampling.presence_penalty, self.allowed)
        if self.matcher and not self.matcher.consume_token(token):
            raise RuntimeError(f"the grammar refused the token it allowed: {self.matcher.get_error()}")
        self.cache.tokens.append(token)
        self.generated += 1
        counted = self.llm.counters
        counted.generated_tokens += 1
        counted.generated_seconds += time.perf_counter() - step
        if token in self.llm.stop_tokens:
            self.finish = "stop"
            return [self._last()]
        if self.request.logprobs is not None:
            self.logprobs.append(self.llm._logprob(logits, token, self.request.logprobs))
        out, hit = self.held.push(self.decoder.push(token))
        chunks = []
        if out:
            chunks.append(Chunk(out, logprobs=tuple(self.logprobs[self.sent:])))
            self.sent = len(self.logprobs)
        if hit:
            self.finish = "stop"
        if hit or self.generated >= self.limit:
            chunks.append(self._last())
        return chunks

    def _last(self) -> Chunk:
        from powerinfer_tools.runtime.tools import parse_calls

        self.done = True
        seconds = time.perf_counter() - self.started
        tail, request = self.held.flush(), self.request
        timings = Timings(len(self.ids) - self.cached, self.prompt_seconds, self.generated, seconds,
                          self.llm.model.stats().get("density"))
        whole = tuple(self.logprobs) if request.logprobs is not None else None
        calls = parse_calls(self.held.emitted, request.tools) if request.tools else ()
        return Chunk(tail, Completion(self.held.emitted, "tool_calls" if calls else self.finish,
                                      Usage(len(self.ids), self.generated, self.cached), timings, whole, calls),
                     tuple(self.logprobs[self.sent:]))


@dataclass
class _Job:
    """A request in the scheduler: its generation, the slot it runs in (None while it waits), the chunks handed to
    its reader, and whether the reader has gone (its slot is then freed at the next step)."""

    gen: _Generation
    out: "queue.Queue[Chunk | BaseException]" = field(default_factory=queue.Queue)
    slot: int | None = None
    gone: threading.Event = field(default_factory=threading.Event)


class _Scheduler:
    """LLM(parallel=N): N slots, each a sequence of the engine with its own KV cache, and one thread that runs every
    request in one loop (continuous batching, as llama-server's --parallel): between two steps the waiting
    requests take the free slots (each its prompt evaluated into its slot: the slot whose cache shares the longest
    prefix with it, then the least recently used), then one decode step computes a token for every running request
    (pi_decode_step) and each draws its next token. A request whose reader went away leaves its slot at the next
    step. Each slot's cache is kept for the next request that shares a prefix with it (the prompt cache)."""

    def __init__(self, llm: "LLM", n: int):
        self.llm, self.n = llm, n
        self.caches = [_Cache() for _ in range(n)]
        self.last_used = [0] * n
        self.running: dict[int, _Job] = {}  # by slot
        self.waiting: deque[_Job] = deque()
        self.changed = threading.Condition()
        self.closed = False
        self.clock = 0
        self.thread = threading.Thread(target=self._loop, name="pi-scheduler", daemon=True)
        self.thread.start()

    def busy_count(self) -> int:
        return len(self.running)

    def submit(self, gen: _Generation) -> Iterator[Chunk]:
        job = _Job(gen)
        with self.changed:
            if self.closed:
                raise RuntimeError("the LLM is closed")
            self.waiting.append(job)
            self.changed.notify()
        return self._follow(job)

    def _follow(self, job: _Job) -> Iterator[Chunk]:
        """The job's chunks as the scheduler makes them; closing or dropping the iterator frees its slot."""
        try:
            while True:
                item = job.out.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.completion is not None:
                    return
        finally:
            job.gone.set()
            with self.changed:
                self.changed.notify()

    def close(self) -> None:
        with self.changed:
            self.closed = True
            self.changed.notify()
        self.thread.join()

    def _slot_for(self, ids: list[int], free: list[int]) -> int:
        """The free slot whose cache shares the longest prefix with ids, where that is more than half of them (as
        llama-server's slot_prompt_similarity); else the least recently used, so that a prompt sharing only a chat
        template's first tokens does not push out another conversation's prefix."""
        shared = {k: shared_prefix(self.caches[k].tokens, ids) for k in free}
        best = max(free, key=lambda k: (shared[k], -self.last_used[k]))
        return best if 2 * shared[best] > len(ids) else min(free, key=lambda k: self.last_used[k])

    def _loop(self) -> None:
        while True:
            with self.changed:
                while not self.closed and not self.waiting and not self.running:
                    self.changed.wait()
                if self.closed:
                    break
                admitted = []
                free = [k for k in range(self.n) if k not in self.running]
                while self.waiting and free:
                    job = self.waiting.popleft()
                    if job.gone.is_set():
                        continue
                    job.slot = self._slot_for(job.gen.ids, free)
                    free.remove(job.slot)
                    admitted.append(job)
                    self.running[job.slot] = job
            with self.llm._step:
                for job in admitted:
                    self._admit(job)
                self._step()
        for job in list(self.running.values()) + list(self.waiting):
            job.out.put(RuntimeError("the LLM was closed"))

    def _finish(self, job: _Job, error: BaseException | None = None) -> None:
        """The job leaves its slot, whose cache stays for the next request sharing a prefix."""
        if error is not None:
            job.out.put(error)
            self.caches[job.slot] = _Cache()  # what the sequence holds is not known: nothing is reused from it
        else:
            self.caches[job.slot] = job.gen.cache
        self.clock += 1
        self.last_used[job.slot] = self.clock
        with self.changed:
            self.running.pop(job.slot, None)

    def _advance(self, job: _Job, logits: np.ndarray) -> None:
        chunks = job.gen.advance(logits)
        if job.gen.done:  # its slot free before its reader sees the end: its next request may take it back
            self._finish(job)
        for chunk in chunks:
            job.out.put(chunk)

    def _admit(self, job: _Job) -> None:
        from powerinfer_tools.runtime.inference import engine_errors

        m = self.llm.model
        try:
            with engine_errors():
                m.select(job.slot)
                previous, self.caches[job.slot] = self.caches[job.slot], _Cache()
                logits = job.gen.prefill(previous)
                self._advance(job, logits)
        except BaseException as exc:  # handed to its reader
            self._finish(job, exc)

    def _step(self) -> None:
        """One decode step of every running request with a token to evaluate; each then draws its next."""
        from powerinfer_tools.runtime.inference import engine_errors

        for job in [j for j in self.running.values() if not j.gen.done and j.gone.is_set()]:
            self._finish(job)
        jobs = [j for j in self.running.values() if j.gen.pending is not None and not j.gen.done]
        if not jobs:
            return
        m = self.llm.model
        try:
            with engine_errors():
                logits = m.decode_step([j.slot for j in jobs], [j.gen.pending for j in jobs])
        except BaseException as exc:
            for job in jobs:
                self._finish(job, exc)
            return
        for job, row in zip(jobs, logits):
            try:
                with engine_errors():
                    m.select(job.slot)
                    self._advance(job, row)
            except BaseException as exc:
                self._finish(job, exc)


class _StopFilter:
    """Holds back the end of the text that could be the start of a stop string, so a stop string is never
    streamed; `emitted` is everything let through."""

    def __init__(self, stops: Sequence[str]):
        self.stops = list(stops)
        self.text = ""      # held back
        self.emitted = ""
        self.hit = False

    def push(self, piece: str) -> tuple[str, bool]:
        self.text += piece
        for s in self.stops:
            at = self.text.find(s)
            if at >= 0:
                out, self.text, self.hit = self.text[:at], "", True
                self.emitted += out
                return out, True
        keep = max((k for s in self.stops for k in range(min(len(s) - 1, len(self.text)), 0, -1)
                    if self.text.endswith(s[:k])), default=0)
        out, self.text = self.text[:len(self.text) - keep], self.text[len(self.text) - keep:]
        self.emitted += out
        return out, False

    def flush(self) -> str:
        out, self.text = self.text, ""
        self.emitted += out
        return out


def _sampling(sampling: Sampling | None, options: dict) -> Sampling:
    """The call's Sampling, checked."""
    if sampling is not None and options:
        raise RequestError("give sampling= or its fields as keyword arguments, not both")
    if sampling is not None and not isinstance(sampling, Sampling):
        raise RequestError(f"sampling must be a Sampling record (or give its fields as keyword arguments), "
                           f"not {sampling!r}", param="sampling")
    unknown = sorted(set(options) - set(Sampling.__dataclass_fields__))
    if unknown:
        raise RequestError(f"unknown option {unknown[0]!r}: the sampling options are "
                           f"{', '.join(Sampling.__dataclass_fields__)}", param=unknown[0])
    sampling = sampling or Sampling(**options)
    sampling.check()
    return sampling


def _request(max_tokens, stop, sampling: Sampling, constraint=None, logprobs=None, tools=frozenset()) -> _Request:
    """A generation's arguments checked before it waits for the LLM. stop: a string, strings, or None for none."""
    if logprobs is not None and (not _is_integer(logprobs) or not 0 <= logprobs <= MAX_TOP_LOGPROBS):
        raise RequestError(f"logprobs must be None or an integer in [0, {MAX_TOP_LOGPROBS}] (the count of top "
                           f"alternatives), not {logprobs!r}", param="logprobs")
    if max_tokens is not None and (not _is_integer(max_tokens) or max_tokens < 0):
        raise RequestError(f"max_tokens must be None or a non-negative integer, not {max_tokens!r}",
                           param="max_tokens")
    if stop is None or isinstance(stop, str):
        stop = () if stop is None else (stop,)
    if isinstance(stop, bytes) or not isinstance(stop, Iterable):
        raise RequestError(f"stop must be a string or a list of strings, not {stop!r}", param="stop")
    stop = tuple(stop)
    if not all(isinstance(s, str) for s in stop):
        raise RequestError(f"stop must be a string or a list of strings, not {stop!r}", param="stop")
    for s in stop:
        _check_text(s)
    return _Request(None if max_tokens is None else int(max_tokens), tuple(s for s in stop if s), sampling,
                    constraint, None if logprobs is None else int(logprobs), tools)


def _is_number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _is_integer(value) -> bool:
    """An int (or a numpy integer), not a bool: True taken for 1 would hide a mistake."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _check_text(text) -> None:
    if not isinstance(text, str):
        raise RequestError(f"expected text (str), not {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise RequestError(f"the text is not valid UTF-8 (at character {exc.start})") from None
