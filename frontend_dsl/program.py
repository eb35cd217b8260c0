"""Program (what `@function` returns): run, run_batch and their async twins; the default backend."""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from forklm.frontend_dsl.backends.base import Backend
from forklm.frontend_dsl.executor import Executor, RunDefaults
from forklm.frontend_dsl.primitives import LOGPROB_OPTIONS
from forklm.frontend_dsl.state import ProgramState
from forklm.runtime.sampling import SamplingParams

_SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))
_IGNORED_RUN_OPTIONS = frozenset({"use_thread"})  # SGLang run() options with no meaning here

_default_backend: Backend | None = None
_default_lock = threading.Lock()


def set_default_backend(backend: Any) -> None:
    """The backend programs use when `run` is given none (a Backend or an Engine)."""
    global _default_backend
    _default_backend = _as_backend(backend)


def get_default_backend() -> Backend:
    """The default backend; an in-process Engine on the default model is built on first use."""
    global _default_backend
    with _default_lock:
        if _default_backend is None:
            from forklm.frontend_dsl.backends.engine_backend import EngineBackend

            _default_backend = EngineBackend()
        return _default_backend


def _as_backend(backend: Any) -> Backend:
    if backend is None:
        return get_default_backend()
    if isinstance(backend, Backend):
        return backend
    from forklm.frontend_dsl.backends.engine_backend import EngineBackend
    from forklm.runtime.engine import Engine

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
        call_args, defaults = self._split(args, kwargs)
        state = ProgramState(Executor(_as_backend(backend), defaults))
        if stream:
            state._ex.start_body(lambda: self._call_recording(state, call_args))
        else:
            self._invoke(state, call_args)
        return state

    def run_batch(self, batch_kwargs: list[Any], *, backend: Any = None,
                  num_threads: int | str = "auto", progress_bar: bool = False,
                  generator_style: bool = False, **defaults: Any) -> Any:
        """Run one program per item (a dict of arguments, or a list of positional values) on a
        thread pool, so their gens share engine batches. Returns the finished states in input
        order (a generator of them with generator_style=True). A failing item does not stop the
        others: its error is raised when its state is read."""
        backend_obj = _as_backend(backend)
        items = [self._item_kwargs(item) for item in batch_kwargs]
        if not items:
            return iter([]) if generator_style else []
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

    async def run_async(self, *args: Any, **kwargs: Any) -> ProgramState:
        """`await prog.run_async(...)`: the finished state; the event loop is not blocked."""

        def run_to_end() -> ProgramState:
            state = self.run(*args, **kwargs)
            state._ex.wait()
            return state

        return await asyncio.to_thread(run_to_end)

    async def run_batch_async(self, batch_kwargs: list[Any], **kwargs: Any) -> list[ProgramState]:
        """`await prog.run_batch_async([...])`: run_batch without blocking the event loop."""
        kwargs.pop("generator_style", None)
        return await asyncio.to_thread(self.run_batch, batch_kwargs, **kwargs)

    # -- helpers -------------------------------------------------------------------------------
    def _run_to_end(self, backend: Backend, item: dict[str, Any],
                    defaults: dict[str, Any]) -> ProgramState:
        call_args, run_defaults = self._split((), {**defaults, **item})
        state = ProgramState(Executor(backend, run_defaults))
        self._call_recording(state, call_args)
        state._ex.wait()
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
        prog_kwargs, defaults = dict(self.bind_arguments), RunDefaults()
        for key, value in kwargs.items():
            if key in self.arg_names or (takes_var_kw and key not in _SAMPLING_FIELDS):
                prog_kwargs[key] = value
            elif key in _SAMPLING_FIELDS:
                if value is not None:
                    defaults.sampling[key] = value
            elif key in LOGPROB_OPTIONS:
                if value is not None:
                    defaults.logprob_options[key] = value
            elif key not in _IGNORED_RUN_OPTIONS:
                raise TypeError(f"{self.func.__name__}() got an unexpected keyword {key!r}; it is "
                                f"neither a program argument {self.arg_names} nor a run default "
                                f"{sorted(_SAMPLING_FIELDS | set(LOGPROB_OPTIONS))}")
        bound = self.signature.bind(None, *args, **prog_kwargs)
        bound.apply_defaults()
        return bound, defaults


def _show_progress(futures: list[Future]) -> None:
    from concurrent.futures import as_completed

    from tqdm import tqdm

    for _ in tqdm(as_completed(futures), total=len(futures)):
        pass

