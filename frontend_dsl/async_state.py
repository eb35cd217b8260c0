"""AsyncProgramState: the `s` of an `async def` program. Appending is the same as in a plain
program (it queues and returns at once); every read is awaited: `await s["x"]`, `await s.text()`,
`await forks.join()`. An error of a gen or select is raised at the awaited read."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator, Awaitable, Coroutine, Generator, Iterator
from typing import Any

from forklm.frontend_dsl.async_executor import AsyncExecutor
from forklm.frontend_dsl.executor import Executor
from forklm.frontend_dsl.state import Appending, BranchGroup, PieceFilter, check_fork


class Pending(Awaitable[Any]):
    """A read of an async program's state: await it. Used as text without `await` (an f-string,
    str(), a condition) it raises TypeError instead of putting "<coroutine ...>" in a prompt."""

    __slots__ = ("_awaitable", "_what")

    def __init__(self, awaitable: Coroutine[Any, Any, Any] | asyncio.Future[Any], what: str):
        self._awaitable, self._what = awaitable, what

    def __await__(self) -> Generator[Any, None, Any]:
        return self._awaitable.__await__()

    def _not_awaited(self, *_: Any) -> Any:
        if inspect.iscoroutine(self._awaitable):
            self._awaitable.close()  # it will never run; no second, vaguer warning
        raise TypeError(f"{self._what} is a read of an async program's state: write "
                        f"`await {self._what}`")

    __str__ = __format__ = __bool__ = __iter__ = __len__ = _not_awaited

    def __repr__(self) -> str:
        return f"<pending read {self._what}: await it>"


class AsyncProgramState(Appending):
    """The state of an `async def` program, on the event loop that runs it (appending as
    ProgramState)."""

    _ex: AsyncExecutor

    def __init__(self, executor: AsyncExecutor):
        self._ex = executor

    # -- awaited reads -------------------------------------------------------------------------
    def __getitem__(self, name: str) -> Pending:
        return Pending(self._ex.get_async(name), f"s[{name!r}]")

    def get_var(self, name: str) -> Pending:
        return Pending(self._ex.get_async(name), f"s.get_var({name!r})")

    def get_meta_info(self, name: str) -> Pending:
        return Pending(self._ex.get_async(name, table="meta_info"), f"s.get_meta_info({name!r})")

    def sync(self) -> Pending:
        return Pending(self._ex.sync_async(), "s.sync()")

    def error(self) -> Pending:
        return Pending(self._error(), "s.error()")

    def text(self) -> Pending:
        return Pending(self._after_sync(lambda: self._ex.text), "s.text()")

    def messages(self) -> Pending:
        return Pending(self._after_sync(self._ex.chat_messages), "s.messages()")

    def variables(self) -> Pending:
        return Pending(self._after_sync(lambda: dict(self._ex.variables)), "s.variables()")

    async def text_async_iter(self, var_name: str | None = None,
                              return_logprobs: bool = False) -> AsyncIterator[Any]:
        """Text pieces from the start, as ProgramState.text_async_iter (a gen's text arrives
        whole: async programs do not stream token by token)."""
        pieces = PieceFilter(var_name, return_logprobs)
        async for event in self._ex.events.aiter():
            for piece in pieces.feed(event):
                yield piece
            if pieces.done:
                return
        if self._ex.error is not None:
            raise self._ex.error

    def text_iter(self, var_name: str | None = None,
                  return_logprobs: bool = False) -> Iterator[Any]:
        raise TypeError("text_iter blocks; an async program reads with "
                        "`async for piece in s.text_async_iter(...)`")

    async def _after_sync(self, value: Any) -> Any:
        await self._ex.sync_async()
        return value()

    async def _error(self) -> BaseException | None:
        await self._ex.wait_async()
        return self._ex.error

    # -- fork ----------------------------------------------------------------------------------
    def fork(self, size: int = 1, position_ids_offset: Any = None) -> AsyncProgramStateGroup:
        """`size` branches that start from this state once what was appended before the fork
        has run; nothing is awaited here."""
        check_fork(size, position_ids_offset)
        fork_id, branches = self._ex.fork(size)
        return AsyncProgramStateGroup(
            [AsyncProgramState(b) for b in branches if isinstance(b, AsyncExecutor)], self, fork_id)

    def __repr__(self) -> str:
        return f"AsyncProgramState({self._ex.text!r}, running={self._ex._running})"


class AsyncProgramStateGroup(BranchGroup[AsyncProgramState]):
    """What `s.fork(n)` returns in an async program."""

    def __init__(self, states: list[AsyncProgramState], parent: AsyncProgramState, fork_id: int):
        self.states, self.parent, self.fork_id = states, parent, fork_id

    def join(self, mode: str = "gather_variable") -> Pending:
        """Queue the merge (as ProgramStateGroup.join) on the parent; awaiting the result waits
        until it is done and raises a branch's error. Not awaiting it is fine: the parent's
        next awaited read waits for it."""
        self._check_mode(mode)
        branches: list[Executor] = [s._ex for s in self.states]
        return Pending(self.parent._ex.join_async(self.fork_id, branches, mode), "forks.join()")
