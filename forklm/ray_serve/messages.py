"""What travels between the ingress and an engine replica over Ray: the HTTP request as received
(with the routing key the request router reads) and the response as a head plus body chunks."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ReplicaRequest:
    method: str
    path: str
    query: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes
    # The prompt text the cache-aware policy matches (forklm.router.prompts.prompt_text).
    route_key: str = ""
    # Fan-out (/get_server_info, /flush_cache): the target-th live replica in replica-id order,
    # not a policy pick; None = routed by the policy.
    target: int | None = None
    # Affinity (a session's requests, a Responses API follow-up): this replica (its id) while it
    # is alive, else the policy's pick.
    replica: str | None = None


@dataclass(frozen=True)
class ResponseHead:
    """The first item of every replica answer; body chunks (bytes) follow."""

    status: int
    headers: list[tuple[bytes, bytes]]
    replica: str  # the replica's id, so callers can tell replicas apart

    @property
    def is_stream(self) -> bool:
        return any(k.lower() == b"content-type" and v.startswith(b"text/event-stream")
                   for k, v in self.headers)
