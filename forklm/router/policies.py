"""Routing policies: pick a replica index for a request, given the replicas that are alive and
the requests each has in flight. Pure logic (no processes, no HTTP), so tests drive it directly."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from forklm.router.prefix_tree import PrefixTree


class Choice(NamedTuple):
    replica: int
    cache_hit: bool = False  # cache_aware: chosen for its prefix match, not for its load


class Policy(Protocol):
    def choose(self, text: str, alive: Sequence[int], loads: Sequence[int]) -> Choice:
        """Pick one of `alive` (non-empty) for a request whose prompt is `text` ("" when it has
        none); loads[i] is replica i's requests in flight."""
        ...

    def forget(self, replica: int) -> None:
        """Forget what was sent to a replica (it died, or its cache was flushed)."""
        ...


class RoundRobin:
    def __init__(self, num_replicas: int):
        self._next = itertools.count()

    def choose(self, text: str, alive: Sequence[int], loads: Sequence[int]) -> Choice:
        return Choice(alive[next(self._next) % len(alive)])

    def forget(self, replica: int) -> None:
        pass


class ShortestQueue:
    def __init__(self, num_replicas: int):
        self._ties = itertools.count()  # rotates among equally loaded replicas

    def choose(self, text: str, alive: Sequence[int], loads: Sequence[int]) -> Choice:
        return Choice(least_loaded(alive, loads, next(self._ties)))

    def forget(self, replica: int) -> None:
        pass


def least_loaded(alive: Sequence[int], loads: Sequence[int], turn: int = 0) -> int:
    low = min(loads[i] for i in alive)
    candidates = [i for i in alive if loads[i] == low]
    return candidates[turn % len(candidates)]


@dataclass(frozen=True)
class CacheAwareConfig:
    # sgl-router's defaults: a match must cover half the prompt to count as a cache hit ...
    cache_threshold: float = 0.5
    # ... and load wins over locality once max - min load > 32 and max > 1.0001 * min.
    balance_abs_threshold: int = 32
    balance_rel_threshold: float = 1.0001
    # Characters remembered per replica (~4 chars a token: 2M chars ~ 500k tokens, more than a
    # CPU replica's KV pool holds), pruned LRU; about 100 bytes a node, a few MB per replica.
    max_tree_chars: int = 2_000_000


class CacheAware:
    """sgl-router's cache-aware policy: while loads are balanced, the replica whose tree matches
    the longest prefix (when it covers cache_threshold of the prompt); otherwise, or without
    such a match, the least loaded. The chosen replica's tree then holds the prompt."""

    def __init__(self, num_replicas: int, config: CacheAwareConfig | None = None):
        self.config = config or CacheAwareConfig()
        self.trees = [PrefixTree(self.config.max_tree_chars) for _ in range(num_replicas)]
        self._ties = itertools.count()

    def choose(self, text: str, alive: Sequence[int], loads: Sequence[int]) -> Choice:
        choice = self._pick(text, alive, loads)
        self.remember(text, choice.replica)
        return choice

    def remember(self, text: str, replica: int) -> None:
        """Record that `text` went to `replica` (choose does; a caller whose request ended up
        elsewhere than chosen, e.g. Ray Serve spilling over a full replica, says where)."""
        if text:
            tree = self.trees[replica]
            tree.insert(text)
            tree.prune()

    def _pick(self, text: str, alive: Sequence[int], loads: Sequence[int]) -> Choice:
        if not text or self.imbalanced([loads[i] for i in alive]):
            return Choice(least_loaded(alive, loads, next(self._ties)))
        matched = {i: self.trees[i].match(text) for i in alive}
        best = max(alive, key=lambda i: (matched[i], -loads[i]))
        if matched[best] >= self.config.cache_threshold * len(text):
            return Choice(best, cache_hit=True)
        return Choice(least_loaded(alive, loads, next(self._ties)))

    def imbalanced(self, loads: Sequence[int]) -> bool:
        high, low = max(loads), min(loads)
        return (high - low > self.config.balance_abs_threshold
                and high > self.config.balance_rel_threshold * low)

    def forget(self, replica: int) -> None:
        self.trees[replica] = PrefixTree(self.config.max_tree_chars)


POLICIES: dict[str, Callable[[int], Policy]] = {
    "round_robin": RoundRobin, "shortest_queue": ShortestQueue, "cache_aware": CacheAware}


def make_policy(name: str, num_replicas: int) -> Policy:
    if name not in POLICIES:
        raise ValueError(f"load_balance_method={name!r}: expected one of {', '.join(POLICIES)}")
    return POLICIES[name](num_replicas)
