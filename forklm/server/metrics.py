"""Prometheus metrics, in a registry owned by one app (so several apps in a process never clash)."""

from __future__ import annotations

from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from forklm.runtime.engine.results import GenerateOutput

# Seconds; CPU prefill of a long prompt can take seconds, a cached one milliseconds.
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class ServerMetrics:
    """Counters move as requests finish; the gauges are refreshed from engine.stats() on scrape."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("forklm_requests", "Generation requests finished, by endpoint "
                                "and finish reason", ["endpoint", "finish_reason"], registry=r)
        self.key_requests = Counter("forklm_key_requests", "Generation requests finished, by "
                                    "API key name ('' without keys) and finish reason",
                                    ["key", "finish_reason"], registry=r)
        self.http_errors = Counter("forklm_http_errors", "Requests answered with an error status",
                                   ["status"], registry=r)
        self.prompt_tokens = Counter("forklm_prompt_tokens", "Prompt tokens", registry=r)
        self.generated_tokens = Counter("forklm_generation_tokens", "Generated tokens", registry=r)
        self.cached_tokens = Counter("forklm_cached_tokens",
                                     "Prompt tokens served from the radix cache", registry=r)
        self.running = Gauge("forklm_num_running_reqs", "Requests in the running batch",
                             registry=r)
        self.waiting = Gauge("forklm_num_waiting_reqs", "Requests waiting in the engine",
                             registry=r)
        self.in_flight = Gauge("forklm_num_admitted_reqs",
                               "Requests admitted by the server and not finished", registry=r)
        self.kv_usage = Gauge("forklm_kv_usage", "Fraction of KV slots owned by requests",
                              registry=r)
        self.kv_cached_usage = Gauge("forklm_kv_cached_usage",
                                     "Fraction of KV slots held by the radix cache", registry=r)
        self.cache_hit_rate = Gauge("forklm_cache_hit_rate",
                                    "Cached prompt tokens / prompt tokens, since start", registry=r)
        self.spec_accept_rate = Gauge("forklm_spec_accept_rate", "Speculative draft tokens "
                                      "accepted / drafted, since start", registry=r)
        self.spec_accept_length = Gauge("forklm_spec_accept_length", "Tokens a verified "
                                        "speculative draft yields on average (0: none)", registry=r)
        self.ttft = Histogram("forklm_time_to_first_token_seconds", "Time to first token",
                              buckets=_TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("forklm_time_per_output_token_seconds",
                              "Time per output token after the first", buckets=_TPOT_BUCKETS,
                              registry=r)

    def record_output(self, endpoint: str, out: GenerateOutput, key: str = "") -> None:
        """Count one finished request of the API key named `key`."""
        reason = out.finish_reason.type if out.finish_reason else "unknown"
        self.requests.labels(endpoint=endpoint, finish_reason=reason).inc()
        self.key_requests.labels(key=key, finish_reason=reason).inc()
        self.prompt_tokens.inc(out.prompt_tokens)
        self.generated_tokens.inc(out.completion_tokens)
        self.cached_tokens.inc(out.cached_tokens)

    def record_timing(self, ttft_s: float, decode_s: float, num_tokens: int) -> None:
        self.ttft.observe(ttft_s)
        if num_tokens > 1:
            self.tpot.observe(decode_s / (num_tokens - 1))

    def refresh(self, stats: dict[str, Any], admitted: int) -> None:
        capacity = max(stats["kv_capacity"], 1)
        self.running.set(stats["running"])
        self.waiting.set(stats["waiting"])
        self.in_flight.set(admitted)
        self.kv_usage.set(stats["kv_used"] / capacity)
        self.kv_cached_usage.set(stats["kv_cached"] / capacity)
        self.cache_hit_rate.set(stats["cache_hit_rate"])
        self.spec_accept_rate.set(stats["spec_accept_rate"])
        self.spec_accept_length.set(stats["spec_accept_length"])

    def render(self) -> bytes:
        return generate_latest(self.registry)
