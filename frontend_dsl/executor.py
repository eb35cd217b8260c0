"""The executor behind a program state: appended nodes are queued and run in order by a worker, so
the program runs ahead and waits only when it reads a variable that is not ready.

Each node kind's execution is written once, as a coroutine in `_HANDLERS`. A plain program's
worker is a thread that drives them with `drive` (their awaits are blocking calls and never
suspend); an async program's worker is a task on its event loop (AsyncExecutor overrides the few
awaits: the backend calls, the wait for a join's branches, a branch's start)."""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from forklm.frontend_dsl import choices, ir
from forklm.frontend_dsl.backends.base import Backend, BackendError, ChatTurn, GenResult
from forklm.frontend_dsl.defaults import RunDefaults
from forklm.frontend_dsl.expr import cannot_append, flatten
from forklm.frontend_dsl.reasoning import ReasoningSplit
from forklm.frontend_dsl.streaming import EventLog, TextEvent, VariableEvent

T = TypeVar("T")


def drive(coro: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine whose awaits never suspend (a plain program's handlers, whose backend calls
    block the worker thread) to its end, without an event loop."""
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]
    coro.close()
    raise AssertionError("a plain program's worker awaited something that suspends")


def appendable(node: Any) -> bool:
    """Whether a program state runs `node` when it is appended (`s += node`)."""
    return isinstance(node, str) or (isinstance(node, ir.Node) and node.appendable)


class Executor:
    """Owns one program state's text, messages and variables. Only the worker mutates them while
    nodes are queued; readers wait on `_cond` until the variable's producers are done. A fork or
    join is queued as its IR node, with the branch executors it starts or merges beside it."""

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
        self._opaque = 0  # queued joins: what they set is known only when they run
        self._branches: dict[int, list[Executor]] = {}  # id(queued fork or join) -> branches
        self._fork_ids = itertools.count()
        self._num_queued = self._num_done = 0  # nodes queued / run without error, ever
        self._cond = threading.Condition()
        self._running = False
        self._body_thread: int | None = None  # a body running in the background (stream=True)
        self._on_done: list[Callable[[], None]] = []  # see when_done
        self.events = EventLog(self._cond, self.done)

    # -- the program's side --------------------------------------------------------------------
    def submit(self, expr: Any) -> None:
        """Queue `expr`'s nodes; raises ValueError (queueing nothing) for one it cannot run."""
        nodes = flatten(expr)
        for node in nodes:
            if not appendable(node):
                raise cannot_append(node)
        self._enqueue(nodes)

    def fork(self, size: int) -> tuple[int, list[Executor]]:
        """(fork id, branches): copies of this state as it is once the queue reaches the fork. A
        plain program waits for that here (raising the program's error), so its branches are
        ready when returned."""
        fork_id, branches = self._queue_fork(size)
        self.drain()
        self._raise_error()
        return fork_id, branches

    def _queue_fork(self, size: int) -> tuple[int, list[Executor]]:
        fork = ir.Fork(size, [], id=next(self._fork_ids))
        branches = [self._new_branch() for _ in range(size)]
        self._enqueue([fork], branches)
        return fork.id, branches

    def join(self, fork_id: int, branches: list[Executor], mode: str) -> None:
        """Queue the merge of `branches`: each variable they set becomes a list on this state."""
        self._enqueue([ir.Join(fork_id, mode)], branches)

    def _new_branch(self) -> Executor:
        return Executor(self.backend, self.defaults)

    def _enqueue(self, nodes: list[Any], branches: list[Executor] | None = None) -> None:
        with self._cond:
            if self.error is not None:  # the program already failed: raised at the next read
                if branches is not None:
                    self._abandon(branches)
                return
            for node in nodes:
                self._queue.append(node)
                self._num_queued += 1
                if branches is not None:
                    self._branches[id(node)] = branches
                self._count_pending(node, +1)
            if not self._running:
                self._running = True
                self._start_worker()

    def _count_pending(self, node: Any, step: int) -> None:
        """Count a queued node's outputs in (+1) or out (-1); a join's are counted as opaque."""
        if isinstance(node, ir.Join):
            self._opaque += step
        for name in node.produced_names() if isinstance(node, ir.Node) else []:
            self._pending[name] += step

    def _start_worker(self) -> None:
        """Start running the queue (called with `_cond` held, once per idle-to-busy change)."""
        threading.Thread(target=lambda: drive(self._work()), name="forklm-program",
                         daemon=True).start()

    def get(self, name: Any, table: str = "variables") -> Any:
        """Block until every queued producer of `name` has run; raise the program's error if any."""
        values = getattr(self, table)
        with self._cond:
            self._cond.wait_for(lambda: self.error is not None or (
                not self._pending[name] and not self._opaque
                and (name in values or not self._body_pending())))
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

    def sync(self) -> None:
        self.wait()
        with self._cond:
            self._raise_error()

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

    # -- the worker (a thread here, a task in AsyncExecutor) -----------------------------------
    async def _work(self) -> None:
        try:
            await self._released()
        except BaseException as e:  # the parent failed before the fork: the branch fails too
            self.error = self.error or e
        while (node := self._next()) is not None:
            try:
                await self._execute(node)
            except BaseException as e:  # raised to the program at its next read
                self._fail(node, e)
                if isinstance(e, asyncio.CancelledError):
                    with self._cond:
                        self._drop_queue()
                    self._stop()
                    raise
            with self._cond:
                self._count_pending(node, -1)
                self.events.notify()
            self._notify()
        self._stop()

    async def _released(self) -> None:
        """Until this state may run its queue: a plain program's branch may at once (its fork
        waited for the parent before returning it)."""

    def _next(self) -> Any:
        """The next queued node, or None when the queue is empty or the program failed; then the
        worker is no longer running (in the same locked step: a later append starts another)."""
        with self._cond:
            if self._queue and self.error is None:
                return self._queue.popleft()
            self._drop_queue()
            return None

    def _stop(self) -> None:
        """The worker is done: wake every reader and call the when_done callbacks that are due."""
        with self._cond:
            self.events.notify()
            due = self._take_on_done()
        self._notify()
        for fn in due:
            fn()

    def _fail(self, node: Any, error: BaseException) -> None:
        with self._cond:
            self.error = self.error or error
            self._abandon(self._branches.pop(id(node), []))

    def _drop_queue(self) -> None:
        """The queue is done or the program failed: forget what is left (hold `_cond`); forks
        that never ran fail their branches with the program's error."""
        for node in self._queue:
            self._abandon(self._branches.pop(id(node), []))
        self._queue.clear()
        self._pending.clear()
        self._opaque = 0
        self._running = False

    def _abandon(self, branches: list[Executor]) -> None:
        """Branches whose fork will never run (the program failed first)."""
        for branch in branches:
            branch._never_released(self.error)

    def _never_released(self, error: BaseException | None) -> None:
        """This branch's fork will never run (a plain program's fork raised instead)."""

    def _notify(self) -> None:
        """Wake what waits for a change beyond `_cond`'s waiters (an event loop's readers)."""

    async def _execute(self, node: Any) -> None:
        handler = next((_HANDLERS[t] for t in type(node).__mro__ if t in _HANDLERS), None)
        assert handler is not None, f"submit() queued a node it cannot run: {node!r}"
        await handler(self, node)
        with self._cond:
            self._num_done += 1

    def _append(self, text: str, owner: Any = None,
                logprobs: list[list[Any]] | None = None) -> None:
        """Append to the text and log the piece for streaming; it belongs to every open var_scope
        and to `owner` (the gen or select producing it), if any. `logprobs`: the entries of the
        tokens the piece holds (logged even when their text is not complete yet)."""
        if not text and not logprobs:
            return
        owners = (*self._scopes, owner) if owner is not None else tuple(self._scopes)
        with self._cond:
            self.text += text
            self.events.append(TextEvent(text, owners, logprobs or None))

    def _set(self, name: Any, value: Any, meta_info: Any) -> None:
        with self._cond:
            self.variables[name] = value
            self.meta_info[name] = meta_info
            self.produced.append(name)
            self.events.append(VariableEvent(name, value))

    # -- what the worker awaits: blocking here, awaited on the loop in AsyncExecutor -----------
    async def _generate(self, call: GenCall) -> GenResult:
        """The gen's backend call, its output appended as it streams (call.on_text)."""
        return self.backend.generate_turn(self.text, self._turn(), call.params, call.options,
                                          on_text=call.on_text)

    async def _select(self, node: ir.Select) -> choices.ChoicesDecision:
        return self.backend.select(self.text, node.choices, choices.resolve(node.choices_method))

    async def _finished(self, branch: Executor) -> None:
        """Until `branch` is done; its error is raised here (it stops this state too)."""
        branch.sync()

    # -- the node handlers (one per node type, see _HANDLERS) ----------------------------------
    async def _run_str(self, text: str) -> None:
        self._append(text)

    async def _run_text(self, node: ir.Text) -> None:
        self._append(node.text)

    async def _run_gen(self, gen: ir.Gen) -> None:
        """Call the backend, appending its output as it streams; a backend that does not stream
        (or streams only part) has the rest appended when it returns. A reasoning gen appends
        only the content (its reasoning is held back as it streams)."""
        call = GenCall(self, gen)
        call.finish(await self._generate(call))

    async def _run_select(self, node: ir.Select) -> None:
        decision = await self._select(node)
        self._append(decision.decision, node.name)
        self._set(node.name, decision.decision, decision.meta_info)

    async def _begin_role(self, node: ir.RoleBegin) -> None:
        if self._role is not None:
            raise ValueError(f"Nested roles are not allowed: {node.role} inside {self._role[0]}")
        prefix, suffix = self.backend.role_prefix_suffix(node.role, self.messages)
        if not self.messages and node.role != "system" and self.implied_system is None:
            default = self.backend.default_system_prompt()
            if default and default in prefix:  # the template put it in the text: list it too
                self.implied_system = default
        self._append(prefix)
        self._role = (node.role, len(self.text), suffix)

    async def _end_role(self, node: ir.RoleEnd) -> None:
        if self._role is None or self._role[0] != node.role:
            raise ValueError(f"{node.role}_end without a matching {node.role}_begin")
        _, start, suffix = self._role
        self.messages.append({"role": node.role, "content": self.text[start:].lstrip()})
        self._append(suffix)
        self._role = None

    async def _begin_scope(self, node: ir.ScopeBegin) -> None:
        self._scopes[node.name] = len(self.text)

    async def _end_scope(self, node: ir.ScopeEnd) -> None:
        self._set(node.name, self.text[self._scopes.pop(node.name):], None)

    async def _run_set(self, node: ir.SetVar) -> None:
        assert node.source == "literal", f"a program state sets values, not references: {node}"
        self._set(node.name, node.value, None)

    async def _run_fork(self, node: ir.Fork) -> None:
        """The branches start as copies of this state as it is now."""
        for branch in self._branches.pop(id(node)):
            self.copy_into(branch)
            branch._release()

    def _release(self) -> None:
        """This branch's fork has run: its queue may start (see `_released`)."""

    async def _run_join(self, node: ir.Join) -> None:
        """Once every branch is done, each variable a branch set becomes a list (branch order);
        concate_and_append also appends each branch's new text."""
        branches = self._branches.pop(id(node))
        for branch in branches:
            await self._finished(branch)
        names = list(dict.fromkeys(n for b in branches for n in b.produced if n is not None))
        if node.mode == "concate_and_append":
            self._append("".join(b.text[b.fork_start:] for b in branches))
        for name in names:
            self._set(name, [b.variables.get(name) for b in branches],
                      [b.meta_info.get(name) for b in branches])

    def _turn(self) -> ChatTurn:
        role, start = (self._role[0], self._role[1]) if self._role else (None, len(self.text))
        return ChatTurn(self.chat_messages(), role, self.text[start:])

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
        self.meta: dict[str, Any] | None = None  # the stream's meta_info so far (logprobs joined)

    def on_text(self, piece: str, meta_info: dict[str, Any] | None = None) -> None:
        """A streamed piece; a backend streaming logprobs passes the chunk's own meta_info
        (its tokens' output_token_logprobs and, on the first, the prompt's)."""
        self.streamed.append(piece)
        entries = None
        if meta_info is not None:
            self.meta = grow_meta_info(self.meta, meta_info)
            entries = meta_info.get("output_token_logprobs")
        text = piece if self.split is None else self.split.feed(piece)
        self.ex._append(text, self.gen.name, entries)

    def finish(self, result: GenResult) -> None:
        sent, split = "".join(self.streamed), self.split
        if not result.text.startswith(sent):
            raise BackendError(f"{type(self.ex.backend).__name__} streamed {sent!r}, which does "
                               f"not begin its result {result.text!r}")
        rest = result.text[len(sent):]
        self.ex._append(rest if split is None else split.feed(rest) + split.finish(),
                        self.gen.name, self._unstreamed_logprobs(result))
        self.ex._store_gen(self.gen, result, split)

    def _unstreamed_logprobs(self, result: GenResult) -> list[list[Any]] | None:
        """The result's output logprob entries the stream did not carry (all of them from a
        backend that returns whole), so a logprob stream always covers every token."""
        if result.samples is not None:
            return None
        entries = result.meta_info.get("output_token_logprobs") or []
        sent = len((self.meta or {}).get("output_token_logprobs") or [])
        return list(entries[sent:]) or None


# meta_info keys whose lists grow chunk by chunk; the prompt's come on the first chunk only.
_GROWING = ("output_token_logprobs", "output_top_logprobs")
_ONCE = ("input_token_logprobs", "input_top_logprobs")


def grow_meta_info(so_far: dict[str, Any] | None, chunk: dict[str, Any]) -> dict[str, Any]:
    """A stream's meta_info after `chunk`: the growing logprob lists joined (a new dict, so a
    reader holding the last one never sees it change), the prompt's kept from the first chunk,
    counts and finish reason from the latest, and SGLang's output_token_logprobs_length."""
    merged = {**chunk}
    for key in _GROWING:
        if key in chunk:
            merged[key] = [*(so_far or {}).get(key, []), *chunk[key]]
    for key in _ONCE:
        if so_far and so_far.get(key):
            merged[key] = so_far[key]
    merged["output_token_logprobs_length"] = len(merged.get("output_token_logprobs", []))
    return merged


# Every node a program state runs: what `s += ...` appends (ir.Node.appendable), forks and joins.
_HANDLERS: dict[type, Callable[[Executor, Any], Awaitable[None]]] = {
    str: Executor._run_str,
    ir.Text: Executor._run_text,
    ir.Gen: Executor._run_gen,
    ir.Select: Executor._run_select,
    ir.RoleBegin: Executor._begin_role,
    ir.RoleEnd: Executor._end_role,
    ir.ScopeBegin: Executor._begin_scope,
    ir.ScopeEnd: Executor._end_scope,
    ir.SetVar: Executor._run_set,
    ir.Fork: Executor._run_fork,
    ir.Join: Executor._run_join,
}


def handles(node_type: type) -> bool:
    """Whether the executor runs nodes of `node_type` (the check that every node kind has one)."""
    return any(t in _HANDLERS for t in node_type.__mro__)
