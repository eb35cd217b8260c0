"""Affinity: requests that must reach one replica whatever the policy, as with the `--dp-size`
router: a session's requests and its /close_session go where /open_session went, a Responses API
follow-up where its previous response is stored. Tables of replica ids, bounded."""

from __future__ import annotations

import json
from typing import Any

from forklm.ray_serve.messages import ResponseHead
from forklm.router.routing import previous_response_id, remember_bounded, response_id, session_id


class Affinity:
    def __init__(self) -> None:
        self.sessions: dict[str, str] = {}  # session id -> the replica holding its pins
        self.responses: dict[str, str] = {}  # stored response id -> its replica

    def replica_for(self, path: str, body: Any) -> str | None:
        """The replica this request must reach, or None (the policy decides)."""
        if path == "/close_session":
            return self.sessions.get(_closed_session(body) or "")
        for key, table in ((session_id(body), self.sessions),
                           (previous_response_id(body), self.responses)):
            if key is not None and key in table:
                return table[key]
        return None

    def answered(self, path: str, body: Any, head: ResponseHead, first_chunk: bytes) -> None:
        """Learn from a successful answer: an opened or closed session, a stored response."""
        if head.status != 200:
            return
        if path == "/open_session":
            remember_bounded(self.sessions, json.loads(first_chunk), head.replica)
        elif path == "/close_session":
            self.sessions.pop(_closed_session(body) or "", None)
        elif path == "/v1/responses":
            found = response_id(first_chunk)
            if found:
                remember_bounded(self.responses, found, head.replica)


def _closed_session(body: Any) -> str | None:
    sid = body.get("session_id") if isinstance(body, dict) else None
    return sid if isinstance(sid, str) else None
