"""`pi-tools serve`: an OpenAI-compatible HTTP API over the engine (FastAPI on uvicorn)."""
