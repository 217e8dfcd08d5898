"""Running the application on uvicorn: say where it listens, stop cleanly on SIGTERM as on Ctrl-C."""
from __future__ import annotations

import signal
import sys
from collections.abc import Callable

import uvicorn

from powerinfer_tools.core.errors import UserError


class _Server(uvicorn.Server):
    """uvicorn's server, announcing its address once it listens (the port it got, when asked for port 0), and
    telling the application the moment it begins to shut down, so the requests in flight end at once rather than
    at uvicorn's grace timeout (which cancels them with a traceback each)."""

    def __init__(self, config: uvicorn.Config, on_stop: Callable[[], None]):
        super().__init__(config)
        self.on_stop = on_stop

    async def startup(self, sockets=None):
        await super().startup(sockets)
        if self.started:
            for server in self.servers:
                for sock in server.sockets:
                    host, port = sock.getsockname()[:2]
                    host = f"[{host}]" if ":" in host else host
                    print(f"pi-tools serve: listening on http://{host}:{port} (OpenAI API at /v1; Ctrl-C stops)",
                          file=sys.stderr, flush=True)

    async def shutdown(self, sockets=None):
        self.on_stop()
        await super().shutdown(sockets)


class Stopped(SystemExit):
    """SIGTERM, after uvicorn's graceful shutdown: the normal end of a server, exit status 0."""


def _terminated(signum, frame):
    raise Stopped(0)


def listen(app, host: str, port: int, access_log: bool, on_stop: Callable[[], None]) -> None:
    """Serve until Ctrl-C or SIGTERM. Then uvicorn stops accepting, on_stop() ends the requests in flight, uvicorn
    waits for their answers to go out (10 s at most), then raises the signal again: SIGINT ends as every
    interrupted command does, SIGTERM as a normal stop."""
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=access_log,
                            timeout_graceful_shutdown=10)
    server = _Server(config, on_stop)
    previous = signal.signal(signal.SIGTERM, _terminated)
    try:
        server.run()
    except SystemExit as exc:  # uvicorn's own exit when it cannot bind (after its log line saying why)
        if isinstance(exc, Stopped) or server.started:
            raise
        raise UserError(f"could not listen on {host}:{port}") from None
    finally:
        signal.signal(signal.SIGTERM, previous)
