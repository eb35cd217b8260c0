"""Backends a program runs on: the in-process Engine (the embedded default) and a forklm server
over HTTP (RuntimeEndpoint)."""

from forklm.frontend_dsl.backends.base import Backend, BackendError, GenResult
from forklm.frontend_dsl.backends.engine_backend import EngineBackend
from forklm.frontend_dsl.backends.runtime_endpoint import RuntimeEndpoint

__all__ = ["Backend", "BackendError", "EngineBackend", "GenResult", "RuntimeEndpoint"]
