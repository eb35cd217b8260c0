"""ReplicaSlots: Ray replica ids <-> the small integers forklm's policies index replicas by. A
removed replica's index is given to the next new one, so the policy's per-replica state (its
prefix tree) stays bounded while Ray replaces replicas."""

from __future__ import annotations

import logging
from collections.abc import Hashable, Iterable

logger = logging.getLogger(__name__)


class ReplicaSlots:
    def __init__(self, capacity: int):
        assert capacity >= 1, capacity
        self.capacity = capacity
        self.index: dict[Hashable, int] = {}  # replica id -> its slot

    def sync(self, live: Iterable[Hashable]) -> list[int]:
        """Take the live replica ids: the gone ones free their slot, new ones get the lowest free
        one. Returns the freed slots (their policy state must be forgotten)."""
        live = list(live)
        gone = [rid for rid in self.index if rid not in set(live)]
        freed = [self.index.pop(rid) for rid in gone]
        for rid in live:
            if rid not in self.index:
                self._assign(rid)
        return freed

    def _assign(self, rid: Hashable) -> None:
        taken = set(self.index.values())
        free = next((i for i in range(self.capacity) if i not in taken), None)
        if free is None:  # more replicas than planned for: it only takes spill-over
            logger.warning("no routing slot for replica %s (%d in use)", rid, self.capacity)
            return
        self.index[rid] = free
