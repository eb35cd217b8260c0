"""forklm on Ray Serve (forklm/ray_serve/): Ray stays optional, then a local Ray instance with two
single-CPU engine replicas behind the ingress, routed by the cache-aware policy: W1 through it
equals one plain engine token for token and reuses its prefix on one replica; OpenAI endpoints,
streaming, sessions, errors and the fan-out endpoints through the ingress."""

from __future__ import annotations

import asyncio
import json
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # benchmarks/

from benchmarks.workloads import shared_prefix  # noqa: E402
from forklm.router.replicas import free_port  # noqa: E402

# Batch- and cache-hit-invariant logits: the replicas batch and hit their caches unlike the
# reference engine (the same config, in this process), yet must give the same greedy tokens.
ENGINE = {"dtype": "auto", "enable_deterministic_inference": True, "max_total_tokens": 4096}
GREEDY = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
REPLICA_HEADER = "x-forklm-replica"


# ---------------------------------------------------------------- Ray stays optional (fast)

def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"})


def test_ray_stays_optional():
    """Importing forklm (even forklm.ray_serve) and parsing `forklm serve` never import ray;
    `forklm serve --ray` without ray says which extra to install."""
    done = _python("import sys, forklm, forklm.cli, forklm.ray_serve\n"
                   "forklm.cli.build_parser().parse_args(['serve', '--dp-size', '2'])\n"
                   "assert 'ray' not in sys.modules, 'ray was imported'\n"
                   "sys.modules['ray'] = None  # as if ray were not installed\n"
                   "sys.exit(forklm.cli.main(['serve', '--ray']))\n")
    assert done.returncode == 2, done.stderr
    assert "pip install 'forklm[ray]'" in done.stderr, done.stderr


def test_serve_run_builds_the_app_from_serve_flags():
    """`serve run forklm.ray_serve:app dp-size=2 ...` reads `forklm serve`'s own flags (either
    spelling, true/false switches) and refuses an unknown one, naming the arguments."""
    pytest.importorskip("ray")
    from ray.serve.deployment import Application

    from forklm.ray_serve.app import application_from_flags

    app = application_from_flags({"dp-size": 2, "max_total_tokens": 4096,
                                  "disable-radix-cache": "true"})
    assert isinstance(app, Application)
    with pytest.raises(ValueError, match="no-such-flag"):
        application_from_flags({"no-such-flag": 1})


def test_ray_health_checks_follow_the_health_check_flags():
    """Ray Serve restarts a dead or stuck replica itself: on the period and deadline given."""
    from forklm.ray_serve.app import ReplicaPlan
    from forklm.runtime.config import EngineConfig
    from forklm.server.config import ServerConfig

    plan = ReplicaPlan.of(EngineConfig(), ServerConfig(health_check_interval_secs=2,
                                                       health_check_timeout_secs=7))
    assert (plan.health_check_period_s, plan.health_check_timeout_s) == (2, 7)


def test_replica_slots_reuse_a_removed_replicas_index():
    from forklm.ray_serve.replica_slots import ReplicaSlots

    slots = ReplicaSlots(capacity=2)
    assert slots.sync(["a", "b"]) == [] and slots.index == {"a": 0, "b": 1}
    assert slots.sync(["b", "c"]) == [0] and slots.index == {"b": 1, "c": 0}
    assert slots.sync(["b", "c", "d"]) == [] and "d" not in slots.index  # no room: spill-over


# ---------------------------------------------------------------- a local Ray Serve cluster

@pytest.fixture(scope="module")
def ray_app():
    """Ray (2 CPUs, no dashboard) serving two single-CPU replicas, cache_aware, on a free port;
    shut down after the module."""
    ray = pytest.importorskip("ray")
    from ray import serve

    from forklm.ray_serve.app import build_application
    from forklm.server.config import ServerConfig

    port = free_port()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             object_store_memory=100 * 1024 * 1024)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        app = build_application({**ENGINE, "num_threads": 1},
                                ServerConfig(dp_size=2, load_balance_method="cache_aware"))
        serve.run(app, name="forklm", route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def _replica_stats(base: str) -> dict[str, dict]:
    info = httpx.get(base + "/get_server_info", timeout=60).json()
    return {r["replica"]: r["internal_state"] for r in info["replicas"]}


async def _generate_all(base: str, prompts: list[str]) -> list[httpx.Response]:
    """The first prompt alone (its prefix is then cached), the rest all at once."""
    async with httpx.AsyncClient(timeout=120) as client:
        async def one(prompt: str) -> httpx.Response:
            return await client.post(base + "/generate",
                                     json={"text": prompt, "sampling_params": GREEDY})

        first = await one(prompts[0])
        return [first, *await asyncio.gather(*(one(p) for p in prompts[1:]))]


@pytest.mark.slow
def test_w1_equals_one_engine_and_stays_on_one_replica(ray_app, make_engine):
    prompts = [r.prompt for r in shared_prefix(num_requests=6).requests]
    before = _replica_stats(ray_app)
    assert len(before) == 2
    answers = asyncio.run(_generate_all(ray_app, prompts))
    assert all(a.status_code == 200 for a in answers), [a.text for a in answers]

    engine = make_engine(**ENGINE)
    expected = [engine.generate(p, GREEDY)["output_ids"] for p in prompts]
    assert [a.json()["output_ids"] for a in answers] == expected

    # cache_aware: the shared prefix keeps every request on the replica that cached it
    assert len({a.headers[REPLICA_HEADER] for a in answers}) == 1
    after = _replica_stats(ray_app)
    sent = sum(after[r]["prompt_tokens"] - before[r]["prompt_tokens"] for r in after)
    cached = sum(after[r]["cache_hit_tokens"] - before[r]["cache_hit_tokens"] for r in after)
    assert sent == sum(a.json()["meta_info"]["prompt_tokens"] for a in answers)
    # Split over both replicas (round robin: 4 and 4), each replica's first request computes
    # the prefix: at most n-2 requests could hit it. One replica lets n-1 of them hit it.
    ids = [engine.tokenizer.encode(p) for p in prompts]
    prefix_len = max(len(os.path.commonprefix([ids[0], other])) for other in ids[1:])
    assert cached > (len(prompts) - 2) * prefix_len, (cached, prefix_len)


@pytest.mark.slow
def test_openai_endpoints_and_streaming_through_the_ingress(ray_app, make_engine):
    engine = make_engine(**ENGINE)
    r = httpx.post(ray_app + "/v1/completions", json={
        "model": "SmolLM2-135M-Instruct", "prompt": "The capital of France is",
        "max_tokens": 8, "temperature": 0}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == engine.generate(
        "The capital of France is", {"max_new_tokens": 8, "temperature": 0})["text"]

    chat = {"model": "SmolLM2-135M-Instruct", "max_tokens": 12, "temperature": 0,
            "messages": [{"role": "user", "content": "Name a colour."}]}
    whole = httpx.post(ray_app + "/v1/chat/completions", json=chat, timeout=60)
    assert whole.status_code == 200, whole.text
    with httpx.stream("POST", ray_app + "/v1/chat/completions", json={**chat, "stream": True},
                      timeout=60) as stream:
        assert stream.headers["content-type"].startswith("text/event-stream")
        events = [line for line in stream.iter_lines() if line]
    assert events[-1] == "data: [DONE]" and len(events) > 3  # streamed as it went
    deltas = [json.loads(e[len("data: "):])["choices"] for e in events[:-1]]
    text = "".join(c[0]["delta"].get("content") or "" for c in deltas if c)
    assert text == whole.json()["choices"][0]["message"]["content"]


@pytest.mark.slow
def test_a_sessions_requests_stay_on_its_replica(ray_app):
    sid = httpx.post(ray_app + "/open_session", json={}, timeout=60)
    assert sid.status_code == 200, sid.text
    served = {sid.headers[REPLICA_HEADER]}
    for text in ("apple", "zebra crossing", "42 is", "Lorem ipsum"):  # no shared prefix
        r = httpx.post(ray_app + "/generate", timeout=60, json={
            "text": text, "sampling_params": GREEDY, "session_params": {"id": sid.json()}})
        assert r.status_code == 200, r.text
        served.add(r.headers[REPLICA_HEADER])
    assert len(served) == 1, served
    close = {"session_id": sid.json()}
    assert httpx.post(ray_app + "/close_session", json=close, timeout=60).status_code == 200
    gone = httpx.post(ray_app + "/close_session", json=close, timeout=60)
    assert gone.status_code == 404 and sid.json() in gone.json()["error"]["message"]


@pytest.mark.slow
def test_bad_requests_get_a_4xx_json_error(ray_app):
    bad = [("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": -1}}),
           ("/v1/chat/completions", {"model": "SmolLM2-135M-Instruct"}),  # no messages
           ("/v1/completions", "not json")]
    for path, body in bad:
        kwargs = {"content": body} if isinstance(body, str) else {"json": body}
        r = httpx.post(ray_app + path, timeout=60, **kwargs)
        assert 400 <= r.status_code < 500, (path, r.status_code, r.text)
        assert r.json()["error"]["message"], (path, r.text)


@pytest.mark.slow
def test_server_info_metrics_and_flush_reach_every_replica(ray_app):
    stats = _replica_stats(ray_app)
    assert len(stats) == 2 and all(s is not None for s in stats.values())
    metrics = httpx.get(ray_app + "/metrics", timeout=60).text
    for replica in stats:
        assert f'forklm_replica_prompt_tokens{{replica="{replica}"}}' in metrics
    r = httpx.post(ray_app + "/flush_cache", timeout=60)
    assert r.status_code == 200 and r.json()["success"], r.text
    assert all(s["kv_cached"] == 0 for s in _replica_stats(ray_app).values())


@pytest.mark.slow
def test_a_replica_killed_under_load_loses_no_unstarted_request(ray_app):
    """Last in the module: SIGKILL the engine replica running a started stream and plain
    requests. The plain ones are resent (Ray routes them to the live replica) and answered, the
    stream ends with an error event naming its replica, and Ray Serve has two replicas running
    again within a minute."""
    from ray import serve

    events, replica, started = [], [], threading.Event()

    def long_stream() -> None:
        body = {"text": "Tell a long story.", "stream": True,
                "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}}
        with httpx.stream("POST", ray_app + "/generate", json=body, timeout=180) as r:
            replica.append(r.headers[REPLICA_HEADER])
            for line in r.iter_lines():
                if line:
                    events.append(line)
                    started.set()

    stream = threading.Thread(target=long_stream)
    stream.start()
    assert started.wait(60), "the stream did not start"
    (victim,) = replica
    answers: list[httpx.Response] = []
    load = threading.Thread(target=lambda: answers.extend(asyncio.run(_plain_load(ray_app, 8))))
    load.start()
    deadline = time.monotonic() + 60
    while (state := _replica_stats(ray_app)[victim])["running"] + state["waiting"] < 3:
        assert time.monotonic() < deadline, state  # the stream and 2 plain requests
        time.sleep(0.1)
    killed_at = time.monotonic()
    os.kill(_replica_pid(victim), signal.SIGKILL)
    for thread in (stream, load):
        thread.join(timeout=180)
    assert [a.status_code for a in answers] == [200] * 8, [a.text for a in answers]
    assert {a.headers[REPLICA_HEADER] for a in answers} - {victim}  # the other one answered
    assert events[-1] == "data: [DONE]" and victim in events[-2] and '"code": 502' in events[-2]
    while (running := _running_replicas(serve)) < 2:
        assert time.monotonic() - killed_at < 60, f"{running} replicas running"
        time.sleep(0.5)
    # Ray reports the new replica RUNNING before the ingress's handle routes to it (a fan-out
    # then reaches the one replica twice): wait for both to answer.
    while len(stats := _replica_stats(ray_app)) < 2 or victim in stats:
        assert time.monotonic() - killed_at < 60, stats
        time.sleep(0.5)
    health = httpx.get(ray_app + "/health", timeout=60)
    assert health.status_code == 200 and health.json()["replicas_alive"] == 2, health.text


async def _plain_load(base: str, n: int) -> list[httpx.Response]:
    """n plain /generate requests at once that share most of the long stream's prompt, so the
    cache-aware policy sends them where it runs (spread by load, they could all miss it)."""
    async with httpx.AsyncClient(timeout=180) as client:
        return list(await asyncio.gather(*(client.post(base + "/generate", json={
            "text": f"Tell a long story. {i}",
            "sampling_params": {"max_new_tokens": 48, "ignore_eos": True}}) for i in range(n))))


def _replica_pid(replica_id: str) -> int:
    """The process of the Ray Serve replica actor with this id (its name ends in #id)."""
    from ray._private import state  # the actor table: a debugging API, fine in a test

    (pid,) = [actor["Pid"] for actor in state.actors(actor_state_name="ALIVE").values()
              if actor["Name"].endswith("#" + replica_id)]
    return pid


def _running_replicas(serve) -> int:
    deployments = serve.status().applications["forklm"].deployments
    return deployments["forklm_engine"].replica_states.get("RUNNING", 0)
