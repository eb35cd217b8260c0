"""Replica processes: each a `forklm serve` child on a loopback port with its own engine, radix
cache and share of the CPU threads; started together, replaced one by one when removed (see
supervisor.py), and stopped with the router."""

from __future__ import annotations

import asyncio
import dataclasses
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


@dataclass(eq=False)
class Replica:
    """One replica process. Starting (not routed to) until its /health answers 200, then alive
    until removed (death says why); its replacement is a new Replica for the same index."""

    index: int
    port: int
    proc: subprocess.Popen
    alive: bool = True
    starting: bool = False
    death: str | None = None  # why it was removed
    in_flight: int = 0  # requests the router sent and has not finished relaying
    probe_failures: int = 0  # health probes in a row that got no answer
    # Since the router started, over this index's processes (a replacement carries them on):
    routed: int = 0
    cache_hits: int = 0  # cache_aware chose it for its prefix match
    fallbacks: int = 0  # cache_aware chose it for its load
    failed: int = 0  # requests that failed because it died
    restarts: int = 0  # processes started for this index after the first
    last_death: str | None = None  # why the process before this one was removed

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def name(self) -> str:
        return f"replica {self.index} (pid {self.proc.pid}, 127.0.0.1:{self.port})"

    def successor(self, port: int, proc: subprocess.Popen) -> Replica:
        """The replacement process for this index: starting, with the counters carried on."""
        return dataclasses.replace(self, port=port, proc=proc, alive=False, starting=True,
                                   death=None, in_flight=0, probe_failures=0,
                                   restarts=self.restarts + 1,
                                   last_death=self.death or self.last_death)

    def counters(self) -> dict[str, Any]:
        return {"index": self.index, "pid": self.proc.pid, "port": self.port, "alive": self.alive,
                "starting": self.starting, "death": self.death, "in_flight": self.in_flight,
                "routed": self.routed, "cache_hits": self.cache_hits,
                "fallbacks": self.fallbacks, "failed": self.failed, "restarts": self.restarts,
                "last_death": self.last_death}


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
        elif isinstance(value, (list, tuple)):  # a list flag (--lora-paths a=/x b=/y)
            if value:
                cmd += [flag, *map(str, value)]
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
    """The replicas, replicas[i] the current process of index i (a list the Router shares).
    `start` spawns them, `wait_ready` waits for every /health, `respawn` replaces a removed
    one, `mark_dead` removes one, `stop` ends them all."""

    flags: dict[str, Any]
    dp_size: int
    headers: dict[str, str] = field(default_factory=dict)  # e.g. the API key for probes
    replicas: list[Replica] = field(default_factory=list)

    def start(self) -> None:
        for index in range(self.dp_size):
            port, proc = self._spawn(index)
            self.replicas.append(Replica(index, port, proc))

    def respawn(self, replica: Replica) -> Replica:
        """Start the successor of a removed replica, in its place (starting: not routed)."""
        assert replica.death is not None and self.replicas[replica.index] is replica, replica
        successor = replica.successor(*self._spawn(replica.index))
        self.replicas[replica.index] = successor
        return successor

    def _spawn(self, index: int) -> tuple[int, subprocess.Popen]:
        port = free_port()
        proc = subprocess.Popen(replica_command(port, self.flags), env=sleeping_threads_env(),
                                preexec_fn=_die_with_parent)  # replicas share cores: no spinning
        logger.info("started replica %d: pid %d, port %d", index, proc.pid, port)
        return port, proc

    def alive(self) -> list[Replica]:
        return [r for r in self.replicas if r.alive]

    async def wait_ready(self, client: httpx.AsyncClient, timeout_s: float) -> None:
        """Return when every replica answers /health 200; RuntimeError if one exits first."""
        await asyncio.wait_for(asyncio.gather(*(self.wait_healthy(client, r)
                                                for r in self.replicas)), timeout_s)

    async def wait_healthy(self, client: httpx.AsyncClient, replica: Replica) -> None:
        """Return once `replica` answers /health 200; RuntimeError if it exits first."""
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
        """Remove a replica (alive or starting) from routing, killing it if it still runs;
        False if it was already removed."""
        if replica.death is not None:
            return False
        replica.alive, replica.starting, replica.death = False, False, reason
        logger.error("%s removed from routing: %s", replica.name, reason)
        if replica.proc.poll() is None:
            replica.proc.kill()  # SIGKILL also ends a stopped (SIGSTOP) process
        return True

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
