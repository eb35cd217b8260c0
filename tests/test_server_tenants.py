"""A server shared by several API keys: the keys file, cache salts end to end (hits and time to
first token), salting by key, each key's share of the engine (a flood from one key against
another's single request), and what one key cannot do to another's requests."""

from __future__ import annotations

import asyncio
import json
import statistics
import threading
import time

import httpx
import pytest
from conftest import assert_idle_and_clean, serve_in_thread, wait_until
from prometheus_client.parser import text_string_to_metric_families

from forklm.runtime.errors import InvalidArgumentError
from forklm.server.config import ServerConfig
from forklm.server.errors import ApiError
from forklm.server.tenants import TenantGate, Tenants, load_api_keys

KEYS = [
    {"name": "alice", "key": "sk-alice-0123"},
    {"name": "bob", "key": "sk-bob-4567"},
    {"name": "carol", "key": "sk-carol-89ab", "max_running_requests": 1, "max_queued_requests": 1},
    {"name": "flood", "key": "sk-flood-cdef", "max_running_requests": 2},
    {"name": "solo", "key": "sk-solo-0000"},
]


def _auth(name: str) -> dict[str, str]:
    return {"Authorization": "Bearer " + next(k["key"] for k in KEYS if k["name"] == name)}


# ---------------------------------------------------------------- the keys file


@pytest.mark.parametrize("content, problem", [
    ("not json", "cannot be read as JSON"),
    (json.dumps({"keys": []}), "keys"),
    (json.dumps([{"name": "a", "key": "k"}, {"name": "a", "key": "j"}]), "share a name: 'a'"),
    (json.dumps([{"name": "a", "key": "k"}, {"name": "b", "key": "k"}]), "share a key"),
    (json.dumps([{"name": "a b", "key": "k"}]), "keys.0.name"),
    (json.dumps([{"name": "a", "key": "k", "admin": True}]), "keys.0.admin"),
    (json.dumps([{"name": "a", "key": "k", "max_running_requests": 0}]), "max_running_requests"),
])
def test_a_bad_keys_file_is_refused_naming_the_problem(tmp_path, content, problem):
    path = tmp_path / "keys.json"
    path.write_text(content)
    with pytest.raises(InvalidArgumentError, match="api_keys_file") as info:
        ServerConfig(api_keys_file=str(path))
    assert problem in str(info.value)
    with pytest.raises(InvalidArgumentError, match="cannot be read"):
        load_api_keys(str(tmp_path / "missing.json"))


def test_keys_authenticate_to_their_names_and_salts():
    entries = load_api_keys_from([{"name": "a", "key": "ka", "cache_salt": "team"},
                                  {"name": "b", "key": "kb"}])
    tenants = Tenants("single", entries, salt_by_key=True, max_running=None, max_queued=None,
                      retry_after_s=1)
    assert tenants.authenticate(b"ka").cache_salt(None) == "team\x1f"
    assert tenants.authenticate(b"kb").cache_salt("x") == "b\x1fx"
    assert tenants.authenticate(b"single").name == "default"
    assert tenants.authenticate(b"k") is None and tenants.authenticate(b"") is None
    unsalted = Tenants(None, entries[1:], False, None, None, 1).authenticate(b"kb")
    assert unsalted.cache_salt(None) is None and unsalted.cache_salt("x") == "x"
    with pytest.raises(InvalidArgumentError, match="default"):
        Tenants("k", load_api_keys_from([{"name": "default", "key": "x"}]), False, None, None, 1)


def load_api_keys_from(keys: list[dict]) -> list:
    from forklm.server.tenants import ApiKeyEntry

    return [ApiKeyEntry(**k) for k in keys]


# ---------------------------------------------------------------- a key's share


def test_a_gate_runs_its_share_queues_in_order_and_refuses_beyond():
    async def scenario() -> None:
        gate = TenantGate("k", max_running=2, max_queued=2)
        await gate.acquire(2)
        order: list[str] = []

        async def waiter(name: str, num: int) -> None:
            await gate.acquire(num)
            order.append(name)

        first = asyncio.create_task(waiter("first", 1))
        second = asyncio.create_task(waiter("second", 1))
        await asyncio.sleep(0)
        assert (gate.running, gate.queued) == (2, 2)
        with pytest.raises(ApiError) as full:
            await gate.acquire(1)
        assert full.value.status == 429 and "'k'" in full.value.message
        with pytest.raises(ApiError) as never:
            await gate.acquire(3)
        assert never.value.status == 400
        gate.release(1)
        await first
        assert order == ["first"] and (gate.running, gate.queued) == (2, 1)
        second.cancel()  # a client gone while queued leaves the line
        with pytest.raises(asyncio.CancelledError):
            await second
        assert (gate.running, gate.queued) == (2, 0)
        gate.release(2)
        assert gate.running == 0
        unbounded = TenantGate("u", None, None)
        await unbounded.acquire(100)
        unbounded.release(100)

    asyncio.run(scenario())


# ---------------------------------------------------------------- a real shared server

PREFIX = "Here is a long shared document that every request starts with. " * 60


@pytest.fixture(scope="module")
def server(make_engine, tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "keys.json"
    path.write_text(json.dumps({"keys": KEYS}))
    server = serve_in_thread(make_engine(), api_keys_file=str(path), cache_salt_by_key=True)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def open_server(live_server):
    return live_server  # no keys: one tenant, salts from the requests only


def _generate(base: str, text: str, key: str | None = None, **fields) -> tuple[dict, float]:
    """The result of a one-token greedy /generate and its latency (~ the time to first token)."""
    body = {"text": text, "sampling_params": {"max_new_tokens": 1, "temperature": 0}, **fields}
    start = time.perf_counter()
    r = httpx.post(base + "/generate", json=body, headers=_auth(key) if key else None,
                   timeout=120)
    elapsed = time.perf_counter() - start
    assert r.status_code == 200, r.text
    return r.json(), elapsed


@pytest.mark.slow
def test_two_salts_share_no_prefix_and_time_to_first_token_shows_none(open_server):
    base = open_server.base_url
    text = PREFIX + "Question one?"
    first, uncached_s = _generate(base, text, cache_salt="salt-a")
    n = first["meta_info"]["prompt_tokens"]
    assert n > 600 and first["meta_info"]["cached_tokens"] == 0
    other, other_s = _generate(base, text, cache_salt="salt-b")
    assert other["meta_info"]["cached_tokens"] == 0
    unsalted, _ = _generate(base, text)
    assert unsalted["meta_info"]["cached_tokens"] == 0
    again, hit_s = _generate(base, text, cache_salt="salt-a")
    assert again["meta_info"]["cached_tokens"] == n - 1
    # the other salt waited as long as a cold prompt does, the same salt a fraction of it
    assert other_s > 0.5 * uncached_s and hit_s < 0.5 * other_s, (uncached_s, other_s, hit_s)
    chat = {"model": open_server.engine.config.model_path, "max_tokens": 1,
            "messages": [{"role": "user", "content": PREFIX}]}
    usages = [httpx.post(base + "/v1/chat/completions", json={**chat, "cache_salt": salt},
                         timeout=120).json()["usage"] for salt in ("c", "d", "c")]
    cached = [u.get("prompt_tokens_details", {}).get("cached_tokens", 0) for u in usages]
    assert cached[0] == cached[1] == 0 and cached[2] > 600
    assert_idle_and_clean(open_server.engine)


@pytest.mark.slow
def test_keys_are_checked_and_salted_apart(server):
    base = server.base_url
    assert httpx.post(base + "/generate", json={"text": "Hi"}).status_code == 401
    wrong = {"Authorization": "Bearer sk-nobody"}
    assert httpx.post(base + "/generate", json={"text": "Hi"}, headers=wrong).status_code == 401
    text = PREFIX + "Keys."
    alice, _ = _generate(base, text, "alice")
    bob, _ = _generate(base, text, "bob")
    assert alice["meta_info"]["cached_tokens"] == bob["meta_info"]["cached_tokens"] == 0
    # the same request salt under two keys is still two namespaces
    _generate(base, text, "alice", cache_salt="shared")
    assert _generate(base, text, "bob", cache_salt="shared")[0]["meta_info"]["cached_tokens"] == 0
    again, _ = _generate(base, text, "alice")
    assert again["meta_info"]["cached_tokens"] == again["meta_info"]["prompt_tokens"] - 1
    metrics = httpx.get(base + "/metrics", headers=_auth("alice")).text
    counts = {s.labels["key"]: s.value for f in text_string_to_metric_families(metrics)
              for s in f.samples if s.name == "forklm_key_requests_total"}
    assert counts["alice"] >= 3 and counts["bob"] >= 2
    assert_idle_and_clean(server.engine)


@pytest.mark.slow
def test_one_key_cannot_abort_or_continue_another_keys_requests(server):
    base = server.base_url
    result: list[dict] = []
    long = {"text": "Tell me a story.", "rid": "alice-story",
            "sampling_params": {"max_new_tokens": 30, "ignore_eos": True}}
    thread = threading.Thread(target=lambda: result.append(httpx.post(
        base + "/generate", json=long, headers=_auth("alice"), timeout=120).json()))
    thread.start()
    deadline = time.monotonic() + 20
    while server.engine.stats()["running"] == 0:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    r = httpx.post(base + "/abort_request", json={"rid": "alice-story"}, headers=_auth("bob"))
    assert r.status_code == 200
    thread.join(timeout=120)
    assert result[0]["meta_info"]["finish_reason"]["type"] == "length"
    model = server.engine.config.model_path
    first = httpx.post(base + "/v1/responses", headers=_auth("alice"), timeout=60,
                       json={"model": model, "input": "Hello", "max_output_tokens": 2}).json()
    follow = {"model": model, "input": "More", "max_output_tokens": 2,
              "previous_response_id": first["id"]}
    theirs = httpx.post(base + "/v1/responses", json=follow, headers=_auth("bob"), timeout=60)
    assert theirs.status_code == 400 and "not found" in theirs.json()["error"]["message"]
    assert httpx.post(base + "/v1/responses", json=follow, headers=_auth("alice"),
                      timeout=60).status_code == 200


@pytest.mark.slow
def test_a_key_over_its_share_waits_then_gets_429(server):
    base, answers = server.base_url, []
    body = {"text": "Count slowly.", "sampling_params": {"max_new_tokens": 40, "ignore_eos": True}}

    def send() -> None:
        answers.append(httpx.post(base + "/generate", json=body, headers=_auth("carol"),
                                  timeout=120))

    threads = [threading.Thread(target=send) for _ in range(3)]
    for t in threads:
        t.start()
        time.sleep(0.3)  # in order: running, queued, refused
    for t in threads:
        t.join(timeout=120)
    statuses = sorted(a.status_code for a in answers)
    assert statuses == [200, 200, 429], [a.text for a in answers]
    refused = next(a for a in answers if a.status_code == 429)
    assert "carol" in refused.json()["error"]["message"] and refused.headers["Retry-After"]
    assert server.app.state.service.tenants.gates["carol"].running == 0


@pytest.mark.slow
def test_a_flood_from_one_key_costs_another_key_no_more_than_two_neighbours(server):
    """The flood key's share is 2 running requests: ten flooding threads slow another key's
    request no more than two ordinary neighbours do (without the share they would batch all
    ten beside it: 3.1-3.4x its idle latency, against 1.1-1.3x measured with it on an Intel
    AVX-512 machine). Compared with two neighbours measured on the same machine, not with a
    fixed factor of the idle latency: how much two neighbours cost depends on the CPU."""
    base = server.base_url
    solo = {"text": "Name three colours.",
            "sampling_params": {"max_new_tokens": 24, "ignore_eos": True, "temperature": 0}}

    def solo_latency() -> float:
        start = time.perf_counter()
        r = httpx.post(base + "/generate", json=solo, headers=_auth("solo"), timeout=120)
        assert r.status_code == 200, r.text
        return time.perf_counter() - start

    def beside(key: str, threads: int, queued: int) -> tuple[float, list[int]]:
        """solo's median latency while `threads` threads of `key` keep sending long requests
        (once `queued` of them wait behind the key's share)."""
        stop, answers = threading.Event(), []

        def send() -> None:
            with httpx.Client(timeout=300) as client:
                while not stop.is_set():
                    answers.append(client.post(base + "/generate", headers=_auth(key), json={
                        "text": "Write a long essay.",
                        "sampling_params": {"max_new_tokens": 30, "ignore_eos": True}}
                    ).status_code)

        workers = [threading.Thread(target=send) for _ in range(threads)]
        for t in workers:
            t.start()
        try:
            deadline = time.monotonic() + 30
            gate = server.app.state.service.tenants.gates[key]
            while gate.running < min(threads, 2) or gate.queued < queued:
                assert time.monotonic() < deadline, f"{key}'s requests never started"
                time.sleep(0.05)
            return statistics.median(solo_latency() for _ in range(3)), answers
        finally:
            stop.set()
            for t in workers:
                t.join(timeout=300)

    solo_latency()  # warm
    idle = statistics.median(solo_latency() for _ in range(3))
    two, _ = beside("bob", 2, 0)
    flooded, answers = beside("flood", 10, 8)
    assert flooded <= 1.5 * two, (idle, two, flooded)
    assert answers and set(answers) == {200}
    assert_idle_and_clean(server.engine)


def test_the_router_matches_prompts_within_their_salt():
    """--dp-size's cache-aware routing keys a salted request inside its salt (the request's
    within its key's, as the replicas combine them): another salt's prompts never attract it."""
    from forklm.router.prompts import prompt_text

    body = {"text": "a shared prompt"}
    plain = prompt_text("/generate", body)
    salted = {prompt_text("/generate", {**body, "cache_salt": "s"}),
              prompt_text("/generate", body, key_salt="k"),
              prompt_text("/generate", {**body, "cache_salt": "s"}, key_salt="k"),
              prompt_text("/generate", {**body, "cache_salt": "t"})}
    assert plain == "a shared prompt" and len(salted) == 4
    assert all(not key.startswith(plain) and key.endswith(plain) for key in salted)


@pytest.mark.slow
def test_each_keys_sessions_are_its_own(server):
    base = server.base_url
    pins = server.engine.parts.kv.pins
    opened = httpx.post(base + "/open_session", json={"session_id": "s1"}, headers=_auth("alice"))
    assert opened.status_code == 200 and opened.json() == "s1"
    assert "alice\x1fs1" in pins.sessions and "s1" not in pins.sessions
    closing = httpx.post(base + "/close_session", json={"session_id": "s1"}, headers=_auth("bob"))
    assert closing.status_code == 404  # bob has no session s1, and cannot close alice's
    theirs = httpx.post(base + "/open_session", json={"session_id": "s1"}, headers=_auth("bob"))
    assert theirs.status_code == 200 and "bob\x1fs1" in pins.sessions
    fresh = httpx.post(base + "/open_session", json={}, headers=_auth("bob")).json()
    assert f"bob\x1f{fresh}" in pins.sessions
    _generate(base, "Pinned for alice.", "alice", session_params={"id": "s1"})
    wait_until(lambda: bool(pins.sessions["alice\x1fs1"].pins), 10)  # pinned as it is released
    assert not pins.sessions["bob\x1fs1"].pins
    for key, sid in (("alice", "s1"), ("bob", "s1"), ("bob", fresh)):
        r = httpx.post(base + "/close_session", json={"session_id": sid}, headers=_auth(key))
        assert r.status_code == 200, r.text
    assert not any(k.startswith(("alice\x1f", "bob\x1f")) for k in pins.sessions)
