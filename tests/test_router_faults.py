"""Fleet faults of the --dp-size router without processes: the relay resends a request whose
replica failed before the client got a byte, a started stream ends with an error event, the
supervisor finds stuck replicas and restarts removed ones with backoff. Replicas are stand-ins
answered by an httpx.MockTransport."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from types import SimpleNamespace

import httpx
import pytest

from forklm.router.app import create_router_app
from forklm.router.policies import RoundRobin
from forklm.router.replicas import Replica, ReplicaSet
from forklm.router.routing import Router
from forklm.router.supervisor import Backoff, HealthCheck, Supervisor
from forklm.server.config import ServerConfig

SSE = {"content-type": "text/event-stream"}
ANSWER = {"text": "ok"}


def _proc(pid: int, exit_code: int | None = None) -> SimpleNamespace:
    """A stand-in Popen: poll() is exit_code (None while running)."""
    proc = SimpleNamespace(pid=pid, returncode=exit_code, killed=False)
    proc.poll = lambda: proc.returncode

    def kill() -> None:
        proc.killed, proc.returncode = True, -9

    proc.kill = kill
    return proc


class _Broken(httpx.AsyncByteStream):
    """A body that sends `chunks`, then fails as a connection to a killed process does."""

    def __init__(self, *chunks: bytes):
        self.chunks = chunks

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for chunk in self.chunks:
            yield chunk
        raise httpx.RemoteProtocolError("peer closed connection without sending complete body")


Handler = Callable[[int, httpx.Request], httpx.Response]


def _fleet(handler: Handler, exit_codes: tuple[int | None, ...] = (None, None),
           **config: object) -> tuple[httpx.AsyncClient, Router, list[int]]:
    """A router app over replicas on ports 1000+i, round robin from replica 0; handler(i,
    request) answers replica i's requests. Returns a client of the app, its Router and the
    replica index of each request the replicas got."""
    seen: list[int] = []

    def route(request: httpx.Request) -> httpx.Response:
        index = request.url.port - 1000
        seen.append(index)
        return handler(index, request)

    replicas = [Replica(i, 1000 + i, _proc(i, code)) for i, code in enumerate(exit_codes)]
    replica_set = ReplicaSet({}, len(replicas), replicas=replicas)
    router = Router(replica_set.replicas, RoundRobin(len(replicas)))
    upstream = httpx.AsyncClient(transport=httpx.MockTransport(route))
    app = create_router_app(replica_set, router, upstream,
                            ServerConfig(dp_size=len(replicas), **config))  # type: ignore[arg-type]
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://router")
    return client, router, seen


def _post(handler: Handler, body: dict, exit_codes: tuple[int | None, ...] = (-9, None),
          **config: object) -> tuple[httpx.Response, Router, list[int]]:
    async def run() -> tuple[httpx.Response, Router, list[int]]:
        client, router, seen = _fleet(handler, exit_codes, **config)
        async with client:
            return await client.post("/generate", json=body), router, seen

    return asyncio.run(run())


def _first_fails(failure: Callable[[httpx.Request], httpx.Response]) -> Handler:
    return lambda i, request: failure(request) if i == 0 else httpx.Response(200, json=ANSWER)


def _refused(request: httpx.Request) -> httpx.Response:
    raise httpx.ConnectError("connection refused", request=request)


def _cut_before_the_body(request: httpx.Request) -> httpx.Response:
    return httpx.Response(200, headers={"content-type": "application/json"}, stream=_Broken())


def _cut_mid_body(request: httpx.Request) -> httpx.Response:
    return httpx.Response(200, headers={"content-type": "application/json"},
                          stream=_Broken(b'{"te'))


@pytest.mark.parametrize("failure", [_refused, _cut_before_the_body, _cut_mid_body])
def test_a_plain_request_whose_replica_died_is_resent_to_another(failure):
    answer, router, seen = _post(_first_fails(failure), {"text": "hi"})
    assert answer.status_code == 200 and answer.json() == ANSWER, answer.text
    assert seen == [0, 1]
    dead, live = router.replicas
    assert not dead.alive and "exit code -9" in dead.death and dead.failed == 1
    assert dead.in_flight == live.in_flight == 0 and live.routed == 1


def test_a_stream_that_failed_before_its_first_chunk_is_resent():
    def handler(i: int, request: httpx.Request) -> httpx.Response:
        if i == 0:
            return httpx.Response(200, headers=SSE, stream=_Broken())
        return httpx.Response(200, headers=SSE, content=b'data: {"text": "a"}\n\ndata: [DONE]\n\n')

    answer, _, seen = _post(handler, {"text": "hi", "stream": True})
    assert answer.status_code == 200 and seen == [0, 1]
    assert answer.text == 'data: {"text": "a"}\n\ndata: [DONE]\n\n'


def test_a_started_stream_ends_with_an_error_event_naming_the_replica():
    def handler(i: int, request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, headers=SSE, stream=_Broken(b'data: {"text": "a"}\n\n',
                                                              b"data: {"))

    answer, router, seen = _post(handler, {"text": "hi", "stream": True})
    assert answer.status_code == 200 and seen == [0]  # headers and bytes sent: not resent
    events = [e for e in answer.text.split("\n\n") if e]
    assert events[0] == 'data: {"text": "a"}' and events[1] == "data: {"  # cut, then ended
    error = json.loads(events[2][len("data: "):])["error"]
    assert error["code"] == 502 and "replica 0 (pid 0" in error["message"]
    assert events[3] == "data: [DONE]" and not router.replicas[0].alive


def test_retries_are_bounded_and_can_be_disabled():
    def handler(i: int, request: httpx.Request) -> httpx.Response:
        return _cut_mid_body(request)

    three = (-9, -9, -9)
    answer, _, seen = _post(handler, {"text": "hi"}, three, retry_max_retries=1)
    assert answer.status_code == 502 and len(seen) == 2, answer.text
    assert f"replica {seen[-1]} " in answer.json()["error"]["message"]  # the last failure
    answer, _, seen = _post(handler, {"text": "hi"}, three)
    assert answer.status_code == 502 and sorted(seen) == [0, 1, 2]  # no replica left to try
    answer, _, seen = _post(_first_fails(_refused), {"text": "hi"}, disable_retries=True)
    assert answer.status_code == 502 and seen == [0]
    assert "replica 0" in answer.json()["error"]["message"]


def test_an_error_answer_is_relayed_not_retried():
    def handler(i: int, request: httpx.Request) -> httpx.Response:
        return httpx.Response(400, json={"error": {"message": "bad", "code": 400}})

    answer, _, seen = _post(handler, {"text": "hi"}, (None, None))
    assert answer.status_code == 400 and seen == [0]


def test_fleet_health_counts_live_starting_and_restarts():
    async def run() -> dict:
        client, router, _ = _fleet(lambda i, r: httpx.Response(200), (None, None, None))
        router.replicas[1].alive, router.replicas[1].starting = False, True
        router.replicas[1].restarts = 2
        router.replicas[2].alive, router.replicas[2].death = False, "gone"
        async with client:
            return (await client.get("/health")).json()

    assert asyncio.run(run()) == {"status": "ok", "replicas_alive": 1, "replicas_starting": 1,
                                  "dp_size": 3, "restarts": 2}


# ---------------------------------------------------------------- the supervisor

def test_backoff_doubles_up_to_its_cap_and_resets_after_a_healthy_spell():
    backoff = Backoff(first_s=1, max_s=5, reset_after_s=60)
    assert [backoff.next_delay(0) for _ in range(5)] == [1, 2, 4, 5, 5]
    backoff.healthy(100)
    assert backoff.next_delay(130) == 5  # died 30 s after joining: still backing off
    backoff.healthy(200)
    assert backoff.next_delay(260) == 1  # stayed healthy for a minute: a fresh start


def _supervisor(replica_set: ReplicaSet, health: Callable[[int], httpx.Response],
                **backoff: float) -> Supervisor:
    """A Supervisor whose replicas' /health (by port) answers health(port)."""
    def route(request: httpx.Request) -> httpx.Response:
        return health(request.url.port)

    client = httpx.AsyncClient(transport=httpx.MockTransport(route))
    router = Router(replica_set.replicas, RoundRobin(replica_set.dp_size))
    proxy = create_router_app(replica_set, router, client, ServerConfig()).state.proxy
    return Supervisor(replica_set, proxy, HealthCheck(0.5, 0.01, 2), 5.0, Backoff(**backoff))


def test_a_stuck_replica_is_killed_after_threshold_probes_without_an_answer():
    replica = Replica(0, 1000, _proc(7))
    replica_set = ReplicaSet({}, 1, replicas=[replica])

    def silent(port: int) -> httpx.Response:
        raise httpx.ReadTimeout("no answer")

    supervisor = _supervisor(replica_set, silent)
    first, second = (asyncio.run(supervisor.probe(replica)) for _ in range(2))
    assert first is None and "stuck: no answer to 2 health checks" in second
    assert replica_set.mark_dead(replica, second) and replica.proc.killed
    assert not replica_set.mark_dead(replica, second)  # once
    exited = Replica(1, 1001, _proc(8, 3))
    assert asyncio.run(supervisor.probe(exited)) == "process exited with 3"


def test_a_removed_replica_is_restarted_with_backoff_and_joins_once_healthy(monkeypatch):
    """Replica 0 died; its first successor exits while starting, the second answers /health
    503 (loading) then 200 and takes its place, counters carried on."""
    ports = iter([2000, 2001])
    procs = iter([_proc(20, 1), _proc(21)])
    health_answers = {2001: iter([503, 200])}
    dead = Replica(0, 1000, _proc(10, -9), alive=False, death="killed", routed=5)
    replica_set = ReplicaSet({}, 2, replicas=[dead, Replica(1, 1001, _proc(11))])
    monkeypatch.setattr(replica_set, "_spawn", lambda index: (next(ports), next(procs)))

    def health(port: int) -> httpx.Response:
        return httpx.Response(next(health_answers[port]) if port in health_answers else 200)

    supervisor = _supervisor(replica_set, health, first_s=0.01, max_s=0.04)

    async def run() -> None:
        await supervisor.check()
        assert list(supervisor.restarting) == [0]
        await asyncio.wait_for(supervisor.restarting[0], 5)

    asyncio.run(run())
    replica = replica_set.replicas[0]
    assert replica.alive and not replica.starting and replica.port == 2001
    assert replica.restarts == 2 and replica.routed == 5 and replica.last_death.endswith(
        "exited with 1 while starting")
    assert supervisor.backoffs[0].failures == 2 and not supervisor.restarting
