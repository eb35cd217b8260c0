"""EngineLoop: the engine's background thread. Between scheduler steps it runs the calls posted to
its inbox (submit, abort, flush, stats); a step is schedule -> forward -> sample -> after_step.

With the overlap scheduler (see EngineConfig.disable_overlap_schedule), consecutive decode steps
pipeline: step N+1's forward is launched on the forward worker before step N's samples are
taken to the host and applied (runtime/engine/overlap.py)."""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import torch

from forklm.runtime.cpu_threads import ThreadGovernor, thread_governor
from forklm.runtime.engine.output_processor import (
    StepTokens,
    apply_step,
    fail,
    finish,
    process_logits,
    run_decode_steps,
    sample_step,
)
from forklm.runtime.engine.overlap import ForwardResult, ForwardWorker, InFlight
from forklm.runtime.engine.stats import EngineStats
from forklm.runtime.errors import EngineShutdownError, WorkerLostError
from forklm.runtime.scheduling.request import FinishReason, Req, ReqOutput

# Seconds without requests after which the loop starts the engine's idle work (dense weight
# copies in the background, repacked weights cached on disk, weights moved to huge pages:
# runtime/engine/idle_work.py). Started at once, or after 0.3 s, the copies slowed a server's
# start (their threads took the GIL from uvicorn's start-up and the routes' setup) and would
# slow the first requests; a call that needs one first builds them on the spot.
IDLE_BUILD_AFTER_S = 1.0

if TYPE_CHECKING:
    from forklm.runtime.engine.builder import EngineParts
    from forklm.runtime.scheduling.scheduler import ScheduledBatch

logger = logging.getLogger(__name__)


class EngineLoop:
    """Owns the scheduler and KV state through its thread: every method named `_..._now` runs on
    that thread only; `post`/`call` are the thread-safe way in."""

    def __init__(self, parts: EngineParts):
        self.parts, self.config = parts, parts.config
        self._inbox: queue.Queue[Callable[[], None]] = queue.Queue()
        self._reqs: dict[str, Req] = {}
        self.stats = EngineStats()
        self.closed = False
        self.last_error: Exception | None = None
        self._worker: ForwardWorker | None = None  # set on the thread when overlap is on
        self._in_flight: InFlight | None = None
        self._governor: ThreadGovernor | None = None  # set on the thread: see _run
        # done a slice at a time once the loop has been idle for IDLE_BUILD_AFTER_S
        self._idle_work = list(parts.idle_work)
        self._thread = threading.Thread(target=self._run, name="forklm-engine", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        """Whether the loop still runs steps: not shut down, and its thread has not died."""
        return not self.closed and self._thread.is_alive()

    def post(self, fn: Callable[[], None]) -> None:
        if self.closed:
            raise EngineShutdownError("the engine has been shut down")
        self._inbox.put(fn)

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run fn on the engine thread (between steps) and return its result."""
        return self.call_soon(fn).result()

    def call_soon(self, fn: Callable[[], Any]) -> Future:
        """Queue fn for the engine thread (between steps); the future gets its result."""
        fut: Future = Future()

        def run() -> None:
            try:
                fut.set_result(fn())
            except BaseException as e:  # handed to the caller, not swallowed
                fut.set_exception(e)

        self.post(run)
        return fut

    def submit(self, reqs: list[Req]) -> None:
        """Queue reqs (their sinks set) together: they join the same scheduling step."""
        self.post(lambda: self._add_all_now(reqs))

    def abort(self, rid: str, message: str, tenant: str | None = None) -> None:
        self.post(lambda: self._abort_now(rid, message, tenant))

    def stop(self) -> None:
        """Finish every pending request with an abort, end the thread and wait for it: a loop
        that closed itself (a lost tensor-parallel worker) may still be releasing its runner."""
        if not self.closed:
            with contextlib.suppress(EngineShutdownError):  # closed meanwhile
                self.post(self._stop_now)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=30)

    # -- the thread (engine thread only below) -------------------------------------------------
    def _run(self) -> None:
        threads = self.config.threads_per_rank
        previous = torch.get_num_threads()
        if threads:
            torch.set_num_threads(threads)
        pins = self.parts.kv.pins
        if _overlaps(self.parts):
            self._worker = ForwardWorker(self.parts.runner, torch.get_num_threads())
        else:  # the forwards run on this thread, which can then tell whether it has its core
            self._governor = thread_governor(
                torch.get_num_threads(), self.config.device == "cpu" and self.config.tp_size == 1)
        busy_at = time.monotonic()  # when the loop last had requests
        try:
            while not self.closed:
                idle = not self.parts.scheduler.has_work and self._in_flight is None
                timeout = 0.5
                if self._idle_work:  # nothing to time once it is done
                    now = time.monotonic()
                    if not idle:
                        busy_at = now
                    elif now - busy_at >= IDLE_BUILD_AFTER_S:  # idle long enough: a slice of it
                        if not self._idle_work[0].run_slice():
                            self._idle_work.pop(0)
                        timeout = 0.0
                    else:
                        timeout = min(busy_at + IDLE_BUILD_AFTER_S - now, timeout)
                self._drain_inbox(block=idle, timeout=timeout)
                if not self.closed:
                    self._guarded_step()
                    if pins is not None:
                        pins.expire(time.monotonic())
        finally:
            self._close_now()
            if threads:
                torch.set_num_threads(previous)

    def _guarded_step(self) -> None:
        """A bug in a step must not hang callers: fail every active request loudly instead. A
        lost tensor-parallel worker ends the loop: no later step could run."""
        try:
            if self._in_flight is None:  # a health probe must not interleave with a forward
                self.parts.runner.check_health()
            if self._worker is not None:
                self._step_overlapped(self._worker)
            else:
                self._step()
            if self.config.debug_check_invariants:
                self.parts.kv.check_invariants(self.parts.scheduler.active_reqs())
        except WorkerLostError as e:
            logger.error("engine stopped: %s", e)
            self.last_error = e
            for rid in list(self._reqs):
                self._abort_now(rid, f"engine stopped: {e}")
            self.closed = True
        except Exception as e:
            logger.exception("engine step failed; aborting all requests")
            self.last_error = e
            for rid in list(self._reqs):
                self._abort_now(rid, f"internal error: {e!r}")

    def _close_now(self) -> None:
        """The thread's last act: calls posted as it closed still run (a request they submit is
        aborted at once), then the runner releases its workers."""
        try:
            self._drain_inbox(block=False)
            for rid in list(self._reqs):
                self._abort_now(rid, "engine shut down")
        finally:
            if self._worker is not None:
                self._worker.close()  # the forward in flight ends before its runner does
            self._in_flight = None
            for work in self.parts.idle_work:  # started or not
                work.close()
            self.parts.runner.close()

    def _drain_inbox(self, block: bool, timeout: float = 0.5) -> None:
        try:
            fn = self._inbox.get(timeout=timeout) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            fn()
            try:
                fn = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _step(self) -> None:
        sched, t0, governor = self.parts.scheduler, time.perf_counter(), self._governor
        if governor is not None:
            governor.step_started()
        batch = sched.schedule()
        self._emit_aborted()
        if batch is None:
            return
        tokens, forward_s = self._run_isolated(batch)
        sched.after_step(batch)
        self.stats.record_step(batch, time.perf_counter() - t0, forward_s, tokens)
        if governor is not None:
            governor.step_finished()
            self.stats.cpu_threads = governor.threads

    def _step_overlapped(self, worker: ForwardWorker) -> None:
        """One step of the pipeline: take the step in flight (launching one if none), sample it
        on the device, launch the next decode step when the scheduler can decide it already,
        then bring the samples to the host and apply them while that forward runs."""
        sched = self.parts.scheduler
        if self._in_flight is None:
            batch = sched.schedule()
            self._emit_aborted()
            if batch is None:
                return
            if batch.steps > 1:  # continuous decode steps chain their forwards themselves
                self._finish_plainly(batch, time.perf_counter())
                return
            self._in_flight = worker.launch(batch, None)
        current, self._in_flight = self._in_flight, None
        # Requests that finished after the step was scheduled (aborted while its forward ran, or
        # stopped on the token the step before it sampled) take nothing from it.
        live = [i for i, r in enumerate(current.batch.reqs) if not r.finished]
        batch = current.batch.part(live)
        try:
            forward: ForwardResult = current.result.result()
        except WorkerLostError:
            raise
        except Exception:  # the plain path reruns it, in halves down to the bad request
            self._finish_plainly(batch, current.started)
            return
        if not batch.reqs:
            return
        layout = [forward.layout[i] for i in live]
        try:
            samples = sample_step(batch, forward.logits, layout, self.parts.grammar)
        except Exception:
            self._finish_plainly(batch, current.started)
            return
        ahead = sched.schedule_ahead(batch) if self._may_schedule_ahead(batch) else None
        if ahead is not None:
            ids = samples.next_input_ids()
            if len(ahead.reqs) < len(batch.reqs):
                kept = {id(r) for r in ahead.reqs}
                ids = ids[[i for i, r in enumerate(batch.reqs) if id(r) in kept]]
            self._in_flight = worker.launch(ahead, ids)
        tokens = apply_step(batch, layout, samples, self.parts.grammar)
        if ahead is not None:
            sched.cancel_ahead(ahead)
        sched.after_step(batch)
        self.stats.record_step(batch, time.perf_counter() - current.started, forward.seconds,
                               tokens)

    def _may_schedule_ahead(self, batch: ScheduledBatch) -> bool:
        """Whether the next step's inputs are known before this step's samples are applied: a
        plain decode (no drafts to propose from the new tokens, no grammar-forced tokens to
        append after them)."""
        if batch.phase != "decode" or self.parts.scheduler.drafter is not None:
            return False
        grammar = self.parts.grammar
        return not (grammar is not None and grammar.jump_forward
                    and any(r.grammar is not None for r in batch.reqs))

    def _finish_plainly(self, batch: ScheduledBatch, started: float) -> None:
        """A step whose overlapped forward or sampling failed: rerun through the plain path, which
        isolates the request at fault."""
        if batch.reqs:
            tokens, forward_s = self._run_isolated(batch)
            self.parts.scheduler.after_step(batch)
            self.stats.record_step(batch, time.perf_counter() - started, forward_s, tokens)

    def _run_isolated(self, batch: ScheduledBatch) -> tuple[StepTokens, float]:
        """Forward and sample `batch`; returns (its tokens, forward seconds). A failing batch is
        rerun in halves (a rerun forward writes the same KV again; process_logits raises only
        before it changes a request) down to the requests that fail alone: only those are
        aborted, so one request's bad input cannot take its batch neighbours down."""
        try:
            t1 = time.perf_counter()
            if batch.steps > 1:  # forwards and sampling, then the requests take the tokens
                tokens = run_decode_steps(self.parts.runner, batch, self.parts.grammar)
                return tokens, time.perf_counter() - t1
            logits, layout = self.parts.runner.forward(batch)
            forward_s = time.perf_counter() - t1
            return process_logits(batch, logits, layout, self.parts.grammar), forward_s
        except WorkerLostError:  # not the batch's fault: rerunning its halves cannot help
            raise
        except Exception as e:
            if len(batch.reqs) == 1:
                logger.exception("request %s failed its engine step", batch.reqs[0].rid)
                self._fail_alone(batch.reqs[0], batch.extend_lens[0] * batch.steps, e)
                return StepTokens(0, 0, 0, 0), 0.0
            logger.warning("a step of %d requests failed (%r); rerunning it in halves",
                           len(batch.reqs), e)
        results = [self._run_isolated(half) for half in _halves(batch)]
        tokens = StepTokens(*map(sum, zip(*(t for t, _ in results))))
        return tokens, sum(s for _, s in results)

    def _fail_alone(self, req: Req, extend_len: int, error: Exception) -> None:
        """Abort req, whose step failed. The KV this step was to compute may be unwritten: it is
        dropped first, so that releasing req does not put it in the radix cache."""
        if req.row is not None:
            self.parts.kv.trim(req, max(req.num_computed - extend_len, req.prefix_len))
        self.parts.scheduler.abort(req)  # after_step then finds it finished and released
        fail(req, f"engine error: {error!r}")

    def _emit_aborted(self) -> None:
        sched = self.parts.scheduler
        while sched.aborted:
            req = sched.aborted.pop()
            self._reqs.pop(req.rid, None)
            finish(req, req.finish_reason or FinishReason("abort"))

    def _add_all_now(self, reqs: list[Req]) -> None:
        for req in reqs:
            self._add_now(req)

    def _add_now(self, req: Req) -> None:
        if req.rid in self._reqs:
            finish(req, FinishReason("abort", message=f"duplicate rid {req.rid!r}"))
            return
        self._reqs[req.rid] = req
        wrapped = req.sink

        def sink(out: ReqOutput) -> None:
            if out.finished:
                self._reqs.pop(out.rid, None)
                self.stats.record_finished(out.req)
            wrapped(out)

        req.sink = sink
        if self.parts.kv.pins is not None:
            self.parts.kv.pins.touch(req.session_id)
        self.parts.scheduler.waiting.append(req)

    def _abort_now(self, rid: str, message: str, tenant: str | None = None) -> None:
        req = self._reqs.get(rid)
        if req is None or req.finished or (tenant is not None and req.tenant != tenant):
            return
        self.parts.scheduler.abort(req)
        finish(req, FinishReason("abort", message=message))

    def flush_now(self) -> bool:
        if self.parts.scheduler.has_work:
            return False
        self.parts.kv.flush()
        return True

    def _stop_now(self) -> None:
        for rid in list(self._reqs):
            self._abort_now(rid, "engine shut down")
        self.closed = True

    def stats_now(self) -> dict[str, Any]:
        # idle_work_left: start-up work (dense copies, the records cache, huge pages) still to
        # be done in idle time; 0 once the engine runs at its full speed
        return {**self.stats.snapshot(self.parts.scheduler, self.parts.kv),
                "idle_work_left": len(self._idle_work)}


def _overlaps(parts: EngineParts) -> bool:
    """Whether the overlap scheduler runs: as configured (unset: on a GPU only), and not with
    tensor parallelism (rank 0's health probes share the collectives' group with the forward)."""
    config = parts.config
    setting = config.disable_overlap_schedule
    wanted = torch.device(config.device).type == "cuda" if setting is None else not setting
    return wanted and config.tp_size == 1


def _halves(batch: ScheduledBatch) -> list[ScheduledBatch]:
    """The batch's requests split in two, each half with its own lengths, samples and drafts."""
    cut, n = len(batch.reqs) // 2, len(batch.reqs)
    return [batch.part(range(0, cut)), batch.part(range(cut, n))]
