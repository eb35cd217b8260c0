"""The executor behind a ProgramState: a queue of appended nodes run in order by a worker thread,
so the Python program runs ahead and blocks only when it reads a variable that is not ready."""

from __future__ import annotations

import inspect
import threading
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from forklm.frontend_dsl.backends.base import Backend, BackendError, GenResult
from forklm.frontend_dsl.primitives import (
    DTYPE_RULES,
    Gen,
    RoleBegin,
    RoleEnd,
    Select,
    SetVar,
    VarScopeBegin,
    VarScopeEnd,
    flatten,
)
from forklm.frontend_dsl.streaming import EventLog, TextEvent, VariableEvent
from forklm.runtime.sampling import SamplingParams


@dataclass(frozen=True)
class JoinNode:
    """Merge the results of forked children into the parent (built by ProgramStateGroup.join)."""

    variables: dict[str, list[Any]] = field(default_factory=dict)
    meta_info: dict[str, list[Any]] = field(default_factory=dict)
    text: str = ""


@dataclass
class RunDefaults:
    """Run-level defaults every gen inherits: SamplingParams-named fields and logprob options."""

    sampling: dict[str, Any] = field(default_factory=dict)
    logprob_options: dict[str, Any] = field(default_factory=dict)


def _produces(node: Any) -> str | None:
    if isinstance(node, (Gen, Select)):
        return node.name
    if isinstance(node, (VarScopeEnd, SetVar)):
        return node.name
    return None


class Executor:
    """Owns one program state's text, messages and variables. Only the worker thread mutates
    them while nodes are queued; readers wait on `_cond` until the variable's producers are done."""

    def __init__(self, backend: Backend, defaults: RunDefaults):
        self.backend, self.defaults = backend, defaults
        self.text = ""
        self.messages: list[dict[str, str]] = []
        self.variables: dict[Any, Any] = {}
        self.meta_info: dict[Any, Any] = {}
        self.produced: list[Any] = []  # variable names set since creation, in order (for join)
        self.error: BaseException | None = None
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
        self.events = EventLog(self._cond, self.done)

    # -- user thread ---------------------------------------------------------------------------
    def submit(self, expr: Any) -> None:
        nodes = flatten(expr) if not isinstance(expr, JoinNode) else [expr]
        with self._cond:
            if self.error is not None:
                return  # the program already failed; the error is raised at the next read
            for node in nodes:
                self._queue.append(node)
                for name in self._names(node):
                    self._pending[name] += 1
            if not self._running:
                self._running = True
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
        children = []
        for _ in range(size):
            child = Executor(self.backend, self.defaults)
            child.text, child.fork_start = self.text, len(self.text)
            if self.text:  # so a branch's stream, too, concatenates to its whole text
                with child._cond:
                    child.events.append(TextEvent(self.text, ()))
            child.messages = [dict(m) for m in self.messages]
            child.implied_system = self.implied_system
            child.variables, child.meta_info = dict(self.variables), dict(self.meta_info)
            child._role, child._scopes = self._role, dict(self._scopes)
            children.append(child)
        return children

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
        name = _produces(node)
        return [] if name is None else [name]

    # -- worker thread -------------------------------------------------------------------------
    def _work(self) -> None:
        while True:
            with self._cond:
                if not self._queue or self.error is not None:
                    self._queue.clear()
                    self._pending.clear()
                    self._running = False
                    self.events.notify()
                    return
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

    def _execute(self, node: Any) -> None:
        if isinstance(node, str):
            self._append(node)
        elif isinstance(node, Gen):
            result = self._generate(node)
            self._set(node.name, result.text, result.meta_info)
        elif isinstance(node, Select):
            decision = self.backend.select(self.text, node.choices, node.choices_method)
            self._append(decision.decision, node.name)
            self._set(node.name, decision.decision, decision.meta_info)
        elif isinstance(node, RoleBegin):
            self._begin_role(node.role)
        elif isinstance(node, RoleEnd):
            self._end_role(node.role)
        elif isinstance(node, VarScopeBegin):
            self._scopes[node.name] = len(self.text)
        elif isinstance(node, VarScopeEnd):
            self._set(node.name, self.text[self._scopes.pop(node.name):], None)
        elif isinstance(node, SetVar):
            self._set(node.name, node.value, None)
        elif isinstance(node, JoinNode):
            self._append(node.text)
            for name, values in node.variables.items():
                self._set(name, values, node.meta_info.get(name))
        else:
            raise AssertionError(f"unknown node {node!r}")

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

    def _generate(self, gen: Gen) -> GenResult:
        """Call the backend, appending its output as it streams; a backend that does not stream
        (or streams only part) has the rest appended when it returns."""
        params, options = self._resolve(gen)
        prompt, streamed = self.text, []

        def on_text(piece: str) -> None:
            streamed.append(piece)
            self._append(piece, gen.name)

        if _accepts_on_text(type(self.backend)):
            result = self.backend.generate(prompt, params, options, on_text=on_text)
        else:
            result = self.backend.generate(prompt, params, options)
        sent = "".join(streamed)
        if not result.text.startswith(sent):
            raise BackendError(f"{type(self.backend).__name__} streamed {sent!r}, which does not "
                               f"begin its result {result.text!r}")
        self._append(result.text[len(sent):], gen.name)
        return result

    def _resolve(self, gen: Gen) -> tuple[SamplingParams, dict[str, Any]]:
        """Run defaults overlaid with the gen's own settings; a dtype adds its regex and stops."""
        merged = {**self.defaults.sampling, **gen.sampling}
        if gen.dtype is not None:
            regex, stops = DTYPE_RULES[gen.dtype]
            stop = merged.get("stop") or []
            merged["regex"] = regex
            merged["stop"] = [*([stop] if isinstance(stop, str) else stop), *stops] or None
        options = {**self.defaults.logprob_options, **gen.logprob_options}
        return SamplingParams.from_dict(merged), options

    def load_finished(self, text: str, messages: list[dict[str, str]],
                      variables: dict[Any, Any], meta_info: dict[Any, Any]) -> None:
        """Fill a fresh executor with a program run elsewhere (a server); the text and variables
        are logged as events, so streaming readers replay them."""
        self._append(text)
        for name, value in variables.items():
            self._set(name, value, meta_info.get(name))
        self.messages = [dict(m) for m in messages]

    def _begin_role(self, role: str) -> None:
        if self._role is not None:
            raise ValueError(f"Nested roles are not allowed: {role} inside {self._role[0]}")
        prefix, suffix = self.backend.role_prefix_suffix(role, self.messages)
        if not self.messages and role != "system" and self.implied_system is None:
            default = self.backend.default_system_prompt()
            if default and default in prefix:  # the template put it in the text: list it too
                self.implied_system = default
        self._append(prefix)
        self._role = (role, len(self.text), suffix)

    def _end_role(self, role: str) -> None:
        if self._role is None or self._role[0] != role:
            raise ValueError(f"{role}_end without a matching {role}_begin")
        _, start, suffix = self._role
        self.messages.append({"role": role, "content": self.text[start:].lstrip()})
        self._append(suffix)
        self._role = None


_ON_TEXT_SUPPORT: dict[type[Backend], bool] = {}


def _accepts_on_text(backend_type: type[Backend]) -> bool:
    """Backends written before streaming take (prompt, sampling_params, logprob_options) only."""
    if backend_type not in _ON_TEXT_SUPPORT:
        params = inspect.signature(backend_type.generate).parameters
        _ON_TEXT_SUPPORT[backend_type] = "on_text" in params or any(
            p.kind is p.VAR_KEYWORD for p in params.values())
    return _ON_TEXT_SUPPORT[backend_type]

