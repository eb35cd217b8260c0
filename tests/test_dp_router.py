"""Data parallelism (forklm/router/): the prefix tree and the policies as pure logic, then one
`forklm serve --dp-size 2` process (two replicas behind the cache-aware router) end to end."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from types import SimpleNamespace

import httpx
import pytest
from conftest import REPO_ROOT
from hypothesis import given, settings
from hypothesis import strategies as st

from forklm.router.launch import replica_flags
from forklm.router.policies import (
    POLICIES,
    CacheAware,
    CacheAwareConfig,
    RoundRobin,
    ShortestQueue,
)
from forklm.router.prefix_tree import PrefixTree
from forklm.router.prompts import MAX_KEY_CHARS, prompt_text
from forklm.router.replicas import Replica, replica_command
from forklm.router.routing import Router

# ---------------------------------------------------------------- prefix tree (property tests)

_texts = st.text(alphabet="abc", max_size=12)
_ops = st.lists(st.tuples(st.sampled_from(["insert", "match", "prune"]), _texts), max_size=40)


@settings(max_examples=300, deadline=None)
@given(ops=_ops, max_chars=st.integers(0, 30))
def test_prefix_tree_invariants_under_random_operations(ops, max_chars):
    tree, inserted = PrefixTree(max_chars), set()
    for op, text in ops:
        if op == "insert":
            tree.insert(text)
            inserted.add(text)
            assert tree.match(text) == len(text)  # just inserted: matches fully
        elif op == "match":
            matched = tree.match(text)
            assert 0 <= matched <= len(text)
            # never more than the longest common prefix with something inserted
            assert matched <= max((_lcp(text, t) for t in inserted), default=0)
        else:
            tree.prune()
            assert tree.size <= max_chars
        tree.check_invariants()


def _lcp(a: str, b: str) -> int:
    return len(os.path.commonprefix([a, b]))


def test_prefix_tree_prune_evicts_the_least_recently_used_leaf():
    tree = PrefixTree(max_chars=12)
    tree.insert("shared-old")
    tree.insert("shared-new")  # "shared-" + "old" + "new": 13 chars
    tree.match("shared-new")
    tree.prune()
    assert tree.size <= 12 and tree.match("shared-new") == 10 and tree.match("shared-old") == 7


# ---------------------------------------------------------------- policies

def test_round_robin_and_shortest_queue():
    rr = RoundRobin(3)
    assert [rr.choose("x", [0, 1, 2], [0, 0, 0]).replica for _ in range(4)] == [0, 1, 2, 0]
    assert {rr.choose("x", [0, 2], [0, 0, 0]).replica for _ in range(4)} == {0, 2}
    sq = ShortestQueue(3)
    assert sq.choose("x", [0, 1, 2], [3, 1, 2]).replica == 1
    assert sq.choose("x", [0, 2], [3, 1, 2]).replica == 2  # 1 is dead


def test_cache_aware_follows_the_prefix_while_balanced():
    policy = CacheAware(2)
    prefix = "Answer each question in one short sentence. " * 4
    first = policy.choose(prefix + "Q1", [0, 1], [0, 0])
    assert not first.cache_hit
    loads = [0, 0]
    loads[first.replica] = 5  # busier, but within balance_abs_threshold: locality wins
    for q in ("Q2", "Q3", "Q4"):
        choice = policy.choose(prefix + q, [0, 1], loads)
        assert choice == (first.replica, True)
    other = policy.choose("something else entirely", [0, 1], loads)
    assert other == (1 - first.replica, False)  # no match: the least loaded


def test_cache_aware_balances_when_loads_drift_apart():
    policy = CacheAware(2, CacheAwareConfig(balance_abs_threshold=4))
    policy.choose("shared prefix text", [0, 1], [0, 0])  # lands on 0 (tie: first)
    assert policy.choose("shared prefix text 2", [0, 1], [4, 0]) == (0, True)  # 4 - 0 not > 4
    assert policy.choose("shared prefix text 3", [0, 1], [5, 0]) == (1, False)  # 5 - 0 > 4


def test_cache_aware_threshold_and_dead_replicas():
    policy = CacheAware(2, CacheAwareConfig(cache_threshold=0.5))
    policy.choose("abcdefgh", [0, 1], [0, 0])
    assert policy.choose("abXXXXXXXXXX", [0, 1], [1, 0]).cache_hit is False  # 2/12 < 0.5
    assert policy.choose("abcdefXX", [0, 1], [1, 0]) == (0, True)  # 6/8
    policy.forget(0)
    assert policy.choose("abcdefgh", [1], [0, 0]) == (1, False)  # 0's tree is gone


def test_prompt_text_of_each_endpoint():
    assert prompt_text("/generate", {"text": ["a", "b"]}) == "a"
    assert prompt_text("/generate", {"input_ids": [[1, 2], [3]]}) == "\x00ids:1,2"
    assert prompt_text("/v1/completions", {"prompt": "p"}) == "p"
    chat = {"messages": [{"role": "system", "content": "s"},
                         {"role": "user", "content": [{"type": "text", "text": "u"}]}]}
    assert prompt_text("/v1/chat/completions", chat) == "system:s\nuser:u\n"
    anthropic = {"system": "s", "messages": chat["messages"][1:]}
    assert prompt_text("/v1/messages", anthropic) == "system:s\nuser:u\n"  # the same turns
    assert prompt_text("/v1/programs/run", {"program_text": "t"}) == "t"
    assert prompt_text("/generate", None) == prompt_text("/generate", {"text": 3}) == ""
    assert len(prompt_text("/generate", {"text": "x" * 10**6})) == MAX_KEY_CHARS  # bounded


def _fake_replicas(n: int) -> list[Replica]:
    return [Replica(i, 1000 + i, SimpleNamespace(pid=i, poll=lambda: None)) for i in range(n)]


def test_router_keeps_sessions_on_their_replica_and_forgets_dead_ones():
    replicas = _fake_replicas(2)
    router = Router(replicas, RoundRobin(2))
    router.sessions["s"] = replicas[1]
    body = {"text": "x", "session_params": {"id": "s"}}
    assert [router.pick("/generate", body).index for _ in range(3)] == [1, 1, 1]
    router.remember_response(b'{"id": "resp_0af", "object": "response"}', replicas[1])
    follow_up = {"input": "more", "previous_response_id": "resp_0af"}
    assert [router.pick("/v1/responses", follow_up).index for _ in range(3)] == [1, 1, 1]
    replicas[1].alive = False
    router.remove(replicas[1])
    assert "s" not in router.sessions and router.pick("/generate", body).index == 0
    assert not router.responses and router.pick("/v1/responses", follow_up).index == 0
    for i in range(65537):  # remembered sessions are bounded: the oldest go first
        router.remember_session(f"s{i}", replicas[0])
    assert len(router.sessions) == 65536 and "s0" not in router.sessions


def test_round_robin_spreads_a_shared_prefix_batch_that_cache_aware_keeps_together():
    prompts = [("Answer each question. " * 10) + f"Q{i}?" for i in range(8)]
    for policy, expected in ((RoundRobin(2), {0: 4, 1: 4}), (CacheAware(2), {0: 8})):
        router = Router(_fake_replicas(2), policy)
        landed: dict[int, int] = {}
        for p in prompts:
            index = router.pick("/generate", {"text": p}).index
            landed[index] = landed.get(index, 0) + 1
        assert landed == expected, policy


def test_replica_flags_share_the_cores_and_drop_the_router_flags():
    cores = len(os.sched_getaffinity(0))
    flags = replica_flags({"dtype": "float32", "disable_radix_cache": False},
                          {"port": 1, "dp_size": 2, "api_key": "k"}, 2)
    assert flags == {"dtype": "float32", "disable_radix_cache": False, "api_key": "k",
                     "num_threads": max(1, cores // 2)}
    cmd = replica_command(5, flags)
    assert cmd[cmd.index("--port") + 1] == "5" and "--no-disable-radix-cache" in cmd
    assert replica_flags({"num_threads": 3}, {}, 2)["num_threads"] == 3
    # A list flag reaches each replica as its items (every replica loads the same adapters).
    cmd = replica_command(5, {"lora_paths": ["a=/x", "/y"], "allowed_image_url_prefixes": []})
    assert cmd[cmd.index("--lora-paths"):] == ["--lora-paths", "a=/x", "/y"]
    fleet = {"retry_max_retries": 1, "disable_retries": True, "health_check_timeout_secs": 2.0,
             "health_check_interval_secs": 0.5, "health_failure_threshold": 2}
    assert replica_flags({}, fleet, 2) == {"num_threads": max(1, cores // 2)}  # the router's


# ---------------------------------------------------------------- a real dp_size=2 server

def _free_port() -> int:
    from forklm.router.replicas import free_port

    return free_port()


@pytest.fixture(scope="module")
def dp_server():
    """`forklm serve --dp-size 2` (cache_aware) on the default model in fp32; a replica that
    misses 2 health checks of 3 s is stuck (not the default 3 of 5 s: the stuck test is faster)."""
    port = _free_port()
    log = tempfile.NamedTemporaryFile("w+", prefix="dp-router-", suffix=".log")  # noqa: SIM115
    cmd = [sys.executable, "-m", "forklm", "serve", "--dp-size", "2", "--port", str(port),
           "--dtype", "float32", "--max-total-tokens", "4096", "--graceful-shutdown-s", "2",
           "--health-check-timeout-secs", "3", "--health-failure-threshold", "2"]
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, _tail(log.name)
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "router did not come up"
            time.sleep(0.3)
        yield SimpleNamespace(base=base, proc=proc, log=log.name)
    finally:
        pids = [r["pid"] for r in _replicas(base)] if proc.poll() is None else []
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, _tail(log.name)
        for pid in pids:  # the router stopped its replicas
            assert not _running(pid), f"replica {pid} left running"
        log.close()


def _tail(path: str) -> str:
    with open(path) as f:
        return f.read()[-3000:]


def _replicas(base: str) -> list[dict]:
    return httpx.get(base + "/get_server_info", timeout=10).json()["replicas"]


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] != "Z"


def _wait_busy(base: str) -> list[dict]:
    """The replicas with a request in flight, once there is one."""
    deadline = time.monotonic() + 20
    while not (busy := [r for r in _replicas(base) if r["in_flight"]]):
        assert time.monotonic() < deadline, "no request in flight"
        time.sleep(0.05)
    return busy


def _routed(base: str) -> list[int]:
    return [r["routed"] for r in _replicas(base)]


def _generate(base: str, text: str, **extra) -> dict:
    body = {"text": text, "sampling_params": {"max_new_tokens": 8, "temperature": 0}, **extra}
    r = httpx.post(base + "/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.slow
def test_greedy_through_the_router_equals_a_direct_engine(dp_server, make_engine):
    engine = make_engine()
    for prompt in ("The capital of France is", "def fibonacci(n):"):
        direct = engine.generate(prompt, {"max_new_tokens": 8, "temperature": 0})
        assert _generate(dp_server.base, prompt)["output_ids"] == direct["output_ids"]


@pytest.mark.slow
def test_cache_aware_keeps_a_shared_prefix_batch_on_one_replica(dp_server):
    prefix = "Answer each question in one short sentence.\n\n" + "Q: why? A: because.\n" * 40
    before = _routed(dp_server.base)

    async def batch() -> list[dict]:
        async with httpx.AsyncClient(timeout=60) as client:
            first = await client.post(dp_server.base + "/generate", json={
                "text": prefix + "Q: 0?", "sampling_params": {"max_new_tokens": 2}})
            rest = await asyncio.gather(*(client.post(dp_server.base + "/generate", json={
                "text": prefix + f"Q: {i}?", "sampling_params": {"max_new_tokens": 2}})
                for i in range(1, 6)))
        return [r.json() for r in (first, *rest)]

    results = asyncio.run(batch())
    delta = [a - b for a, b in zip(_routed(dp_server.base), before)]
    assert sorted(delta) == [0, 6], delta
    cached = [r["meta_info"]["cached_tokens"] for r in results[1:]]
    assert min(cached) >= 0.9 * results[0]["meta_info"]["prompt_tokens"] - 10, cached
    replicas = _replicas(dp_server.base)
    assert sum(r["cache_hits"] for r in replicas) >= 5
    metrics = httpx.get(dp_server.base + "/metrics").text
    assert 'forklm_router_replica_cache_aware_hits{replica="' in metrics


@pytest.mark.slow
def test_sessions_and_programs_stay_on_one_replica(dp_server):
    import forklm as sgl

    base = dp_server.base
    sid = httpx.post(base + "/open_session", json={}).json()
    before = _routed(base)
    for text in ("apple", "zebra crossing", "42 is", "Lorem ipsum"):
        _generate(base, text, session_params={"id": sid})
    delta = [a - b for a, b in zip(_routed(base), before)]
    assert sorted(delta) == [0, 4], delta
    assert httpx.post(base + "/close_session", json={"session_id": sid}).status_code == 200
    gone = httpx.post(base + "/close_session", json={"session_id": sid})
    assert gone.status_code == 404 and sid in gone.json()["error"]["message"]

    @sgl.function
    def two_turns(s):
        s += "Name a colour: " + sgl.gen("a", max_tokens=4, temperature=0)
        s += "\nName a number: " + sgl.gen("b", max_tokens=4, temperature=0)

    before = _routed(base)
    backend = sgl.RuntimeEndpoint(base)
    try:
        state = two_turns.run(backend=backend)
        assert state["a"] is not None and state["b"] is not None  # waits for the run
    finally:
        backend.close()
    delta = [a - b for a, b in zip(_routed(base), before)]
    assert min(delta) == 0 and max(delta) >= 2, delta


@pytest.mark.slow
def test_openai_client_through_the_router(dp_server):
    import openai

    client = openai.OpenAI(base_url=dp_server.base + "/v1", api_key="unused")
    model = client.models.list().data[0].id
    chat = client.chat.completions.create(model=model, max_tokens=4, temperature=0,
                                          messages=[{"role": "user", "content": "Hi"}])
    assert chat.choices[0].message.content
    pieces = [c.choices[0].text for c in client.completions.create(
        model=model, prompt="Once upon", max_tokens=4, temperature=0, stream=True) if c.choices]
    assert len(pieces) >= 2
    first = client.responses.create(model=model, input="Hi", max_output_tokens=4)
    for _ in range(3):  # stored on one replica: follow-ups must find it
        later = client.responses.create(model=model, input="More", max_output_tokens=2,
                                        previous_response_id=first.id)
        assert later.output_text is not None
    bad = httpx.post(dp_server.base + "/v1/completions", json={"model": model, "prompt": 1})
    assert bad.status_code == 400 and bad.json()["error"]["param"]  # the replica's own 400
    huge = httpx.post(dp_server.base + "/generate", content=b" " * (8 * 2**20 + 1),
                      headers={"content-type": "application/json"})
    assert huge.status_code == 413 and "max_request_body_bytes" in huge.text  # the router's


@pytest.mark.slow
def test_abort_request_reaches_the_replica_running_the_rid(dp_server):
    base, answers = dp_server.base, []

    def long_request() -> None:
        body = {"text": "Count to a thousand:", "rid": "abort-me",
                "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}}
        answers.append(httpx.post(base + "/generate", json=body, timeout=60))

    thread = threading.Thread(target=long_request)
    thread.start()
    _wait_busy(base)
    assert httpx.post(base + "/abort_request", json={"rid": "abort-me"}).status_code == 200
    thread.join(timeout=30)
    assert answers[0].json()["meta_info"]["finish_reason"]["type"] == "abort", answers[0].text


@pytest.mark.slow
def test_a_client_that_goes_away_frees_the_replica(dp_server):
    body = {"text": "Write a very long essay.", "sampling_params": {"max_new_tokens": 3000,
                                                                    "ignore_eos": True}}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(dp_server.base + "/generate", json=body, timeout=1.5)
    deadline = time.monotonic() + 15
    while any(r["in_flight"] or r["internal_state"]["running"] for r in _replicas(dp_server.base)):
        assert time.monotonic() < deadline, _replicas(dp_server.base)
        time.sleep(0.1)


@pytest.mark.slow
def test_a_replica_killed_under_load_loses_no_unstarted_request_and_is_restarted(dp_server):
    """SIGKILL the replica running a started stream and several plain requests: every plain
    request is answered (resent to the other replica), the stream ends with an error event
    naming the replica, and within a minute the fleet is back to two replicas serving."""
    base, events, started = dp_server.base, [], threading.Event()

    def long_stream() -> None:
        body = {"text": "Tell a long story.", "stream": True,
                "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}}
        with httpx.stream("POST", base + "/generate", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line:
                    events.append(line)
                    started.set()

    stream = threading.Thread(target=long_stream)
    stream.start()
    assert started.wait(30), "the stream did not start"
    (victim,) = _wait_busy(base)
    answers: list[httpx.Response] = []
    load = threading.Thread(target=lambda: answers.extend(asyncio.run(_load(base, 10))))
    load.start()
    deadline = time.monotonic() + 30
    while _replicas(base)[victim["index"]]["in_flight"] < 4:  # the stream and 3 plain ones
        assert time.monotonic() < deadline, _replicas(base)
        time.sleep(0.05)
    killed_at = time.monotonic()
    os.kill(victim["pid"], signal.SIGKILL)
    for thread in (stream, load):
        thread.join(timeout=120)
    assert [a.status_code for a in answers] == [200] * 10, [a.text for a in answers]
    name = f"replica {victim['index']} (pid {victim['pid']}"
    assert events[-1] == "data: [DONE]" and name in events[-2] and '"code": 502' in events[-2]
    health = _wait_fleet(base, restarts=1, deadline_s=60 - (time.monotonic() - killed_at))
    assert health["replicas_alive"] == 2 and health["replicas_starting"] == 0
    back = _replicas(base)[victim["index"]]
    assert back["alive"] and back["pid"] != victim["pid"] and back["restarts"] == 1
    # the 4 requests in flight when it was killed failed there; the 3 plain ones were resent
    assert back["failed"] >= 4 and "-9" in back["last_death"], back  # SIGKILL's exit code
    before = _routed(base)
    assert [a.status_code for a in asyncio.run(_load(base, 6, "again "))] == [200] * 6
    assert all(n > 0 for n in (a - b for a, b in zip(_routed(base), before))), _routed(base)


@pytest.mark.slow
def test_a_stuck_replica_is_killed_and_replaced(dp_server):
    """SIGSTOP a replica: the health probe (3 s deadline, 2 failures, the fixture's flags)
    finds it stuck; it is killed and restarted, and a request sent to it meanwhile is resent."""
    base = dp_server.base
    before = _wait_fleet(base, restarts=0, deadline_s=60)
    stuck = _replicas(base)[0]
    os.kill(stuck["pid"], signal.SIGSTOP)
    try:
        answers = asyncio.run(_load(base, 2))  # round the tie: one of them goes to the stuck one
        assert [a.status_code for a in answers] == [200, 200], [a.text for a in answers]
        _wait_fleet(base, restarts=before["restarts"] + 1, deadline_s=60)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(stuck["pid"], signal.SIGCONT)
    replaced = _replicas(base)[0]
    assert replaced["pid"] != stuck["pid"] and "stuck" in replaced["last_death"], replaced
    assert not _running(stuck["pid"])


async def _load(base: str, n: int, tag: str = "") -> list[httpx.Response]:
    """n plain /generate requests at once, prompts with no common prefix (cache_aware spreads
    them by load; a new tag: none with an earlier load's), long enough to be running when the
    test acts."""
    topics = ["rivers", "bread", "stars", "trains", "owls", "salt", "glass", "tides", "moss",
              "kites", "bells", "maps"]
    async with httpx.AsyncClient(timeout=120) as client:
        return list(await asyncio.gather(*(client.post(base + "/generate", json={
            "text": f"{tag}{i} {topics[i % len(topics)]}: write about them.",
            "sampling_params": {"max_new_tokens": 48, "ignore_eos": True}}) for i in range(n))))


def _wait_fleet(base: str, restarts: int, deadline_s: float) -> dict:
    """/health once every replica is alive after at least `restarts` restarts."""
    deadline = time.monotonic() + deadline_s
    while True:
        health = httpx.get(base + "/health", timeout=5).json()
        if health["replicas_alive"] == health["dp_size"] and health["restarts"] >= restarts:
            return health
        assert time.monotonic() < deadline, health
        time.sleep(0.2)


def test_dp_flags_are_validated():
    from forklm.runtime.errors import InvalidArgumentError
    from forklm.server.config import ServerConfig

    assert ServerConfig(dp_size=2).load_balance_method == "cache_aware"
    with pytest.raises(InvalidArgumentError, match="dp_size"):
        ServerConfig(dp_size=0)
    with pytest.raises(InvalidArgumentError, match="round_robin, shortest_queue, cache_aware"):
        ServerConfig(load_balance_method="random")
    for bad in ({"retry_max_retries": -1}, {"health_check_timeout_secs": 0},
                {"health_check_interval_secs": -1.0}, {"health_failure_threshold": 0}):
        with pytest.raises(InvalidArgumentError, match=next(iter(bad))):
            ServerConfig(**bad)


def test_every_load_balance_method_has_a_policy():
    from forklm.server.config import LOAD_BALANCE_METHODS

    assert tuple(POLICIES) == LOAD_BALANCE_METHODS


@pytest.mark.slow
def test_a_replica_that_cannot_start_fails_the_router_with_its_reason(tmp_path):
    cmd = [sys.executable, "-m", "forklm", "serve", "--dp-size", "2", "--port", str(_free_port()),
           "--model-path", str(tmp_path / "missing")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr
    assert "exited with 2 while starting" in done.stderr and "missing" in done.stderr
