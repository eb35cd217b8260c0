"""Replica processes: each a `forklm serve` child on a loopback port with its own engine, radix
cache and share of the CPU threads; started together, watched, and stopped with the router."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
from dataclasses import dataclass, field
from typing import Any

import httpx

from forklm.runtime.child_process import forklm_command, free_port
from forklm.runtime.cpu_threads import sleeping_threads_env

logger = logging.getLogger(__name__)
# Consecutive failed health probes (no answer at all; a 503 "busy" is an answer) before a replica
# that still runs is declared dead and killed, so its in-flight requests fail instead of hanging.
_MAX_PROBE_FAILURES = 3


@dataclass(eq=False)
class Replica:
    index: int
    port: int
    proc: subprocess.Popen
    alive: bool = True
    death: str | None = None  # why it was removed
    in_flight: int = 0  # requests the router sent and has not finished relaying
    routed: int = 0
    cache_hits: int = 0  # cache_aware chose it for its prefix match
    fallbacks: int = 0  # cache_aware chose it for its load
    failed: int = 0  # requests that failed because it died
    probe_failures: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def name(self) -> str:
        return f"replica {self.index} (pid {self.proc.pid}, 127.0.0.1:{self.port})"

    def counters(self) -> dict[str, Any]:
        return {"index": self.index, "pid": self.proc.pid, "port": self.port, "alive": self.alive,
                "death": self.death, "in_flight": self.in_flight, "routed": self.routed,
                "cache_hits": self.cache_hits, "fallbacks": self.fallbacks, "failed": self.failed}


def replica_threads(dp_size: int, num_threads: int | None) -> int:
    """torch threads per replica: the user's num_threads, else the cores shared evenly."""
    if num_threads:
        return num_threads
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cores or 1) // dp_size)


def replica_command(port: int, flags: dict[str, Any]) -> list[str]:
    """`python -m forklm serve` on 127.0.0.1:port with `flags` (field name -> value) as options."""
    cmd = forklm_command("serve", "--host", "127.0.0.1", "--port", str(port))
    for name, value in flags.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            cmd.append(flag if value else "--no-" + flag[2:])
        else:
            cmd += [flag, str(value)]
    return cmd


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM it when the router dies, even by SIGKILL (Linux)."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


@dataclass
class ReplicaSet:
    """The replicas; `start` spawns them, `wait_ready` waits for every /health, `watch` marks
    dead ones (calling on_death), `stop` ends them all."""

    flags: dict[str, Any]
    dp_size: int
    headers: dict[str, str] = field(default_factory=dict)  # e.g. the API key for probes
    replicas: list[Replica] = field(default_factory=list)

    def start(self) -> None:
        env = sleeping_threads_env()  # replicas share cores: no spinning
        for index in range(self.dp_size):
            port = free_port()
            proc = subprocess.Popen(replica_command(port, self.flags), env=env,
                                    preexec_fn=_die_with_parent)
            self.replicas.append(Replica(index, port, proc))
            logger.info("started replica %d: pid %d, port %d", index, proc.pid, port)

    def alive(self) -> list[Replica]:
        return [r for r in self.replicas if r.alive]

    async def wait_ready(self, client: httpx.AsyncClient, timeout_s: float) -> None:
        """Return when every replica answers /health 200; RuntimeError if one exits first."""
        await asyncio.wait_for(asyncio.gather(*(self._ready(client, r) for r in self.replicas)),
                               timeout_s)

    async def _ready(self, client: httpx.AsyncClient, replica: Replica) -> None:
        while True:
            if replica.proc.poll() is not None:
                raise RuntimeError(f"{replica.name} exited with {replica.proc.returncode} "
                                   "while starting")
            try:
                r = await client.get(replica.url + "/health", headers=self.headers, timeout=2)
                if r.status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.5)

    def mark_dead(self, replica: Replica, reason: str) -> bool:
        """Remove a replica from routing (and kill it if it still runs); False if already out."""
        if not replica.alive:
            return False
        replica.alive, replica.death = False, reason
        logger.error("%s removed from routing: %s", replica.name, reason)
        if replica.proc.poll() is None:
            replica.proc.kill()
        return True

    async def probe(self, client: httpx.AsyncClient, replica: Replica) -> str | None:
        """One liveness check; the reason it is dead, or None."""
        code = replica.proc.poll()
        if code is not None:
            return f"process exited with {code}"
        try:
            await client.get(replica.url + "/health", headers=self.headers, timeout=5)
            replica.probe_failures = 0
        except httpx.HTTPError as e:
            replica.probe_failures += 1
            if replica.probe_failures >= _MAX_PROBE_FAILURES:
                return f"no answer to {_MAX_PROBE_FAILURES} health checks ({e!r})"
        return None

    def stop(self, grace_s: float) -> None:
        """SIGTERM every replica (each finishes or aborts its requests), SIGKILL after grace_s."""
        for r in self.replicas:
            if r.proc.poll() is None:
                r.proc.terminate()
        for r in self.replicas:
            try:
                r.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                r.proc.kill()
                r.proc.wait()
