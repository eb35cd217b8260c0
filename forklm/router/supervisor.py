"""Supervisor: keeps the fleet at --dp-size. It probes every live replica's /health with a
deadline (a replica that gives no answer several times in a row is stuck: it is killed), and
restarts each removed replica with backoff; a replacement takes traffic once /health says 200."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass

import httpx

from forklm.router.proxy import Proxy
from forklm.router.replicas import Replica, ReplicaSet
from forklm.server.config import ServerConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class HealthCheck:
    """sgl-router's health-check knobs. A 503 ("busy") is an answer: only silence counts."""

    timeout_s: float
    interval_s: float
    failure_threshold: int

    @classmethod
    def of(cls, config: ServerConfig) -> HealthCheck:
        return cls(config.health_check_timeout_secs, config.health_check_interval_secs,
                   config.health_failure_threshold)


@dataclass
class Backoff:
    """Delays before restarting one replica index: first_s, doubling per failed start up to
    max_s; back to first_s once a replacement has stayed healthy for reset_after_s (so a replica
    that crashes soon after each start is not restarted in a tight loop)."""

    first_s: float = 1.0
    max_s: float = 30.0
    reset_after_s: float = 60.0
    failures: int = 0  # starts since the last one that stayed healthy
    healthy_since: float | None = None

    def next_delay(self, now: float) -> float:
        """The wait before the next start (counting it as one more failure until healthy)."""
        if self.healthy_since is not None and now - self.healthy_since >= self.reset_after_s:
            self.failures = 0
        self.healthy_since = None
        delay = min(self.max_s, self.first_s * 2 ** self.failures)
        self.failures += 1
        return delay

    def healthy(self, now: float) -> None:
        self.healthy_since = now


class Supervisor:
    """`run` until cancelled: each interval, probe the live replicas and start a restart task
    for each removed one without one. Cancelling it cancels the restarts (a replica already
    spawned is in the ReplicaSet, so ReplicaSet.stop ends it)."""

    def __init__(self, replica_set: ReplicaSet, proxy: Proxy, health: HealthCheck,
                 startup_timeout_s: float, backoff: Backoff | None = None):
        self.replica_set, self.proxy, self.health = replica_set, proxy, health
        self.startup_timeout_s = startup_timeout_s
        self.backoffs = [dataclasses.replace(backoff or Backoff())  # one per index
                         for _ in range(replica_set.dp_size)]
        self.restarting: dict[int, asyncio.Task[None]] = {}  # index -> its restart

    async def run(self) -> None:
        try:
            while True:
                await asyncio.sleep(self.health.interval_s)
                await self.check()
        finally:
            for task in list(self.restarting.values()):
                task.cancel()

    async def check(self) -> None:
        """One round: stuck or exited replicas leave routing; removed ones get restarted."""
        live = self.replica_set.alive()
        reasons = await asyncio.gather(*(self.probe(r) for r in live))
        for replica, reason in zip(live, reasons):
            if reason is not None:
                self.proxy.remove(replica, reason)
        for replica in self.replica_set.replicas:
            if replica.death is not None and replica.index not in self.restarting:
                self.restarting[replica.index] = asyncio.create_task(self.restart(replica))

    async def probe(self, replica: Replica) -> str | None:
        """One liveness check; the reason it is dead (or stuck), or None."""
        code = replica.proc.poll()
        if code is not None:
            return f"process exited with {code}"
        try:
            await self.proxy.client.get(replica.url + "/health", headers=self.replica_set.headers,
                                        timeout=self.health.timeout_s)
            replica.probe_failures = 0
        except httpx.HTTPError as e:
            replica.probe_failures += 1
            if replica.probe_failures >= self.health.failure_threshold:
                return (f"stuck: no answer to {replica.probe_failures} health checks within "
                        f"{self.health.timeout_s:g} s ({type(e).__name__})")
        return None

    async def restart(self, removed: Replica) -> None:
        """Start successors of `removed` until one is healthy, backing off between starts; it
        then joins routing with an empty policy state (removal forgot the old one's)."""
        try:
            await self._restart(removed)
        finally:
            self.restarting.pop(removed.index, None)

    async def _restart(self, removed: Replica) -> None:
        backoff = self.backoffs[removed.index]
        while True:
            delay = backoff.next_delay(time.monotonic())
            logger.warning("restarting replica %d in %g s (attempt %d): %s", removed.index,
                           delay, backoff.failures, removed.death)
            await asyncio.sleep(delay)
            replica = self.replica_set.respawn(removed)
            try:
                await asyncio.wait_for(self.replica_set.wait_healthy(self.proxy.client, replica),
                                       self.startup_timeout_s)
            except (RuntimeError, TimeoutError) as e:
                self.replica_set.mark_dead(replica, str(e) or "no /health 200 in time")
                removed = replica
                continue
            replica.alive, replica.starting = True, False
            backoff.healthy(time.monotonic())
            logger.warning("%s is healthy and back in routing", replica.name)
            return
