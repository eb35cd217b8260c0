"""Backends a program runs on: the in-process Engine (the embedded default), a forklm server over
HTTP (RuntimeEndpoint), a local server process (Runtime, which lives with the server it starts:
forklm/server/local_runtime.py, loaded on first use) and any OpenAI-compatible server (OpenAI)."""

import importlib
from typing import TYPE_CHECKING, Any

__all__ = ["Backend", "BackendError", "ChatTurn", "EngineBackend", "GenResult", "OpenAI",
           "Runtime", "RuntimeEndpoint"]
# name -> its module, imported on first use: the server's program endpoint needs the engine's
# backend, not the HTTP client (httpx) that RuntimeEndpoint and the OpenAI backend load
_HOME = {
    **dict.fromkeys(("Backend", "BackendError", "ChatTurn", "GenResult"),
                    "forklm.frontend_dsl.backends.base"),
    "EngineBackend": "forklm.frontend_dsl.backends.engine_backend",
    "OpenAI": "forklm.frontend_dsl.backends.openai_backend",
    "RuntimeEndpoint": "forklm.frontend_dsl.backends.runtime_endpoint",
    "Runtime": "forklm.server.local_runtime",
}

if TYPE_CHECKING:
    from forklm.frontend_dsl.backends.base import Backend, BackendError, ChatTurn, GenResult
    from forklm.frontend_dsl.backends.engine_backend import EngineBackend
    from forklm.frontend_dsl.backends.openai_backend import OpenAI
    from forklm.frontend_dsl.backends.runtime_endpoint import RuntimeEndpoint
    from forklm.server.local_runtime import Runtime


def __getattr__(name: str) -> Any:
    module = _HOME.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
