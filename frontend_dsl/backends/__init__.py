"""Backends a program runs on: the in-process Engine (the embedded default), a forklm server over
HTTP (RuntimeEndpoint), a local server process (Runtime) and any OpenAI-compatible server
(OpenAI)."""

from forklm.frontend_dsl.backends.base import Backend, BackendError, ChatTurn, GenResult
from forklm.frontend_dsl.backends.engine_backend import EngineBackend
from forklm.frontend_dsl.backends.openai_backend import OpenAI
from forklm.frontend_dsl.backends.runtime import Runtime
from forklm.frontend_dsl.backends.runtime_endpoint import RuntimeEndpoint

__all__ = ["Backend", "BackendError", "ChatTurn", "EngineBackend", "GenResult", "OpenAI",
           "Runtime", "RuntimeEndpoint"]
