"""The executor behind a ProgramState: a queue of appended nodes run in order by a worker thread,
so the Python program runs ahead and blocks only when it reads a variable that is not ready."""

from __future__ import annotations

import threading
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from forklm.frontend_dsl import choices, ir
from forklm.frontend_dsl.backends.base import Backend, BackendError, ChatTurn, GenResult
from forklm.frontend_dsl.defaults import RunDefaults
from forklm.frontend_dsl.expr import cannot_append, flatten
from forklm.frontend_dsl.reasoning import ReasoningSplit
from forklm.frontend_dsl.streaming import EventLog, TextEvent, VariableEvent


@dataclass(frozen=True)
class JoinNode:
    """Merge the results of forked children into the parent (built by ProgramStateGroup.join)."""

    variables: dict[str, list[Any]] = field(default_factory=dict)
    meta_info: dict[str, list[Any]] = field(default_factory=dict)
    text: str = ""


class Executor:
    """Owns one program state's text, messages and variables. Only the worker thread mutates
    them while nodes are queued; readers wait on `_cond` until the variable's producers are done."""

    INTERNAL_NODES: tuple[type, ...] = (JoinNode,)  # queued as they are, not user expressions
    error: BaseException | None  # what stopped the program, raised at its next read

    def __init__(self, backend: Backend, defaults: RunDefaults):
        self.backend, self.defaults = backend, defaults
        self.text = ""
        self.messages: list[dict[str, str]] = []
        self.variables: dict[Any, Any] = {}
        self.meta_info: dict[Any, Any] = {}
        self.produced: list[Any] = []  # variable names set since creation, in order (for join)
        self.error = None
        self.fork_start = 0
        # The template's default system prompt when it injected one before the first message
        # (in the text but not written by the program); messages() lists it first.
        self.implied_system: str | None = None
        self._role: tuple[str, int, str] | None = None  # (role, content start, suffix)
        self._scopes: dict[str, int] = {}
        self._queue: deque[Any] = deque()
        self._pending: Counter[Any] = Counter()
        self._cond = threading.Condition()
        self._running = False
        self._body_thread: int | None = None  # a body running in the background (stream=True)
        self._on_done: list[Callable[[], None]] = []  # see when_done
        self.events = EventLog(self._cond, self.done)

    # -- user thread ---------------------------------------------------------------------------
    def submit(self, expr: Any) -> None:
        """Queue `expr`'s nodes; raises ValueError (queueing nothing) for one it cannot run."""
        nodes = [expr] if isinstance(expr, self.INTERNAL_NODES) else flatten(expr)
        for node in nodes:
            if not isinstance(node, self.INTERNAL_NODES) and not runs(node):
                raise cannot_append(node)
        with self._cond:
            if self.error is not None:
                return  # the program already failed; the error is raised at the next read
            for node in nodes:
                self._queue.append(node)
                self._enqueue_hook(node)
                for name in self._names(node):
                    self._pending[name] += 1
            if not self._running:
                self._running = True
                self._start_worker()

    def _enqueue_hook(self, node: Any) -> None:
        """What a subclass counts as a node is queued (called with `_cond` held)."""

    def _start_worker(self) -> None:
        """Start running the queue (called with `_cond` held, once per idle-to-busy change)."""
        threading.Thread(target=self._work, name="forklm-program", daemon=True).start()

    def get(self, name: Any, table: str = "variables") -> Any:
        """Block until every queued producer of `name` has run; raise the program's error if any."""
        values = getattr(self, table)
        with self._cond:
            self._cond.wait_for(lambda: self.error is not None or (not self._pending[name] and (
                name in values or not self._body_pending())))
            self._raise_error()
            if name not in values:
                raise KeyError(f"no variable {name!r}; the state has {sorted(map(str, values))}")
            return values[name]

    def wait(self) -> None:
        """Block until the program body and the queue are done (or failed); never raises."""
        with self._cond:
            self._cond.wait_for(lambda: not self._running and not self._body_pending())

    def drain(self) -> None:
        """Block until the queued nodes have run (callable from the program body)."""
        with self._cond:
            self._cond.wait_for(lambda: not self._running)

    def when_done(self, fn: Callable[[], None]) -> None:
        """Call fn once nothing is queued or running and no background body can append more:
        now if that holds already, else from the thread that finishes last."""
        with self._cond:
            if not self.done():
                self._on_done.append(fn)
                return
        fn()

    def _take_on_done(self) -> list[Callable[[], None]]:
        """The when_done callbacks due now (hold `_cond`)."""
        if not self.done():
            return []
        due, self._on_done = self._on_done, []
        return due

    def start_body(self, body: Callable[[], None]) -> None:
        """Run the program body in a background thread (stream=True); until it returns, other
        threads' reads of names not yet produced wait for it."""

        def run() -> None:
            try:
                body()
            finally:
                with self._cond:
                    self._body_thread = None
                    self.events.notify()
                    due = self._take_on_done()
                for fn in due:
                    fn()

        thread = threading.Thread(target=run, name="forklm-program-body", daemon=True)
        with self._cond:  # registered before the body can append or anyone can read
            thread.start()
            self._body_thread = thread.ident

    def _body_pending(self) -> bool:
        return self._body_thread not in (None, threading.get_ident())

    def done(self) -> bool:
        """Nothing is queued or running and no background body can append more (hold `_cond`)."""
        return not self._running and not self._body_pending()

    def chat_messages(self) -> list[dict[str, str]]:
        """The messages with the template's implied system prompt first, as the text has it."""
        implied = [] if self.implied_system is None else [
            {"role": "system", "content": self.implied_system}]
        return [*implied, *(dict(m) for m in self.messages)]

    def sync(self) -> None:
        self.wait()
        with self._cond:
            self._raise_error()

    def fork(self, size: int) -> list[Executor]:
        self.drain()
        self._raise_error()
        children = [Executor(self.backend, self.defaults) for _ in range(size)]
        for child in children:
            self.copy_into(child)
        return children

    def copy_into(self, child: Executor) -> None:
        """Make a fresh `child` a fork branch of this state as it is now."""
        child.text, child.fork_start = self.text, len(self.text)
        if self.text:  # so a branch's stream, too, concatenates to its whole text
            with child._cond:
                child.events.append(TextEvent(self.text, ()))
        child.messages = [dict(m) for m in self.messages]
        child.implied_system = self.implied_system
        child.variables, child.meta_info = dict(self.variables), dict(self.meta_info)
        child._role, child._scopes = self._role, dict(self._scopes)

    def load_finished(self, text: str, messages: list[dict[str, str]],
                      variables: dict[Any, Any], meta_info: dict[Any, Any]) -> None:
        """Fill a fresh executor with a program run elsewhere (a server); the text and variables
        are logged as events, so streaming readers replay them."""
        self._append(text)
        for name, value in variables.items():
            self._set(name, value, meta_info.get(name))
        self.messages = [dict(m) for m in messages]

    def record_error(self, error: BaseException) -> None:
        """Keep an error raised outside the worker (the program body) unless one came first."""
        with self._cond:
            self._cond.wait_for(lambda: not self._running)
            self.error = self.error or error
            self.events.notify()

    def _raise_error(self) -> None:
        if self.error is not None:
            raise self.error

    @staticmethod
    def _names(node: Any) -> list[Any]:
        if isinstance(node, JoinNode):
            return [*node.variables]
        if not isinstance(node, ir.Node):
            return []  # text, or a subclass's internal node
        return ir.produced_names(node)

    # -- worker thread -------------------------------------------------------------------------
    def _drop_queue(self) -> None:
        """The queue is done or the program failed: forget what is left (hold `_cond`)."""
        self._queue.clear()
        self._pending.clear()
        self._running = False

    def _work(self) -> None:
        while True:
            with self._cond:
                if not self._queue or self.error is not None:
                    self._drop_queue()
                    self.events.notify()
                    due = self._take_on_done()
                    break
                node = self._queue.popleft()
            try:
                self._execute(node)
            except BaseException as e:  # handed to the user's thread at the next read
                with self._cond:
                    self.error = e
            with self._cond:
                for name in self._names(node):
                    self._pending[name] -= 1
                self.events.notify()
        for fn in due:
            fn()

    def _execute(self, node: Any) -> None:
        handler = _handler(node)
        assert handler is not None, f"submit() queued a node it cannot run: {node!r}"
        handler(self, node)

    def _append(self, text: str, owner: Any = None) -> None:
        """Append to the text and log the piece for streaming; it belongs to every open var_scope
        and to `owner` (the gen or select producing it), if any."""
        if not text:
            return
        owners = (*self._scopes, owner) if owner is not None else tuple(self._scopes)
        with self._cond:
            self.text += text
            self.events.append(TextEvent(text, owners))

    def _set(self, name: Any, value: Any, meta_info: Any) -> None:
        with self._cond:
            self.variables[name] = value
            self.meta_info[name] = meta_info
            self.produced.append(name)
            self.events.append(VariableEvent(name, value))

    # -- the node handlers (one per node type, see _HANDLERS) ----------------------------------
    def _run_text(self, node: ir.Text) -> None:
        self._append(node.text)

    def _run_gen(self, gen: ir.Gen) -> None:
        """Call the backend, appending its output as it streams; a backend that does not stream
        (or streams only part) has the rest appended when it returns. A reasoning gen appends
        only the content (its reasoning is held back as it streams)."""
        call = GenCall(self, gen)
        call.finish(self.backend.generate_turn(self.text, self._turn(), call.params, call.options,
                                               on_text=call.on_text))

    def _store_gen(self, gen: ir.Gen, result: GenResult, split: ReasoningSplit | None) -> None:
        """Set the gen's variable (with n > 1, a list of the samples') and its reasoning's."""
        samples = result.samples or [(result.text, result.meta_info)]
        texts, metas = [t for t, _ in samples], [m for _, m in samples]
        one = result.samples is None
        reasonings = None
        if split is not None:
            parts = [split.parse(t) for t in texts]
            texts, reasonings = [c for c, _ in parts], [r for _, r in parts]
        self._set(gen.name, texts[0] if one else texts, metas[0] if one else metas)
        if reasonings is not None:
            self._set(ir.reasoning_name(gen.name or ""), reasonings[0] if one else reasonings,
                      None)

    def _turn(self) -> ChatTurn:
        role, start = (self._role[0], self._role[1]) if self._role else (None, len(self.text))
        return ChatTurn(self.chat_messages(), role, self.text[start:])

    def _begin_role(self, node: ir.RoleBegin) -> None:
        if self._role is not None:
            raise ValueError(f"Nested roles are not allowed: {node.role} inside {self._role[0]}")
        prefix, suffix = self.backend.role_prefix_suffix(node.role, self.messages)
        if not self.messages and node.role != "system" and self.implied_system is None:
            default = self.backend.default_system_prompt()
            if default and default in prefix:  # the template put it in the text: list it too
                self.implied_system = default
        self._append(prefix)
        self._role = (node.role, len(self.text), suffix)

    def _end_role(self, node: ir.RoleEnd) -> None:
        if self._role is None or self._role[0] != node.role:
            raise ValueError(f"{node.role}_end without a matching {node.role}_begin")
        _, start, suffix = self._role
        self.messages.append({"role": node.role, "content": self.text[start:].lstrip()})
        self._append(suffix)
        self._role = None

    def _run_select(self, node: ir.Select) -> None:
        self._store_select(node, self.backend.select(
            self.text, node.choices, choices.resolve(node.choices_method)))

    def _store_select(self, node: ir.Select, decision: choices.ChoicesDecision) -> None:
        self._append(decision.decision, node.name)
        self._set(node.name, decision.decision, decision.meta_info)

    def _begin_scope(self, node: ir.ScopeBegin) -> None:
        self._scopes[node.name] = len(self.text)

    def _end_scope(self, node: ir.ScopeEnd) -> None:
        self._set(node.name, self.text[self._scopes.pop(node.name):], None)

    def _run_set(self, node: ir.SetVar) -> None:
        assert node.source == "literal", f"a program state sets values, not references: {node}"
        self._set(node.name, node.value, None)

    def _run_join(self, node: JoinNode) -> None:
        self._append(node.text)
        for name, values in node.variables.items():
            self._set(name, values, node.meta_info.get(name))


class GenCall:
    """One gen's run around its backend call: the params, a callback that appends each streamed
    piece as it arrives, and `finish`, which appends what was not streamed and sets the gen's
    variable (a reasoning gen appends only the content; its reasoning is held back)."""

    def __init__(self, ex: Executor, gen: ir.Gen):
        self.ex, self.gen = ex, gen
        self.params, self.options = ex.defaults.for_gen(gen)
        self.split = None if gen.separate_reasoning is None else ReasoningSplit(
            gen.separate_reasoning, ex.text)
        self.streamed: list[str] = []

    def on_text(self, piece: str) -> None:
        self.streamed.append(piece)
        self.ex._append(piece if self.split is None else self.split.feed(piece), self.gen.name)

    def finish(self, result: GenResult) -> None:
        sent, split = "".join(self.streamed), self.split
        if not result.text.startswith(sent):
            raise BackendError(f"{type(self.ex.backend).__name__} streamed {sent!r}, which does "
                               f"not begin its result {result.text!r}")
        rest = result.text[len(sent):]
        self.ex._append(rest if split is None else split.feed(rest) + split.finish(),
                        self.gen.name)
        self.ex._store_gen(self.gen, result, split)


_HANDLERS: dict[type, Callable[[Executor, Any], None]] = {
    str: Executor._append,
    ir.Text: Executor._run_text,
    ir.Gen: Executor._run_gen,
    ir.Select: Executor._run_select,
    ir.RoleBegin: Executor._begin_role,
    ir.RoleEnd: Executor._end_role,
    ir.ScopeBegin: Executor._begin_scope,
    ir.ScopeEnd: Executor._end_scope,
    ir.SetVar: Executor._run_set,
    JoinNode: Executor._run_join,
}


def _handler(node: Any) -> Callable[[Executor, Any], None] | None:
    return next((_HANDLERS[t] for t in type(node).__mro__ if t in _HANDLERS), None)


def runs(node: Any) -> bool:
    """Whether a program state can run `node` when it is appended (the interpreter walks the
    graph's other nodes: its blocks, args and reads)."""
    return _handler(node) is not None

