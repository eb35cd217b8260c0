"""The overlap scheduler's parts (SGLang's overlap schedule): while step N's forward runs, the engine
thread takes step N-1's samples to the host and updates its requests (finish checks, detokenizing,
events). Step N is scheduled before those samples reach the host and reads its input tokens
where they were sampled (Scheduler.schedule_ahead, ModelRunner.forward's input_ids).

The forward runs on one worker thread: on a GPU that thread only launches kernels (the host
work overlaps the device's), on the CPU it computes (torch releases the GIL inside its ops)."""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from forklm.runtime.forward.model_runner import LogitsRows, ModelRunner
    from forklm.runtime.scheduling.scheduler import ScheduledBatch


@dataclass
class ForwardResult:
    logits: torch.Tensor
    layout: list[LogitsRows]
    seconds: float  # the forward's own time on the worker


@dataclass
class InFlight:
    """A step whose forward was launched and whose samples the engine has not taken yet."""

    batch: ScheduledBatch
    result: Future  # of ForwardResult
    started: float  # perf_counter() when it was scheduled


class ForwardWorker:
    """One thread that runs forwards in submission order (so KV written by step N is there for
    step N+1), with the engine thread's torch thread count."""

    def __init__(self, runner: ModelRunner, num_threads: int):
        self._runner = runner
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="forklm-forward",
                                        initializer=_set_threads, initargs=(num_threads,))

    def launch(self, batch: ScheduledBatch, input_ids: torch.Tensor | None) -> InFlight:
        started = time.perf_counter()
        return InFlight(batch, self._pool.submit(self._run, batch, input_ids), started)

    def _run(self, batch: ScheduledBatch, input_ids: torch.Tensor | None) -> ForwardResult:
        t0 = time.perf_counter()
        logits, layout = self._runner.forward(batch, input_ids)
        return ForwardResult(logits, layout, time.perf_counter() - t0)

    def close(self) -> None:
        """Wait for the forward in flight (its KV writes must end before the runner closes)."""
        self._pool.shutdown(wait=True)


def _set_threads(num_threads: int) -> None:
    # torch's intra-op thread count is per thread: a new thread would use every core.
    torch.set_num_threads(num_threads)
