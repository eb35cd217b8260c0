"""The executor of an async program: Executor's state and node handlers, its worker a task on the
caller's event loop instead of a thread, gens and selects awaited on the backend's async API.
Reads are coroutines that wait on the loop, never block it."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from forklm.frontend_dsl import choices, ir
from forklm.frontend_dsl.backends.base import Backend, GenResult
from forklm.frontend_dsl.defaults import RunDefaults
from forklm.frontend_dsl.executor import Executor, GenCall


class FinishedProgramError(RuntimeError):
    """Something was appended to an async program's state after its body returned."""


class AsyncExecutor(Executor):
    """Executor for `async def` programs. Must be created and appended to on the event loop
    that runs the program; the queue runs as a task there. A fork branch starts once the
    parent's queue reaches the fork; nothing on the loop waits for it."""

    error: BaseException | None

    def __init__(self, backend: Backend, defaults: RunDefaults, *, released: bool = True):
        super().__init__(backend, defaults)
        self._loop = asyncio.get_running_loop()
        self._task: asyncio.Task[None] | None = None
        self._changed = asyncio.Event()  # replaced by a fresh one at every change
        self._fork_reached: asyncio.Future[None] = self._loop.create_future()
        if released:
            self._fork_reached.set_result(None)
        self.sealed = False  # the body returned: nothing more may be appended

    # -- the event loop (the program body and its readers) -------------------------------------
    def submit(self, expr: Any) -> None:
        if self.sealed:
            raise FinishedProgramError(
                "this async program has finished; append inside its body, or run it again")
        super().submit(expr)

    def fork(self, size: int) -> tuple[int, list[Executor]]:
        """Branches that begin when the parent's queue reaches this point; nothing waits now."""
        return self._queue_fork(size)

    def _new_branch(self) -> Executor:
        return AsyncExecutor(self.backend, self.defaults, released=False)

    async def join_async(self, fork_id: int, branches: list[Executor], mode: str) -> None:
        """Queue the merge of `branches`; returns once it has run, raising the error that
        stopped the program first (a branch's, with its message) if it never ran."""
        position = self._num_queued + 1  # never reached when the join is not queued
        self.join(fork_id, branches, mode)
        await self._until(lambda: self.error is not None or self._num_done >= position)
        if self._num_done < position:
            self._raise_error()

    def _start_worker(self) -> None:
        if asyncio.get_running_loop() is not self._loop:
            raise RuntimeError("an async program's state is used only on the event loop that "
                               "runs it")
        self._task = self._loop.create_task(self._work())

    async def wait_async(self) -> None:
        """Until the queue is done (or failed); never raises."""
        await self._until(lambda: not self._running)

    async def get_async(self, name: Any, table: str = "variables") -> Any:
        """The value once every queued producer of `name` has run; the program's error (the
        failed gen's own exception) if it stopped first."""
        values = getattr(self, table)
        await self._until(lambda: self.error is not None or (
            self._fork_reached.done() and not self._pending[name] and not self._opaque))
        self._raise_error()
        never_forked = self._fork_reached.exception()  # a branch whose fork was never reached
        if never_forked is not None:
            raise never_forked
        if name not in values:
            raise KeyError(f"no variable {name!r}; the state has {sorted(map(str, values))}")
        return values[name]

    async def sync_async(self) -> None:
        await self.wait_async()
        self._raise_error()

    def record_error(self, exc: BaseException) -> None:
        """An error of the body (not of a queued node): kept unless one came first."""
        if self.error is None:
            self.error = exc
        self._notify()

    def seal(self) -> None:
        self.sealed = True

    def cancel(self) -> None:
        """Stop the queue (the in-flight gen's request is aborted by its cancellation)."""
        if self._task is not None and not self._task.done():
            self._task.cancel()

    async def _until(self, ready: Callable[[], bool]) -> None:
        while not ready():
            await self._changed.wait()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()
        with self._cond:
            self.events.notify()

    # -- what the worker task awaits -----------------------------------------------------------
    async def _released(self) -> None:
        await self._fork_reached

    def _release(self) -> None:
        self._fork_reached.set_result(None)
        self._notify()

    def _never_released(self, error: BaseException | None) -> None:
        """The branch fails with the parent's error rather than waiting forever."""
        if not self._fork_reached.done():
            if isinstance(error, asyncio.CancelledError):
                self._fork_reached.cancel()
            else:
                self._fork_reached.set_exception(
                    error or RuntimeError("the program stopped before this fork"))
                self._fork_reached.exception()  # retrieved: no "never retrieved" warning
        self._notify()

    async def _generate(self, call: GenCall) -> GenResult:
        # No per-token streaming: a gen's text is appended whole when it returns, which
        # saves a loop hop per token for every program on the loop.
        return await self.backend.agenerate_turn(self.text, self._turn(), call.params,
                                                 call.options)

    async def _select(self, node: ir.Select) -> choices.ChoicesDecision:
        return await self.backend.aselect(self.text, node.choices,
                                          choices.resolve(node.choices_method))

    async def _finished(self, branch: Executor) -> None:
        assert isinstance(branch, AsyncExecutor), branch
        await branch.sync_async()
