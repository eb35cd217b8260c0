"""Engine scheduling end to end on the default model: continuous batching, retraction under KV
pressure, radix prefix reuse, cache flush, abort, streaming and n > 1."""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import pytest

from forklm.runtime.engine.engine import Engine
from tests.conftest import assert_idle_and_clean, chat_prompt

pytestmark = pytest.mark.slow

GREEDY = {"temperature": 0, "ignore_eos": True}
# Length of the long requests a short one overtakes: it needs ~5 steps, so 64 is a wide margin.
LONG_NEW = 64
# Varied words, so that prompts built from them tokenize to about one token per word.
WORDS = [
    "river", "stone", "lantern", "orange", "quiet", "mountain", "paper", "silver", "window",
    "garden", "thunder", "violet", "candle", "forest", "harbor", "marble", "saddle", "copper",
    "meadow", "pebble", "falcon", "canyon", "velvet", "ember", "glacier", "orchard", "tulip",
    "beacon", "compass", "lagoon",
]


def word_text(seed: int, num_words: int) -> str:
    return " ".join(WORDS[(seed * 7 + j * (seed % 5 + 1)) % len(WORDS)] for j in range(num_words))


class StreamConsumer(threading.Thread):
    """Consumes one streamed request in a thread; `started` is set once its first token arrived."""

    def __init__(self, engine: Engine, prompt: str, params: dict, rid: str | None = None):
        super().__init__(daemon=True)
        self.engine, self.prompt, self.params, self.rid = engine, prompt, params, rid
        self.started = threading.Event()
        self.chunks: list[dict] = []
        self.finished_at = 0.0

    def run(self) -> None:
        for chunk in self.engine.generate(self.prompt, self.params, stream=True, rid=self.rid):
            self.chunks.append(chunk)
            self.started.set()
        self.finished_at = time.perf_counter()

    @property
    def output_ids(self) -> list[int]:
        return [t for c in self.chunks for t in c["output_ids"]]

    @property
    def finish_reason(self) -> dict:
        return self.chunks[-1]["meta_info"]["finish_reason"]


def test_short_request_joins_running_batch(make_engine, tokenizer):
    engine = make_engine()
    short_prompt = chat_prompt(tokenizer, "Name a color.")
    short_params = {**GREEDY, "max_new_tokens": 5}
    solo = engine.generate(short_prompt, short_params)

    long_params = {**GREEDY, "max_new_tokens": LONG_NEW}
    longs = [StreamConsumer(engine, chat_prompt(tokenizer, q), long_params)
             for q in ("Tell me a story.", "Describe the ocean.", "Explain gravity.")]
    for c in longs:
        c.start()
    for c in longs:
        assert c.started.wait(120), "a long request never produced its first token"
    assert engine.stats()["running"] == 3

    short = engine.generate(short_prompt, short_params)
    short_done = time.perf_counter()
    long_tokens_then = [len(c.output_ids) for c in longs]
    for c in longs:
        c.join(300)

    assert short["output_ids"] == solo["output_ids"]
    assert short["meta_info"]["finish_reason"] == {"type": "length", "length": 5}
    assert all(n < LONG_NEW for n in long_tokens_then), long_tokens_then
    assert all(c.finished_at > short_done for c in longs)
    for c in longs:
        assert len(c.output_ids) == LONG_NEW
        assert c.finish_reason == {"type": "length", "length": LONG_NEW}
    assert_idle_and_clean(engine)


def test_retraction_keeps_outputs(make_engine, tokenizer, caplog):
    # 6 x (~58 prompt + 32 new) tokens need ~540 KV slots; 300 slots, with a low reserve for
    # future tokens (conservativeness 0.3), admit 4 at once, and their growth forces retraction.
    prompts = [f"Note {i}: " + word_text(i, 48) for i in range(6)]
    assert all(50 <= len(tokenizer.encode(p)) <= 70 for p in prompts)
    params = {**GREEDY, "max_new_tokens": 32}
    roomy = make_engine().generate(prompts, params)

    tight = make_engine(max_total_tokens=300, schedule_conservativeness=0.3)
    with caplog.at_level(logging.INFO, logger="forklm.runtime.scheduling.scheduler"):
        results = tight.generate(prompts, params)

    assert any("retracted" in r.getMessage() for r in caplog.records), "no retraction happened"
    assert [r["meta_info"]["finish_reason"] for r in results] == [
        {"type": "length", "length": 32}] * 6
    assert [r["output_ids"] for r in results] == [r["output_ids"] for r in roomy]
    assert [r["text"] for r in results] == [r["text"] for r in roomy]
    assert_idle_and_clean(tight)


@pytest.fixture(scope="module")
def shared_prefix_prompts(tokenizer) -> tuple[list[str], int]:
    """16 prompts: one ~300-token shared prefix plus distinct suffixes; and the shared length."""
    prefix = "Background. " + " ".join(word_text(s, 30) + "." for s in range(10))
    prompts = [f"{prefix}\nQuestion {i}: what does {WORDS[i]} mean?" for i in range(16)]
    ids = [tokenizer.encode(p, add_special_tokens=False) for p in prompts]
    shared = 0
    while all(len(x) > shared and x[shared] == ids[0][shared] for x in ids):
        shared += 1
    assert shared >= 300
    return prompts, shared


def test_shared_prefix_is_reused(make_engine, shared_prefix_prompts):
    prompts, shared = shared_prefix_prompts
    params = {"temperature": 0, "max_new_tokens": 8}
    engine = make_engine()
    assert engine.flush_cache()
    hits_before = engine.stats()["cache_hit_tokens"]
    results = engine.generate(prompts, params)

    cached = [r["meta_info"]["cached_tokens"] for r in results]
    assert cached[0] == 0
    assert all(c >= 0.9 * shared for c in cached[1:]), (cached, shared)
    assert engine.stats()["cache_hit_tokens"] - hits_before == sum(cached)
    assert all(r["meta_info"]["finish_reason"]["type"] in ("stop", "length") for r in results)
    assert_idle_and_clean(engine)

    # Without the cache every prompt is computed in full (4 of them: ~320 tokens each is slow).
    no_cache = make_engine(disable_radix_cache=True)
    uncached = no_cache.generate(prompts[:4], params)
    assert [r["meta_info"]["cached_tokens"] for r in uncached] == [0] * 4
    assert [r["output_ids"] for r in uncached] == [r["output_ids"] for r in results[:4]]
    assert no_cache.stats()["kv_cached"] == 0
    assert_idle_and_clean(no_cache)


def test_flush_cache_drops_prefixes(make_engine, tokenizer):
    engine = make_engine()
    prompt = chat_prompt(tokenizer, "Why is the sky blue? " + word_text(3, 20))
    params = {**GREEDY, "max_new_tokens": 2}
    engine.generate(prompt, params)
    again = engine.generate(prompt, params)
    assert again["meta_info"]["cached_tokens"] > 0

    assert engine.flush_cache() is True
    assert engine.stats()["kv_cached"] == 0
    after = engine.generate(prompt, params)
    assert after["meta_info"]["cached_tokens"] == 0
    assert after["output_ids"] == again["output_ids"]
    assert_idle_and_clean(engine)


def test_abort_running_request(make_engine, tokenizer):
    engine = make_engine()
    other_prompt = chat_prompt(tokenizer, "Count from one to ten.")
    other_params = {**GREEDY, "max_new_tokens": 24}
    solo = engine.generate(other_prompt, other_params)

    long = StreamConsumer(engine, chat_prompt(tokenizer, "Write a long essay."),
                          {**GREEDY, "max_new_tokens": 400}, rid="long-to-abort")
    other = StreamConsumer(engine, other_prompt, other_params)
    long.start(), other.start()
    assert long.started.wait(120) and other.started.wait(120)
    assert engine.flush_cache() is False  # refused while requests are in flight
    engine.abort("long-to-abort")
    long.join(60), other.join(120)

    assert long.finish_reason["type"] == "abort"
    assert len(long.output_ids) < 400
    assert long.chunks[-1]["meta_info"]["id"] == "long-to-abort"
    assert other.output_ids == solo["output_ids"]
    assert other.finish_reason == {"type": "length", "length": 24}
    engine.abort("long-to-abort")  # aborting a finished request is a no-op
    assert_idle_and_clean(engine)


def test_streaming_matches_generate(make_engine, tokenizer):
    engine = make_engine()
    prompt = chat_prompt(tokenizer, "Say hello in French, Spanish and Japanese.")
    params = {"temperature": 0, "max_new_tokens": 32}
    whole = engine.generate(prompt, params)

    chunks = list(engine.generate(prompt, params, stream=True))
    assert len(chunks) > 1
    assert "".join(c["text"] for c in chunks) == whole["text"]
    assert [t for c in chunks for t in c["output_ids"]] == whole["output_ids"]
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    assert chunks[-1]["meta_info"]["finish_reason"] == whole["meta_info"]["finish_reason"]

    async def collect() -> list[dict]:
        stream = await engine.async_generate(prompt, params, stream=True)
        return [c async for c in stream]

    async_chunks = asyncio.run(collect())
    assert "".join(c["text"] for c in async_chunks) == whole["text"]
    assert async_chunks[-1]["meta_info"]["finish_reason"] == whole["meta_info"]["finish_reason"]

    async def both() -> list[dict]:
        return await asyncio.gather(engine.async_generate(prompt, params),
                                    engine.async_generate(prompt, params))

    assert [r["text"] for r in asyncio.run(both())] == [whole["text"]] * 2
    assert_idle_and_clean(engine)


def test_n_samples(make_engine, tokenizer):
    engine = make_engine()
    prompt = chat_prompt(tokenizer, "Write a sentence about cats.")
    params = {"n": 2, "temperature": 0.8, "seed": 7, "max_new_tokens": 16, "ignore_eos": True}
    results = engine.generate(prompt, params)

    assert isinstance(results, list) and len(results) == 2
    assert all(r["meta_info"]["completion_tokens"] == 16 for r in results)
    assert len({r["meta_info"]["id"] for r in results}) == 2
    assert results[0]["output_ids"] != results[1]["output_ids"]
    again = engine.generate(prompt, params)  # seeded: reproducible
    assert [r["output_ids"] for r in again] == [r["output_ids"] for r in results]
    assert_idle_and_clean(engine)


def test_n_samples_stream_with_their_index(make_engine, tokenizer):
    engine = make_engine()
    prompt = chat_prompt(tokenizer, "Write a sentence about cats.")
    params = {"n": 2, "temperature": 0.8, "seed": 7, "max_new_tokens": 16, "ignore_eos": True}
    results = engine.generate(prompt, params)
    chunks = list(engine.generate(prompt, params, stream=True))
    for i, result in enumerate(results):
        mine = [c for c in chunks if c["index"] == i]
        assert [t for c in mine for t in c["output_ids"]] == result["output_ids"]
        assert "".join(c["text"] for c in mine) == result["text"]
        assert mine[-1]["meta_info"]["finish_reason"] == result["meta_info"]["finish_reason"]
        assert all(c["meta_info"]["finish_reason"] is None for c in mine[:-1])
    assert {c["index"] for c in chunks} == {0, 1}
    assert_idle_and_clean(engine)


def generate_or_abort(engine: Engine, prompt: str, params: dict, timeout_s: float) -> dict:
    """generate(), but a request still unfinished after timeout_s is aborted and the test fails
    (instead of hanging the suite)."""
    rid = f"bounded-{time.monotonic_ns()}"

    async def run() -> dict:
        return await asyncio.wait_for(engine.async_generate(prompt, params, rid=rid), timeout_s)

    try:
        return asyncio.run(run())
    except TimeoutError:
        engine.abort(rid)
        pytest.fail(f"the request did not finish within {timeout_s} s")


def test_lone_request_starts_although_its_reserve_exceeds_the_pool(make_engine, tokenizer):
    # ~30 prompt tokens + 0.7 * 60 KV slots reserved for future tokens > 48 slots. With nothing
    # else running there is no one to wait for, so it must start; the 40-token context ends it.
    engine = make_engine(max_total_tokens=48, context_length=40)
    prompt = "Note 0: " + word_text(0, 24)
    num_prompt = len(tokenizer.encode(prompt))
    assert 26 <= num_prompt <= 34
    params = {**GREEDY, "max_new_tokens": 60}
    result = generate_or_abort(engine, prompt, params, timeout_s=60)
    assert result["meta_info"]["finish_reason"] == {"type": "length", "length": 40 - num_prompt}
    assert_idle_and_clean(engine)

    # Without the context limit it runs until the pool is full, then gives up (no hang, no leak).
    engine = make_engine(max_total_tokens=48)
    result = generate_or_abort(engine, prompt, params, timeout_s=60)
    assert result["meta_info"]["finish_reason"]["type"] == "abort"
    assert "out of KV cache memory" in result["meta_info"]["finish_reason"]["message"]
    assert 0 < result["meta_info"]["completion_tokens"] < 60
    assert_idle_and_clean(engine)


def test_caller_going_away_does_not_break_the_engine(make_engine):
    # A cancelled future (wait_for timed out) and a stream whose event loop has closed make their
    # requests' sinks raise inside the engine thread; a batch neighbour must not notice.
    engine = make_engine(max_total_tokens=1024)
    params = {**GREEDY, "max_new_tokens": 12}
    solo = engine.generate("The weather today is", params)

    async def cancel_one_beside_another() -> dict:
        neighbour = asyncio.ensure_future(engine.async_generate("The weather today is", params))
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(engine.async_generate(
                "Once upon a time", {**GREEDY, "max_new_tokens": 8}), timeout=0.2)
        return await neighbour

    assert asyncio.run(cancel_one_beside_another())["output_ids"] == solo["output_ids"]

    async def read_one_chunk() -> None:
        stream = await engine.async_generate("Once upon a time", {**GREEDY, "max_new_tokens": 30},
                                             stream=True)
        async for _ in stream:
            break

    asyncio.run(read_one_chunk())  # its loop closes while the request may still be running
    assert engine.generate("The weather today is", params)["output_ids"] == solo["output_ids"]
    assert_idle_and_clean(engine)


def test_cancelled_async_generate_aborts_its_request(make_engine):
    engine = make_engine(max_total_tokens=1024)

    async def cancel() -> None:
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(engine.async_generate(
                "Once upon a time", {**GREEDY, "max_new_tokens": 200}, rid="cancelled"), 0.3)

    asyncio.run(cancel())
    try:
        deadline = time.monotonic() + 3
        while engine.stats()["running"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert engine.stats()["running"] == 0
    finally:
        engine.abort("cancelled")
        while engine.stats()["running"]:
            time.sleep(0.05)


def test_decode_build_fast_path_equals_the_general_build(make_engine, tokenizer, monkeypatch):
    """Every plain decode step's ForwardBatch and layout from ModelRunner._build_decode equal
    what the general _build makes for it: requests of different lengths decoding together, one
    joining mid-way, one wanting prompt logprobs (which takes the general path)."""
    import dataclasses

    import torch

    engine = make_engine()
    runner = engine.parts.runner
    fast, general, compared = runner._build_decode, runner._build_general, []

    def checked(batch, input_ids=None):
        fb, layout = fast(batch, input_ids)
        want_fb, want_layout = general(batch, input_ids)
        for field in dataclasses.fields(fb):
            got, want = getattr(fb, field.name), getattr(want_fb, field.name)
            if isinstance(want, torch.Tensor):
                assert got.dtype == want.dtype and torch.equal(got, want), field.name
            else:
                assert got == want, field.name
        assert layout == want_layout
        compared.append(len(batch.reqs))
        return fb, layout

    monkeypatch.setattr(runner, "_build_decode", checked)
    prompts = [chat_prompt(tokenizer, q) for q in ("Name a color.", "Count to five, slowly.",
                                                   "Write one long sentence about rivers.")]
    params = [{"temperature": 0, "max_new_tokens": n, "ignore_eos": True} for n in (6, 12, 20)]
    expected = [engine.generate(p, s)["output_ids"] for p, s in zip(prompts, params)]
    late = threading.Timer(0.05, lambda: results.append(engine.generate(
        prompts[0], params[0], return_logprob=True, logprob_start_len=0)))
    results: list = []
    late.start()
    outs = engine.generate(prompts, params)
    late.join()
    assert [o["output_ids"] for o in outs] == expected
    assert results[0]["output_ids"] == expected[0]
    assert max(compared) >= 3 and 1 in compared  # steps of the whole batch and of one alone
    assert_idle_and_clean(engine)
