"""forklm: a structured-generation program runtime for LLMs.

Public API re-exports live here; the engine is in forklm.runtime, the language in forklm.frontend_dsl.
They load on first use (PEP 562), so importing one runtime module does not load the whole stack.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from forklm.runtime.cpu_threads import preload_openmp

# OpenMP threads that spin a bounded while between ops, unless the user chose a wait policy: torch's
# libgomp loads now, before torch, and the environment stays as it was (runtime/cpu_threads.py).
preload_openmp()

# name -> the module that defines it; every other public name is the language's (frontend_dsl).
_RUNTIME_NAMES = {
    "Engine": "forklm.runtime.engine.engine",
    "EngineConfig": "forklm.runtime.config",
    "SamplingParams": "forklm.runtime.sampling.params",
    **dict.fromkeys(("EngineShutdownError", "ForkLMError", "InvalidArgumentError",
                     "KVCacheFullError", "ModelNotFoundError", "UnsupportedModelError"),
                    "forklm.runtime.errors"),
}
_SUBPACKAGES = ("frontend_dsl", "kernels", "runtime", "server")

if TYPE_CHECKING:  # what __getattr__ gives, for type checkers
    from forklm.frontend_dsl import *  # noqa: F403
    from forklm.runtime.config import EngineConfig  # noqa: F401
    from forklm.runtime.engine.engine import Engine  # noqa: F401
    from forklm.runtime.errors import (  # noqa: F401
        EngineShutdownError,
        ForkLMError,
        InvalidArgumentError,
        KVCacheFullError,
        ModelNotFoundError,
        UnsupportedModelError,
    )
    from forklm.runtime.sampling.params import SamplingParams  # noqa: F401


def __getattr__(name: str) -> Any:
    if name in _RUNTIME_NAMES:
        value = getattr(importlib.import_module(_RUNTIME_NAMES[name]), name)
    elif name in _SUBPACKAGES:  # `import forklm; forklm.runtime...` as before the lazy loading
        value = importlib.import_module(f"forklm.{name}")
    elif name == "__version__":  # `import forklm as sgl; sgl.__version__`, as SGLang's
        value = importlib.import_module("forklm.frontend_dsl.global_config").__version__
    elif name == "__all__":
        value = [*_dsl_names(), *_RUNTIME_NAMES]
    elif not name.startswith("_") and name in _dsl_names():
        value = getattr(importlib.import_module("forklm.frontend_dsl"), name)
    else:
        raise AttributeError(f"module 'forklm' has no attribute {name!r}")
    globals()[name] = value  # the next lookup is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_dsl_names(), *_RUNTIME_NAMES})


def _dsl_names() -> list[str]:
    return list(importlib.import_module("forklm.frontend_dsl").__all__)
