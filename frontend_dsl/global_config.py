"""`sgl.global_config` (SGLang's process-wide frontend settings) and `sgl.__version__`."""

from __future__ import annotations

from importlib import metadata
from typing import Any

from forklm.runtime.errors import InvalidArgumentError

try:
    __version__ = metadata.version("forklm")
except metadata.PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0.0.0+unknown"


class GlobalConfig:
    """SGLang's GlobalConfig fields, each honoured or refused:

    - `default_backend`: the backend programs run on when given none (`set_default_backend`);
      None until one is set or the default in-process Engine is built.
    - `enable_precache_with_tracing` (True): `run_batch` of several items prefills the program's
      constant prefix once before they start.
    - `skip_special_tokens_in_output`, `spaces_between_special_tokens_in_out` (True): the
      detokenizer settings of every gen that does not set them (run defaults).
    - `verbosity` (0): kept for SGLang programs that set it; forklm reports through `logging`.
    - `enable_parallel_encoding` (False): joining forks by concatenating their KV caches is not
      something forklm can do (the joined text is prefilled as text), so setting it to True raises.
    And forklm's own:
    - `pin_program_context` (True): each program run holds an engine session, so the context
      its gens end with stays pinned in the radix cache while it runs (see SessionClient);
      False runs every gen as a plain request.
    Setting an unknown name raises AttributeError (a misspelt setting would otherwise do nothing).
    """

    _BOOLS = ("enable_precache_with_tracing", "skip_special_tokens_in_output",
              "spaces_between_special_tokens_in_out", "enable_parallel_encoding",
              "pin_program_context")

    def __init__(self) -> None:
        self.verbosity = 0
        self.enable_precache_with_tracing = True
        self.skip_special_tokens_in_output = True
        self.spaces_between_special_tokens_in_out = True
        self.enable_parallel_encoding = False
        self.pin_program_context = True

    @property
    def default_backend(self) -> Any:
        from forklm.frontend_dsl import program

        return program.current_default_backend()

    @default_backend.setter
    def default_backend(self, backend: Any) -> None:
        from forklm.frontend_dsl import program

        program.set_default_backend(backend)

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "default_backend":
            object.__setattr__(self, name, value)  # the property's setter
            return
        if name == "verbosity":
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise InvalidArgumentError(name, value, "must be an int >= 0")
        elif name in self._BOOLS:
            if not isinstance(value, bool):
                raise InvalidArgumentError(name, value, "must be a bool")
            if name == "enable_parallel_encoding" and value:
                raise InvalidArgumentError(name, value, (
                    "forklm cannot concatenate forked branches' KV caches; join(mode="
                    "'concate_and_append') appends the branches' text, which the next gen "
                    "prefills as text"))
        else:
            known = ["default_backend", "verbosity", *self._BOOLS]
            raise AttributeError(f"global_config has no setting {name!r}; known: {known}")
        object.__setattr__(self, name, value)

    def run_defaults(self) -> dict[str, Any]:
        """The sampling run defaults these settings imply (none while they are SGLang's)."""
        out: dict[str, Any] = {}
        if not self.skip_special_tokens_in_output:
            out["skip_special_tokens"] = False
        if not self.spaces_between_special_tokens_in_out:
            out["spaces_between_special_tokens"] = False
        return out

    def __repr__(self) -> str:
        names = ["verbosity", *self._BOOLS]
        return "GlobalConfig(" + ", ".join(f"{n}={getattr(self, n)!r}" for n in names) + ")"


global_config = GlobalConfig()
