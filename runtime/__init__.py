"""forklm's engine: config, model, paged KV pool, radix cache, scheduler, sampling, detokenizer.

The main names are importable from here; each loads its module on first use (PEP 562), so a
light module (the radix cache, the KV pool) imports without the model stack.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "Engine": "forklm.runtime.engine",
    "EngineClient": "forklm.runtime.engine_client",
    "EngineConfig": "forklm.runtime.config",
    "GenerateOutput": "forklm.runtime.results",
    "ModelInfo": "forklm.runtime.builder",
    "RequestGroup": "forklm.runtime.intake",
    "SamplingParams": "forklm.runtime.sampling_params",
}
__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:  # what __getattr__ gives, for type checkers
    from forklm.runtime.builder import ModelInfo  # noqa: F401
    from forklm.runtime.config import EngineConfig  # noqa: F401
    from forklm.runtime.engine import Engine  # noqa: F401
    from forklm.runtime.engine_client import EngineClient  # noqa: F401
    from forklm.runtime.intake import RequestGroup  # noqa: F401
    from forklm.runtime.results import GenerateOutput  # noqa: F401
    from forklm.runtime.sampling_params import SamplingParams  # noqa: F401


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'forklm.runtime' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value
