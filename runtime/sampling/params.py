"""SamplingParams: one request's sampling knobs (SGLang's names and defaults), validated once on
creation, and the decoding Constraint they may carry."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

from forklm.runtime.errors import InvalidArgumentError
from forklm.runtime.sampling.checks import (
    check_extras,
    check_grammar_size,
    is_number,
    normalize_logit_bias,
    normalize_structural_tag,
    shorten,
    str_list,
)
from forklm.runtime.sampling.stop_regex import normalize_stop_regex

# SGLang rewrites temperature < 1e-6 to greedy: dividing logits by it would overflow anyway.
_GREEDY_TEMPERATURE = 1e-6

# Bounds on what one request may ask for, so that no value can fail inside an engine step (and so
# take the other requests of its batch down) or cost work far beyond its output.
# Samples of one request (OpenAI's server-side bound too); each is a full request.
MAX_N = 64
# int32's largest: above the vocabulary size top_k keeps every token anyway, and a larger Python
# int overflows the tensor the sampler builds from it.
MAX_TOP_K = 2**31 - 1
# Beyond a few the distribution is all but uniform; the bound keeps logits / temperature finite
# in float32 (1e39 would be inf there, and -inf / inf is nan).
MAX_TEMPERATURE = 1e4
# logits / penalty must stay finite in float32 (a penalty of 1e-40 is 0 there).
MIN_REPETITION_PENALTY = 0.01
# Stop strings are matched on every step; a long one also holds that much text back from the
# stream (the same bound as stop_regex's matches: runtime/sampling/stop_regex.py MAX_MATCH_LEN).
MAX_STOP_STRINGS = 64
MAX_STOP_LEN = 1024  # characters
# Each stop token id is looked up on every step (and banned under min_new_tokens).
MAX_STOP_TOKEN_IDS = 1024

# field -> (valid?, why); the type is checked before the range.
_INT_RULES = {
    "max_new_tokens": (lambda v: v >= 0, "must be an int >= 0 (0 = prefill/score only)"),
    "min_new_tokens": (lambda v: v >= 0, "must be an int >= 0"),
    "top_k": (lambda v: v == -1 or 1 <= v <= MAX_TOP_K,
              f"must be an int, -1 (off) or in [1, {MAX_TOP_K}]"),
    "n": (lambda v: 1 <= v <= MAX_N, f"must be an int in [1, {MAX_N}]"),
}
_FLOAT_RULES = {
    "temperature": (lambda v: 0 <= v <= MAX_TEMPERATURE,
                    f"must be a number in [0, {MAX_TEMPERATURE:g}] (0 = greedy)"),
    "top_p": (lambda v: 0 < v <= 1, "must be a number in (0, 1]"),
    "min_p": (lambda v: 0 <= v <= 1, "must be a number in [0, 1]"),
    "frequency_penalty": (lambda v: -2 <= v <= 2, "must be a number in [-2, 2]"),
    "presence_penalty": (lambda v: -2 <= v <= 2, "must be a number in [-2, 2]"),
    "repetition_penalty": (lambda v: MIN_REPETITION_PENALTY <= v <= 2,
                           f"must be a number in [{MIN_REPETITION_PENALTY}, 2] (1 = off)"),
}
_BOOL_FIELDS = ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens",
                "no_stop_trim")
_ALIASES = {"sampling_seed": "seed"}
# The fields whose OpenAI API name differs (the server's OpenAI endpoints and the DSL's OpenAI
# backend map every other field by its own name).
OPENAI_NAMES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens"}
CONSTRAINT_KINDS = ("regex", "json_schema", "ebnf", "choices", "structural_tag")


class Constraint(NamedTuple):
    """A decoding constraint in canonical text form; also the grammar compile cache's key."""

    kind: str  # one of CONSTRAINT_KINDS
    # The regex, the schema as JSON text, the EBNF text, the choices as a JSON list, or the
    # structural tag as JSON text.
    spec: str


@dataclass(frozen=True)
class SamplingParams:
    """One request's sampling knobs; the only place they are defined (validated on creation)."""

    max_new_tokens: int = 128  # 0 = prefill/score only
    min_new_tokens: int = 0  # EOS and stop ids are banned until this many tokens exist
    temperature: float = 1.0  # < 1e-6 = greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 = off
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] | None = None  # a single str becomes [str]
    stop_token_ids: list[int] | None = None
    # Regexes searched in the output text as it grows (see runtime/sampling/stop_regex.py); [] = none.
    stop_regex: list[str] | None = None  # a single str becomes [str]
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    n: int = 1
    seed: int | None = None  # "sampling_seed" in from_dict; None = the engine picks one
    # token id (int or decimal str) -> added to its logit before sampling, in [-100, 100]
    # (OpenAI's range: +-100 is in effect a ban or a forced choice); stored with int keys.
    logit_bias: Mapping[int, float] | None = None
    # SGLang's per-request data for custom logit processors: kept, but forklm runs none.
    custom_params: Mapping[str, Any] | None = None
    stream_interval: int | None = None  # native streams send a chunk per this many tokens
    # Constrained decoding, at most one of: the output fully matches `regex`; is JSON valid under
    # `json_schema` (a dict or JSON text; stored as text); derives from `ebnf` (xgrammar's EBNF
    # dialect, start rule `root`); equals one of `choices`; or follows `structural_tag` (SGLang's
    # {"type": "structural_tag", "structures": [{begin, schema, end}], "triggers": [...]}, or
    # xgrammar's {"type": "structural_tag", "format": {...}}; a dict or JSON text, stored as text).
    regex: str | None = None
    json_schema: str | Mapping[str, Any] | None = None
    ebnf: str | None = None
    choices: list[str] | None = None
    structural_tag: str | Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        for name, (ok, why) in _INT_RULES.items():
            _check(_is_int(getattr(self, name)) and ok(getattr(self, name)), name,
                   getattr(self, name), why)
        for name, (ok, why) in _FLOAT_RULES.items():
            value = getattr(self, name)
            _check(is_number(value) and ok(value), name, value, why)
            object.__setattr__(self, name, float(value))
        for name in _BOOL_FIELDS:
            _check(isinstance(getattr(self, name), bool), name, getattr(self, name),
                   "must be a bool")
        _check(self.min_new_tokens <= self.max_new_tokens, "min_new_tokens",
               self.min_new_tokens, f"must be <= max_new_tokens ({self.max_new_tokens})")
        _check(self.seed is None or (_is_int(self.seed) and 0 <= self.seed < 2**64), "seed",
               self.seed, "must be None or an int in [0, 2**64)")
        object.__setattr__(self, "stop", _normalize_stop(self.stop))
        object.__setattr__(self, "stop_token_ids", _normalize_stop_ids(self.stop_token_ids))
        object.__setattr__(self, "stop_regex", normalize_stop_regex(self.stop_regex))
        object.__setattr__(self, "logit_bias", normalize_logit_bias(self.logit_bias))
        check_extras(self.custom_params, self.stream_interval)
        _check_constraint(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> SamplingParams:
        """Build from a request's JSON object; unknown keys are rejected, listing known ones."""
        known = {f.name for f in dataclasses.fields(cls)}
        kwargs: dict[str, Any] = {}
        for key, value in d.items():
            name = _ALIASES.get(key, key)
            if name not in known:
                raise InvalidArgumentError(key, value, "unknown sampling parameter; known: "
                                           + ", ".join(sorted(known | set(_ALIASES))))
            if name in kwargs and kwargs[name] != value:
                raise InvalidArgumentError(key, value, f"conflicts with {name}={kwargs[name]!r}")
            kwargs[name] = value
        return cls(**kwargs)

    @classmethod
    def coerce(cls, x: SamplingParams | Mapping[str, Any] | None) -> SamplingParams:
        if x is None:
            return cls()
        if isinstance(x, SamplingParams):
            return x
        if isinstance(x, Mapping):
            return cls.from_dict(x)
        raise InvalidArgumentError("sampling_params", x, "expected a SamplingParams, dict or None")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def uses_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0
                or self.presence_penalty != 0.0)

    @property
    def constraint(self) -> Constraint | None:
        for kind in CONSTRAINT_KINDS:
            value = getattr(self, kind)
            if value is not None:
                return Constraint(kind, value if isinstance(value, str) else json.dumps(value))
        return None

    @property
    def uses_truncation(self) -> bool:
        """Whether top-k or top-p cut the distribution (min-p alone needs no candidates)."""
        return self.top_k != -1 or self.top_p < 1.0


def _check(ok: bool, name: str, value: object, why: str) -> None:
    if not ok:
        raise InvalidArgumentError(name, value, why)


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _normalize_stop(stop: object) -> list[str] | None:
    items = str_list(stop, "stop", MAX_STOP_STRINGS, "stop strings")
    for s in items or ():
        _check(0 < len(s) <= MAX_STOP_LEN, "stop", shorten(s),
               f"stop strings must have 1..{MAX_STOP_LEN} characters")
    return items


def _check_constraint(params: SamplingParams) -> None:
    """At most one constraint, each of the right type; a schema dict is stored as JSON text."""
    given = [k for k in CONSTRAINT_KINDS if getattr(params, k) is not None]
    if len(given) > 1:
        raise InvalidArgumentError(given[1], getattr(params, given[1]),
                                   f"only one of {', '.join(CONSTRAINT_KINDS)} may be set "
                                   f"(also got {given[0]})")
    for kind in ("regex", "ebnf"):
        value = getattr(params, kind)
        _check(value is None or (isinstance(value, str) and value != ""), kind, value,
               "must be a non-empty str")
    object.__setattr__(params, "structural_tag", normalize_structural_tag(params.structural_tag))
    schema = params.json_schema
    if isinstance(schema, Mapping):
        try:
            object.__setattr__(params, "json_schema", json.dumps(schema))
        except (TypeError, ValueError, RecursionError) as e:  # RecursionError: nested too deep
            raise InvalidArgumentError("json_schema", "<object>",
                                       f"not JSON-serializable: {e!r}") from e
    else:
        _check(schema is None or (isinstance(schema, str) and schema != ""), "json_schema",
               schema, "must be a dict or a non-empty JSON str")
    choices = params.choices
    if choices is not None:
        _check(isinstance(choices, (list, tuple)) and len(choices) > 0
               and all(isinstance(c, str) and c for c in choices), "choices", choices,
               "must be a non-empty list of non-empty str")
        object.__setattr__(params, "choices", list(choices))
    constraint = params.constraint
    if constraint is not None:
        check_grammar_size(*constraint)


def _normalize_stop_ids(ids: object) -> list[int] | None:
    if ids is None:
        return None
    if not isinstance(ids, (list, tuple, set, frozenset)) or len(ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidArgumentError("stop_token_ids", _short_list(ids),
                                   f"must be a list of at most {MAX_STOP_TOKEN_IDS} token ids")
    if not all(_is_int(t) and t >= 0 for t in ids):
        raise InvalidArgumentError("stop_token_ids", ids, "must be a list of token ids (ints >= 0)")
    return list(ids)


def _short_list(value: object) -> object:
    return f"<{len(value)} items>" if isinstance(value, (list, tuple, set, frozenset)) else value
