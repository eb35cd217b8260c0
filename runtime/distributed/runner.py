"""TensorParallelRunner: rank 0's ModelRunner. Each step it builds the ForwardBatch as one process
would, broadcasts it, runs its own shard in step with the workers, and gathers the logits."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch

from forklm.runtime.distributed.group import TPGroup, leave_group
from forklm.runtime.distributed.step_channel import Command, send_step
from forklm.runtime.errors import WorkerLostError
from forklm.runtime.forward.model_runner import LogitsRows, ModelRunner

if TYPE_CHECKING:
    from forklm.runtime.distributed.processes import WorkerProcesses
    from forklm.runtime.distributed.shard import ModelShard
    from forklm.runtime.kvcache.manager import KVCacheManager
    from forklm.runtime.scheduling.scheduler import ScheduledBatch

logger = logging.getLogger(__name__)

# While idle, rank 0 pings the workers this often: a worker on another machine that died is
# noticed (and /health turns unhealthy) within this, not at the next request.
PING_INTERVAL_S = 2.0


class TensorParallelRunner(ModelRunner):
    """Contract: forward() either returns the full logits on rank 0 or raises WorkerLostError,
    after which the group is broken and only close() may be called."""

    def __init__(self, shard: ModelShard, kv: KVCacheManager, group: TPGroup,
                 workers: WorkerProcesses, vocab_size: int):
        super().__init__(shard.model, shard.attn, kv, str(group.device))
        self.shard, self.group, self.workers = shard, group, workers
        self.vocab_size = vocab_size  # the logits' width; the ranks' slices are padded past it
        self.broken: Exception | None = None
        self._last_contact = time.monotonic()

    def forward(self, batch: ScheduledBatch, input_ids: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, list[LogitsRows]]:
        fb, layout = self._build(batch, input_ids)  # a bad request fails here, before any collective
        self._check_usable()
        try:
            send_step(self.group, Command.FORWARD, fb)
            local = self.model(fb.to(self.device), self.attn)  # [rows, vocab / tp_size]
            logits = self.group.gather_to_first(local)
        except Exception as e:
            raise self._lost(e) from e
        self._last_contact = time.monotonic()
        assert logits is not None
        return logits[:, : self.vocab_size], layout

    def check_health(self) -> None:
        """Raises WorkerLostError when a local worker process has exited, or (every
        PING_INTERVAL_S while idle) when a rank does not answer a ping."""
        self._check_usable()
        dead = self.workers.exited()
        if dead:
            raise self._lost(RuntimeError(dead))
        if time.monotonic() - self._last_contact >= PING_INTERVAL_S:
            try:
                send_step(self.group, Command.PING)
                self.group.ping()
            except Exception as e:
                raise self._lost(e) from e
            self._last_contact = time.monotonic()

    def close(self) -> None:
        """Tell the workers to exit (when the group still works), wait for the local ones
        (killing any that do not exit within seconds), and leave the group."""
        if self.broken is None:
            try:
                send_step(self.group, Command.SHUTDOWN)
            except Exception:
                logger.warning("could not tell the workers to shut down", exc_info=True)
        self.workers.stop()
        leave_group()

    def _check_usable(self) -> None:
        if self.broken is not None:
            raise WorkerLostError(f"tensor parallelism is broken: {self.broken}")

    def _lost(self, cause: Exception) -> WorkerLostError:
        # The workers' exit codes say more than the collective's error, when one has exited.
        dead = self.workers.exited(wait_s=1.0)
        self.broken = cause
        why = dead or f"a collective failed: {cause}"
        logger.error("tensor-parallel group lost: %s", why)
        return WorkerLostError(f"tensor-parallel worker lost ({why})")
