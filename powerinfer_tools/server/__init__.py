"""`pi-tools serve`: an OpenAI-compatible HTTP API over the engine (FastAPI on uvicorn).

The default limits are here, where `pi-tools serve --help` reads them without loading the server."""

MAX_BODY_MIB = 4.0  # the default limit: megabytes of text, more than any context holds, and seconds to tokenize
BODY_TIMEOUT_S = 60.0  # the default time a request's body may take to arrive: 4 MiB at well under 1 Mbit/s
