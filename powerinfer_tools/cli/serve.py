"""`pi-tools serve`: the OpenAI-compatible HTTP server (powerinfer_tools.server) on uvicorn."""
from __future__ import annotations

import sys
from typing import Optional

import typer

from powerinfer_tools.cli import flags
from powerinfer_tools.core.errors import UserError
from powerinfer_tools.core.numbers import Range
from powerinfer_tools.server import BODY_TIMEOUT_S, MAX_BODY_MIB


@flags.engine_options
def serve(
    model: str = flags.model_option(),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on: 127.0.0.1 serves this machine "
                             "only; 0.0.0.0 every network it is on (then give --api-key)."),
    port: int = typer.Option(8080, "--port", help="TCP port; 0 picks a free one (printed)."),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="PI_API_KEY", help="Require "
                                          "'Authorization: Bearer KEY' on every request but /health (or set "
                                          "PI_API_KEY); printable ASCII, what a header carries."),
    alias: Optional[str] = typer.Option(None, "--alias", "-a", help="The model's name in /v1/models. Default: the "
                                        "file's name."),
    ctx_size: Optional[int] = flags.ctx_size_option("It holds a request's prompt and reply together."),
    log_requests: bool = typer.Option(False, "--log-requests", help="Log each request on stderr (uvicorn's "
                                      "access log)."),
    max_body_mib: float = typer.Option(MAX_BODY_MIB, "--max-body-mib", help="Refuse a request body larger than "
                                       "this many MiB with a 413, before parsing it."),
    body_timeout: float = typer.Option(BODY_TIMEOUT_S, "--body-timeout", help="Answer a request whose body has "
                                       "not all arrived within this many seconds with a 408, and close its "
                                       "connection."),
    parallel: int = typer.Option(1, "--parallel", "-np", help="Requests generated at once (llama-server's "
                                 "--parallel): that many slots, each a KV cache of the whole context and its own prompt "
                                 "cache; one engine step computes a token for every running request, a new request "
                                 "joins between steps. Above 1 the FFN runs in dense, gate or predictor mode (auto "
                                 "becomes dense; --sparse-mode input and --input-sparsity are refused)."),
    pooling: str = typer.Option("mean", "--pooling", help="How /v1/embeddings pools a text's last hidden states "
                                "(llama-server's --pooling): mean, or last (the last token's)."),
    engine: flags.EngineArgs = None,
):
    """Serve a model over the OpenAI API, as llama.cpp's llama-server does: POST /v1/chat/completions (the
    model's chat template) and /v1/completions, streamed as server-sent events with "stream": true;
    /v1/embeddings (the pooled last hidden states); GET /v1/models and /health. Requests are answered one at a
    time in order of arrival (--parallel N: N at once); a client that resends its conversation reuses the KV cache
    for the part it shares with an earlier request (with --parallel, the slot whose cache shares the most).

    Point any OpenAI client at http://HOST:PORT/v1 (docs/serve.md).

    Examples:

      pi-tools serve -m smollm2

      pi-tools serve -m smollm2 --parallel 4

      pi-tools serve -m smollm2.q4_0.powerinfer.gguf --port 8081 -t 4 --sparse-mode gate

      pi-tools serve -m relu7b.q4_0.powerinfer.gguf --vram-budget 4 --profile prof --host 0.0.0.0 --api-key s3cret
    """
    from powerinfer_tools.runtime.llm import LLM, MAX_PARALLEL, PARALLEL_MODES, POOLINGS
    from powerinfer_tools.server.app import create_app
    from powerinfer_tools.server.listen import listen

    if not 0 <= port <= 65535:
        raise UserError(f"--port must be in 0..65535, not {port}")
    Range(0, 1 << 20, low_open=True, unit=" MiB").check("--max-body-mib", max_body_mib)
    Range(0, 1 << 20, low_open=True, unit=" s").check("--body-timeout", body_timeout)
    if api_key is not None:
        check_api_key(api_key)
    if host not in ("127.0.0.1", "localhost", "::1") and api_key is None:
        print(f"pi-tools: warning: serving on {host} without --api-key: anyone who reaches this port can use it",
              file=sys.stderr)
    if pooling not in POOLINGS:
        raise UserError(f"--pooling must be one of {', '.join(POOLINGS)}, not {pooling!r}")
    options = engine.llm_options()
    if not 1 <= parallel <= MAX_PARALLEL:
        raise UserError(f"--parallel must be in 1..{MAX_PARALLEL}, not {parallel}")
    if parallel > 1:
        if options["sparse_mode"] == "auto":
            options["sparse_mode"] = "dense"  # what auto runs on a SiLU model; its per-layer choice is per sequence
        if options["sparse_mode"] not in PARALLEL_MODES or options["input_sparsity"]:
            raise UserError(f"--parallel {parallel} decodes requests together in {', '.join(PARALLEL_MODES)} mode only "
                            f"(each token the bits it gets alone): --sparse-mode {options['sparse_mode']}"
                            f"{' with --input-sparsity' if options['input_sparsity'] else ''} is refused")
    with LLM(model, ctx_size=ctx_size, parallel=parallel, **options) as llm:
        app = create_app(llm, alias or llm.name, api_key, max_body_mib, body_timeout, pooling)
        try:
            listen(app, host, port, log_requests, app.state.worker.stop)
        finally:
            app.state.worker.shutdown()


def check_api_key(key: str) -> None:
    """Only a key that 'Authorization: Bearer KEY' can carry: printable ASCII (clients refuse other characters or
    send bytes that never match), with no space at either end (a header drops it)."""
    if not key.strip():
        raise UserError("--api-key is empty")
    for i, ch in enumerate(key, 1):
        if not " " <= ch <= "~":
            kind = "a non-ASCII character" if ord(ch) > 127 else "a control character"
            raise UserError(f"--api-key (or PI_API_KEY) has {kind} at position {i}: an HTTP header carries only "
                            "printable ASCII")
    if key != key.strip():
        raise UserError("--api-key (or PI_API_KEY) starts or ends with a space, which an HTTP header drops")
