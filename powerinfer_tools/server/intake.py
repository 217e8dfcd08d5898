"""What happens to a request before the routes see it: its body is read whole, within a size limit, and its
connection is watched for the client going away.

A body over the limit is refused with a 413 before anything parses it: at once from its Content-Length, or as
soon as the bytes received pass the limit (a chunked body), so a huge prompt never reaches JSON decoding or the
tokenizer. Once the body is in, request.state.client_left is an asyncio.Event set the moment the client closes its
connection, which ends its generation at the next token whether it streams or not. A request still sending its
body when the server stops is answered with a 503 rather than waited for, and one whose body has not all come
within the body timeout with a 408 that closes its connection (a client that stops sending holds nothing).
"""
from __future__ import annotations

import asyncio
import json

from powerinfer_tools.server import BODY_TIMEOUT_S
_ENDED = object()


async def race(awaitable, *events: asyncio.Event):
    """The awaitable's result, or _ENDED as soon as one of the events is set (the awaitable is then cancelled):
    a request waits for its next piece of work and, at the same time, for the reasons to stop waiting."""
    task = asyncio.ensure_future(awaitable)
    waiters = [asyncio.ensure_future(e.wait()) for e in events]
    try:
        await asyncio.wait([task, *waiters], return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waiters:
            w.cancel()
        if not task.done():
            task.cancel()
    return task.result() if task.done() and not task.cancelled() else _ENDED


def ended(result) -> bool:
    return result is _ENDED


async def send_error(send, status: int, message: str, kind: str, code: str, close: bool = False) -> None:
    """An OpenAI-style JSON error sent straight to the connection, before the routes. uvicorn then discards the
    rest of the body as it arrives (never buffered), so a client that sends it all still reads the answer;
    `close`: the connection is closed after it instead."""
    body = json.dumps({"error": {"message": message, "type": kind, "param": None, "code": code}}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status,
                "headers": headers + ([(b"connection", b"close")] if close else [])})
    await send({"type": "http.response.body", "body": body})


class Intake:
    """ASGI middleware: the body limit and timeout, the watch on the connection, the 503 for a body cut by
    shutdown."""

    def __init__(self, app, max_body: int, stopped: asyncio.Event, body_timeout: float = BODY_TIMEOUT_S):
        self.app, self.max_body, self.stopped, self.body_timeout = app, max_body, stopped, body_timeout

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = next((v for k, v in scope["headers"] if k == b"content-length"), None)
        if declared is not None and int(declared) > self.max_body:
            return await self._too_large(send)
        body, more = bytearray(), True
        deadline = asyncio.get_running_loop().time() + self.body_timeout
        while more:
            try:
                message = await race(asyncio.wait_for(receive(), deadline - asyncio.get_running_loop().time()),
                                     self.stopped)
            except asyncio.TimeoutError:
                return await send_error(send, 408, f"the request body did not arrive within {self.body_timeout:g} "
                                        "s (pi-tools serve --body-timeout)", "invalid_request_error",
                                        "request_timeout", close=True)
            if ended(message):
                return await send_error(send, 503, "the server is shutting down", "server_error",
                                        "server_shutting_down")
            if message["type"] == "http.disconnect":
                return  # gone before its request was in: nobody to answer
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.max_body:
                return await self._too_large(send)

        left = asyncio.Event()

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            left.set()

        replayed = False

        async def replay():
            """The body, then (the route asking for more, as a streaming response does) the client's leaving."""
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            await left.wait()
            return {"type": "http.disconnect"}

        scope.setdefault("state", {})["client_left"] = left
        watcher = asyncio.ensure_future(watch())
        try:
            await self.app(scope, replay, send)
        finally:
            watcher.cancel()

    async def _too_large(self, send) -> None:
        limit = f"{self.max_body / 2**20:g} MiB"
        await send_error(send, 413, f"the request body is larger than this server's limit of {limit} "
                         "(pi-tools serve --max-body-mib)", "invalid_request_error", "request_too_large")
