"""Router: which replica serves a request. Affinity first (a session's requests and
/close_session go where /open_session went; an abort goes where its rid runs), then the policy."""

from __future__ import annotations

from typing import Any

from forklm.router.policies import CacheAware, Policy, least_loaded
from forklm.router.prompts import prompt_text
from forklm.router.replicas import Replica


class NoReplicaError(Exception):
    """No replica is alive to take the request."""


class Router:
    def __init__(self, replicas: list[Replica], policy: Policy):
        self.replicas, self.policy = replicas, policy
        self.sessions: dict[str, Replica] = {}  # session id -> the replica holding its pins
        self.rids: dict[str, Replica] = {}  # rid -> replica, while the request is in flight

    def alive(self) -> list[Replica]:
        return [r for r in self.replicas if r.alive]

    def pick(self, path: str, body: Any) -> Replica:
        """The replica for a request to `path` with JSON `body` (None when not JSON); counts it."""
        session = _session_id(body)
        if session is not None and session in self.sessions and self.sessions[session].alive:
            return self._count(self.sessions[session], None)
        alive = self.alive()
        if not alive:
            raise NoReplicaError("no replica is alive")
        loads = [r.in_flight for r in self.replicas]
        choice = self.policy.choose(prompt_text(path, body), [r.index for r in alive], loads)
        return self._count(self.replicas[choice.replica], choice.cache_hit)

    def pick_idle(self) -> Replica:
        """For reads (model info, tokenizer): the least loaded, not counted as routed."""
        alive = self.alive()
        if not alive:
            raise NoReplicaError("no replica is alive")
        loads = [r.in_flight for r in self.replicas]
        return self.replicas[least_loaded([r.index for r in alive], loads)]

    def _count(self, replica: Replica, cache_hit: bool | None) -> Replica:
        replica.routed += 1
        if isinstance(self.policy, CacheAware) and cache_hit is not None:
            if cache_hit:
                replica.cache_hits += 1
            else:
                replica.fallbacks += 1
        return replica

    def remove(self, replica: Replica) -> None:
        """Forget a dead replica's sessions, rids and prefix tree."""
        self.policy.forget(replica.index)
        for table in (self.sessions, self.rids):
            for key in [k for k, r in table.items() if r is replica]:
                del table[key]

    def track_rids(self, rids: list[str], replica: Replica) -> list[str]:
        """Remember where these rids run (for /abort_request) until untrack_rids."""
        for rid in rids:
            self.rids[rid] = replica
        return rids

    def untrack_rids(self, rids: list[str]) -> None:
        for rid in rids:
            self.rids.pop(rid, None)


def _session_id(body: Any) -> str | None:
    params = body.get("session_params") if isinstance(body, dict) else None
    sid = params.get("id") if isinstance(params, dict) else None
    return sid if isinstance(sid, str) else None


def request_rids(body: Any) -> list[str]:
    rid = body.get("rid") if isinstance(body, dict) else None
    if isinstance(rid, str):
        return [rid]
    return [r for r in rid if isinstance(r, str)] if isinstance(rid, list) else []
