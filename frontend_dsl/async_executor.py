"""The executor of an async program: the same state and node handlers as Executor, run by one
asyncio task on the caller's event loop instead of a thread, with gens and selects awaited on the
backend's async API. Reads are coroutines that wait on the loop, never block it."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from forklm.frontend_dsl import choices, ir
from forklm.frontend_dsl.backends.base import Backend
from forklm.frontend_dsl.defaults import RunDefaults
from forklm.frontend_dsl.executor import Executor, GenCall, JoinNode


class ForkPoint:
    """Queued on a parent by `fork`: when the parent's queue reaches it, the branches start as
    copies of the parent as it is then (after everything appended before the fork)."""

    def __init__(self, branches: list[AsyncExecutor]):
        self.branches = branches


class JoinPoint:
    """Queued on a parent by `join`: waits for every branch to finish, then merges their variables
    (and text, for concate_and_append) into the parent as JoinNode does. What it sets is known
    only then, so reads on the parent wait for it whatever name they ask for."""

    def __init__(self, branches: list[AsyncExecutor], mode: str):
        self.branches, self.mode = branches, mode
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()


class FinishedProgramError(RuntimeError):
    """Something was appended to an async program's state after its body returned."""


class AsyncExecutor(Executor):
    """Executor for `async def` programs. Must be created and appended to on the event loop
    that runs the program; the queue runs as a task there."""

    INTERNAL_NODES = (JoinNode, ForkPoint, JoinPoint)
    error: BaseException | None

    def __init__(self, backend: Backend, defaults: RunDefaults, *, inherited: bool = True):
        super().__init__(backend, defaults)
        self._loop = asyncio.get_running_loop()
        self._task: asyncio.Task[None] | None = None
        self._changed = asyncio.Event()  # replaced by a fresh one at every change
        self._opaque = 0  # queued JoinPoints: their outputs are not known in advance
        # A fork branch starts once its parent reaches the fork (see ForkPoint).
        self._inherited: asyncio.Future[None] = self._loop.create_future()
        if inherited:
            self._inherited.set_result(None)
        self.sealed = False  # the body returned: nothing more may be appended

    # -- the event loop (the program body and its readers) -------------------------------------
    def submit(self, expr: Any) -> None:
        if self.sealed:
            raise FinishedProgramError(
                "this async program has finished; append inside its body, or run it again")
        super().submit(expr)

    def _start_worker(self) -> None:
        if asyncio.get_running_loop() is not self._loop:
            raise RuntimeError("an async program's state is used only on the event loop that "
                               "runs it")
        self._task = self._loop.create_task(self._work_async())

    def _enqueue_hook(self, node: Any) -> None:
        if isinstance(node, JoinPoint):
            self._opaque += 1

    async def wait_async(self) -> None:
        """Until the queue is done (or failed); never raises."""
        await self._until(lambda: not self._running)

    async def get_async(self, name: Any, table: str = "variables") -> Any:
        """The value once every queued producer of `name` has run; the program's error (the
        failed gen's own exception) if it stopped first."""
        values = getattr(self, table)
        await self._until(lambda: self.error is not None or (
            self._inherited.done() and not self._pending[name] and not self._opaque))
        self._raise_error()
        inherited_error = self._inherited.exception()  # a branch whose fork was never reached
        if inherited_error is not None:
            raise inherited_error
        if name not in values:
            raise KeyError(f"no variable {name!r}; the state has {sorted(map(str, values))}")
        return values[name]

    async def sync_async(self) -> None:
        await self.wait_async()
        self._raise_error()

    def fork(self, size: int) -> list[Executor]:
        """Branches that begin when the parent's queue reaches this point; nothing waits now."""
        branches = [AsyncExecutor(self.backend, self.defaults, inherited=False)
                    for _ in range(size)]
        self.submit(ForkPoint(branches))
        return list(branches)

    def join_later(self, branches: list[AsyncExecutor], mode: str) -> asyncio.Future[None]:
        """Queue the merge of `branches`; the returned future resolves when it has run."""
        point = JoinPoint(branches, mode)
        self.submit(point)
        return point.done

    def record_error(self, exc: BaseException) -> None:
        """An error of the body (not of a queued node): kept unless one came first."""
        if self.error is None:
            self.error = exc
        self._wake()

    def seal(self) -> None:
        self.sealed = True

    def cancel(self) -> None:
        """Stop the queue (the in-flight gen's request is aborted by its cancellation)."""
        if self._task is not None and not self._task.done():
            self._task.cancel()

    async def _until(self, ready: Callable[[], bool]) -> None:
        while not ready():
            await self._changed.wait()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()
        with self._cond:
            self.events.notify()

    # -- the worker task -----------------------------------------------------------------------
    async def _work_async(self) -> None:
        try:
            await self._inherited
        except BaseException as e:  # the parent failed before the fork: the branch fails too
            self.error = self.error or e
        while True:
            with self._cond:
                if not self._queue or self.error is not None:
                    self._drop_queue()
                    break
                node = self._queue.popleft()
            try:
                await self._execute_async(node)
            except asyncio.CancelledError as e:
                self.error = self.error or e
                _cancel_point(node, self.error)
                with self._cond:
                    self._drop_queue()
                self._wake()
                raise
            except BaseException as e:  # raised to the program at its next awaited read
                self.error = self.error or e
                _cancel_point(node, self.error)
            with self._cond:
                for name in self._names(node):
                    self._pending[name] -= 1
                if isinstance(node, JoinPoint):
                    self._opaque -= 1
            self._wake()
        self._wake()

    def _drop_queue(self) -> None:
        """As Executor's, and the forks and joins left never run: they fail with the error."""
        for node in self._queue:
            _cancel_point(node, self.error)
        super()._drop_queue()
        self._opaque = 0

    async def _execute_async(self, node: Any) -> None:
        if isinstance(node, ir.Gen):
            call = GenCall(self, node)
            # No per-token streaming: a gen's text is appended whole when it returns, which
            # saves a loop hop per token for every program on the loop.
            call.finish(await self.backend.agenerate_turn(
                self.text, self._turn(), call.params, call.options))
        elif isinstance(node, ir.Select):
            self._store_select(node, await self.backend.aselect(
                self.text, node.choices, choices.resolve(node.choices_method)))
        elif isinstance(node, ForkPoint):
            for branch in node.branches:
                self.copy_into(branch)
                branch._inherited.set_result(None)
                branch._wake()
        elif isinstance(node, JoinPoint):
            await self._join(node)
        else:
            self._execute(node)

    async def _join(self, point: JoinPoint) -> None:
        for branch in point.branches:
            await branch.sync_async()  # a branch's error stops the parent, with its message
        names = list(dict.fromkeys(n for b in point.branches for n in b.produced if n is not None))
        text = ""
        if point.mode == "concate_and_append":
            text = "".join(b.text[b.fork_start:] for b in point.branches)
        self._run_join(JoinNode(
            variables={n: [b.variables.get(n) for b in point.branches] for n in names},
            meta_info={n: [b.meta_info.get(n) for b in point.branches] for n in names},
            text=text))
        point.done.set_result(None)


def _cancel_point(node: Any, error: BaseException | None) -> None:
    """A fork or join that will never run (the program failed first, with `error`): its branches
    fail with that error, and its waiter gets it, rather than waiting forever."""
    futures: list[asyncio.Future[None]] = []
    if isinstance(node, ForkPoint):
        futures = [branch._inherited for branch in node.branches]
    elif isinstance(node, JoinPoint):
        futures = [node.done]
    for future in futures:
        if future.done():
            continue
        if isinstance(error, asyncio.CancelledError):
            future.cancel()
        else:
            future.set_exception(error or RuntimeError("the program stopped before this point"))
            future.exception()  # retrieved: whoever awaits it still gets it, no "never retrieved"
    if isinstance(node, ForkPoint):
        for branch in node.branches:
            branch._wake()
