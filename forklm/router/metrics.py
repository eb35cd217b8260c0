"""The router's Prometheus metrics, per replica; refreshed from the router's counters and each
replica's /get_server_info on scrape."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from forklm.router.replicas import Replica


class RouterMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.http_errors = Counter("forklm_router_http_errors", "Requests answered with an "
                                   "error status by the router", ["status"], registry=r)
        label = ["replica"]
        self.alive = Gauge("forklm_router_replica_alive", "1 while routed to", label, registry=r)
        self.restarts = Gauge("forklm_router_replica_restarts", "Processes started for the "
                              "replica after the first, since start", label, registry=r)
        self.in_flight = Gauge("forklm_router_replica_in_flight", "Requests in flight", label,
                               registry=r)
        self.routed = Gauge("forklm_router_replica_routed", "Requests routed, since start",
                            label, registry=r)
        self.cache_hits = Gauge("forklm_router_replica_cache_aware_hits", "cache_aware picks by "
                                "prefix match, since start", label, registry=r)
        self.fallbacks = Gauge("forklm_router_replica_cache_aware_fallbacks", "cache_aware "
                               "picks by load, since start", label, registry=r)
        self.hit_rate = Gauge("forklm_router_replica_cache_hit_rate", "The replica's cached "
                              "prompt tokens / prompt tokens, since start", label, registry=r)

    def render(self, replicas: list[Replica], stats: list[dict[str, Any] | None]) -> bytes:
        for replica, stat in zip(replicas, stats):
            name = str(replica.index)
            self.alive.labels(name).set(int(replica.alive))
            self.restarts.labels(name).set(replica.restarts)
            self.in_flight.labels(name).set(replica.in_flight)
            self.routed.labels(name).set(replica.routed)
            self.cache_hits.labels(name).set(replica.cache_hits)
            self.fallbacks.labels(name).set(replica.fallbacks)
            if stat is not None:
                self.hit_rate.labels(name).set(stat.get("cache_hit_rate", 0.0))
        return generate_latest(self.registry)
