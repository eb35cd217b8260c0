"""Programs keep their context pinned while they run (issue 17 §3), in process and over
RuntimeEndpoint: one engine session per program run (fork branches share it), its pins released
on every way out (finished, failed, cancelled), gone sessions and engines without a radix cache
run unpinned, and the KV pool invariants hold throughout."""

from __future__ import annotations

import asyncio

import pytest

import forklm as sgl
from forklm.frontend_dsl.global_config import global_config
from forklm.runtime.errors import InvalidArgumentError
from tests.conftest import assert_idle_and_clean, wait_until

pytestmark = pytest.mark.slow

GREEDY = {"temperature": 0.0}


@pytest.fixture(scope="module")
def engine(make_engine):
    return make_engine()


@pytest.fixture(scope="module")
def backend(engine):
    return sgl.EngineBackend(engine)


def released(engine) -> bool:
    stats = engine.stats()
    return stats["open_sessions"] == 0 and stats["pinned_tokens"] == 0


def pins_now(engine) -> tuple[int, int]:
    stats = engine.stats()
    return stats["open_sessions"], stats["pinned_tokens"]


def test_a_program_pins_its_context_between_gens_and_releases_it(engine, backend):
    seen: list[tuple[int, int]] = []

    @sgl.function
    def chat(s):
        s += sgl.user("Name a colour.")
        s += sgl.assistant(sgl.gen("a", max_tokens=6))
        s["a"]  # between two gens (a tool would run here)
        wait_until(lambda: pins_now(engine)[1] > 0, timeout=5)
        seen.append(pins_now(engine))
        s += sgl.user("Another one?") + sgl.assistant(sgl.gen("b", max_tokens=6))

    state = chat.run(backend=backend, **GREEDY)
    assert state["b"]
    prompt_tokens = len(engine.tokenizer.encode(state.text()))
    sessions, pinned = seen[0]
    assert sessions == 1 and 0 < pinned < prompt_tokens  # the context up to the first answer
    wait_until(lambda: released(engine), timeout=5)
    assert_idle_and_clean(engine)


def test_fork_branches_share_the_run_session_with_one_pin_each(engine, backend):
    seen: list[int] = []

    @sgl.function
    def branches(s):
        s += sgl.system("You are brief.")
        forks = s.fork(3)
        forks += [sgl.user(f"Name a {kind}.") + sgl.assistant(sgl.gen("x", max_tokens=4))
                  for kind in ("fruit", "colour", "river")]
        forks.join()
        sessions = engine.parts.kv.pins.sessions
        # the engine pins a finished request's sequence right after handing out its result
        wait_until(lambda: sum(len(x.pins) for x in list(sessions.values())) >= 3, timeout=5)
        seen.append(sum(len(x.pins) for x in list(sessions.values())))
        seen.append(engine.stats()["open_sessions"])

    branches.run(backend=backend, **GREEDY)
    assert seen == [3, 1]  # three leaves (the branches differ) pinned, one session
    wait_until(lambda: released(engine), timeout=5)
    assert_idle_and_clean(engine)


def test_pins_are_released_when_the_program_fails(engine, backend):
    @sgl.function
    def fails(s):
        s += sgl.user("Say hi.") + sgl.assistant(sgl.gen("a", max_tokens=4))
        s["a"]
        raise RuntimeError("the tool crashed")

    with pytest.raises(RuntimeError, match="tool crashed"):
        fails.run(backend=backend, **GREEDY)
    wait_until(lambda: released(engine), timeout=5)

    states = fails.run_batch([{}, {}], backend=backend, **GREEDY)
    assert all(isinstance(s.error(), RuntimeError) for s in states)
    wait_until(lambda: released(engine), timeout=5)
    assert_idle_and_clean(engine)


def test_async_programs_hold_a_session_and_release_it_when_cancelled(engine, backend):
    seen: list[tuple[int, int]] = []

    @sgl.function
    async def slow(s):
        s += sgl.user("Tell a story.") + sgl.assistant(sgl.gen("a", max_tokens=4))
        await s["a"]
        await asyncio.to_thread(wait_until, lambda: pins_now(engine)[1] > 0, 5)
        seen.append(pins_now(engine))
        s += sgl.user("Longer.") + sgl.assistant(sgl.gen("b", max_tokens=400, ignore_eos=True))
        await s["b"]

    async def main():
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(slow.run_async(backend=backend, **GREEDY), timeout=3.0)

    asyncio.run(main())
    assert seen and seen[0][0] == 1 and seen[0][1] > 0
    wait_until(lambda: released(engine) and engine.stats()["running"] == 0, timeout=10)
    assert_idle_and_clean(engine)


def test_a_session_that_idled_out_lets_the_program_go_on_unpinned(engine, backend):
    @sgl.function
    def outlives(s):
        s += sgl.user("Name a city.") + sgl.assistant(sgl.gen("a", max_tokens=4))
        s["a"]
        for sid in list(engine.parts.kv.pins.sessions):  # as the idle timeout would
            engine.close_session(sid)
        s += sgl.user("Another?") + sgl.assistant(sgl.gen("b", max_tokens=4))

    with_pins = outlives.run(backend=backend, **GREEDY)
    global_config.pin_program_context = False
    try:
        plain = outlives.run(backend=backend, **GREEDY)
    finally:
        global_config.pin_program_context = True
    assert with_pins.text() == plain.text()  # same tokens, pinned or not
    wait_until(lambda: released(engine), timeout=5)
    assert_idle_and_clean(engine)


def test_no_radix_cache_means_no_session_and_the_same_results(make_engine, backend):
    plain_engine = make_engine(disable_radix_cache=True)

    @sgl.function
    def two(s):
        s += sgl.user("Name a colour.") + sgl.assistant(sgl.gen("a", max_tokens=5))
        s += sgl.user("Another?") + sgl.assistant(sgl.gen("b", max_tokens=5))

    state = two.run(backend=sgl.EngineBackend(plain_engine), **GREEDY)
    assert state.text() == two.run(backend=backend, **GREEDY).text()
    assert_idle_and_clean(plain_engine)


def test_runtime_endpoint_programs_hold_a_server_session(live_server):
    engine = live_server.engine
    endpoint = sgl.RuntimeEndpoint(live_server.base_url)
    seen: list[tuple[int, int]] = []

    @sgl.function
    def chat(s):
        s += sgl.user("Name a planet.") + sgl.assistant(sgl.gen("a", max_tokens=5))
        s["a"]
        wait_until(lambda: pins_now(engine)[1] > 0, timeout=5)
        seen.append(pins_now(engine))
        s += sgl.user("Another?") + sgl.assistant(sgl.gen("b", max_tokens=5))

    @sgl.function
    async def achat(s):
        s += sgl.user("Name a planet.") + sgl.assistant(sgl.gen("a", max_tokens=5))
        await s["a"]
        await asyncio.to_thread(wait_until, lambda: pins_now(engine)[1] > 0, 5)
        seen.append(pins_now(engine))
        s += sgl.user("Another?") + sgl.assistant(sgl.gen("b", max_tokens=5))

    try:
        text = chat.run(backend=endpoint, **GREEDY).text()
        wait_until(lambda: released(engine), timeout=5)
        assert asyncio.run(achat.run_async(backend=endpoint, **GREEDY)).text() == text
        wait_until(lambda: released(engine), timeout=5)
    finally:
        endpoint.close()
    assert [s for s, _ in seen] == [1, 1] and all(p > 0 for _, p in seen)
    assert_idle_and_clean(engine)


def test_a_session_opened_without_waiting_is_usable_at_once(engine):
    sid = engine.open_session(wait=False)  # what a program's first gen does
    engine.generate("Hello there", {"max_new_tokens": 2, "temperature": 0},
                    session_params={"id": sid})
    wait_until(lambda: engine.stats()["pinned_tokens"] > 0, timeout=5)
    assert engine.close_session(sid) and released(engine)
    with pytest.raises(InvalidArgumentError, match="fresh"):
        engine.open_session("named", wait=False)
    assert_idle_and_clean(engine)
