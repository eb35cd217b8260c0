"""forklm: a structured-generation program runtime for LLMs.

Public API re-exports live here; the engine is in forklm.runtime, the language in forklm.frontend_dsl.
"""

from __future__ import annotations

from forklm.runtime.config import EngineConfig
from forklm.runtime.errors import ForkLMError, InvalidArgumentError, ModelNotFoundError

__all__ = ["EngineConfig", "ForkLMError", "InvalidArgumentError", "ModelNotFoundError"]
