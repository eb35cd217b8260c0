"""forklm: a structured-generation program runtime for LLMs.

Public API re-exports live here; the engine is in forklm.runtime, the language in forklm.frontend_dsl.
"""

from __future__ import annotations

import os

# OpenMP threads that spin while idle make the engine ~15x slower when another process (or the
# HTTP server's threads) share the cores; this must be set before torch is imported.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from forklm import frontend_dsl as _dsl  # noqa: E402
from forklm.frontend_dsl import *  # noqa: E402,F403  (the language: SGLang's frontend names)
from forklm.runtime.config import EngineConfig  # noqa: E402
from forklm.runtime.engine import Engine  # noqa: E402
from forklm.runtime.errors import (  # noqa: E402
    EngineShutdownError,
    ForkLMError,
    InvalidArgumentError,
    KVCacheFullError,
    ModelNotFoundError,
    UnsupportedModelError,
)
from forklm.runtime.sampling import SamplingParams  # noqa: E402

__all__ = [
    *_dsl.__all__,
    "Engine", "EngineConfig", "EngineShutdownError", "ForkLMError", "InvalidArgumentError",
    "KVCacheFullError", "ModelNotFoundError", "UnsupportedModelError", "SamplingParams",
]
