"""Typed exceptions for user and configuration problems (internal invariants use assert)."""

from __future__ import annotations


class ForkLMError(Exception):
    """Base class of every error forklm raises on purpose."""


class InvalidArgumentError(ForkLMError, ValueError):
    """A request or config argument has a bad value; the message names the argument and value."""

    def __init__(self, name: str, value: object, why: str):
        self.name, self.value = name, value
        super().__init__(f"{name}={value!r}: {why}")


class GrammarCompileTimeoutError(InvalidArgumentError):
    """A constraint's grammar was not compiled within EngineConfig.grammar_compile_timeout_s."""


class ModelNotFoundError(ForkLMError, ValueError):
    """The model path does not resolve to a loadable model; the message says what to install."""


class UnsupportedModelError(ModelNotFoundError):
    """The model was found but its architecture, or a config field that changes its computation,
    is not supported; the message lists what is."""


class KVCacheFullError(ForkLMError, RuntimeError):
    """The slot allocator cannot satisfy a request even after evicting the radix cache."""


class EngineShutdownError(ForkLMError, RuntimeError):
    """A request was submitted to, or was pending in, an engine that has shut down."""


class WorkerLostError(EngineShutdownError):
    """A tensor-parallel rank died or a collective with it failed: the engine cannot run another
    step, so it fails its requests and shuts down."""
