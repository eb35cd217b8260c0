"""The worker processes one node starts (torch.multiprocessing, spawn): each runs worker.main for
its rank. Rank 0 watches the ones on its own node: their exit is a lost worker."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING

import torch.multiprocessing as mp

if TYPE_CHECKING:
    from forklm.runtime.config import EngineConfig

logger = logging.getLogger(__name__)

# How long stop() waits for workers told to exit, before it terminates (then kills) them.
STOP_TIMEOUT_S = 10.0


@dataclass
class WorkerProcesses:
    init_addr: str  # host:port where they meet rank 0
    procs: dict[int, BaseProcess] = field(default_factory=dict)  # rank -> process

    @classmethod
    def spawn(cls, config: EngineConfig, init_addr: str, ranks: Iterable[int]) -> WorkerProcesses:
        from forklm.runtime.distributed.worker import main

        ctx = mp.get_context("spawn")  # fork would copy rank 0's threads and torch state
        workers = cls(init_addr)
        for rank in ranks:
            proc = ctx.Process(target=main, args=(rank, config, init_addr), daemon=True,
                               name=f"forklm-tp{rank}")
            proc.start()
            workers.procs[rank] = proc
        return workers

    @property
    def pids(self) -> dict[int, int | None]:
        return {rank: p.pid for rank, p in self.procs.items()}

    def exited(self, wait_s: float = 0.0) -> str:
        """Which workers have exited ("" when none), waiting up to wait_s for one to: a failed
        collective is often seen just before its peer's exit is."""
        deadline = time.monotonic() + wait_s
        while True:
            dead = [f"rank {r} (pid {p.pid}) exited with code {p.exitcode}"
                    for r, p in self.procs.items() if p.exitcode is not None]
            if dead or time.monotonic() >= deadline:
                return "; ".join(dead)
            time.sleep(0.05)

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """Wait for the workers to exit, then terminate and at last kill the ones left."""
        deadline = time.monotonic() + timeout_s
        for proc in self.procs.values():
            proc.join(max(0.0, deadline - time.monotonic()))
        for stage in ("terminate", "kill"):
            left = [p for p in self.procs.values() if p.is_alive()]
            if not left:
                return
            logger.warning("%s tensor-parallel workers %s", stage, [p.pid for p in left])
            for proc in left:
                getattr(proc, stage)()
                proc.join(2.0)
