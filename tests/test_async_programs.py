"""Async programs (`async def` bodies whose reads are awaited) on the default model: the same text
as their plain twins (greedy), on the caller's event loop without a thread per program, errors
raised at the awaited read, cancellation that frees the engine, and the misuses that must fail
loudly (a read used without await, a blocking entry point on a running loop)."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest

import forklm as sgl
from forklm.frontend_dsl.async_executor import FinishedProgramError
from forklm.frontend_dsl.backends import BackendError
from tests.conftest import assert_idle_and_clean, wait_until

pytestmark = pytest.mark.slow

GREEDY = {"temperature": 0.0}


@pytest.fixture(scope="module")
def engine(make_engine):
    return make_engine()


@pytest.fixture(scope="module")
def backend(engine):
    return sgl.EngineBackend(engine)


@sgl.function
async def triage(s, question):
    s += sgl.system("You answer briefly.")
    s += sgl.user(question)
    s += sgl.assistant(sgl.gen("answer", max_tokens=12, stop="\n"))
    answer = await s["answer"]
    if len(answer) > 20:  # control flow on a generated value: fine at run time
        s += sgl.user("Shorter, please.")
        s += sgl.assistant(sgl.gen("short", max_tokens=6))
    forks = s.fork(2)
    forks += [sgl.user("Is that certain?"), sgl.user("Why?")]
    forks += sgl.assistant(sgl.gen("follow_up", max_tokens=5))
    await forks.join()
    s += sgl.user("Yes or no?")
    s += sgl.assistant(sgl.select("verdict", choices=["yes", "no"]))


@sgl.function
def triage_sync(s, question):
    s += sgl.system("You answer briefly.")
    s += sgl.user(question)
    s += sgl.assistant(sgl.gen("answer", max_tokens=12, stop="\n"))
    answer = s["answer"]
    if len(answer) > 20:
        s += sgl.user("Shorter, please.")
        s += sgl.assistant(sgl.gen("short", max_tokens=6))
    forks = s.fork(2)
    forks += [sgl.user("Is that certain?"), sgl.user("Why?")]
    forks += sgl.assistant(sgl.gen("follow_up", max_tokens=5))
    forks.join()
    s += sgl.user("Yes or no?")
    s += sgl.assistant(sgl.select("verdict", choices=["yes", "no"]))


QUESTIONS = ["What is the capital of France?", "How many legs has a spider?",
             "What colour is the sky?", "Name a prime number."]


def test_async_program_gives_the_plain_programs_state(engine, backend):
    async def main():
        return await triage.run_async(QUESTIONS[0], backend=backend, **GREEDY)

    state = asyncio.run(main())
    twin = triage_sync.run(QUESTIONS[0], backend=backend, **GREEDY)
    assert state.text() == twin.text()
    assert state.messages() == twin.messages()
    assert state["follow_up"] == twin["follow_up"] and len(state["follow_up"]) == 2
    assert state["verdict"] in ("yes", "no") and state["verdict"] == twin["verdict"]
    assert state.get_meta_info("answer")["completion_tokens"] <= 12
    assert_idle_and_clean(engine)


def test_run_batch_async_runs_on_the_loop_without_threads(engine, backend):
    """Every item is a task on the caller's loop: the process gains no thread while 24 programs
    run (the plain run_batch starts a pool and a worker thread per program)."""
    items = [{"question": q} for q in QUESTIONS * 6]
    before = threading.active_count()
    peak = 0

    async def watch(done: asyncio.Event) -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, threading.active_count())
            await asyncio.sleep(0.01)

    async def main():
        done = asyncio.Event()
        watcher = asyncio.create_task(watch(done))
        states = await triage.run_batch_async(items, backend=backend, **GREEDY)
        done.set()
        await watcher
        return states

    states = asyncio.run(main())
    assert peak <= before + 1  # asyncio.to_thread of the prefix hint may borrow one worker
    twins = triage_sync.run_batch(items, backend=backend, **GREEDY)
    assert [s.text() for s in states] == [t.text() for t in twins]
    assert_idle_and_clean(engine)


def test_error_of_a_gen_is_raised_at_the_awaited_read(engine, backend):
    caught: list[BaseException] = []

    @sgl.function
    async def bad(s):
        s += "word " * 20000 + sgl.gen("n", max_tokens=4)  # over the context: the engine refuses
        try:
            await s["n"]
        except ValueError as e:
            caught.append(e)
            raise

    state = asyncio.run(bad.run_async(backend=backend))
    assert len(caught) == 1 and "context_length" in str(caught[0])
    with pytest.raises(ValueError) as raised:  # the finished state raises it on read too
        state.text()
    assert raised.value is caught[0]
    assert_idle_and_clean(engine)


def test_an_aborted_gen_raises_backend_error_at_the_await(engine, backend):
    caught: list[BaseException] = []

    @sgl.function
    async def long(s):
        s += "Count to a thousand: 1, 2, 3," + sgl.gen("count", max_tokens=400, ignore_eos=True)
        try:
            await s["count"]
        except BackendError as e:
            caught.append(e)

    async def run():
        seen_rids: list[str] = []
        prepare = engine.prepare

        def recording(*args, **kwargs):
            group = prepare(*args, **kwargs)
            seen_rids.extend(group.rids)
            return group

        engine.prepare = recording  # type: ignore[method-assign]
        try:
            task = asyncio.ensure_future(long.run_async(backend=backend))
            await asyncio.to_thread(wait_until, lambda: bool(seen_rids) and
                                    engine.stats()["running"] == 1)
            engine.abort(seen_rids[0])
            return await task
        finally:
            del engine.prepare

    state = asyncio.run(run())
    assert len(caught) == 1 and "aborted by the caller" in str(caught[0])
    with pytest.raises(BackendError):  # the program stays failed, as a plain one does
        state["count"]
    assert_idle_and_clean(engine)


def test_cancelling_a_program_aborts_its_gen(engine, backend):
    @sgl.function
    async def long(s):
        s += "Once upon a time" + sgl.gen("story", max_tokens=400, ignore_eos=True)
        await s["story"]

    async def main():
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(long.run_async(backend=backend), timeout=1.0)

    asyncio.run(main())
    wait_until(lambda: engine.stats()["running"] == 0, timeout=10)
    assert_idle_and_clean(engine)


def test_misuses_fail_loudly(backend):
    @sgl.function
    async def formats_a_read(s):
        s += "Say hi:" + sgl.gen("x", max_tokens=2)
        s += f"You said {s['x']}"  # no await: must not put "<coroutine ...>" in the prompt

    state = asyncio.run(formats_a_read.run_async(backend=backend, **GREEDY))
    with pytest.raises(TypeError, match=r"await s\['x'\]"):
        state.text()

    @sgl.function
    async def short(s):
        s += "Hi" + sgl.gen("x", max_tokens=1)

    async def on_a_loop():
        with pytest.raises(TypeError, match="run_async"):
            short.run(backend=backend)
        with pytest.raises(TypeError, match="run_batch_async"):
            short.run_batch([{}, {}], backend=backend)
        done = await short.run_async(backend=backend, **GREEDY)
        with pytest.raises(FinishedProgramError):
            done += "more"
        return done

    done = asyncio.run(on_a_loop())
    assert done.text().startswith("Hi")
    # Outside a loop, the blocking entry points run the program on a loop of their own.
    assert short.run(backend=backend, **GREEDY).text() == done.text()


def test_async_program_traces_like_its_plain_twin():
    @sgl.function
    async def shared(s, topic):
        s += sgl.system("You write one line.")
        s += sgl.user("Topic: " + topic)
        s += sgl.assistant(sgl.gen("line", max_tokens=8))
        line = await s["line"]
        s += "Echo: " + line

    @sgl.function
    def shared_sync(s, topic):
        s += sgl.system("You write one line.")
        s += sgl.user("Topic: " + topic)
        s += sgl.assistant(sgl.gen("line", max_tokens=8))
        line = s["line"]
        s += "Echo: " + line

    a, b = json.loads(shared.trace().to_json()), json.loads(shared_sync.trace().to_json())
    a.pop("name"), b.pop("name")
    assert a == b


def test_async_program_over_runtime_endpoint(live_server, backend):
    endpoint = sgl.RuntimeEndpoint(live_server.base_url)
    try:
        async def main(on):
            return await triage.run_async(QUESTIONS[1], backend=on, **GREEDY)

        assert asyncio.run(main(endpoint)).text() == asyncio.run(main(backend)).text()
    finally:
        endpoint.close()


def test_num_threads_bounds_how_many_async_programs_run_at_once(backend):
    live = peak = 0

    @sgl.function
    async def counted(s, i):
        nonlocal live, peak
        live += 1
        peak = max(peak, live)
        s += f"Item {i}:" + sgl.gen("x", max_tokens=2)
        await s["x"]
        live -= 1

    states = asyncio.run(counted.run_batch_async([{"i": i} for i in range(6)], backend=backend,
                                                 num_threads=2, **GREEDY))
    assert peak == 2 and all(s.text().startswith(f"Item {i}:") for i, s in enumerate(states))
    with pytest.raises(sgl.InvalidArgumentError, match="num_threads"):
        asyncio.run(counted.run_batch_async([{"i": 0}], backend=backend, num_threads=0))
