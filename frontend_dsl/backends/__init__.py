"""Backends a program runs on: the in-process Engine (the embedded default)."""

from forklm.frontend_dsl.backends.base import Backend, BackendError, GenResult
from forklm.frontend_dsl.backends.engine_backend import EngineBackend

__all__ = ["Backend", "BackendError", "EngineBackend", "GenResult"]
