"""Sessions that keep their context in the radix cache between requests (prefix pinning).

A radix cache under pressure evicts the least recently used prefixes, including the context of a
program between two of its gens (waiting on a tool, a select, its fork's siblings), which must
then be computed again. A session is a handle a program (or an agent loop) holds while it runs:
each of its requests that finishes pins the sequence it ended with (prompt + output), replacing
the session's pin on any ancestor of that sequence, so a chain of gens holds one path and forks
hold one leaf per branch. Pins are released when the session closes, after `idle_s` without a
request. A pin that would take the pinned total over `max_tokens` is not made (the session
keeps its pin on the shorter prefix), so ordinary requests always keep the rest of the pool and
pins already held are never churned: under cyclic access (agents waiting on tools in turn),
shedding the least recently used pin would drop exactly the context needed next.

Only the engine thread touches this (EngineLoop posts open/close to it).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from forklm.runtime.kvcache.radix_cache import RadixCache, TreeNode

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class _Pin:
    node: TreeNode
    tokens: int  # the pinned path's length from the root


@dataclass
class _Session:
    pins: list[_Pin] = field(default_factory=list)
    last_used: float = field(default_factory=time.monotonic)


class SessionPins:
    def __init__(self, cache: RadixCache, max_tokens: int, idle_s: float):
        self.cache, self.max_tokens, self.idle_s = cache, max_tokens, idle_s
        self.sessions: dict[str, _Session] = {}
        self.pinned_tokens = 0  # sum over pins of their path length (shared prefixes counted per pin)
        self._next_expiry_check = 0.0

    def open(self, session_id: str) -> bool:
        """False when the id is already open."""
        if session_id in self.sessions:
            return False
        self.sessions[session_id] = _Session()
        return True

    def close(self, session_id: str) -> bool:
        """Release the session's pins and forget it; False when it was not open."""
        session = self.sessions.pop(session_id, None)
        if session is None:
            return False
        for pin in session.pins:
            self._release(pin)
        return True

    def release_all(self) -> None:
        """Release every pin; the sessions stay open (a cache flush)."""
        for session in self.sessions.values():
            for pin in session.pins:
                self._release(pin)
            session.pins.clear()

    def touch(self, session_id: str | None) -> None:
        """A request of the session arrived: its pins are in use."""
        if session_id is not None and (session := self.sessions.get(session_id)) is not None:
            session.last_used = time.monotonic()

    def pin(self, session_id: str, node: TreeNode) -> bool:
        """Pin the path ending at `node` for the session, replacing its pins on ancestors of
        `node`; False (nothing changes) when the session is not open or the pinned total would
        exceed the cap."""
        session = self.sessions.get(session_id)
        if session is None or node is self.cache.root:
            return False
        session.last_used = time.monotonic()
        ancestors, tokens = _path(node)
        replaced = [p for p in session.pins if p.node in ancestors]
        if self.pinned_tokens - sum(p.tokens for p in replaced) + tokens > self.max_tokens:
            return False
        self.cache.lock(node)  # before any release, so the shared path never looks evictable
        for old in replaced:
            session.pins.remove(old)
            self._release(old)
        session.pins.append(_Pin(node, tokens))
        self.pinned_tokens += tokens
        return True

    def expire(self, now: float) -> None:
        """Release the pins of sessions idle for idle_s (checked at most once a second)."""
        if now < self._next_expiry_check:
            return
        self._next_expiry_check = now + 1.0
        for session_id, session in self.sessions.items():
            if session.pins and now - session.last_used > self.idle_s:
                logger.info("session %s idle for %.0f s: its %d pins released", session_id,
                            now - session.last_used, len(session.pins))
                for pin in session.pins:
                    self._release(pin)
                session.pins.clear()

    def check_invariants(self) -> None:
        """Every pin holds a lock on a node still in the tree; the total is within the cap."""
        total = 0
        for session in self.sessions.values():
            for pin in session.pins:
                assert pin.node.lock_ref > 0, f"pinned {pin.node} is not locked"
                assert self.cache.root in _path(pin.node)[0], f"pinned {pin.node} is detached"
                total += pin.tokens
        assert total == self.pinned_tokens <= self.max_tokens, (
            f"pinned tokens {total} (counted {self.pinned_tokens}, cap {self.max_tokens})")

    @property
    def num_pins(self) -> int:
        return sum(len(s.pins) for s in self.sessions.values())

    def _release(self, pin: _Pin) -> None:
        self.cache.unlock(pin.node)
        self.pinned_tokens -= pin.tokens


def _path(node: TreeNode) -> tuple[set[TreeNode], int]:
    """The nodes from `node` up to the root, and the tokens on that path."""
    nodes: set[TreeNode] = set()
    tokens = 0
    n: TreeNode | None = node
    while n is not None:
        nodes.add(n)
        tokens += len(n)
        n = n.parent
    return nodes, tokens
