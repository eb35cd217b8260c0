"""Run defaults (what every gen of one run inherits) and how a gen becomes one engine call."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from forklm.frontend_dsl.ir import Gen
from forklm.runtime.engine.engine_request import LOGPROB_OPTIONS, LogprobOptions
from forklm.runtime.sampling.params import SamplingParams

SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))

# dtype name -> (regex, extra stop strings), as SGLang's RuntimeEndpoint rewrites `gen(dtype=...)`.
REGEX_INT = r"[-+]?[0-9]+[ \n]*"
REGEX_FLOAT = r"[-+]?[0-9]*\.?[0-9]+[ \n]*"
REGEX_BOOL = r"(True|False)"
REGEX_STR = r"\"[\w\d\s]*\""
DTYPE_RULES: dict[str, tuple[str, list[str]]] = {
    "int": (REGEX_INT, [" ", "\n"]),
    "float": (REGEX_FLOAT, [" ", "\n"]),
    "str": (REGEX_STR, []),
    "bool": (REGEX_BOOL, []),
}


@dataclass(frozen=True)
class RunDefaults:
    """Run-level defaults every gen inherits: SamplingParams-named fields and logprob options
    (only those set; a gen's own settings take precedence)."""

    sampling: dict[str, Any] = field(default_factory=dict)
    logprob: LogprobOptions = field(default_factory=LogprobOptions)

    NAMES: ClassVar[frozenset[str]] = SAMPLING_FIELDS | frozenset(LOGPROB_OPTIONS)

    @classmethod
    def from_kwargs(cls, kwargs: Mapping[str, Any]) -> tuple[RunDefaults, dict[str, Any]]:
        """The run defaults among `kwargs` (a None value sets none, SGLang's reading) and the
        keywords that are not run defaults, as they were."""
        sampling = {k: v for k, v in kwargs.items() if k in SAMPLING_FIELDS and v is not None}
        logprob = {k: v for k, v in kwargs.items() if k in LOGPROB_OPTIONS and v is not None}
        rest = {k: v for k, v in kwargs.items() if k not in cls.NAMES}
        return cls(sampling, LogprobOptions(**logprob)), rest

    def checked(self) -> RunDefaults:
        """These defaults once the sampling fields are valid together (else InvalidArgumentError)."""
        SamplingParams.from_dict(self.sampling)
        return self

    def to_kwargs(self) -> dict[str, Any]:
        """The defaults as the keywords `from_kwargs` reads back."""
        return {**self.sampling, **self.logprob.to_dict()}

    def for_gen(self, gen: Gen) -> tuple[SamplingParams, LogprobOptions]:
        """The engine call of `gen`: these defaults overlaid with its own settings; a dtype adds
        its regex and stop strings. Returns the parameters and the backend's logprob_options."""
        merged = {**self.sampling, **gen.sampling}
        if gen.dtype is not None:
            regex, stops = DTYPE_RULES[gen.dtype]
            stop = merged.get("stop") or []
            merged["regex"] = regex
            merged["stop"] = [*([stop] if isinstance(stop, str) else stop), *stops] or None
        return SamplingParams.from_dict(merged), self.logprob.overlay(gen.logprob_options)
