"""IngressMetrics: the ingress's Prometheus text: its error counts (GuardMiddleware and the
routes count them) and, per engine replica, the stats its /get_server_info reported."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

# engine stat -> its help text; each becomes forklm_replica_<stat>{replica="..."}
_REPLICA_STATS = {
    "running": "Requests running", "waiting": "Requests waiting",
    "prompt_tokens": "Prompt tokens of finished requests, since start",
    "cache_hit_tokens": "Of those, served from the radix cache",
    "cache_hit_rate": "cache_hit_tokens / prompt_tokens",
    "generated_tokens": "Tokens generated, since start",
}


class IngressMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.http_errors = Counter("forklm_ingress_http_errors", "Requests answered with an "
                                   "error status by the ingress", ["status"], registry=r)
        self.stats = {name: Gauge(f"forklm_replica_{name}", text, ["replica"], registry=r)
                      for name, text in _REPLICA_STATS.items()}

    def render(self, replicas: list[dict[str, Any]]) -> bytes:
        """replicas: [{"replica": id, "internal_state": engine stats or None}, ...]."""
        for replica in replicas:
            state = replica["internal_state"] or {}
            for name, gauge in self.stats.items():
                if isinstance(state.get(name), (int, float)):
                    gauge.labels(replica["replica"]).set(state[name])
        return generate_latest(self.registry)
