"""RadixCache: unit tests plus random insert/match/lock/evict walks against a brute-force model."""

from __future__ import annotations

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from forklm.runtime.errors import KVCacheFullError
from forklm.runtime.kvcache.pool import SlotAllocator
from forklm.runtime.kvcache.radix_cache import RadixCache, TreeNode


def make_cache(capacity: int = 64) -> tuple[SlotAllocator, RadixCache]:
    alloc = SlotAllocator(capacity)
    return alloc, RadixCache(alloc)


def cache_seq(alloc: SlotAllocator, cache: RadixCache, token_ids: list[int]) -> torch.Tensor:
    """Insert like the engine: allocate for the whole sequence, free the duplicates."""
    slots = alloc.allocate(len(token_ids))
    prefix_len = cache.insert(token_ids, slots)
    alloc.free(slots[:prefix_len])
    return slots


def test_match_on_empty_tree():
    _, cache = make_cache()
    result = cache.match_prefix([1, 2, 3])
    assert result.slots.numel() == 0 and result.slots.dtype == torch.int64
    assert result.node is cache.root
    assert (cache.num_queried_tokens, cache.num_hit_tokens) == (3, 0)


def test_exact_match_returns_inserted_slots():
    alloc, cache = make_cache()
    slots = cache_seq(alloc, cache, [1, 2, 3])
    result = cache.match_prefix([1, 2, 3, 4])
    assert result.slots.tolist() == slots.tolist()
    assert result.node.key == [1, 2, 3]
    assert cache.num_hit_tokens == 3
    cache.check_invariants()


def test_partial_match_splits_the_edge():
    alloc, cache = make_cache()
    slots = cache_seq(alloc, cache, [1, 2, 3, 4])
    result = cache.match_prefix([1, 2, 9])
    assert result.slots.tolist() == slots[:2].tolist()
    assert result.node.key == [1, 2] and list(result.node.children) == [3]
    assert result.node.children[3].value.tolist() == slots[2:].tolist()
    cache.check_invariants()


def test_insert_returns_present_prefix_len():
    alloc, cache = make_cache()
    first = cache_seq(alloc, cache, [1, 2, 3])
    slots = alloc.allocate(5)
    assert cache.insert([1, 2, 7, 8, 9], slots) == 2
    alloc.free(slots[:2])
    assert cache.insert([], torch.empty(0, dtype=torch.int64)) == 0
    match = cache.match_prefix([1, 2, 7, 8, 9])
    assert match.slots.tolist() == first[:2].tolist() + slots[2:].tolist()
    assert cache.total_size == 6 and alloc.num_free == 64 - 6
    cache.check_invariants()


def test_lock_protects_from_eviction():
    alloc, cache = make_cache()
    cache_seq(alloc, cache, [1, 2, 3])
    cache_seq(alloc, cache, [5, 6])
    node = cache.match_prefix([1, 2]).node
    cache.lock(node)
    assert cache.protected_size == 2 and cache.evictable_size == 3
    assert cache.evict(100) == 3  # [3] and [5, 6]; [1, 2] is locked
    assert cache.match_prefix([1, 2, 3]).slots.numel() == 2
    cache.unlock(node)
    assert cache.protected_size == 0
    assert cache.evict(100) == 2 and cache.total_size == 0
    cache.check_invariants()


def test_lock_covers_the_node_itself_and_ancestors():
    alloc, cache = make_cache()
    cache_seq(alloc, cache, [1, 2, 3, 4])
    leaf = cache.match_prefix([1, 2, 3, 4]).node
    cache.match_prefix([1, 2])  # splits above the leaf
    cache.lock(leaf)
    assert cache.protected_size == 4 and cache.evict(10) == 0
    cache.check_invariants()


def test_split_inherits_lock():
    alloc, cache = make_cache()
    cache_seq(alloc, cache, [1, 2, 3, 4])
    leaf = cache.match_prefix([1, 2, 3, 4]).node
    cache.lock(leaf)
    upper = cache.match_prefix([1, 2]).node
    assert upper.lock_ref == 1 and leaf.parent is upper
    cache.check_invariants()
    cache.unlock(leaf)
    assert upper.lock_ref == 0 and cache.evictable_size == 4
    cache.check_invariants()


def test_unlock_below_zero_asserts():
    alloc, cache = make_cache()
    cache_seq(alloc, cache, [1])
    with pytest.raises(AssertionError, match="already 0"):
        cache.unlock(cache.match_prefix([1]).node)


def test_evict_is_lru():
    alloc, cache = make_cache()
    for seq in ([1, 1], [2, 2], [3, 3]):
        cache_seq(alloc, cache, seq)
    cache.match_prefix([1, 1])  # [2, 2] is now the oldest
    assert cache.evict(1) == 2
    assert cache.match_prefix([2, 2]).slots.numel() == 0
    assert cache.evict(1) == 2
    assert cache.match_prefix([3, 3]).slots.numel() == 0
    assert cache.match_prefix([1, 1]).slots.numel() == 2


def test_evict_climbs_to_parent_that_becomes_a_leaf():
    alloc, cache = make_cache()
    cache_seq(alloc, cache, [1, 2, 3])
    cache_seq(alloc, cache, [1, 2, 4])
    cache_seq(alloc, cache, [9])
    cache.match_prefix([9])  # [9] is the newest, so the [1, 2] branch goes first
    assert cache.evict(3) == 4  # [3], [4], then their parent [1, 2] as a whole
    assert cache.match_prefix([9]).slots.numel() == 1 and cache.total_size == 1
    cache.check_invariants()


def test_evict_frees_to_allocator():
    alloc, cache = make_cache(8)
    slots = cache_seq(alloc, cache, [1, 2, 3, 4])
    assert alloc.num_free == 4
    assert cache.evict(2) == 4
    assert alloc.num_free == 8
    assert set(slots.tolist()) <= set(alloc.free_slots().tolist())
    cache.check_invariants()


def test_reset_frees_the_tree():
    alloc, cache = make_cache(8)
    cache_seq(alloc, cache, [1, 2, 3])
    cache_seq(alloc, cache, [1, 5])
    cache.reset()
    assert alloc.num_free == 8 and cache.total_size == 0 and cache.all_slots().numel() == 0
    cache.check_invariants()


def test_check_invariants_catches_bad_accounting():
    alloc, cache = make_cache()
    cache_seq(alloc, cache, [1, 2])
    cache._evictable_size += 1
    with pytest.raises(AssertionError, match="total_size"):
        cache.check_invariants()


def test_check_invariants_catches_freed_tree_slot():
    alloc, cache = make_cache()
    slots = cache_seq(alloc, cache, [1, 2])
    alloc.free(slots[:1])
    with pytest.raises(AssertionError, match="free list"):
        cache.check_invariants()


# ---- random walks against a brute-force model ---------------------------------------------------

CAPACITY = 24
sequences = st.lists(st.integers(0, 3), min_size=1, max_size=12)


def tree_contents(cache: RadixCache) -> dict[tuple[int, ...], int]:
    """Every cached prefix mapped to the slot of its last token, read off the tree."""
    contents: dict[tuple[int, ...], int] = {}
    stack: list[tuple[TreeNode, tuple[int, ...]]] = [(cache.root, ())]
    while stack:
        node, prefix = stack.pop()
        for token, slot in zip(node.key, node.value.tolist(), strict=True):
            prefix += (token,)
            contents[prefix] = slot
        stack.extend((child, prefix) for child in node.children.values())
    return contents


class RadixMachine(RuleBasedStateMachine):
    """The model maps every cached prefix to the slot of its last token."""

    def __init__(self):
        super().__init__()
        self.alloc = SlotAllocator(CAPACITY)
        self.cache = RadixCache(self.alloc)
        self.model: dict[tuple[int, ...], int] = {}
        self.locks: list[tuple[TreeNode, tuple[int, ...]]] = []
        self.held: list[torch.Tensor] = []  # slots the test owns across steps, like decode slots

    def longest_cached(self, seq: list[int]) -> int:
        n = 0
        while n < len(seq) and tuple(seq[: n + 1]) in self.model:
            n += 1
        return n

    def slots_of(self, prefix: tuple[int, ...]) -> list[int]:
        return [self.model[prefix[: i + 1]] for i in range(len(prefix))]

    def allocate(self, n: int) -> torch.Tensor | None:
        """Allocate like the engine: evict when short; None if locks pin too much."""
        short = n - self.alloc.num_free
        if short > 0:
            self.evict(short)
        try:
            return self.alloc.allocate(n)
        except KVCacheFullError:
            assert self.cache.evictable_size == 0
            return None

    def match(self, seq: list[int]):
        expected_len = self.longest_cached(seq)
        result = self.cache.match_prefix(seq)
        assert result.slots.tolist() == self.slots_of(tuple(seq[:expected_len]))
        return result, expected_len

    @rule(seq=sequences)
    def insert_fresh(self, seq):
        slots = self.allocate(len(seq))
        if slots is None:
            return
        expected_len = self.longest_cached(seq)
        assert self.cache.insert(seq, slots) == expected_len
        self.alloc.free(slots[:expected_len])
        for i in range(expected_len, len(seq)):
            self.model[tuple(seq[: i + 1])] = int(slots[i])

    @rule(seq=sequences)
    def match_then_insert(self, seq):
        result, matched_len = self.match(seq)
        self.cache.lock(result.node)  # protect the matched slots while allocating
        new_slots = self.allocate(len(seq) - matched_len)
        self.cache.unlock(result.node)
        if new_slots is None:
            return
        assert self.cache.insert(seq, torch.cat([result.slots, new_slots])) == matched_len
        for i in range(matched_len, len(seq)):
            self.model[tuple(seq[: i + 1])] = int(new_slots[i - matched_len])

    @rule(seq=sequences)
    def match_and_lock(self, seq):
        result, matched_len = self.match(seq)
        self.cache.lock(result.node)
        self.locks.append((result.node, tuple(seq[:matched_len])))

    @precondition(lambda self: self.locks)
    @rule(index=st.integers(0, 100))
    def unlock(self, index):
        node, _ = self.locks.pop(index % len(self.locks))
        self.cache.unlock(node)

    @rule(num_tokens=st.integers(0, CAPACITY))
    def evict(self, num_tokens):
        evictable_before = self.cache.evictable_size
        freed = self.cache.evict(num_tokens)
        assert freed >= min(num_tokens, evictable_before)
        assert self.cache.evictable_size == evictable_before - freed
        assert freed >= num_tokens or self.cache.evictable_size == 0
        remaining = tree_contents(self.cache)
        evicted = set(self.model) - set(remaining)
        assert len(evicted) == freed and set(remaining) <= set(self.model)
        for _, locked in self.locks:
            assert not any(locked[: len(e)] == e for e in evicted), "a locked prefix was evicted"
        self.model = {k: v for k, v in self.model.items() if k in remaining}

    @rule(n=st.integers(1, 6))
    def hold(self, n):
        slots = self.allocate(n)
        if slots is not None:
            self.held.append(slots)

    @precondition(lambda self: self.held)
    @rule(index=st.integers(0, 100))
    def release(self, index):
        self.alloc.free(self.held.pop(index % len(self.held)))

    @precondition(lambda self: not self.locks)
    @rule()
    def reset(self):
        self.cache.reset()
        self.model = {}

    @invariant()
    def consistent(self):
        self.cache.check_invariants()
        assert tree_contents(self.cache) == self.model
        locked = {p[:i] for _, p in self.locks for i in range(1, len(p) + 1)}
        assert self.cache.protected_size == len(locked)
        num_held = sum(s.numel() for s in self.held)
        assert self.alloc.num_free + self.cache.total_size + num_held == CAPACITY


RadixMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
test_radix_machine = RadixMachine.TestCase
