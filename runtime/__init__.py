"""forklm's engine: config, model, paged KV pool, radix cache, scheduler, sampling, detokenizer.

The main names are importable from here; each loads its module on first use (PEP 562), so a
light module (the radix cache, the KV pool) imports without the model stack.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "Engine": "forklm.runtime.engine.engine",
    "EngineClient": "forklm.runtime.engine.client",
    "EngineConfig": "forklm.runtime.config",
    "EngineRequest": "forklm.runtime.engine.engine_request",
    "GenerateOutput": "forklm.runtime.engine.results",
    "ModelInfo": "forklm.runtime.engine.builder",
    "RequestGroup": "forklm.runtime.engine.intake",
    "SamplingParams": "forklm.runtime.sampling.params",
}
__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:  # what __getattr__ gives, for type checkers
    from forklm.runtime.config import EngineConfig  # noqa: F401
    from forklm.runtime.engine.builder import ModelInfo  # noqa: F401
    from forklm.runtime.engine.client import EngineClient  # noqa: F401
    from forklm.runtime.engine.engine import Engine  # noqa: F401
    from forklm.runtime.engine.engine_request import EngineRequest  # noqa: F401
    from forklm.runtime.engine.intake import RequestGroup  # noqa: F401
    from forklm.runtime.engine.results import GenerateOutput  # noqa: F401
    from forklm.runtime.sampling.params import SamplingParams  # noqa: F401


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'forklm.runtime' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value
