"""The OpenAI-compatible HTTP API over one LLM: the ASGI application `pi-tools serve` runs with uvicorn.

One engine serves every client. Generations run one at a time on a single worker thread, in the order the
requests came (a FIFO of one-thread executor), and the LLM's prompt cache makes a client that resends its
conversation evaluate only the new part. Rendering and tokenizing a prompt to check that it fits happen on a
thread of their own before the request queues, so a huge or bad request never takes the engine's turn. A client
that goes away, streaming or not, ends its generation at the next token; one that goes away while queued never
starts. When the server stops, every request ends where it stands: a stream with a last chunk and [DONE], any
other with a 503.
"""
from __future__ import annotations

import asyncio
import base64
import hmac
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing

import numpy as np
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

from powerinfer_tools.core.errors import RequestError, UserError
from powerinfer_tools.runtime.inference import EngineFailure
from powerinfer_tools.runtime.llm import LLM, Chunk, Completion, TokenLogprob
from powerinfer_tools.server import BODY_TIMEOUT_S, MAX_BODY_MIB
from powerinfer_tools.server.intake import Intake, ended, race
from powerinfer_tools.server.metrics import metrics_text
from powerinfer_tools.server.schemas import ChatRequest, CompletionRequest, Detokenize, EmbeddingRequest, Tokenize


class ApiError(Exception):
    """An error answered as the OpenAI API answers one: {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.kind, self.param, self.code = status, kind, param, code

    def response(self) -> JSONResponse:
        return JSONResponse({"error": {"message": str(self), "type": self.kind, "param": self.param,
                                       "code": self.code}}, status_code=self.status)


class ClientGone(Exception):
    """The client closed its connection: its generation is ended and nobody is left to answer."""


class ShuttingDown(Exception):
    """The server is stopping: the request ends where it stands."""


_DONE = object()


class Worker:
    """Runs jobs on `threads` threads (one, or one per slot of an LLM with parallel slots, whose scheduler steps
    them together); their chunks come back to the event loop through a queue. A job ends at its next token when its
    client leaves or the server stops, and the request waiting on it is released at once (ClientGone,
    ShuttingDown): an engine step in progress never holds an answer back."""

    def __init__(self, threads: int = 1):
        self.executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="pi-engine")
        self.stopping = threading.Event()  # read by the engine's thread
        self.stopped = asyncio.Event()     # awaited by the requests
        self._count = threading.Lock()
        self.waiting = self.running = 0    # jobs queued, the job generating (/metrics)

    def _counted(self, waiting: int, running: int) -> None:
        with self._count:
            self.waiting, self.running = self.waiting + waiting, self.running + running

    def stop(self) -> None:
        """The server begins to shut down (called on the event loop): every job ends, running or queued."""
        self.stopping.set()
        self.stopped.set()

    def _why(self) -> Exception:
        return ShuttingDown() if self.stopped.is_set() else ClientGone()

    async def beside(self, fn: Callable, left: asyncio.Event):
        """fn() on a thread of its own, beside the engine's, released as a job is: a slow tokenization holds
        neither the engine nor the request."""
        result = await race(asyncio.to_thread(fn), self.stopped, left)
        if ended(result):
            raise self._why()
        return result

    async def run(self, start: Callable[[], Iterator[Chunk]], left: asyncio.Event) -> AsyncIterator[Chunk]:
        """The chunks of the generation start() begins on the engine's thread, up to the one with the Completion
        (ask no further); ShuttingDown or ClientGone where it is cut short."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        gone = threading.Event()  # the client left, the request ended, or the server is stopping: stop now

        def put(item) -> None:
            if not loop.is_closed():  # the server stopped during this step: nobody waits for it
                loop.call_soon_threadsafe(queue.put_nowait, item)

        def work() -> None:
            self._counted(-1, 1)
            try:
                if gone.is_set() or self.stopping.is_set():
                    return
                chunks = start()
                try:
                    for chunk in chunks:
                        put(chunk)
                        if gone.is_set() or self.stopping.is_set():
                            break
                finally:
                    chunks.close()
            except BaseException as exc:  # handed to the request, which answers with it
                put(exc)
            finally:
                self._counted(0, -1)
                put(_DONE)

        self._counted(1, 0)
        self.executor.submit(work)
        try:
            while True:
                item = await race(queue.get(), self.stopped, left)
                if ended(item) or item is _DONE:  # _DONE before the Completion: the job was cut
                    raise self._why()
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            gone.set()

    async def call(self, fn: Callable, left: asyncio.Event):
        """fn()'s result, run on the engine's thread in turn with the generations (it uses the engine): skipped
        where its client left or the server stopped before its turn; a client that leaves meanwhile is released
        at once, the call finishing unseen."""
        def work():
            self._counted(-1, 1)
            try:
                if self.stopping.is_set() or left.is_set():
                    return _DONE
                return fn()
            finally:
                self._counted(0, -1)

        self._counted(1, 0)
        result = await race(asyncio.wrap_future(self.executor.submit(work)), self.stopped, left)
        if ended(result) or result is _DONE:
            raise self._why()
        return result

    def shutdown(self) -> None:
        self.stopping.set()
        self.executor.shutdown(wait=True)


def create_app(llm: LLM, model_id: str, api_key: str | None = None, max_body_mib: float = MAX_BODY_MIB,
               body_timeout: float = BODY_TIMEOUT_S, pooling: str = "mean") -> FastAPI:
    """The application for `llm`, answering to `model_id` in /v1/models (any name is accepted in requests);
    /v1/embeddings pools as `pooling` says (LLM.embed); call app.state.worker.stop() when the server begins to
    shut down."""
    worker = Worker(llm.parallel)
    created = int(time.time())
    app = FastAPI(title="powerinfer-tools", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.worker = worker

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError):
        return exc.response()

    @app.exception_handler(RequestError)
    async def _refused(request: Request, exc: RequestError):
        return ApiError(400, str(exc), param=exc.param, code=exc.code).response()

    @app.exception_handler(UserError)
    async def _user_error(request: Request, exc: UserError):
        return ApiError(400, str(exc)).response()

    @app.exception_handler(EngineFailure)
    async def _engine_failure(request: Request, exc: EngineFailure):
        if exc.callers:
            return ApiError(400, str(exc)).response()
        return ApiError(500, f"the engine failed: {exc}", "server_error", code="engine_error").response()

    @app.exception_handler(ShuttingDown)
    async def _stopping(request: Request, exc: ShuttingDown):
        return ApiError(503, "the server is shutting down", "server_error", code="server_shutting_down").response()

    @app.exception_handler(ClientGone)
    async def _gone(request: Request, exc: ClientGone):
        return Response(status_code=499)  # nginx's "client closed request", for the access log: nobody reads it

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        first = exc.errors()[0]
        kind = first.get("type")
        if kind == "json_invalid":
            return ApiError(400, "the body is not valid JSON").response()
        where = [str(p) for p in first.get("loc", ()) if p != "body"]
        param = ".".join(where) or None
        if kind == "extra_forbidden":
            return ApiError(400, f"unrecognized request argument: {param}", param=param).response()
        message = first.get("msg", "invalid request")
        return ApiError(400, f"{param}: {message}" if param else message, param=param).response()

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException):
        # FastAPI's own 400 for a body it cannot decode (bytes that are not UTF-8) says only "error parsing"
        detail = "the body is not valid JSON (UTF-8)" if exc.status_code == 400 else str(exc.detail)
        return ApiError(exc.status_code, detail).response()

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception):
        return ApiError(500, f"internal error: {type(exc).__name__}: {exc}", "server_error").response()

    @app.middleware("http")
    async def _auth(request: Request, call_next):
        if api_key is not None and request.url.path != "/health":
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                return ApiError(401, "invalid or missing API key (Authorization: Bearer KEY)",
                                "authentication_error", code="invalid_api_key").response()
        return await call_next(request)

    app.add_middleware(Intake, max_body=int(max_body_mib * 2**20), stopped=worker.stopped,  # outermost
                       body_timeout=body_timeout)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(metrics_text(llm, worker), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_id, "object": "model", "created": created,
                                            "owned_by": "powerinfer-tools", "meta": {"n_ctx": llm.n_ctx}}]}

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request):
        messages, tools = body.chat_messages(), body.tool_list()
        left = request.state.client_left
        await worker.beside(lambda: _fits(llm, llm.chat_prompt(messages, tools), False, body, "messages"), left)

        def start():
            return llm.chat(messages, max_tokens=body.limit(), stop=body.stops(), stream=True, sampling=body.sampling(),
                            fit=False, response_format=body.format(), grammar=body.grammar,
                            logprobs=body.logprob_count(), tools=tools, tool_choice=body.choice())

        return await _answer(worker.run(start, left), body, model_id, chat=True)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        try:
            prompt = body.text()
        except ValueError as exc:
            raise ApiError(400, str(exc), param="prompt") from None
        left = request.state.client_left
        await worker.beside(lambda: _fits(llm, prompt, True, body, "prompt"), left)

        def start():
            return llm.complete(prompt, max_tokens=body.limit(), stop=body.stops(), stream=True,
                                sampling=body.sampling(), fit=False, response_format=body.format(),
                                grammar=body.grammar, logprobs=body.logprob_count())

        return await _answer(worker.run(start, left), body, model_id, chat=False,
                             echo=prompt if body.echo else "")

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest, request: Request):
        if body.dimensions is not None and body.dimensions != llm.model.n_embd:
            raise ApiError(400, f"dimensions must be the model's width, {llm.model.n_embd}: a shortened embedding is "
                           "not computed", param="dimensions")
        out = await worker.call(lambda: llm.embed(body.input, pooling), request.state.client_left)
        data = [{"object": "embedding", "index": i, "embedding": _encoded(v, body.encoding_format)}
                for i, v in enumerate(out.vectors)]
        return {"object": "list", "data": data, "model": model_id,
                "usage": {"prompt_tokens": out.prompt_tokens, "total_tokens": out.prompt_tokens}}

    @app.post("/tokenize")
    async def tokenize(body: Tokenize, request: Request):
        return {"tokens": await worker.beside(lambda: llm.tokenize(body.content, body.add_special),
                                              request.state.client_left)}

    @app.post("/detokenize")
    async def detokenize(body: Detokenize, request: Request):
        return {"content": await worker.beside(lambda: llm.detokenize(body.tokens), request.state.client_left)}

    return app


def _encoded(vector: np.ndarray, encoding_format: str) -> list[float] | str:
    """An embedding as the OpenAI API sends it: floats, or base64 of its little-endian float32 bytes."""
    if encoding_format == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()


def _fits(llm: LLM, prompt: str, add_special: bool, body, param: str) -> None:
    """The checks the engine's turn makes, made before the request queues for it: the sampling values, the
    logprobs, the grammar (compiled), and the prompt's tokens against the context (a prompt far past it refused
    from a tokenized head, so a refused request leaves no tokenizer's peak behind). The LLM tokenizes again at its
    turn: a prompt that got this far fits the context, so that is short."""
    body.sampling().check()
    body.logprob_count()
    if not getattr(body, "tools", None):  # chat with tools: its call format is built and checked at the call
        llm.constraint(body.format(), body.grammar)
    llm.token_limit(len(llm.prompt_ids(prompt, add_special, param)), body.limit(), fit=False, param=param)


async def _answer(chunks: AsyncIterator[Chunk], body, model_id: str, chat: bool, echo: str = ""):
    """The whole answer, or a stream of server-sent events; an error before the first chunk is an HTTP error."""
    first = await chunks.__anext__()
    reply = _Reply(chat, model_id, body.logprob_count() is not None, len(echo), bool(getattr(body, "tools", None)))
    if not body.stream:
        async with aclosing(chunks):
            last = first
            while last.completion is None:
                last = await chunks.__anext__()
        return reply.whole(last.completion, echo)
    return StreamingResponse(reply.events(first, chunks, body.include_usage, echo), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


class _Reply:
    """The JSON objects of one answer, chat or text completion."""

    def __init__(self, chat: bool, model_id: str, logprobs: bool = False, offset: int = 0, tools: bool = False):
        self.chat, self.logprobs = chat, logprobs
        self.tools = tools  # the answer may be calls: known at its end, so a stream sends it whole there
        self.offset = offset  # a completion's text_offset: the characters of the answer before the next token
        self.model = model_id
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def _envelope(self, obj: str, choices: list) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": "powerinfer-tools", "choices": choices}

    def whole(self, c: Completion, echo: str) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant"} | self._said(c),
                      "logprobs": self._logprobs(c.logprobs), "finish_reason": c.finish_reason}
            out = self._envelope("chat.completion", [choice])
        else:
            choice = {"index": 0, "text": echo + c.text, "logprobs": self._logprobs(c.logprobs),
                      "finish_reason": c.finish_reason}
            out = self._envelope("text_completion", [choice])
        return out | {"usage": usage(c), "timings": timings(c)}

    @staticmethod
    def _said(c: Completion, streamed: bool = False) -> dict:
        """A chat answer's content, or its tool calls (a stream's delta numbers them)."""
        if not c.tool_calls:
            return {"content": c.text}
        return {"content": None, "tool_calls": [({"index": i} if streamed else {}) | {"id": t.id, "type": "function",
                "function": {"name": t.name, "arguments": t.arguments}} for i, t in enumerate(c.tool_calls)]}

    def _logprobs(self, entries: tuple[TokenLogprob, ...] | None) -> dict | None:
        """OpenAI's logprobs object of these tokens (None where none were asked for): chat's `content` list, or
        the completions API's parallel lists with each token's text_offset."""
        if not self.logprobs or entries is None:
            return None
        if self.chat:
            def one(e: TokenLogprob) -> dict:
                return {"token": e.token, "logprob": e.logprob, "bytes": list(e.bytes)}
            return {"content": [one(e) | {"top_logprobs": [one(t) for t in e.top]} for e in entries]}
        offsets = []
        for e in entries:
            offsets.append(self.offset)
            self.offset += len(e.token)
        return {"tokens": [e.token for e in entries], "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [{t.token: t.logprob for t in e.top} for e in entries], "text_offset": offsets}

    def _piece(self, text: str | None, finish: str | None, first: bool = False,
               logprobs: tuple[TokenLogprob, ...] | None = None) -> dict:
        if self.chat:
            delta = ({"role": "assistant", "content": text or ""} if first else
                     {"content": text} if text is not None else {})
            return self._envelope("chat.completion.chunk", [{"index": 0, "delta": delta,
                                                             "logprobs": self._logprobs(logprobs),
                                                             "finish_reason": finish}])
        return self._envelope("text_completion", [{"index": 0, "text": text or "", "logprobs": self._logprobs(logprobs),
                                                   "finish_reason": finish}])

    async def events(self, first: Chunk, rest: AsyncIterator[Chunk], include_usage: bool, echo: str):
        try:
            if self.chat:
                yield _event(self._piece("", None, first=True))
            elif echo:
                yield _event(self._piece(echo, None))
            chunk = first
            while True:
                if (chunk.text or chunk.logprobs) and not self.tools:
                    yield _event(self._piece(chunk.text, None, logprobs=chunk.logprobs))
                if chunk.completion is not None:
                    c = chunk.completion
                    if self.tools:
                        whole = self._piece(None, None, logprobs=c.logprobs)
                        whole["choices"][0]["delta"] = {"role": "assistant"} | self._said(c, streamed=True)
                        yield _event(whole)
                    yield _event(self._piece(None, c.finish_reason) | {"timings": timings(c)})
                    if include_usage:
                        yield _event(self._envelope(self._piece(None, None)["object"], []) | {"usage": usage(c)})
                    break
                try:
                    chunk = await rest.__anext__()
                except ShuttingDown:  # cut short, as at max_tokens; no usage (OpenAI's own may miss a cut stream's)
                    yield _event(self._piece(None, "length"))
                    break
            yield "data: [DONE]\n\n"
        except ClientGone:
            return  # nobody to send the rest to
        finally:
            await rest.aclose()  # a client gone mid-stream: the worker stops at its next token


def _event(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def usage(c: Completion) -> dict:
    return {"prompt_tokens": c.usage.prompt_tokens, "completion_tokens": c.usage.completion_tokens,
            "total_tokens": c.usage.total_tokens, "prompt_tokens_details": {"cached_tokens": c.usage.cached_tokens}}


def timings(c: Completion) -> dict:
    """llama-server's timings object, with the cache's share and the FFN density this engine adds."""
    t = c.timings
    return {"cache_n": c.usage.cached_tokens, "prompt_n": t.prompt_tokens, "prompt_ms": 1000 * t.prompt_seconds,
            "prompt_per_second": t.prompt_tokens_per_second, "predicted_n": t.generated_tokens,
            "predicted_ms": 1000 * t.generated_seconds, "predicted_per_second": t.generated_tokens_per_second,
            "ffn_density": t.ffn_density}
