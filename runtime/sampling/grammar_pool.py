"""CompilePool: grammar compiles on their own threads under a time budget, so that no slow or
abandoned compile holds up the others.

xgrammar compiles in C++ (releasing the GIL) and cannot be interrupted, so a compile is never
killed; instead it stops counting against the pool. At most `num_threads` *fresh* compiles
(started, within their budget, still awaited) run at once; a compile that overran its budget or
that nobody awaits any more (the client left) keeps its thread but frees its place, so the next
compile starts beside it at once. Threads are capped at `max_threads` in all: past that, compiles
queue, and a queued compile fails at its deadline like a slow one. A compile nobody awaits any more
is dropped before it starts.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from itertools import chain
from typing import Any

from forklm.runtime.errors import EngineShutdownError

# Fresh compiles at once. Typical regexes and schemas compile in 1-10 ms; four places keep a few
# slow (but within budget) schemas from queueing everyone else's on a small CPU.
COMPILE_THREADS = 4
# Threads in all, counting compiles past their budget or abandoned: each may run for a minute
# (JSONSchemaBench's slowest schema takes 47 s), so this bounds the CPU a hostile client can burn.
MAX_COMPILE_THREADS = 12


@dataclass(eq=False)
class CompileJob:
    """One compile. `outcome` gets what the compile itself returns or raises (whenever it ends);
    `future` is what callers await: the outcome, or the budget's error at `deadline`, or cancelled
    when every waiter left before it started. Fields other than the futures change under the
    pool's lock."""

    run: Callable[[], Any]
    deadline: float  # time.monotonic()
    timeout_error: Callable[[bool], BaseException]  # arg: whether it had started
    future: Future = field(default_factory=Future)
    outcome: Future = field(default_factory=Future)
    waiters: int = 0
    started: bool = False
    expired: bool = False
    dropped: bool = False  # every waiter left before it started

    @classmethod
    def finished(cls, result: Any) -> CompileJob:
        """A job already done with `result` (a compile that finished after its budget)."""
        job = cls(lambda: result, 0.0, lambda _: AssertionError("finished"), started=True)
        job.outcome.set_result(result)
        job.future.set_result(result)
        return job

    @property
    def fresh(self) -> bool:
        return not self.expired and self.waiters > 0


class CompilePool:
    """Runs CompileJobs under a per-job budget of `timeout_s`. All methods are thread-safe.
    Futures are settled outside the lock, so their callbacks may call back into the pool."""

    def __init__(self, timeout_s: float, num_threads: int = COMPILE_THREADS,
                 max_threads: int = MAX_COMPILE_THREADS, name: str = "forklm-grammar"):
        assert 1 <= num_threads <= max_threads, (num_threads, max_threads)
        self.timeout_s, self.num_threads, self.max_threads = timeout_s, num_threads, max_threads
        self._name = name
        self._cond = threading.Condition()
        self._pending: deque[CompileJob] = deque()
        self._running: set[CompileJob] = set()
        self._num_started = 0
        self._closed = False
        self._watchdog: threading.Thread | None = None

    def submit(self, run: Callable[[], Any],
               timeout_error: Callable[[bool], BaseException]) -> CompileJob:
        """Queue run() (started at once when a place is free), awaited by one waiter."""
        job = CompileJob(run, time.monotonic() + self.timeout_s, timeout_error, waiters=1)
        with self._cond:
            if self._closed:
                raise EngineShutdownError("the engine has been shut down")
            self._pending.append(job)
            self._start_ready()
            if self._watchdog is None:
                self._watchdog = threading.Thread(target=self._watch, daemon=True,
                                                  name=f"{self._name}-watchdog")
                self._watchdog.start()
            self._cond.notify_all()
        return job

    def join(self, job: CompileJob) -> bool:
        """One more waiter for job; False when it was dropped (submit a new one)."""
        with self._cond:
            if job.dropped:
                return False
            job.waiters += 1
            return True

    def leave(self, job: CompileJob) -> None:
        """A waiter stopped waiting; the last one drops a job that has not started, and frees
        the place of one that has."""
        with self._cond:
            job.waiters -= 1
            assert job.waiters >= 0, job
            if job.waiters > 0 or job.expired or job.dropped or job.future.done():
                return  # still awaited, or already out of the queue
            if not job.started:
                self._pending.remove(job)
                job.dropped = True
            self._start_ready()
        if job.dropped:
            job.future.cancel()
            job.outcome.cancel()

    def close(self) -> None:
        """Drop the queued jobs; running ones end on their own (daemon threads)."""
        with self._cond:
            self._closed = True
            dropped = list(self._pending)
            self._pending.clear()
            for job in dropped:
                job.dropped = True
            self._cond.notify_all()
        for job in dropped:
            job.future.cancel()
            job.outcome.cancel()

    def num_fresh(self) -> int:
        with self._cond:
            return sum(job.fresh for job in self._running)

    # -- internals (callers hold self._cond) ---------------------------------------------------
    def _start_ready(self) -> None:
        while (self._pending and sum(job.fresh for job in self._running) < self.num_threads
               and len(self._running) < self.max_threads):
            job = self._pending.popleft()
            job.started = True
            self._running.add(job)
            self._num_started += 1
            threading.Thread(target=self._run, args=(job,), daemon=True,
                             name=f"{self._name}-{self._num_started}").start()

    def _run(self, job: CompileJob) -> None:
        try:
            result, error = job.run(), None
        except BaseException as e:  # noqa: BLE001 - handed to the waiters
            result, error = None, e
        with self._cond:
            self._running.discard(job)
            self._start_ready()
        _settle(job.outcome, result, error)
        _settle(job.future, result, error)

    def _watch(self) -> None:
        """Fail every job whose deadline passed, queued or running; sleep until the next one."""
        while True:
            with self._cond:
                if self._closed:
                    return
                now = time.monotonic()
                due = [job for job in chain(self._pending, self._running)
                       if not job.expired and job.deadline <= now]
                for job in due:
                    job.expired = True
                    if not job.started:
                        self._pending.remove(job)
                if due:
                    self._start_ready()
                else:
                    deadlines = [job.deadline for job in chain(self._pending, self._running)
                                 if not job.expired]
                    self._cond.wait(min(deadlines) - now if deadlines else None)
                    continue
            for job in due:
                _settle(job.future, None, job.timeout_error(job.started))
                if not job.started:
                    job.outcome.cancel()


def _settle(fut: Future, result: Any, error: BaseException | None) -> None:
    """Set fut's result or error unless it is already done (a race between the compile ending
    and its deadline has one winner)."""
    try:
        if error is None:
            fut.set_result(result)
        else:
            fut.set_exception(error)
    except InvalidStateError:
        pass
