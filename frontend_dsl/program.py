"""Program (what `@function` returns): run, run_batch and their async twins; the default backend."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from forklm.frontend_dsl.backends.base import Backend
from forklm.frontend_dsl.defaults import SAMPLING_FIELDS, RunDefaults
from forklm.frontend_dsl.executor import Executor
from forklm.frontend_dsl.global_config import global_config
from forklm.frontend_dsl.state import ProgramState
from forklm.runtime.errors import InvalidArgumentError

if TYPE_CHECKING:
    from forklm.frontend_dsl.ir import Graph

logger = logging.getLogger(__name__)

IGNORED_RUN_OPTIONS = frozenset({"use_thread"})  # SGLang run() options with no meaning here

_default_backend: Backend | None = None
_default_lock = threading.Lock()


def set_default_backend(backend: Any) -> None:
    """The backend programs use when `run` is given none (a Backend or an Engine)."""
    global _default_backend
    _default_backend = as_backend(backend)


def current_default_backend() -> Backend | None:
    """The default backend if one is set or built, else None (builds nothing)."""
    return _default_backend


def get_default_backend() -> Backend:
    """The default backend; an in-process Engine on the default model is built on first use."""
    global _default_backend
    with _default_lock:
        if _default_backend is None:
            from forklm.frontend_dsl.backends.engine_backend import EngineBackend

            _default_backend = EngineBackend()
        return _default_backend


def as_backend(backend: Any) -> Backend:
    """`backend` as a Backend: None is the default backend, an Engine runs in process."""
    if backend is None:
        return get_default_backend()
    if isinstance(backend, Backend):
        return backend
    from forklm.frontend_dsl.backends.engine_backend import EngineBackend
    from forklm.runtime.engine.engine import Engine

    if isinstance(backend, Engine):
        return EngineBackend(backend)
    raise TypeError(f"expected a forklm Backend or Engine, got {type(backend).__name__}")


class Program:
    """A program: `def prog(s, *args)` decorated with `@function`. Call it (or `.run`) to execute."""

    def __init__(self, func: Callable[..., Any], num_api_spec_tokens: int | None = None,
                 bind_arguments: dict[str, Any] | None = None):
        params = list(inspect.signature(func).parameters.values())
        if not params:
            raise TypeError(f"program {func.__name__} must take the state `s` as first argument")
        self.func, self.num_api_spec_tokens = func, num_api_spec_tokens
        self.signature = inspect.signature(func)
        self.is_async = inspect.iscoroutinefunction(func)  # reads are awaited; runs on a loop
        self.arg_names = [p.name for p in params[1:]]
        self.bind_arguments = dict(bind_arguments or {})

    def bind(self, **kwargs: Any) -> Program:
        """A copy with some program arguments fixed."""
        unknown = set(kwargs) - set(self.arg_names)
        if unknown:
            raise TypeError(f"{self.func.__name__} has no argument(s) {sorted(unknown)}")
        return Program(self.func, self.num_api_spec_tokens, {**self.bind_arguments, **kwargs})

    def __call__(self, *args: Any, **kwargs: Any) -> ProgramState:
        return self.run(*args, **kwargs)

    def run(self, *args: Any, backend: Any = None, stream: bool = False,
            **kwargs: Any) -> ProgramState:
        """Run the program; keyword arguments that are not program arguments are run defaults for
        every gen (SamplingParams fields and return_logprob/logprob_start_len/top_logprobs_num).
        Returns at once with the state; its reads block until their values exist. With
        stream=True the program body itself runs in a background thread."""
        if self.is_async:
            self._outside_loop("run", "await prog.run_async(...)")
            if stream:
                raise TypeError(f"{self.func.__name__} is an async program; stream=True is for "
                                "plain ones (an async program reads s.text_async_iter())")
            return asyncio.run(self.run_async(*args, backend=backend, **kwargs))
        call_args, defaults = self._split(args, {**global_config.run_defaults(), **kwargs})
        backend_obj, release = with_session(as_backend(backend))
        state = ProgramState(Executor(backend_obj, defaults))
        try:
            if stream:
                state._ex.start_body(lambda: self._call_recording(state, call_args))
            else:
                self._invoke(state, call_args)
        finally:  # the session ends with the program (appends after that run unpinned)
            state._ex.when_done(release)
        return state

    def run_batch(self, batch_kwargs: list[Any], *, backend: Any = None,
                  num_threads: int | str = "auto", progress_bar: bool = False,
                  generator_style: bool = False, **defaults: Any) -> Any:
        """Run one program per item (a dict of arguments, or a list of positional values) on a
        thread pool, so their gens share engine batches. Returns the finished states in input
        order (a generator of them with generator_style=True). A failing item does not stop the
        others: its error is raised when its state is read; a bad argument fails the call.
        With several items the program is traced first (its body runs once on placeholders): a
        backend that runs whole batches itself gets the graph (`run_program_batch`); otherwise
        the graph's constant prefix is prefilled once so every item hits the prefix cache. A
        program that cannot be traced just runs item by item."""
        if self.is_async:
            self._outside_loop("run_batch", "await prog.run_batch_async(...)")
            states = asyncio.run(self.run_batch_async(
                batch_kwargs, backend=backend, num_threads=num_threads,
                progress_bar=progress_bar, **defaults))
            return iter(states) if generator_style else states
        backend_obj = as_backend(backend)
        defaults = {**global_config.run_defaults(), **defaults}
        items = [self._item_kwargs(item) for item in batch_kwargs]
        if not items:
            return iter([]) if generator_style else []
        for item in items:  # a bad argument fails the whole call here, before anything runs
            self._split((), {**defaults, **item})
        whole = self._run_whole_batch(backend_obj, items, defaults)
        if whole is not None:
            return iter(whole) if generator_style else whole
        if num_threads == "auto":
            num_threads = max(96, (os.cpu_count() or 1) * 16)
        assert isinstance(num_threads, int) and num_threads >= 1, num_threads
        pool = ThreadPoolExecutor(max_workers=min(num_threads, len(items)))
        futures = [pool.submit(self._run_to_end, backend_obj, item, defaults) for item in items]
        pool.shutdown(wait=False)
        if generator_style:
            return (f.result() for f in futures)
        if progress_bar:
            _show_progress(futures)
        return [f.result() for f in futures]

    def trace(self, **arguments: Any) -> Graph:
        """The program's request graph, built without a model. Arguments not given here are
        placeholders (the graph's arguments); raises TraceError when the program's text or control
        flow depends on a generated value."""
        from forklm.frontend_dsl.tracer import trace_program

        return trace_program(self, arguments)

    def cache(self, backend: Any = None) -> str:
        """SGLang's `cache_program`: prefill the text every run of this program starts with (its
        leading constant text and role markers, up to the first argument or gen) into the
        backend's prefix cache, so later runs hit it. Returns the prefix ("" when the program
        starts with a value that varies; nothing is sent then)."""
        backend_obj = as_backend(backend)
        prefix = constant_prefix(backend_obj, self._prefix_graph())
        if prefix:
            backend_obj.cache_prefix(prefix)
        return prefix

    async def run_async(self, *args: Any, backend: Any = None, **kwargs: Any) -> ProgramState:
        """`await prog.run_async(...)`: the finished state (its reads return at once); the event
        loop is not blocked. An `async def` program runs on this loop, no thread: its body
        awaits its reads (`await s["x"]`) and its gens and selects are awaited on the backend.
        A plain program runs in a thread."""
        if not self.is_async:
            def run_to_end() -> ProgramState:
                state = self.run(*args, backend=backend, **kwargs)
                state._ex.wait()
                return state

            return await asyncio.to_thread(run_to_end)
        call_args, defaults = self._split(args, {**global_config.run_defaults(), **kwargs})
        return await self._run_body_async(as_backend(backend), call_args, defaults)

    async def run_batch_async(self, batch_kwargs: list[Any], *, backend: Any = None,
                              num_threads: int | str = "auto", progress_bar: bool = False,
                              **kwargs: Any) -> list[ProgramState]:
        """`await prog.run_batch_async([...])`: the finished states in input order. An `async def`
        program runs every item as a task on this loop (no thread per item; the engine batches
        their gens), at most `num_threads` at once when it is an int ("auto": all); as in
        run_batch, a traced program's constant prefix is prefilled once first, and a backend
        that runs whole batches gets the graph. A plain program runs run_batch in a thread."""
        kwargs.pop("generator_style", None)
        if not self.is_async:
            return await asyncio.to_thread(self.run_batch, batch_kwargs, backend=backend,
                                           num_threads=num_threads, progress_bar=progress_bar,
                                           **kwargs)
        if num_threads != "auto" and (not isinstance(num_threads, int) or num_threads < 1):
            raise InvalidArgumentError("num_threads", num_threads, 'expected an int >= 1 or "auto"')
        limit = asyncio.Semaphore(num_threads if isinstance(num_threads, int) else len(batch_kwargs)
                                  or 1)
        backend_obj = as_backend(backend)
        defaults = {**global_config.run_defaults(), **kwargs}
        items = [self._item_kwargs(item) for item in batch_kwargs]
        runs = [self._split((), {**defaults, **item}) for item in items]  # bad args fail here
        states = await asyncio.to_thread(self._run_whole_batch, backend_obj, items, defaults)
        if states is not None:
            return states

        async def run_item(call_args: inspect.BoundArguments, run_defaults: RunDefaults
                           ) -> ProgramState:
            async with limit:
                return await self._run_body_async(backend_obj, call_args, run_defaults)

        tasks = [asyncio.ensure_future(run_item(call_args, run_defaults))
                 for call_args, run_defaults in runs]
        try:
            if progress_bar:
                await _show_progress_async(tasks)
            return list(await asyncio.gather(*tasks))
        finally:
            for task in tasks:  # the caller was cancelled: so is every item still running
                task.cancel()

    async def _run_body_async(self, backend: Backend, call_args: inspect.BoundArguments,
                              defaults: RunDefaults) -> ProgramState:
        """Await the body and then its queue; an exception the body raises is kept as the
        state's error (raised when the returned state is read). Cancelled, the gen in flight
        is aborted."""
        from forklm.frontend_dsl.async_executor import AsyncExecutor
        from forklm.frontend_dsl.async_state import AsyncProgramState

        backend, release = with_session(backend)
        ex = AsyncExecutor(backend, defaults)
        try:
            try:
                await self.func(AsyncProgramState(ex), *call_args.args[1:], **call_args.kwargs)
            except Exception as e:  # noqa: BLE001 - the program's own error, kept for its reader
                ex.record_error(e)
            await ex.wait_async()
        except BaseException:
            ex.cancel()
            raise
        finally:
            release()  # queued, not awaited: a cancelled run releases its pins too
        ex.seal()
        return ProgramState(ex)

    def _outside_loop(self, method: str, instead: str) -> None:
        """An async program's blocking entry points start their own event loop, so they cannot
        run on a thread that already runs one."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return
        raise TypeError(f"{self.func.__name__} is an async program and this thread runs an event "
                        f"loop: {method}() would block it; use {instead}")

    # -- helpers -------------------------------------------------------------------------------
    def _prefix_graph(self) -> Graph:
        """The graph of the program's start (up to where it cannot be traced)."""
        from forklm.frontend_dsl.tracer import trace_program

        return trace_program(self, {}, prefix_only=True)

    def _run_whole_batch(self, backend: Backend, items: list[dict[str, Any]],
                         defaults: dict[str, Any]) -> list[ProgramState] | None:
        """With several items, the program's graph: the finished states when the backend runs
        whole batches itself; otherwise its constant prefix prefilled (a hint) and None, and
        the caller runs the items one by one (also when the program cannot be traced)."""
        graph = self._try_trace() if len(items) > 1 else None
        if graph is None:
            return None
        states = backend.run_program_batch(graph, items, defaults)
        if states is None and global_config.enable_precache_with_tracing:
            hint_prefix(backend, graph)
        return states

    def _try_trace(self) -> Graph | None:
        """The graph for batch-level optimizations, or None when the program cannot be traced
        (it then simply runs item by item)."""
        try:
            return self.trace()
        except Exception as e:  # noqa: BLE001 - tracing runs user code on placeholders
            logger.debug("%s is not traceable (%s); no batch prefix hint", self.func.__name__, e)
            return None

    def _run_to_end(self, backend: Backend, item: dict[str, Any],
                    defaults: dict[str, Any]) -> ProgramState:
        call_args, run_defaults = self._split((), {**defaults, **item})
        backend, release = with_session(backend)
        state = ProgramState(Executor(backend, run_defaults))
        try:
            self._call_recording(state, call_args)
            state._ex.wait()
        finally:
            release()
        return state

    def _invoke(self, state: ProgramState, bound: inspect.BoundArguments) -> None:
        self.func(state, *bound.args[1:], **bound.kwargs)

    def _call_recording(self, state: ProgramState, call_args: inspect.BoundArguments) -> None:
        """Run the body; an exception it raises is kept as the state's error (raised on read)."""
        try:
            self._invoke(state, call_args)
        except BaseException as e:
            state._ex.record_error(e)

    def _item_kwargs(self, item: Any) -> dict[str, Any]:
        if isinstance(item, dict):
            return item
        if isinstance(item, (list, tuple)):
            if len(item) != len(self.arg_names):
                raise TypeError(f"Given arguments mismatch the SGL function signature: "
                                f"{len(item)} values for {self.arg_names}")
            return dict(zip(self.arg_names, item))
        raise TypeError(f"a batch item must be a dict or a list of arguments, got {item!r}")

    def _split(self, args: tuple[Any, ...], kwargs: dict[str, Any]
               ) -> tuple[inspect.BoundArguments, RunDefaults]:
        """Program arguments (bound to the signature, defaults applied) vs run defaults."""
        takes_var_kw = any(p.kind is p.VAR_KEYWORD for p in self.signature.parameters.values())
        prog_kwargs = {k: v for k, v in kwargs.items()
                       if k in self.arg_names or (takes_var_kw and k not in SAMPLING_FIELDS)}
        defaults, rest = RunDefaults.from_kwargs(
            {k: v for k, v in kwargs.items() if k not in prog_kwargs})
        for key in rest:
            if key not in IGNORED_RUN_OPTIONS:
                raise TypeError(f"{self.func.__name__}() got an unexpected keyword {key!r}; it is "
                                f"neither a program argument {self.arg_names} nor a run default "
                                f"{sorted(RunDefaults.NAMES)}")
        prog_kwargs = {**self.bind_arguments, **prog_kwargs}
        bound = self.signature.bind(None, *args, **prog_kwargs)
        bound.apply_defaults()
        return bound, defaults


def with_session(backend: Backend) -> tuple[Backend, Callable[[], None]]:
    """The backend one program run uses, holding an engine session for the run when the backend
    has them and global_config.pin_program_context is on, and the function that releases it."""
    bound = backend.with_session() if global_config.pin_program_context else None
    return bound if bound is not None else (backend, _nothing)


def _nothing() -> None:
    pass


def _show_progress(futures: list[Future]) -> None:
    from concurrent.futures import as_completed

    from tqdm import tqdm

    for _ in tqdm(as_completed(futures), total=len(futures)):
        pass


async def _show_progress_async(tasks: Sequence[asyncio.Future[Any]]) -> None:
    from tqdm import tqdm

    for next_done in tqdm(asyncio.as_completed(tasks), total=len(tasks)):
        with contextlib.suppress(Exception):
            await next_done


def constant_prefix(backend: Backend, graph: Graph) -> str:
    """The text every run of `graph` starts with: its leading texts and the chat template's role
    prefixes and suffixes around them, up to the first node whose text depends on the run."""
    from forklm.frontend_dsl import ir

    text, messages = "", []  # type: tuple[str, list[dict[str, str]]]
    role: tuple[str, int, str] | None = None  # (role, content start, suffix), as the executor
    for node in graph.nodes:
        if isinstance(node, ir.Text):
            text += node.text
        elif isinstance(node, ir.RoleBegin) and role is None:
            prefix, suffix = backend.role_prefix_suffix(node.role, messages)
            text += prefix
            role = (node.role, len(text), suffix)
        elif isinstance(node, ir.RoleEnd) and role is not None and role[0] == node.role:
            messages.append({"role": node.role, "content": text[role[1]:].lstrip()})
            text, role = text + role[2], None
        elif not isinstance(node, (ir.SetVar, ir.ScopeBegin, ir.ScopeEnd)):
            break
    return text


def hint_prefix(backend: Backend, graph: Graph) -> None:
    """Prefill the graph's constant prefix once, so the batch's items all hit the prefix cache.
    A backend without a cache (or chat template) simply gets no hint."""
    try:
        prefix = constant_prefix(backend, graph)
        if prefix:
            backend.cache_prefix(prefix)
    except NotImplementedError:
        logger.debug("%s cannot cache a prefix; no batch prefix hint", type(backend).__name__)
    except Exception as e:  # noqa: BLE001 - a failed hint must not change the batch's outcome
        logger.warning("prefix hint failed (%s); running the batch without it", e)
