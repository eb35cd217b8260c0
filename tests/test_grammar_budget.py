"""Grammar compiles under a budget: a slow or abandoned compile never delays another request's,
one over budget fails its request with a clear error (over HTTP a 400), a caller that leaves drops
its queued compile or frees its place, and constraint text is bounded before any compile.

Slow compiles are simulated: `_compile` waits on an Event for the constraints marked slow (real
xgrammar compiles run in C++ and release the GIL the same way)."""

from __future__ import annotations

import asyncio
import collections
import json
import random
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace

import httpx
import pytest
import xgrammar as xgr

from forklm.runtime.config import EngineConfig
from forklm.runtime.errors import (
    EngineShutdownError,
    GrammarCompileTimeoutError,
    InvalidArgumentError,
)
from forklm.runtime.sampling.checks import MAX_GRAMMAR_CHARS, MAX_GRAMMAR_DEPTH
from forklm.runtime.sampling.constraints import GrammarBackend
from forklm.runtime.sampling.grammar_pool import CompilePool
from forklm.runtime.sampling.params import Constraint, SamplingParams
from tests.conftest import assert_idle_and_clean, serve_in_thread, wait_until

VOCAB = ["</s>", "a", "b", "c", "ab", "1", "2", "{", "}", '"', ":", ",", " ", "x"]
SLOW = "a+(b|c)*"  # any regex; the patched compile makes it slow


class SlowCompiles:
    """Patches backend._compile: constraints whose spec starts with SLOW wait for release()."""

    def __init__(self, backend: GrammarBackend, monkeypatch: pytest.MonkeyPatch):
        self.gate = threading.Event()
        self.calls: list[str] = []
        compile_one = backend._compile

        def compile_maybe_slowly(constraint: Constraint) -> xgr.CompiledGrammar:
            self.calls.append(constraint.spec)
            if constraint.spec.startswith(SLOW):
                assert self.gate.wait(30), "never released"
            return compile_one(constraint)

        monkeypatch.setattr(backend, "_compile", compile_maybe_slowly)

    def release(self) -> None:
        self.gate.set()


def slow(i: int) -> Constraint:
    return Constraint("regex", SLOW + "x" * i)  # distinct specs: no deduplication


def reqs_of(*constraints: Constraint) -> list:
    return [SimpleNamespace(sampling_params=SimpleNamespace(constraint=c)) for c in constraints]


@pytest.fixture
def backend() -> Iterator[GrammarBackend]:
    info = xgr.TokenizerInfo(VOCAB, xgr.VocabType.RAW, stop_token_ids=[0])
    backend = GrammarBackend(lambda: info, compile_timeout_s=5.0)
    yield backend
    backend.close()


@pytest.fixture
def slow_compiles(backend, monkeypatch) -> Iterator[SlowCompiles]:
    slow_compiles = SlowCompiles(backend, monkeypatch)
    yield slow_compiles
    slow_compiles.release()


def test_abandoned_and_slow_compiles_do_not_delay_a_regex(backend, slow_compiles):
    # The case: two deep schemas whose clients left, and two still awaited.
    abandoned = backend.compile_all(reqs_of(slow(1), slow(2)))
    for fut in abandoned.values():
        assert fut.cancel()
    awaited = backend.compile_all(reqs_of(slow(3), slow(4)))
    start = time.monotonic()
    plain = backend.compile(Constraint("regex", "[ab]+")).result(timeout=5)
    assert time.monotonic() - start < 1.0
    assert isinstance(plain, xgr.CompiledGrammar)
    assert not any(f.done() for f in awaited.values())
    slow_compiles.release()
    for fut in awaited.values():
        assert isinstance(fut.result(timeout=5), xgr.CompiledGrammar)


def test_over_budget_fails_clearly_and_the_late_result_is_kept(backend, slow_compiles,
                                                               monkeypatch):
    monkeypatch.setattr(backend._pool, "timeout_s", 0.2)
    fut = backend.compile_all(reqs_of(slow(0)))[slow(0)]
    with pytest.raises(GrammarCompileTimeoutError,
                       match=r"regex=.*took longer than the 0.2 s budget to compile "
                             r"\(EngineConfig.grammar_compile_timeout_s\)"):
        fut.result(timeout=5)
    # Resubmitted while the overrunning compile still runs: fails at once, no second compile.
    with pytest.raises(GrammarCompileTimeoutError):
        backend.compile(slow(0)).result(timeout=1)
    assert slow_compiles.calls == [slow(0).spec]
    assert backend._pool.num_fresh() == 0  # it no longer holds a place
    slow_compiles.release()
    wait_until(lambda: backend._cache[slow(0)].future.done()
               and backend._cache[slow(0)].future.exception() is None, timeout=5)
    assert isinstance(backend.compile(slow(0)).result(timeout=1), xgr.CompiledGrammar)
    assert slow_compiles.calls == [slow(0).spec]


def test_queued_compile_is_dropped_when_its_caller_leaves(backend, slow_compiles, monkeypatch):
    monkeypatch.setattr(backend, "_pool", CompilePool(5.0, num_threads=1, max_threads=1))
    running = backend.compile_all(reqs_of(slow(0)))
    wait_until(lambda: slow_compiles.calls == [slow(0).spec], timeout=5)
    queued = backend.compile_all(reqs_of(Constraint("regex", "queued")))
    assert queued[Constraint("regex", "queued")].cancel()  # the client left
    assert Constraint("regex", "queued") not in backend._cache
    slow_compiles.release()
    assert isinstance(running[slow(0)].result(timeout=5), xgr.CompiledGrammar)
    time.sleep(0.1)
    assert slow_compiles.calls == [slow(0).spec]  # the dropped compile never started
    backend._pool.close()


def test_shared_compile_survives_one_caller_leaving(backend, slow_compiles, monkeypatch):
    monkeypatch.setattr(backend, "_pool", CompilePool(5.0, num_threads=1, max_threads=1))
    backend.compile_all(reqs_of(slow(0)))  # holds the only thread
    first = backend.compile_all(reqs_of(Constraint("regex", "ab")))
    second = backend.compile_all(reqs_of(Constraint("regex", "ab")))
    first[Constraint("regex", "ab")].cancel()
    slow_compiles.release()
    assert isinstance(second[Constraint("regex", "ab")].result(timeout=5), xgr.CompiledGrammar)
    backend._pool.close()


def test_queued_past_the_budget_says_the_threads_were_busy(backend, slow_compiles,
                                                           monkeypatch):
    monkeypatch.setattr(backend, "_pool", CompilePool(0.2, num_threads=1, max_threads=1))
    backend.compile_all(reqs_of(slow(0)))
    queued = backend.compile_all(reqs_of(Constraint("regex", "queued")))
    with pytest.raises(GrammarCompileTimeoutError, match="all 1 compile threads were busy"):
        queued[Constraint("regex", "queued")].result(timeout=5)
    assert Constraint("regex", "queued") not in backend._cache  # a retry compiles anew
    backend._pool.close()


def test_pool_under_random_load_settles_every_job_within_its_caps():
    """Jobs of random length (some over budget), callers leaving at random: every future ends
    (result, budget error or cancelled), and threads never exceed the caps."""
    rng = random.Random(0)
    pool = CompilePool(0.05, num_threads=2, max_threads=4)
    lock, running, peak = threading.Lock(), [0], [0]

    def work(seconds: float) -> float:
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        time.sleep(seconds)
        with lock:
            running[0] -= 1
        return seconds

    jobs = []
    for _ in range(150):
        seconds = rng.choice([0.0, 0.002, 0.01, 0.1])
        job = pool.submit(lambda s=seconds: work(s), lambda started: TimeoutError(started))
        jobs.append(job)
        if rng.random() < 0.3:
            pool.leave(job)
        time.sleep(rng.random() * 0.003)
    kinds = collections.Counter()
    for job in jobs:
        if job.future.cancelled():
            kinds["dropped"] += 1
            continue
        error = job.future.exception(timeout=5)
        assert error is None or isinstance(error, TimeoutError), error
        kinds["late" if error is not None else "done"] += 1
    assert set(kinds) == {"dropped", "late", "done"}, kinds  # every path was taken
    assert peak[0] <= 4
    wait_until(lambda: running[0] == 0 and pool.num_fresh() == 0, timeout=5)
    pool.close()


@pytest.mark.parametrize("params, name, says", [
    ({"regex": "a" * (MAX_GRAMMAR_CHARS + 1)}, "regex", "characters"),
    ({"ebnf": 'root ::= "' + "a" * MAX_GRAMMAR_CHARS + '"'}, "ebnf", "characters"),
    ({"choices": ["a" * 1000] * 300}, "choices", "characters"),
    ({"json_schema": {"type": "string", "description": "x" * MAX_GRAMMAR_CHARS}}, "json_schema",
     "characters"),
    ({"json_schema": json.dumps({"a": [[[[{}]]]] * 10}).replace("{}", "[" * 70 + "]" * 70)},
     "json_schema", "nested"),
])
def test_constraint_text_is_bounded(params, name, says):
    with pytest.raises(InvalidArgumentError, match=f"^{name}=.*{says}") as e:
        SamplingParams(**params)
    assert e.value.name == name


def test_deep_schema_nesting_is_bounded_but_strings_do_not_count():
    schema: dict = {"type": "string"}
    for _ in range(MAX_GRAMMAR_DEPTH // 2 + 1):
        schema = {"type": "object", "properties": {"x": schema}}
    with pytest.raises(InvalidArgumentError, match="json_schema=.*nested 6[6-9] deep"):
        SamplingParams(json_schema=schema)
    SamplingParams(json_schema={"type": "string", "pattern": "[[[[{{{{" * 20})


def test_depth_is_measured_in_linear_time_on_broken_json():
    start = time.monotonic()
    for text in ['"' + '\\"' * 100_000, '"a\\' * 60_000, '"' * 200_000]:
        with pytest.raises(InvalidArgumentError, match="json_schema"):
            SamplingParams(json_schema="[" * 100 + text)
    assert time.monotonic() - start < 1.0


def test_compiles_after_close_are_refused(backend):
    backend.close()
    with pytest.raises(EngineShutdownError):
        backend.compile(Constraint("regex", "ab"))


def test_budget_is_validated():
    with pytest.raises(InvalidArgumentError, match="grammar_compile_timeout_s"):
        EngineConfig(grammar_compile_timeout_s=0)


# -- through the engine and the server ----------------------------------------------------------
@pytest.fixture(scope="module")
def engine(make_engine):
    return make_engine()


@pytest.fixture
def engine_slow(engine, monkeypatch) -> Iterator[SlowCompiles]:
    """The shared engine with a 0.3 s budget and slow compiles of SLOW regexes."""
    grammar = engine.parts.grammar
    grammar.compile(Constraint("regex", "warm")).result()  # reads the vocabulary (~0.2 s)
    monkeypatch.setattr(grammar._pool, "timeout_s", 0.3)
    slow_compiles = SlowCompiles(grammar, monkeypatch)
    yield slow_compiles
    slow_compiles.release()
    wait_until(lambda: grammar._pool.num_fresh() == 0, timeout=10)
    assert_idle_and_clean(engine)


def test_engine_fails_the_slow_request_and_serves_its_neighbour(engine, engine_slow):
    async def both():
        slow_call = engine.async_generate("Say a.", {"regex": SLOW + "1", "max_new_tokens": 4})
        plain_call = engine.async_generate("Say a.", {"regex": "[ab]{2}", "temperature": 0})
        return await asyncio.gather(slow_call, plain_call, return_exceptions=True)

    start = time.monotonic()
    slow_result, plain_result = asyncio.run(both())
    assert isinstance(slow_result, GrammarCompileTimeoutError), slow_result
    assert "took longer than the 0.3 s budget" in str(slow_result)
    assert plain_result["text"] in {"aa", "ab", "ba", "bb"}
    assert time.monotonic() - start < 10
    with pytest.raises(GrammarCompileTimeoutError):  # the sync path too
        engine.generate("Say a.", {"regex": SLOW + "2", "max_new_tokens": 4})


def test_http_over_budget_is_400_and_a_client_that_leaves_frees_the_compile(engine,
                                                                            engine_slow):
    server = serve_in_thread(engine)
    try:
        with httpx.Client(base_url=server.base_url, timeout=30) as client:
            r = client.post("/generate", json={"text": "Say a.", "sampling_params": {
                "regex": SLOW + "3", "max_new_tokens": 4}})
            assert r.status_code == 400, r.text
            assert r.json()["error"]["param"] == "regex"
            assert "took longer than the 0.3 s budget" in r.json()["error"]["message"]
        engine.parts.grammar._pool.timeout_s = 30.0  # now the client leaves first
        with httpx.Client(base_url=server.base_url, timeout=0.5) as client, \
                pytest.raises(httpx.ReadTimeout):
            client.post("/generate", json={"text": "Say a.", "sampling_params": {
                "regex": SLOW + "4", "max_new_tokens": 4}})
        wait_until(lambda: engine.parts.grammar._pool.num_fresh() == 0, timeout=5)
        wait_until(lambda: server.app.state.service.admission.admitted == 0, timeout=5)
    finally:
        server.stop()


def deep_schema(levels: int) -> dict:
    """Objects of strings and arrays nested `levels` deep: xgrammar's compile time grows ~3x a
    level (9 levels, 59 KB: ~1.4 s on the default model's 49k vocabulary)."""
    schema: dict = {"type": "string"}
    for i in range(levels):
        schema = {"type": "object", "required": [f"k{i}"], "properties": {
            f"k{i}": schema, f"a{i}": {"type": "array", "items": schema}}}
    return schema


def test_a_really_slow_schema_fails_while_a_regex_beside_it_is_served(engine, monkeypatch):
    grammar = engine.parts.grammar
    grammar.compile(Constraint("regex", "warm")).result()  # reads the vocabulary (~0.2 s)
    monkeypatch.setattr(grammar._pool, "timeout_s", 0.05)
    # 10 levels: 0.3-4 s of compiling on a quiet machine (xgrammar and CPUs differ), so the
    # timeout is far below it and the bound below holds with margin on a loaded one (the plain
    # request alone takes ~0.3 s)
    params = SamplingParams(json_schema=deep_schema(10), max_new_tokens=4)

    async def both():
        slow_call = engine.async_generate("Some JSON:", params)
        await asyncio.sleep(0.05)  # the slow compile is running
        start = time.monotonic()
        plain = await engine.async_generate("Say a.", {"regex": "[ab]{3}", "temperature": 0})
        return await asyncio.gather(slow_call, return_exceptions=True), plain, start

    (slow_result,), plain_result, start = asyncio.run(both())
    assert time.monotonic() - start < 2.5  # not queued behind the schema (~4 s)
    assert len(plain_result["text"]) == 3
    assert isinstance(slow_result, GrammarCompileTimeoutError), slow_result
    assert str(slow_result).startswith("json_schema=")
    wait_until(lambda: grammar._pool.num_fresh() == 0)
    assert_idle_and_clean(engine)
