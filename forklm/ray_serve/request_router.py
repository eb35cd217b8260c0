"""PolicyRequestRouter: Ray Serve's request-router extension running forklm's routing policy
(forklm.router.policies: round_robin, shortest_queue, cache_aware) over the engine replicas.

It lives in the caller's process (the ingress), one per deployment handle; its prefix trees
remember what this handle sent, as the `--dp-size` router's do."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from forklm.ray_serve.messages import ReplicaRequest
from forklm.ray_serve.replica_slots import ReplicaSlots
from forklm.router.policies import CacheAware, Choice, make_policy

# Slots per planned replica: Ray may start a replacement before the replica it replaces is gone.
_SLOTS_PER_REPLICA = 2
# Choices kept for requests not yet routed; one cancelled before Ray sent it leaves its entry.
_MAX_PENDING_CHOICES = 65536


class PolicyRequestRouter(RequestRouter):
    """choose_replicas ranks the policy's choice first and the other replicas after it, least
    loaded first: Ray Serve sends to the choice unless it is at max_ongoing_requests. Loads are
    the requests this router routed and Ray has not yet reported complete."""

    def initialize_state(self, load_balance_method: str = "cache_aware",
                         num_replicas: int = 1, **_: Any) -> None:
        self.slots = ReplicaSlots(_SLOTS_PER_REPLICA * num_replicas)
        self.policy = make_policy(load_balance_method, self.slots.capacity)
        self.in_flight = [0] * self.slots.capacity  # slot -> requests routed, not completed
        # (internal request id, replica) of requests routed and not completed
        self.routed: set[tuple[str, ReplicaID]] = set()
        self.choices: dict[str, Choice] = {}  # internal request id -> the policy's choice

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self._forget(self.slots.sync(r.replica_id for r in replicas))

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._forget(self.slots.sync(self.curr_replicas))

    def _forget(self, freed: list[int]) -> None:
        for slot in freed:
            self.policy.forget(slot)
            self.in_flight[slot] = 0

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None,
                              ) -> list[list[RunningReplica]]:
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True  # no busy loop when all full
        if not candidate_replicas:
            return []
        request = forklm_request(pending_request)
        if request is not None and request.target is not None:
            ordered = sorted(candidate_replicas, key=lambda r: r.replica_id.unique_id)
            return [[ordered[request.target % len(ordered)]]]
        pinned = [r for r in candidate_replicas
                  if request is not None and r.replica_id.unique_id == request.replica]
        if pinned:
            return [pinned]
        by_slot = {self.slots.index[r.replica_id]: r for r in candidate_replicas
                   if r.replica_id in self.slots.index}
        if not by_slot:
            return [self._by_load(candidate_replicas)]
        choice = self.policy.choose(request.route_key if request else "", sorted(by_slot),
                                    self.in_flight)
        if pending_request is not None:
            self.choices[pending_request.metadata.internal_request_id] = choice
            if len(self.choices) > _MAX_PENDING_CHOICES:
                del self.choices[next(iter(self.choices))]  # the oldest
        first = by_slot[choice.replica]
        rest = self._by_load([r for r in candidate_replicas if r is not first])
        return [[first], rest] if rest else [[first]]

    def _by_load(self, replicas: Sequence[RunningReplica]) -> list[RunningReplica]:
        """Least loaded first; a replica without a slot (more than planned) last."""
        def load(replica: RunningReplica) -> int:
            slot = self.slots.index.get(replica.replica_id)
            return self.in_flight[slot] if slot is not None else sys.maxsize

        return sorted(replicas, key=load)

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: Any) -> None:
        request_id = pending_request.metadata.internal_request_id
        choice = self.choices.pop(request_id, None)
        slot = self.slots.index.get(replica_id)
        if slot is None:
            return
        self.in_flight[slot] += 1
        self.routed.add((request_id, replica_id))
        request = forklm_request(pending_request)
        if request is None:
            return
        if request.path == "/flush_cache":
            # its cache is (about to be) empty: so is its tree; a refused flush only costs a miss
            self.policy.forget(slot)
        elif isinstance(self.policy, CacheAware) and choice is not None and choice.replica != slot:
            self.policy.remember(request.route_key, slot)  # spilled over: the prefix is there

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self.choices.pop(internal_request_id, None)
        slot = self.slots.index.get(replica_id)
        if (internal_request_id, replica_id) in self.routed:
            self.routed.discard((internal_request_id, replica_id))
            if slot is not None:
                self.in_flight[slot] = max(0, self.in_flight[slot] - 1)


def forklm_request(pending_request: PendingRequest | None) -> ReplicaRequest | None:
    """The ReplicaRequest a handle call carries as its first argument (None for other calls)."""
    if pending_request is None or not pending_request.args:
        return None
    first = pending_request.args[0]
    return first if isinstance(first, ReplicaRequest) else None
