"""Sessions pin the prefixes their requests end with (runtime/kvcache/session_pins.py): pinned paths are
never evicted, every pin is released on every exit (close, idle, cap, flush), and the pinned
total stays within its cap."""

from __future__ import annotations

import time

import httpx
import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from forklm.runtime.errors import InvalidArgumentError
from forklm.runtime.kvcache.pool import SlotAllocator
from forklm.runtime.kvcache.radix_cache import RadixCache
from forklm.runtime.kvcache.session_pins import SessionPins
from tests.conftest import assert_idle_and_clean

CAPACITY, CAP = 256, 96


class PinMachine(RuleBasedStateMachine):
    """Sessions pin random sequences (some extending each other, some forking) while other
    traffic inserts and evicts; pinned tokens must survive every eviction."""

    def __init__(self):
        super().__init__()
        self.alloc = SlotAllocator(CAPACITY)
        self.cache = RadixCache(self.alloc)
        self.pins = SessionPins(self.cache, CAP, idle_s=60.0)
        self.sequences: list[list[int]] = [[]]

    def _insert(self, ids: list[int]):
        if len(ids) > self.alloc.num_free:
            self.cache.evict(len(ids) - self.alloc.num_free)
        if len(ids) > self.alloc.num_free:
            return None
        slots = self.alloc.allocate(len(ids))
        present = self.cache.insert(ids, slots)
        self.alloc.free(slots[:present])
        return self.cache.match_prefix(ids, count=False).node

    @rule(session=st.integers(0, 3))
    def open(self, session):
        self.pins.open(f"s{session}")

    @rule(session=st.integers(0, 3), base=st.integers(0, 20),
          tail=st.lists(st.integers(0, 5), min_size=1, max_size=40))
    def finish_request(self, session, base, tail):
        """A request of the session ends with an earlier sequence plus `tail` and pins it."""
        ids = self.sequences[base % len(self.sequences)] + tail
        node = self._insert(ids)
        if node is None:
            return
        self.sequences.append(ids)
        before = (self.pins.num_pins, self.pins.pinned_tokens)
        pinned = self.pins.pin(f"s{session}", node)
        if f"s{session}" not in self.pins.sessions or len(ids) > CAP:
            assert not pinned
        if not pinned:  # refused: nothing changed
            assert (self.pins.num_pins, self.pins.pinned_tokens) == before

    @rule(tail=st.lists(st.integers(6, 9), min_size=1, max_size=80))
    def other_traffic(self, tail):
        self._insert(tail)

    @rule(n=st.integers(1, CAPACITY))
    def evict(self, n):
        self.cache.evict(n)

    @rule(session=st.integers(0, 3))
    def close(self, session):
        self.pins.close(f"s{session}")

    @rule()
    def idle_out(self):
        self.pins.idle_s = 0.0
        self.pins._next_expiry_check = 0.0
        self.pins.expire(float("inf"))
        self.pins.idle_s = 60.0
        assert self.pins.num_pins == 0

    @invariant()
    def pinned_paths_stay_cached(self):
        self.pins.check_invariants()
        self.cache.check_invariants()
        assert self.cache.root.lock_ref == self.pins.num_pins
        for session in self.pins.sessions.values():
            for pin in session.pins:
                node, tokens = pin.node, 0
                while node is not None:
                    tokens += len(node)
                    node = node.parent
                assert tokens == pin.tokens  # still attached, whole, after any eviction
        assert self.alloc.num_free + self.cache.total_size == CAPACITY

    def teardown(self):
        for session in list(self.pins.sessions):
            self.pins.close(session)
        assert self.cache.root.lock_ref == 0 and self.pins.pinned_tokens == 0


TestPinMachine = PinMachine.TestCase
TestPinMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


def test_a_chain_keeps_one_pin_and_forks_keep_one_per_branch():
    alloc = SlotAllocator(64)
    cache = RadixCache(alloc)
    pins = SessionPins(cache, 64, idle_s=60.0)

    def node_of(ids):
        slots = alloc.allocate(len(ids) - len(cache.match_prefix(ids, count=False).slots))
        full = torch.cat((cache.match_prefix(ids, count=False).slots, slots))
        cache.insert(ids, full)
        return cache.match_prefix(ids, count=False).node

    pins.open("s")
    pins.pin("s", node_of([1, 2, 3]))
    pins.pin("s", node_of([1, 2, 3, 4, 5]))  # the next gen of the chain replaces the pin
    assert pins.num_pins == 1 and pins.pinned_tokens == 5
    pins.pin("s", node_of([1, 2, 3, 4, 5, 6]))
    pins.pin("s", node_of([1, 2, 3, 4, 5, 7]))  # a fork's second branch: both stay
    assert pins.num_pins == 2 and cache.evictable_size == 0
    assert pins.close("s") and cache.root.lock_ref == 0 and not pins.close("s")


def test_a_pin_over_the_cap_is_refused_and_pins_held_stay():
    alloc = SlotAllocator(64)
    cache = RadixCache(alloc)
    pins = SessionPins(cache, 20, idle_s=60.0)

    def node_of(ids):
        present = len(cache.match_prefix(ids, count=False).slots)
        cache.insert(ids, torch.cat((cache.match_prefix(ids, count=False).slots,
                                     alloc.allocate(len(ids) - present))))
        return cache.match_prefix(ids, count=False).node

    pins.open("old")
    pins.open("new")
    assert pins.pin("old", node_of([1] * 12))
    assert not pins.pin("new", node_of([2] * 12))  # 24 > 20: refused, "old" keeps its pin
    assert pins.sessions["old"].pins and not pins.sessions["new"].pins
    assert pins.pin("old", node_of([1] * 16))  # extending its own pin fits: 16 replaces 12
    assert not pins.pin("old", node_of([1] * 24))  # too long: the 16-token pin stays
    assert pins.pinned_tokens == 16 and pins.num_pins == 1
    assert not pins.pin("new", cache.root)


# --- through the engine -------------------------------------------------------------------------

PROMPT = "You are a careful assistant. Answer in one short sentence. Question: why is the sky blue?"


@pytest.fixture(scope="module")
def engine(make_engine):
    return make_engine(max_total_tokens=1024)  # small: other traffic evicts what is not pinned


def _crowd_out(engine, rounds: int = 6) -> None:
    """Unrelated prompts that need most of the pool, so LRU eviction reaches older prefixes."""
    for i in range(rounds):
        engine.generate([f"{i} {j} " + "lorem ipsum dolor sit amet " * 20 for j in range(4)],
                        {"max_new_tokens": 2})


def test_a_session_keeps_its_context_through_cache_pressure(engine, tokenizer):
    params = {"max_new_tokens": 8, "temperature": 0}
    sid = engine.open_session()
    try:
        first = engine.generate(PROMPT, params, session_params={"id": sid})
        assert engine.stats()["pinned_tokens"] > 0
        _crowd_out(engine)
        follow_up = PROMPT + first["text"] + " And why is it red at sunset?"
        second = engine.generate(follow_up, params, session_params={"id": sid})
        pinned_len = len(tokenizer.encode(PROMPT)) + len(first["output_ids"]) - 1
        assert second["meta_info"]["cached_tokens"] >= pinned_len - 1
    finally:
        assert engine.close_session(sid)
    assert engine.stats()["pinned_tokens"] == 0 and engine.stats()["open_sessions"] == 0
    # Without a session the same pressure evicts the context:
    engine.flush_cache()
    first = engine.generate(PROMPT, params)
    _crowd_out(engine)
    again = engine.generate(PROMPT + first["text"] + " And why is it red at sunset?", params)
    assert again["meta_info"]["cached_tokens"] < len(tokenizer.encode(PROMPT)) // 2
    assert_idle_and_clean(engine)


def test_idle_sessions_lose_their_pins_and_flush_releases_them(engine):
    sid = engine.open_session("idle-test")
    pins = engine.parts.kv.pins
    try:
        engine.generate(PROMPT, {"max_new_tokens": 2}, session_params={"id": sid})
        assert engine.stats()["pinned_tokens"] > 0
        assert engine.flush_cache() and engine.stats()["pinned_tokens"] == 0
        engine.generate(PROMPT, {"max_new_tokens": 2}, session_params={"id": sid})
        engine._loop.call(lambda: setattr(pins, "idle_s", 0.0))
        deadline = time.monotonic() + 5  # the idle loop checks expiry about once a second
        while engine.stats()["pinned_tokens"] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert engine.stats()["pinned_tokens"] == 0 and engine.stats()["open_sessions"] == 1
    finally:
        engine._loop.call(lambda: setattr(pins, "idle_s", 120.0))
        engine.close_session(sid)
    assert_idle_and_clean(engine)


def test_session_errors_name_the_argument(engine):
    with pytest.raises(InvalidArgumentError, match="session_params"):
        engine.generate("hi", {"max_new_tokens": 1}, session_params={"id": "never-opened"})
    sid = engine.open_session()
    try:
        with pytest.raises(InvalidArgumentError, match="session_params.offset"):
            engine.generate("hi", {"max_new_tokens": 1}, session_params={"id": sid, "offset": 3})
        with pytest.raises(InvalidArgumentError, match="already open"):
            engine.open_session(sid)
    finally:
        engine.close_session(sid)
    assert not engine.close_session(sid)


def test_sessions_over_http(live_server):
    base = live_server.base_url
    sid = httpx.post(f"{base}/open_session", json={"capacity_of_str_len": 1000}).json()
    body = {"text": PROMPT, "sampling_params": {"max_new_tokens": 2}, "session_params": {"id": sid}}
    assert httpx.post(f"{base}/generate", json=body, timeout=60).status_code == 200
    assert live_server.engine.stats()["pinned_tokens"] > 0
    assert httpx.post(f"{base}/close_session", json={"session_id": sid}).json()["success"]
    assert httpx.post(f"{base}/close_session", json={"session_id": sid}).status_code == 404
    bad = httpx.post(f"{base}/generate", json=body, timeout=60)
    assert bad.status_code == 400 and "session_params" in bad.text
    assert live_server.engine.stats()["pinned_tokens"] == 0


def _no_sessions_left(engine) -> bool:
    deadline = time.monotonic() + 10  # the endpoint closes its session after the response
    while time.monotonic() < deadline:
        stats = engine.stats()
        if stats["open_sessions"] == 0 and stats["pinned_tokens"] == 0:
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("stream", [False, True])
def test_a_server_side_program_pins_while_it_runs_and_releases_at_the_end(live_server, stream):
    program = ('program p(topic)\n"Q: name a {topic}.\\nA:" gen first max_tokens=4\n'
               '"\\nQ: and another?\\nA:" gen second max_tokens=4\n')
    body = {"program_text": program, "arguments": {"topic": "fruit"}, "stream": stream,
            "sampling_params": {"temperature": 0.0}}
    reply = httpx.post(f"{live_server.base_url}/v1/programs/run", json=body, timeout=120)
    assert reply.status_code == 200
    if not stream:
        meta = reply.json()["results"][0]["meta_info"]["variables"]
        # the second gen's prompt extends the first's pinned sequence: all but its new text cached
        assert meta["second"]["cached_tokens"] >= meta["first"]["prompt_tokens"]
    assert _no_sessions_left(live_server.engine)
