"""Radix tree over token ids (page size 1) whose values are KV slot indices, with LRU eviction.

The tree owns one reference to every slot it holds; requests protect a prefix by locking its node.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, NamedTuple

import torch

if TYPE_CHECKING:
    from forklm.runtime.kvcache.pool import SlotAllocator

_EMPTY_SLOTS = torch.empty(0, dtype=torch.int64)


class TreeNode:
    """One edge of the tree: `key` token ids with their KV `value` slots (same length)."""

    __slots__ = ("children", "parent", "key", "value", "lock_ref", "last_access_time", "id")
    _ids = itertools.count()

    def __init__(self, key: list[int], value: torch.Tensor, parent: TreeNode | None, time: int):
        self.children: dict[int, TreeNode] = {}
        self.parent = parent
        self.key = key
        self.value = value
        self.lock_ref = 0
        self.last_access_time = time
        self.id = next(TreeNode._ids)  # tie-breaker for equal access times: older node first

    def __len__(self) -> int:
        return len(self.key)

    def __repr__(self) -> str:
        return f"TreeNode(key={self.key}, lock_ref={self.lock_ref}, t={self.last_access_time})"


class MatchResult(NamedTuple):
    slots: torch.Tensor  # int64 [matched_len], slots of the matched prefix along the path
    node: TreeNode  # deepest node of the match (the root when nothing matched); lock this one


def _common_len(key: list[int], token_ids: Sequence[int], start: int) -> int:
    """Length of the common prefix of `key` and `token_ids[start:]`."""
    n = min(len(key), len(token_ids) - start)
    for i in range(n):
        if key[i] != token_ids[start + i]:
            return i
    return n


class RadixCache:
    """Prefix cache mapping token-id sequences to KV slots.

    Slots the tree holds are only safe to use while the node returned by `match_prefix` is locked;
    unlocked leaves may be evicted (their slots freed to `allocator`) by any `evict` call.
    """

    def __init__(self, allocator: SlotAllocator):
        self.allocator = allocator
        self._clock = itertools.count(1)
        self.reset_counters()
        self._init_tree()

    def _init_tree(self) -> None:
        self.root = TreeNode([], _EMPTY_SLOTS, None, 0)
        self._evictable_size = 0
        self._protected_size = 0
        # Unlocked non-root leaves: exactly the nodes evict may remove next.
        self._evictable_leaves: set[TreeNode] = set()

    def reset_counters(self) -> None:
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0

    @property
    def evictable_size(self) -> int:
        """Tokens in nodes with lock_ref == 0."""
        return self._evictable_size

    @property
    def protected_size(self) -> int:
        """Tokens in nodes with lock_ref > 0."""
        return self._protected_size

    @property
    def total_size(self) -> int:
        return self._evictable_size + self._protected_size

    def match_prefix(self, token_ids: Sequence[int], count: bool = True) -> MatchResult:
        """Longest cached prefix of `token_ids`: its slots and the node that ends it.

        Mutates the tree: a match ending inside an edge splits it so the result ends at a node
        boundary; visited nodes get a fresh access time. Lock `node` before using `slots`.
        count=False: the engine's own lookup (not a request's), kept out of the hit counters.
        """
        now = next(self._clock)
        node, pos, values = self.root, 0, []
        node.last_access_time = now
        while pos < len(token_ids) and (child := node.children.get(token_ids[pos])) is not None:
            common = _common_len(child.key, token_ids, pos)
            if common < len(child):
                child = self._split(child, common)
            child.last_access_time = now
            values.append(child.value)
            node, pos = child, pos + common
        if count:
            self.num_queried_tokens += len(token_ids)
            self.num_hit_tokens += pos
        slots = torch.cat(values) if values else _EMPTY_SLOTS.clone()
        return MatchResult(slots, node)

    def insert(self, token_ids: Sequence[int], slots: torch.Tensor) -> int:
        """Cache `token_ids` with their KV `slots`; returns the length of the prefix already cached.

        The tree keeps its own slots for that prefix and takes ownership of `slots[prefix_len:]`;
        the caller still owns `slots[:prefix_len]` and must free those it allocated itself.
        """
        assert len(token_ids) == slots.numel(), f"{len(token_ids)} tokens vs {slots.numel()} slots"
        now = next(self._clock)
        node, pos = self.root, 0
        node.last_access_time = now
        while pos < len(token_ids):
            child = node.children.get(token_ids[pos])
            if child is None:
                self._add_leaf(node, list(token_ids[pos:]), slots[pos:], now)
                break
            common = _common_len(child.key, token_ids, pos)
            if common < len(child):
                child = self._split(child, common)
            child.last_access_time = now
            node, pos = child, pos + common
        return pos

    def lock(self, node: TreeNode) -> None:
        """Protect `node` and all its ancestors (root included) from eviction."""
        assert node is self.root or node.parent is not None, f"locking a detached node {node}"
        n: TreeNode | None = node
        while n is not None:
            if n.lock_ref == 0:
                self._evictable_size -= len(n)
                self._protected_size += len(n)
                self._evictable_leaves.discard(n)
            n.lock_ref += 1
            n = n.parent

    def unlock(self, node: TreeNode) -> None:
        """Undo one `lock(node)`; nodes whose lock_ref drops to 0 become evictable again."""
        n: TreeNode | None = node
        while n is not None:
            assert n.lock_ref > 0, f"unlock of {n} whose lock_ref is already 0"
            n.lock_ref -= 1
            if n.lock_ref == 0:
                self._evictable_size += len(n)
                self._protected_size -= len(n)
                self._update_leaf_status(n)
            n = n.parent

    def evict(self, num_tokens: int) -> int:
        """Free at least `num_tokens` slots (if that many are evictable) from unlocked leaves, LRU.

        Whole leaves go at once, so more may be freed; a parent left as an unlocked leaf becomes
        a candidate in turn. Returns the number of tokens freed to the allocator.
        """
        if num_tokens <= 0:
            return 0
        heap = [(leaf.last_access_time, leaf.id, leaf) for leaf in self._evictable_leaves]
        heapq.heapify(heap)
        freed, values = 0, []
        while freed < num_tokens and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            assert parent is not None
            values.append(self._delete_leaf(leaf))
            freed += len(leaf)
            if parent in self._evictable_leaves:
                heapq.heappush(heap, (parent.last_access_time, parent.id, parent))
        if values:
            self.allocator.free(torch.cat(values))  # one call: the free-list checks cost per call
        return freed

    def all_slots(self) -> torch.Tensor:
        """Every slot the tree holds (int64), for leak checks."""
        values = [node.value for node in self._nodes() if len(node)]
        return torch.cat(values) if values else _EMPTY_SLOTS.clone()

    def reset(self) -> None:
        """Drop the whole tree and free its slots; nothing may be locked. Hit counters reset too."""
        assert self.root.lock_ref == 0, f"reset with {self.root.lock_ref} locks held"
        self.allocator.free(self.all_slots())
        self._init_tree()
        self.reset_counters()

    def check_invariants(self) -> None:
        """Assert the tree's structure, lock and size accounting, and slot ownership."""
        assert not self.root.key and self.root.parent is None, "root must have an empty key"
        total = protected = 0
        leaves = set()
        for node in self._nodes():
            self._check_node(node)
            total += len(node)
            protected += len(node) if node.lock_ref > 0 else 0
            if node is not self.root and not node.children and node.lock_ref == 0:
                leaves.add(node)
        assert self.total_size == total, f"total_size {self.total_size} != tree sum {total}"
        assert self._protected_size == protected, (
            f"protected_size {self._protected_size} != sum over locked nodes {protected}"
        )
        assert self._evictable_size == total - protected, "evictable_size out of sync"
        assert leaves == self._evictable_leaves, "evictable-leaf set out of sync"
        self._check_slots()

    # ---- internals -------------------------------------------------------------------------

    def _nodes(self) -> Iterator[TreeNode]:
        stack = [self.root]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def _check_node(self, node: TreeNode) -> None:
        assert len(node.key) == node.value.numel(), f"{node}: key/value lengths differ"
        assert node.value.dtype == torch.int64, f"{node}: value dtype {node.value.dtype}"
        assert node is self.root or node.key, f"non-root {node} with an empty key"
        assert node.lock_ref >= 0, f"{node}: negative lock_ref"
        for first, child in node.children.items():
            assert child.key[0] == first, f"{child} stored under token {first}"
            assert child.parent is node, f"{child} has a wrong parent link"
            assert node.lock_ref >= child.lock_ref, f"{node} locked less than child {child}"

    def _check_slots(self) -> None:
        slots = self.all_slots()
        assert torch.unique(slots).numel() == slots.numel(), "a slot is held twice in the tree"
        in_range = (slots >= 0) & (slots < self.allocator.capacity)
        assert bool(in_range.all()), f"tree slots out of range: {slots[~in_range].tolist()}"
        freed = torch.isin(slots, self.allocator.free_slots())
        assert not bool(freed.any()), f"tree slots in the free list: {slots[freed].tolist()}"

    def _split(self, child: TreeNode, split_len: int) -> TreeNode:
        """Cut `child`'s edge after `split_len` tokens; returns the new upper node.

        The upper node inherits the child's lock_ref (whoever locked the child also protects it)
        and access time, so evictable/protected sizes and the leaf set are unchanged.
        """
        parent = child.parent
        assert parent is not None and 0 < split_len < len(child)
        upper_value = child.value[:split_len].clone()
        upper = TreeNode(child.key[:split_len], upper_value, parent, child.last_access_time)
        upper.lock_ref = child.lock_ref
        child.key = child.key[split_len:]
        child.value = child.value[split_len:].clone()
        child.parent = upper
        upper.children[child.key[0]] = child
        parent.children[upper.key[0]] = upper
        return upper

    def _add_leaf(self, parent: TreeNode, key: list[int], value: torch.Tensor, now: int) -> None:
        leaf = TreeNode(key, value.to("cpu", torch.int64, copy=True).reshape(-1), parent, now)
        parent.children[key[0]] = leaf
        self._evictable_size += len(leaf)
        self._evictable_leaves.discard(parent)
        self._evictable_leaves.add(leaf)

    def _delete_leaf(self, leaf: TreeNode) -> torch.Tensor:
        """Detach an unlocked leaf; returns its slots, which the caller must free."""
        parent = leaf.parent
        assert parent is not None and not leaf.children and leaf.lock_ref == 0, f"evicting {leaf}"
        del parent.children[leaf.key[0]]
        leaf.parent = None
        self._evictable_size -= len(leaf)
        self._evictable_leaves.discard(leaf)
        self._update_leaf_status(parent)
        return leaf.value

    def _update_leaf_status(self, node: TreeNode) -> None:
        if node is not self.root and not node.children and node.lock_ref == 0:
            self._evictable_leaves.add(node)
        else:
            self._evictable_leaves.discard(node)
