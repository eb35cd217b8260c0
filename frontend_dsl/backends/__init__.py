"""Backends a program runs on: the in-process Engine (the embedded default), a forklm server over
HTTP (RuntimeEndpoint), a local server process (Runtime, which lives with the server it starts:
forklm/server/local_runtime.py, loaded on first use) and any OpenAI-compatible server (OpenAI)."""

import importlib
from typing import TYPE_CHECKING, Any

from forklm.frontend_dsl.backends.base import Backend, BackendError, ChatTurn, GenResult
from forklm.frontend_dsl.backends.engine_backend import EngineBackend
from forklm.frontend_dsl.backends.openai_backend import OpenAI
from forklm.frontend_dsl.backends.runtime_endpoint import RuntimeEndpoint

__all__ = ["Backend", "BackendError", "ChatTurn", "EngineBackend", "GenResult", "OpenAI",
           "Runtime", "RuntimeEndpoint"]

if TYPE_CHECKING:
    from forklm.server.local_runtime import Runtime


def __getattr__(name: str) -> Any:
    if name != "Runtime":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    runtime = importlib.import_module("forklm.server.local_runtime").Runtime
    globals()[name] = runtime
    return runtime
