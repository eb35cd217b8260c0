"""What a simulation reports: per-request records, and their summary in the benchmarks' terms
(output tok/s, TTFT and per-token latency percentiles, cache hit rate, KV use)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from forklm.sim.replica import ReplicaStats


@dataclass
class RequestRecord:
    session: int
    turn: int
    replica: int
    sent_s: float
    prompt_tokens: int
    first_token_s: float | None = None
    finish_s: float | None = None
    output_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from the radix cache (first admission)
    finish_reason: str = ""

    @property
    def ttft_s(self) -> float:
        assert self.first_token_s is not None, "no token yet"
        return self.first_token_s - self.sent_s

    @property
    def latency_s(self) -> float:
        assert self.finish_s is not None, "not finished"
        return self.finish_s - self.sent_s

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first (None under 2 tokens), as runners.tpot_ms."""
        if self.output_tokens < 2 or self.first_token_s is None or self.finish_s is None:
            return None
        return (self.finish_s - self.first_token_s) / (self.output_tokens - 1)


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between the closest ranks (numpy's default); nan when empty."""
    assert 0.0 <= q <= 1.0, q
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


@dataclass(frozen=True)
class Summary:
    trace: str
    policy: str
    num_replicas: int
    num_requests: int
    wall_s: float
    output_tokens_per_s: float
    ttft_s: tuple[float, float, float]  # p50, p90, p99
    tpot_ms: tuple[float, float, float]
    latency_s: tuple[float, float, float]
    prompt_tokens_sent: int
    prompt_tokens_computed: int
    kv_peak_used: float  # fraction of a replica's KV slots, the highest replica
    kv_mean_used: float  # over steps and replicas
    routed_max_share: float  # the busiest replica's share of requests (1/N is even)

    @property
    def cache_hit_rate(self) -> float:
        return 1 - self.prompt_tokens_computed / max(self.prompt_tokens_sent, 1)


QUANTILES = (0.5, 0.9, 0.99)


@dataclass
class SimResult:
    trace: str
    policy: str
    num_replicas: int
    records: list[RequestRecord]
    replicas: list[ReplicaStats]
    capacities: list[int]

    def summary(self) -> Summary:
        recs = self.records
        start = min(r.sent_s for r in recs)
        wall = max(r.finish_s or 0.0 for r in recs) - start
        out = sum(r.output_tokens for r in recs)
        sent = sum(r.prompt_tokens for r in recs)
        cached = sum(r.cached_tokens for r in recs)
        tpots = [1000 * t for r in recs if (t := r.tpot_s) is not None]
        steps = sum(s.steps for s in self.replicas)
        mean_used = sum(s.kv_used_sum / c for s, c in zip(self.replicas, self.capacities))
        return Summary(
            self.trace, self.policy, self.num_replicas, len(recs), wall,
            out / wall if wall > 0 else math.nan,
            _quantiles([r.ttft_s for r in recs if r.first_token_s is not None]),
            _quantiles(tpots), _quantiles([r.latency_s for r in recs]),
            sent, sent - cached,
            max(s.peak_kv_used / c for s, c in zip(self.replicas, self.capacities)),
            mean_used / max(steps, 1),
            max(s.routed for s in self.replicas) / max(len(recs), 1))


def _quantiles(values: list[float]) -> tuple[float, float, float]:
    p50, p90, p99 = (percentile(values, q) for q in QUANTILES)
    return p50, p90, p99


HEADER = ("| trace | replicas | policy | output tok/s | TTFT p50/p90/p99 s | TPOT p50/p90/p99 ms "
          "| cache hit | KV peak / mean | busiest replica share |\n"
          "| --- | --- | --- | --- | --- | --- | --- | --- | --- |")


def table_row(s: Summary) -> str:
    ttft = "/".join(f"{v:.2f}" for v in s.ttft_s)
    tpot = "/".join(f"{v:.0f}" for v in s.tpot_ms)
    return (f"| {s.trace} | {s.num_replicas} | {s.policy} | {s.output_tokens_per_s:.0f} | {ttft} "
            f"| {tpot} | {s.cache_hit_rate:.1%} | {s.kv_peak_used:.0%} / {s.kv_mean_used:.0%} "
            f"| {s.routed_max_share:.1%} |")
