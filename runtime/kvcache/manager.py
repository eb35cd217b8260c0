"""KVCacheManager: request rows of KV slots, prefix locking, allocation with eviction, and the one
release path every request leaves through (finish, abort, retract)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from forklm.runtime.errors import KVCacheFullError
from forklm.runtime.kvcache.session_pins import SessionPins

if TYPE_CHECKING:
    from forklm.runtime.kvcache.pool import KVPool
    from forklm.runtime.kvcache.radix_cache import RadixCache
    from forklm.runtime.scheduling.request import Req


# Slots a decoding request takes at once for its next tokens (fewer when it has fewer left to
# generate), its own free list until it leaves. One decode step allocates a slot for every
# running request, so slots taken one step at a time interleave the batch's requests, and
# attention then reads each request's keys strided over the pool: 1.8x slower at 16 in flight
# than from runs (benchmarks/NOTES.md).
DECODE_RUN = 32


class KVCacheManager:
    """Slot ownership: the radix cache owns the slots it holds (a request only locks its path);
    a request owns the slots of req_to_token[row, prefix_len:num_computed] and its decode run
    (slots taken ahead for its next tokens); the rest are free."""

    def __init__(self, pool: KVPool, cache: RadixCache | None, max_rows: int, max_context: int,
                 pinned_fraction: float = 0.25, pin_idle_s: float = 120.0,
                 decode_run: int = DECODE_RUN):
        self.pool, self.cache = pool, cache
        self.allocator = pool.allocator
        assert decode_run >= 1, f"decode_run must be >= 1, got {decode_run}"
        self.decode_run = decode_run
        # row -> the slots its request's next decode tokens take, last one first (pop() order).
        # They count as available: an allocation that would fall short takes them all back.
        self.runs: dict[int, list[int]] = {}
        # Sessions' pinned prefixes (session_pins.py); none without a radix cache.
        self.pins = (SessionPins(cache, int(pool.allocator.capacity * pinned_fraction), pin_idle_s)
                     if cache is not None else None)
        self.req_to_token = torch.zeros(max_rows, max_context, dtype=torch.int64)
        # The same memory as a numpy array, for a decode step's few single-slot reads and writes:
        # an element through numpy costs ~0.1 us, a torch index op ~3 us hot and ~10-20 us in a
        # step whose kernels have just flushed the caches (runtime/forward/model_runner.py too).
        self.req_to_token_np = self.req_to_token.numpy()
        self.free_rows = list(range(max_rows - 1, -1, -1))

    @property
    def available_tokens(self) -> int:
        """Slots obtainable now: free ones, requests' decode runs (taken back when short) and what
        eviction of unlocked cache leaves would give."""
        return self._room() + self.num_in_runs

    @property
    def num_in_runs(self) -> int:
        """Slots held in requests' decode runs."""
        return sum(map(len, self.runs.values()))

    def match_len(self, req: Req) -> int:
        """Length of req's prefix found in the cache (no lock taken; may split a node)."""
        if self.cache is None:
            return 0
        return len(self.cache.match_prefix(req.cache_key(req.max_prefix_len())).slots)

    def admit(self, req: Req) -> None:
        """Give req a row and lock its longest cached prefix, which then counts as computed."""
        assert req.row is None, f"request {req.rid} admitted twice"
        req.row = self.free_rows.pop()
        if self.cache is not None:
            match = self.cache.match_prefix(req.cache_key(req.max_prefix_len()))
            self.cache.lock(match.node)
            req.last_node, req.prefix_len = match.node, len(match.slots)
            self.req_to_token[req.row, : req.prefix_len] = match.slots
        req.num_computed = req.prefix_len

    def extend(self, req: Req, num_tokens: int) -> torch.Tensor:
        """Allocate num_tokens slots after req's computed part and record them in its row (one
        token: from its decode run)."""
        row = _row(req)
        slots = (torch.tensor(self._decode_slots([req], [row])) if num_tokens == 1
                 else self.allocate(num_tokens))
        start = req.num_computed
        self.req_to_token[row, start : start + num_tokens] = slots
        req.num_computed += num_tokens
        return slots

    def extend_all(self, reqs: list[Req], lens: list[int]) -> None:
        """extend(req, n) for each pair, with one allocation and one scatter into the rows (a
        decode step of 16 requests: 0.02 ms instead of 0.10-0.16 in 16 rounds of small tensor
        ops). A decode step (one token each) takes each request's slot from its decode run and
        writes it through the numpy view (no tensor op at all)."""
        rows = [_row(req) for req in reqs]
        if all(n == 1 for n in lens):
            table = self.req_to_token_np
            for req, row, slot in zip(reqs, rows, self._decode_slots(reqs, rows), strict=True):
                table[row, req.num_computed] = slot
                req.num_computed += 1
            return
        slots = self.allocate(sum(lens))  # drafts, jump-forward: fresh slots; runs stay
        token_rows: list[int] = []
        cols: list[int] = []
        for req, row, n in zip(reqs, rows, lens, strict=True):
            token_rows += [row] * n
            cols += range(req.num_computed, req.num_computed + n)
            req.num_computed += n
        self.req_to_token[torch.tensor(token_rows, dtype=torch.int64),
                          torch.tensor(cols, dtype=torch.int64)] = slots

    def _decode_slots(self, reqs: list[Req], rows: list[int]) -> list[int]:
        """One slot for each request, from its decode run. Requests without one get a new run
        when the pool has room for all of them without taking other requests' runs back; else
        every run goes back and each request gets one slot."""
        lengths = {row: self._run_length(req)
                   for req, row in zip(reqs, rows) if not self.runs.get(row)}
        if lengths:
            if sum(lengths.values()) > self._room():
                self._drop_runs()
                lengths = dict.fromkeys(rows, 1)
            fresh = self.allocate(sum(lengths.values())).tolist()
            start = 0
            for row, n in lengths.items():
                self.runs[row] = fresh[start : start + n][::-1]
                start += n
        return [self.runs[row].pop() for row in rows]

    def _run_length(self, req: Req) -> int:
        """Slots a new decode run takes: what req may still compute, up to decode_run."""
        left = min(req.remaining_new_tokens(), self.req_to_token.shape[1] - req.num_computed)
        return max(1, min(self.decode_run, left))

    def _drop_run(self, row: int) -> None:
        run = self.runs.pop(row, None)
        if run:
            self.allocator.free(torch.tensor(run, dtype=torch.int64))

    def _drop_runs(self) -> None:
        """Every request's decode run back to the free list, in one call."""
        slots = [slot for run in self.runs.values() for slot in run]
        self.runs.clear()
        if slots:
            self.allocator.free(torch.tensor(slots, dtype=torch.int64))

    def _room(self) -> int:
        """Slots obtainable without taking decode runs back: free ones plus evictable ones."""
        return self.allocator.num_free + (self.cache.evictable_size if self.cache else 0)

    def allocate(self, num_tokens: int) -> torch.Tensor:
        """num_tokens free slots: evicting unlocked cache leaves if needed, and taking every
        decode run back first when even that would fall short."""
        if num_tokens > self._room():
            self._drop_runs()
        short = num_tokens - self.allocator.num_free
        if short > 0 and self.cache is not None:
            self.cache.evict(short)
        if num_tokens > self.allocator.num_free:
            raise KVCacheFullError(f"need {num_tokens} KV slots, {self.allocator.num_free} free")
        return self.allocator.allocate(num_tokens)

    def trim(self, req: Req, num_computed: int) -> None:
        """Free req's slots past num_computed (KV of rejected draft tokens), so they are never
        inserted into the cache as if they were the sequence's."""
        assert req.row is not None and req.prefix_len <= num_computed <= req.num_computed, (
            f"request {req.rid}: cannot trim to {num_computed}")
        self.allocator.free(self.req_to_token[req.row, num_computed : req.num_computed].clone())
        req.num_computed = num_computed

    def cache_unfinished(self, req: Req) -> None:
        """Insert req's computed tokens into the cache (so others can share them while it keeps
        running) and move its lock and row onto the cache's canonical slots."""
        if self.cache is None:
            return
        ids = req.cache_key(req.num_computed)
        self._insert(req, ids)
        match = self.cache.match_prefix(ids, count=False)
        assert len(match.slots) == len(ids), "inserted sequence must match in full"
        # Lock the new node before unlocking the old one, so the shared path never looks evictable.
        self.cache.lock(match.node)
        self.cache.unlock(req.last_node)
        req.last_node, req.prefix_len = match.node, len(ids)
        self.req_to_token[req.row, : len(ids)] = match.slots

    def release(self, req: Req, pin: bool = False) -> None:
        """The single exit: hand computed KV to the cache (or free it), unlock, free the row.
        pin: a finished request of a session leaves its sequence pinned for the session.
        Idempotent: a second call does nothing."""
        if req.row is None:
            return
        self._drop_run(req.row)
        if req.num_computed > req.fill_len:  # a verify step failed: its draft KV is not fill_ids'
            self.trim(req, max(req.fill_len - 1, req.prefix_len))
        if self.cache is not None:
            ids = req.cache_key(req.num_computed)
            self._insert(req, ids)
            if pin and req.session_id is not None and self.pins is not None:
                self.pins.pin(req.session_id, self.cache.match_prefix(ids, count=False).node)
            self.cache.unlock(req.last_node)
        else:
            self.allocator.free(self.req_to_token[req.row, req.prefix_len : req.num_computed].clone())
        self.free_rows.append(req.row)
        req.row, req.last_node, req.prefix_len, req.num_computed = None, None, 0, 0

    def _insert(self, req: Req, ids: list[int]) -> None:
        assert self.cache is not None
        slots = self.req_to_token[req.row, : len(ids)].clone()
        present = self.cache.insert(ids, slots)
        # The cache kept its own slots for [0, present); ours in [prefix_len, present) are duplicates.
        if present > req.prefix_len:
            self.allocator.free(slots[req.prefix_len : present])

    def flush(self) -> None:
        """Drop every cached prefix, sessions' pins included (sessions stay open); only valid
        when no request holds a lock."""
        if self.cache is not None:
            if self.pins is not None:
                self.pins.release_all()
            self.cache.reset()

    def check_invariants(self, active: list[Req]) -> None:
        """free + cached + owned-by-requests == capacity, and no slot is held twice."""
        held = [self.allocator.free_slots()]
        rows = [r.row for r in active if r.row is not None]
        assert set(self.runs) <= set(rows), "a decode run outlived its request"
        held += [torch.tensor(run, dtype=torch.int64) for run in self.runs.values()]
        if self.cache is not None:
            self.cache.check_invariants()
            held.append(self.cache.all_slots())
            # Every lock on the tree belongs to an admitted request or a session's pin.
            pins = 0
            if self.pins is not None:
                self.pins.check_invariants()
                pins = self.pins.num_pins
            assert self.cache.root.lock_ref == len(rows) + pins, (
                f"{self.cache.root.lock_ref} locks for {len(rows)} requests and {pins} pins")
        assert len(rows) == len(set(rows)), "a row is used by two requests"
        assert len(rows) + len(self.free_rows) == self.req_to_token.shape[0], "request row leaked"
        for r in active:
            if r.row is not None:
                held.append(self.req_to_token[r.row, r.prefix_len : r.num_computed])
        everything = torch.cat(held)
        capacity = self.allocator.capacity
        assert everything.numel() == capacity, (
            f"KV slots accounted {everything.numel()} != capacity {capacity}: leak or double count")
        assert torch.unique(everything).numel() == capacity, "a KV slot is owned twice"


def _row(req: Req) -> int:
    assert req.row is not None, f"request {req.rid} has no row: it was not admitted"
    return req.row
