"""ProgramState (the `s` a program appends to, and what `run` returns) and ProgramStateGroup."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator
from typing import Any, Generic, TypeVar

from forklm.frontend_dsl.executor import Executor
from forklm.frontend_dsl.expr import Expr, ExprList
from forklm.frontend_dsl.ir import JOIN_MODES, RoleBegin, RoleEnd, ScopeBegin, ScopeEnd, SetVar
from forklm.frontend_dsl.streaming import PieceFilter, TextEvent
from forklm.runtime.errors import InvalidArgumentError


class ChatBlocks:
    """Role and scope methods shared by ProgramState and the tracer's state: each appends begin
    and end nodes through `_append_node`."""

    def _append_node(self, expr: Any) -> None:
        raise NotImplementedError

    def _role(self, role: str, expr: Any) -> contextlib.AbstractContextManager[None] | None:
        if expr is not None:
            self._append_node(ExprList([RoleBegin(role), expr, RoleEnd(role)]))
            return None
        return self._scope(RoleBegin(role), RoleEnd(role))

    def system(self, expr: Any = None) -> contextlib.AbstractContextManager[None] | None:
        """`s.system("...")` appends a system message; `with s.system():` wraps a block."""
        return self._role("system", expr)

    def user(self, expr: Any = None) -> contextlib.AbstractContextManager[None] | None:
        return self._role("user", expr)

    def assistant(self, expr: Any = None) -> contextlib.AbstractContextManager[None] | None:
        return self._role("assistant", expr)

    def fork(self, size: int = 1, position_ids_offset: Any = None) -> Any:
        raise NotImplementedError

    @contextlib.contextmanager
    def copy(self) -> Iterator[Any]:
        """`with s.copy() as c:` a single fork, joined on exit."""
        group = self.fork(1)
        yield group[0]
        group.join()

    def var_scope(self, name: str) -> contextlib.AbstractContextManager[None]:
        """`with s.var_scope("x"):` makes everything appended inside the block variable `x`."""
        return self._scope(ScopeBegin(name), ScopeEnd(name))

    @contextlib.contextmanager
    def _scope(self, begin: Any, end: Any) -> Iterator[None]:
        self._append_node(begin)
        yield
        self._append_node(end)


A = TypeVar("A", bound="Appending")


class Appending(ChatBlocks):
    """What a running state (plain or async) does without waiting: append (queue) and set
    variables, and say whether a variable exists yet."""

    _ex: Executor

    def __iadd__(self: A, expr: Any) -> A:
        self._ex.submit(expr)
        return self

    def _append_node(self, expr: Any) -> None:
        self._ex.submit(expr)

    def __setitem__(self, name: str, value: Any) -> None:
        self._ex.submit(SetVar(name, value))

    def set_var(self, name: str, value: Any) -> None:
        self[name] = value

    def __contains__(self, name: str) -> bool:
        return name in self._ex.variables  # does not wait, like SGLang


class ProgramState(Appending):
    """`s += "text" | gen(...) | select(...)` queues work and returns at once; `s[name]` blocks
    until that variable is produced. An error in a gen or select is raised (with its original
    type and message) at the next `s[...]`, `text()`, `messages()` or `sync()`."""

    def __init__(self, executor: Executor):
        self._ex = executor

    def __getitem__(self, name: str) -> Any:
        return self._ex.get(name)

    def get_var(self, name: str) -> Any:
        return self._ex.get(name)

    def get_meta_info(self, name: str) -> Any:
        """The backend's meta_info for a gen, or the choices method's for a select."""
        return self._ex.get(name, table="meta_info")

    def sync(self) -> None:
        """Wait until everything appended so far has run."""
        self._ex.sync()

    def error(self) -> BaseException | None:
        """Wait until the queue is drained and return the error that stopped the program, if any."""
        self._ex.wait()
        return self._ex.error

    def text(self) -> str:
        self._ex.sync()
        return self._ex.text

    def messages(self) -> list[dict[str, str]]:
        """The chat so far as role/content dicts (contents left-stripped, as SGLang's). When the
        chat template put its default system prompt in the text (the program wrote no system
        message), it is listed first, so messages and text agree."""
        self._ex.sync()
        return self._ex.chat_messages()

    def variables(self) -> dict[Any, Any]:
        self._ex.sync()
        return dict(self._ex.variables)

    # -- streaming -----------------------------------------------------------------------------
    def text_iter(self, var_name: str | None = None,
                  return_logprobs: bool = False) -> Iterator[Any]:
        """Text pieces as they are produced, from the start: the whole text, or only variable
        `var_name`'s pieces (ending when it is set). The pieces concatenate to `text()` (or the
        variable). Works during `run(..., stream=True)` and after a plain `run` returns. The
        program's error, if any, is raised when the stream ends (for a variable: if it never
        got its value). With `return_logprobs`, `(piece, entries)` pairs: the [logprob, token_id,
        text] entries of the tokens each piece holds, for gens run with return_logprob=True
        (every token's, in order: the same entries as the gen's meta_info once it is done)."""
        pieces = PieceFilter(var_name, return_logprobs)
        for event in self._ex.events.iter():
            yield from pieces.feed(event)
            if pieces.done:
                return
        self._raise_error()

    async def text_async_iter(self, var_name: str | None = None,
                              return_logprobs: bool = False) -> AsyncIterator[Any]:
        """`async for piece in s.text_async_iter(...)`: text_iter without blocking the loop."""
        pieces = PieceFilter(var_name, return_logprobs)
        async for event in self._ex.events.aiter():
            for piece in pieces.feed(event):
                yield piece
            if pieces.done:
                return
        self._raise_error()

    def stream_events(self) -> Iterator[tuple[Any, ...]]:
        """`("text", piece)` and `("variable", name, value)` tuples in the order they happened
        (a variable's event follows its text) until the program is done; then its error, if
        any, is raised."""
        for event in self._ex.events.iter():
            if isinstance(event, TextEvent):
                yield ("text", event.text)
            else:
                yield ("variable", event.name, event.value)
        self._raise_error()

    def _raise_error(self) -> None:
        if self._ex.error is not None:
            raise self._ex.error

    # -- fork ----------------------------------------------------------------------------------
    def fork(self, size: int = 1, position_ids_offset: Any = None) -> ProgramStateGroup:
        """`size` copies of this state (text, messages, variables) that run independently, in the
        same engine batches; waits for this state's queued work first. `position_ids_offset`
        (SGLang's) may only be None or zeros: see check_fork."""
        check_fork(size, position_ids_offset)
        fork_id, branches = self._ex.fork(size)
        return ProgramStateGroup([ProgramState(b) for b in branches], self, fork_id)

    def __repr__(self) -> str:
        self._ex.wait()
        return f"ProgramState({self._ex.text!r})"


def check_fork(size: Any, position_ids_offset: Any) -> None:
    """A fork's arguments. Shifting a branch's position ids would change what it generates, and
    forklm's branches always continue at the parent's positions (SGLang accepts the argument
    and ignores it), so only offsets that shift nothing are accepted."""
    if not isinstance(size, int) or size < 1:
        raise ValueError(f"fork size must be an int >= 1, got {size!r}")
    offsets = position_ids_offset
    if offsets is None or (isinstance(offsets, int) and offsets == 0):
        return
    if (isinstance(offsets, (list, tuple)) and len(offsets) == size
            and all(isinstance(o, int) and o == 0 for o in offsets)):
        return
    raise InvalidArgumentError("position_ids_offset", offsets, (
        "forklm cannot shift a fork branch's position ids (branches continue at the parent's "
        "positions); pass None, or 0 per branch"))


S = TypeVar("S")  # a branch: ProgramState, or TracerState while tracing
G = TypeVar("G", bound="BranchGroup[Any]")


class BranchGroup(Generic[S]):
    """The surface `s.fork(n)` returns, shared by run time and tracing: `group[i]`, `len`,
    iteration and `group += x`, where x is a function of the branch index, a list (one item per
    branch) or one expression for every branch. Subclasses add `join()`."""

    states: list[S]

    def __getitem__(self, i: int) -> S:
        return self.states[i]

    def __setitem__(self, i: int, state: S) -> None:
        """What `forks[i] += expr` stores back: the same branch state, appended to in place."""
        if state is not self.states[i]:
            raise TypeError("a fork group's branches cannot be replaced; append to forks[i]")

    def __len__(self) -> int:
        return len(self.states)

    def __iter__(self) -> Iterator[S]:
        return iter(self.states)

    def __iadd__(self: G, other: Any) -> G:
        if callable(other) and not isinstance(other, (str, Expr)):
            exprs = [other(i) for i in range(len(self.states))]
        elif isinstance(other, (list, tuple)):
            if len(other) != len(self.states):
                raise ValueError(f"got {len(other)} expressions for {len(self.states)} branches")
            exprs = list(other)
        else:
            exprs = [other] * len(self.states)
        for i, expr in enumerate(exprs):
            self[i] += expr
        return self

    @staticmethod
    def _check_mode(mode: str) -> None:
        if mode not in JOIN_MODES:
            raise ValueError(f"Invalid join mode: {mode!r}; expected one of {JOIN_MODES}")


class ProgramStateGroup(BranchGroup[ProgramState]):
    """What `s.fork(n)` returns at run time."""

    def __init__(self, states: list[ProgramState], parent: ProgramState, fork_id: int):
        self.states, self.parent, self.fork_id = states, parent, fork_id

    def join(self, mode: str = "gather_variable") -> None:
        """Wait for every branch; each variable a branch set becomes a list (branch order) on the
        parent. `concate_and_append` also appends each branch's new text to the parent's."""
        self._check_mode(mode)
        executors = [state._ex for state in self.states]
        for ex in executors:
            ex.sync()  # a branch's error is raised here, in the caller's thread
        self.parent._ex.join(self.fork_id, executors, mode)

