"""Router: which replica serves a request. Affinity first (a session's requests and
/close_session go where /open_session went, a Responses API follow-up where its previous response
is stored, an abort where its rid runs), then the policy."""

from __future__ import annotations

import re
from collections.abc import Collection
from typing import Any, TypeVar

from forklm.router.policies import CacheAware, Policy, least_loaded
from forklm.router.prompts import prompt_text
from forklm.router.replicas import Replica

# Sessions and stored responses remembered at most (oldest forgotten first): a client that never
# closes its sessions must not grow the router without bound. The replicas drop idle sessions
# after --session-idle-timeout-s anyway; a forgotten one just follows the policy.
_MAX_REMEMBERED = 65536
_RESPONSE_ID = re.compile(rb'"id": ?"(resp_[0-9a-f]+)"')
T = TypeVar("T")


class NoReplicaError(Exception):
    """No replica is alive to take the request."""


class Router:
    def __init__(self, replicas: list[Replica], policy: Policy):
        self.replicas, self.policy = replicas, policy
        self.sessions: dict[str, Replica] = {}  # session id -> the replica holding its pins
        self.rids: dict[str, Replica] = {}  # rid -> replica, while the request is in flight
        # Responses API: a stored response lives in its replica's memory (previous_response_id)
        self.responses: dict[str, Replica] = {}

    def alive(self, exclude: Collection[Replica] = ()) -> list[Replica]:
        return [r for r in self.replicas if r.alive and r not in exclude]

    def pick(self, path: str, body: Any, exclude: Collection[Replica] = (),
             key_salt: str | None = None) -> Replica:
        """The replica for a request to `path` with JSON `body` (None when not JSON), not one of
        `exclude` (they failed it); counts it. A pinned replica that is gone: the policy.
        key_salt: the sender's API key's cache salt (prompts are matched within it)."""
        for key, table in ((session_id(body), self.sessions),
                           (previous_response_id(body), self.responses)):
            pinned = table.get(key) if key is not None else None
            if pinned is not None and pinned.alive and pinned not in exclude:
                return self._count(pinned, None)
        alive = self.alive(exclude)
        if not alive:
            raise NoReplicaError("no replica is alive")
        loads = [r.in_flight for r in self.replicas]
        choice = self.policy.choose(prompt_text(path, body, key_salt), [r.index for r in alive],
                                    loads)
        return self._count(self.replicas[choice.replica], choice.cache_hit)

    def pick_idle(self, exclude: Collection[Replica] = ()) -> Replica:
        """For reads (model info, tokenizer): the least loaded, not counted as routed."""
        alive = self.alive(exclude)
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

    def remember_session(self, sid: str, replica: Replica) -> None:
        remember_bounded(self.sessions, sid, replica)

    def remember_response(self, body: bytes, replica: Replica) -> None:
        """The id of a Responses API answer (or of its stream's first event) -> its replica."""
        found = response_id(body)
        if found:
            remember_bounded(self.responses, found, replica)

    def remove(self, replica: Replica) -> None:
        """Forget a dead replica's sessions, responses, rids and prefix tree."""
        self.policy.forget(replica.index)
        for table in (self.sessions, self.responses, self.rids):
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


def remember_bounded(table: dict[str, T], key: str, value: T) -> None:
    """table[key] = value, forgetting the oldest key beyond _MAX_REMEMBERED."""
    table[key] = value
    if len(table) > _MAX_REMEMBERED:
        del table[next(iter(table))]  # dicts keep insertion order: the oldest


def response_id(body: bytes) -> str | None:
    """The id of a Responses API answer, or of its stream's first event, in its first bytes."""
    found = _RESPONSE_ID.search(body[:4096])
    return found.group(1).decode() if found else None


def previous_response_id(body: Any) -> str | None:
    value = body.get("previous_response_id") if isinstance(body, dict) else None
    return value if isinstance(value, str) else None


def session_id(body: Any) -> str | None:
    params = body.get("session_params") if isinstance(body, dict) else None
    sid = params.get("id") if isinstance(params, dict) else None
    return sid if isinstance(sid, str) else None


def request_rids(body: Any) -> list[str]:
    rid = body.get("rid") if isinstance(body, dict) else None
    if isinstance(rid, str):
        return [rid]
    return [r for r in rid if isinstance(r, str)] if isinstance(rid, list) else []
