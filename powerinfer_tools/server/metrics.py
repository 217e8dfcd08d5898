"""GET /metrics: what the server has done and holds, in Prometheus' text format (prometheus_client), as
llama-server's --metrics gives it: requests, prompt and generated tokens and their seconds, the requests running
and waiting, the KV cache's use. Read from the LLM's and the worker's own counters at each scrape."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

PREFIX = "powerinfer_"


class ServerCollector:
    """A prometheus_client collector over the LLM (its Counters, its engine's cache) and the worker's queue."""

    def __init__(self, llm, worker):
        self.llm, self.worker = llm, worker

    def collect(self):
        c = self.llm.counters
        counters = (
            ("requests", "Generations run (requests that reached the engine)", c.calls),
            ("prompt_tokens", "Prompt tokens of those requests, cached or not", c.prompt_tokens),
            ("prompt_tokens_cached", "Prompt tokens reused from the KV cache", c.cached_tokens),
            ("prompt_seconds", "Seconds spent evaluating prompts", c.prompt_seconds),
            ("tokens_predicted", "Tokens generated", c.generated_tokens),
            ("tokens_predicted_seconds", "Seconds spent generating tokens", c.generated_seconds),
        )
        for name, text, value in counters:
            yield CounterMetricFamily(PREFIX + name, text, value=value)
        busy, slots = self.llm.slots()
        gauges = (
            ("slots_busy", "Slots (--parallel) generating a request now", busy),
            ("slots_idle", "Slots free for the next request", slots - busy),
            ("requests_processing", "Requests generating now", self.worker.running),
            ("requests_waiting", "Requests queued for the engine", self.worker.waiting),
            ("kv_cache_tokens", "Tokens the KV cache holds", self.llm.model.n_past),
            ("kv_cache_capacity_tokens", "Tokens the KV cache can hold (the context)", self.llm.n_ctx),
        )
        for name, text, value in gauges:
            yield GaugeMetricFamily(PREFIX + name, text, value=value)


def metrics_text(llm, worker) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ServerCollector(llm, worker))
    return generate_latest(registry)
