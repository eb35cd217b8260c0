"""SamplingParams (SGLang's names and defaults) and the batched sampler run once per engine step.

Pipeline per step, vectorized over the rows of `logits` [B, V]:
  1. penalties: repetition (HF/CTRL style) over prompt + output ids, then frequency and presence
     (OpenAI style) over output ids only; skipped when no row uses a penalty.
  2. min-new-tokens: `min_tokens_stop_ids` get -inf while len(output_ids) < min_new_tokens.
  3. temperature: sampled rows are divided by their temperature; greedy rows are left as they are.
  4. logprobs = log_softmax of those logits, i.e. *before* top-k/top-p/min-p truncation. The chosen
     token's logprob and the top logprobs are read from it for every row (one log_softmax pass).
  5. greedy rows (temperature ~ 0 or top_k == 1) take the argmax. Sampled rows apply top-k, then
     top-p over the top-k-renormalized distribution (smallest prefix whose mass reaches top_p; the
     top token is always kept), then min-p (drop p < min_p * p_max), and draw by inverse CDF with
     one uniform from the row's own generator, so a row's sample depends only on its own seed.
Rows with top-k/top-p work on the top candidates (torch.topk, widened until every row's top-p set
fits) instead of sorting the whole vocabulary, which costs ~30x more on CPU.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import torch

from forklm.runtime.errors import InvalidArgumentError

# SGLang rewrites temperature < 1e-6 to greedy: dividing logits by it would overflow anyway.
_GREEDY_TEMPERATURE = 1e-6
# First candidate count for top-p rows without a smaller top_k; a peaked LLM distribution
# usually reaches top_p=0.95 well inside 64 tokens, and topk(64) is ~30x cheaper than a sort.
_MIN_CANDIDATES = 64
_CANDIDATE_GROWTH = 8

# field -> (valid?, why); the type is checked before the range.
_INT_RULES = {
    "max_new_tokens": (lambda v: v >= 0, "must be an int >= 0 (0 = prefill/score only)"),
    "min_new_tokens": (lambda v: v >= 0, "must be an int >= 0"),
    "top_k": (lambda v: v == -1 or v >= 1, "must be an int, -1 (off) or >= 1"),
    "n": (lambda v: v >= 1, "must be an int >= 1"),
}
_FLOAT_RULES = {
    "temperature": (lambda v: v >= 0, "must be a number >= 0 (0 = greedy)"),
    "top_p": (lambda v: 0 < v <= 1, "must be a number in (0, 1]"),
    "min_p": (lambda v: 0 <= v <= 1, "must be a number in [0, 1]"),
    "frequency_penalty": (lambda v: -2 <= v <= 2, "must be a number in [-2, 2]"),
    "presence_penalty": (lambda v: -2 <= v <= 2, "must be a number in [-2, 2]"),
    "repetition_penalty": (lambda v: 0 < v <= 2, "must be a number in (0, 2] (1 = off)"),
}
_BOOL_FIELDS = ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens",
                "no_stop_trim")
_ALIASES = {"sampling_seed": "seed"}
CONSTRAINT_KINDS = ("regex", "json_schema", "ebnf", "choices")


class Constraint(NamedTuple):
    """A decoding constraint in canonical text form; also the grammar compile cache's key."""

    kind: str  # one of CONSTRAINT_KINDS
    spec: str  # the regex, the schema as JSON text, the EBNF text, or the choices as a JSON list


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
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    n: int = 1
    seed: int | None = None  # "sampling_seed" in from_dict; None = the engine picks one
    # Constrained decoding, at most one of: the output fully matches `regex`; is JSON valid under
    # `json_schema` (a dict or JSON text; stored as text); derives from `ebnf` (xgrammar's EBNF
    # dialect, start rule `root`); or equals one of `choices`.
    regex: str | None = None
    json_schema: str | Mapping[str, Any] | None = None
    ebnf: str | None = None
    choices: list[str] | None = None

    def __post_init__(self) -> None:
        for name, (ok, why) in _INT_RULES.items():
            _check(_is_int(getattr(self, name)) and ok(getattr(self, name)), name,
                   getattr(self, name), why)
        for name, (ok, why) in _FLOAT_RULES.items():
            value = getattr(self, name)
            _check(_is_number(value) and ok(value), name, value, why)
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


def _is_number(v: object) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)


def _normalize_stop(stop: object) -> list[str] | None:
    if stop is None:
        return None
    items = [stop] if isinstance(stop, str) else stop
    if not (isinstance(items, (list, tuple)) and all(isinstance(s, str) for s in items)):
        raise InvalidArgumentError("stop", stop, "must be a str or a list of str")
    _check(all(items), "stop", stop, "stop strings must be non-empty")
    return list(items)


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
    schema = params.json_schema
    if isinstance(schema, Mapping):
        try:
            object.__setattr__(params, "json_schema", json.dumps(schema))
        except (TypeError, ValueError) as e:
            raise InvalidArgumentError("json_schema", schema, f"not JSON-serializable: {e}") from e
    else:
        _check(schema is None or (isinstance(schema, str) and schema != ""), "json_schema",
               schema, "must be a dict or a non-empty JSON str")
    choices = params.choices
    if choices is not None:
        _check(isinstance(choices, (list, tuple)) and len(choices) > 0
               and all(isinstance(c, str) and c for c in choices), "choices", choices,
               "must be a non-empty list of non-empty str")
        object.__setattr__(params, "choices", list(choices))


def _normalize_stop_ids(ids: object) -> list[int] | None:
    if ids is None:
        return None
    if not (isinstance(ids, (list, tuple, set, frozenset))
            and all(_is_int(t) and t >= 0 for t in ids)):
        raise InvalidArgumentError("stop_token_ids", ids, "must be a list of token ids (ints >= 0)")
    return list(ids)


class SamplingRow(Protocol):
    """What `sample` reads from each request of the batch (the engine's request object)."""

    sampling_params: SamplingParams
    generator: torch.Generator | None  # per-request RNG; None = torch's global RNG
    origin_input_ids: list[int]  # prompt ids (repetition penalty)
    output_ids: list[int]  # tokens generated so far
    min_tokens_stop_ids: list[int]  # EOS + stop_token_ids, banned until min_new_tokens
    top_logprobs_num: int  # 0 = none


class SampleResult(NamedTuple):
    token_ids: list[int]
    logprobs: list[float]  # logprob of the chosen token (see the module docstring)
    top_logprobs: list[list[tuple[float, int]]]  # per row (logprob, token_id), sorted desc


def sample(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> SampleResult:
    """Pick one token per row of `logits` [B, V] (float32, modified in place; another dtype is
    first copied to float32, since bf16 log-probabilities are too coarse to report)."""
    assert logits.dim() == 2 and logits.shape[0] == len(rows), (tuple(logits.shape), len(rows))
    logits = logits.float()
    params = [r.sampling_params for r in rows]
    apply_penalties(logits, rows)
    _mask_min_new_tokens(logits, rows)
    _scale_by_temperature(logits, params)
    logprobs = torch.log_softmax(logits, dim=-1)  # [B, V]
    token_ids = _choose_tokens(logprobs, rows, params)  # [B]
    chosen = logprobs.gather(1, token_ids[:, None]).squeeze(1)
    return SampleResult(token_ids.tolist(), chosen.tolist(), _top_logprobs(logprobs, rows))


def apply_penalties(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """Repetition, then frequency and presence penalties, in place. Only the (row, token) entries
    that occur are touched, so the cost grows with the id lists, not with B * V."""
    rep_rows = [i for i, r in enumerate(rows) if r.sampling_params.repetition_penalty != 1.0]
    if rep_rows:
        where, _ = _occurrences(rows, rep_rows, logits, with_prompt=True)
        rep = _per_entry([r.sampling_params.repetition_penalty for r in rows], where, logits)
        values = logits[where]
        logits[where] = torch.where(values > 0, values / rep, values * rep)
    additive_rows = [i for i, r in enumerate(rows)
                     if r.sampling_params.frequency_penalty or r.sampling_params.presence_penalty]
    if additive_rows:
        where, counts = _occurrences(rows, additive_rows, logits, with_prompt=False)
        freq = _per_entry([r.sampling_params.frequency_penalty for r in rows], where, logits)
        pres = _per_entry([r.sampling_params.presence_penalty for r in rows], where, logits)
        logits[where] -= freq * counts + pres


def _occurrences(rows: Sequence[SamplingRow], idx: list[int], like: torch.Tensor,
                 with_prompt: bool) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The distinct (row, token) entries of the rows' output (and prompt) ids as index tensors,
    and how often each occurs; built on CPU from the id lists, then moved next to `like`."""
    vocab = like.shape[1]
    ids = [rows[i].output_ids + (rows[i].origin_input_ids if with_prompt else []) for i in idx]
    # One key per entry, row * V + token, so one unique() dedups and counts the whole batch.
    keys = torch.cat([torch.tensor(x, dtype=torch.long) + i * vocab
                      for i, x in zip(idx, ids, strict=True)])
    keys, counts = torch.unique(keys, return_counts=True)
    keys = keys.to(like.device)
    return (keys // vocab, keys % vocab), counts.to(like.device)


def _per_entry(values: list[float], where: tuple[torch.Tensor, torch.Tensor],
               like: torch.Tensor) -> torch.Tensor:
    """Each entry's row value, e.g. the penalty of the row the entry belongs to."""
    return torch.tensor(values, dtype=like.dtype, device=like.device)[where[0]]


def _column(values: list[float], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=like.dtype, device=like.device)[:, None]  # [R, 1]


def _mask_min_new_tokens(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    pairs = [(i, t) for i, r in enumerate(rows)
             if len(r.output_ids) < r.sampling_params.min_new_tokens
             for t in r.min_tokens_stop_ids]
    if pairs:
        row_idx, tok_idx = torch.tensor(pairs, device=logits.device).unbind(1)
        logits[row_idx, tok_idx] = float("-inf")


def _scale_by_temperature(logits: torch.Tensor, params: Sequence[SamplingParams]) -> None:
    temps = [1.0 if p.is_greedy else p.temperature for p in params]
    if any(t != 1.0 for t in temps):
        logits.div_(_column(temps, logits))


def _choose_tokens(logprobs: torch.Tensor, rows: Sequence[SamplingRow],
                   params: Sequence[SamplingParams]) -> torch.Tensor:
    if all(p.is_greedy for p in params):
        return logprobs.argmax(dim=-1)
    token_ids = torch.empty(len(rows), dtype=torch.long, device=logprobs.device)
    greedy = [i for i, p in enumerate(params) if p.is_greedy]
    if greedy:
        token_ids[greedy] = logprobs[greedy].argmax(dim=-1)
    for truncated in (False, True):
        idx = [i for i, p in enumerate(params) if not p.is_greedy
               and p.uses_truncation == truncated]
        if not idx:
            continue
        sub = logprobs if len(idx) == len(rows) else logprobs[idx]  # [R, V]
        u = _uniforms([rows[i] for i in idx], logprobs.device)
        draw = _sample_candidates if truncated else _sample_full
        token_ids[idx] = draw(sub, [params[i] for i in idx], u)
    return token_ids


def _uniforms(rows: Sequence[SamplingRow], device: torch.device) -> torch.Tensor:
    """[R] uniforms in [0, 1), one from each row's own generator, so that batch neighbours never
    shift a row's random stream."""
    draws = [torch.rand((), generator=r.generator,
                        device=r.generator.device if r.generator is not None else "cpu")
             for r in rows]
    return torch.stack([u.to(device) for u in draws])


def _sample_full(logprobs: torch.Tensor, params: Sequence[SamplingParams],
                 u: torch.Tensor) -> torch.Tensor:
    """Draw over the whole vocabulary; min-p is a threshold, so no sort is needed."""
    probs = logprobs.exp()  # [R, V]
    if any(p.min_p > 0 for p in params):
        threshold = _column([p.min_p for p in params], probs) * probs.amax(-1, keepdim=True)
        probs.masked_fill_(probs < threshold, 0.0)
    return _inverse_cdf(probs, u)


def _sample_candidates(logprobs: torch.Tensor, params: Sequence[SamplingParams],
                       u: torch.Tensor) -> torch.Tensor:
    """Top-k, top-p and min-p on the top candidates, sorted by probability."""
    vocab = logprobs.shape[-1]
    top_k = _column([p.top_k if p.top_k > 0 else vocab for p in params], logprobs)
    top_p = _column([p.top_p for p in params], logprobs)
    min_p = _column([p.min_p for p in params], logprobs)
    k = min(vocab, max([_MIN_CANDIDATES] + [p.top_k for p in params]))
    while True:
        cand_logprobs, cand_ids = logprobs.topk(k, dim=-1)  # [R, k], sorted desc
        probs = cand_logprobs.exp()
        in_top_k = torch.arange(k, device=probs.device) < top_k
        kept = probs * in_top_k
        cum = kept.cumsum(-1)  # [R, k]
        # Mass top-p is measured against: the top-k set's (all inside the candidates when
        # top_k <= k), else the whole distribution's, which is 1.
        mass = torch.where(top_k <= k, cum[:, -1:], torch.ones_like(top_p))
        # Every row's top-p prefix ends inside the candidates once their mass reaches top_p.
        if k == vocab or bool((cum[:, -1:] >= top_p * mass).all()):
            break
        k = min(vocab, k * _CANDIDATE_GROWTH)
    keep = in_top_k & (cum - kept < top_p * mass) & (probs >= min_p * probs[:, :1])
    pos = _inverse_cdf(probs * keep, u)
    return cand_ids.gather(1, pos[:, None]).squeeze(1)


def _inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Index drawn from each row of non-negative `weights` [R, N] with uniforms `u` [R]."""
    cdf = weights.cumsum(-1)  # [R, N]
    target = u[:, None].to(cdf.dtype) * cdf[:, -1:]
    pos = torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=weights.shape[-1] - 1)
    # u * total can round up to total, running past the last positive weight: take that one.
    bad = weights.gather(1, pos[:, None]).squeeze(1) <= 0
    if bool(bad.any()):
        last = (weights[bad] > 0).flip(-1).to(torch.int8).argmax(-1)
        pos[bad] = weights.shape[-1] - 1 - last
    return pos


def _top_logprobs(logprobs: torch.Tensor, rows: Sequence[SamplingRow]):
    nums = [r.top_logprobs_num for r in rows]
    out: list[list[tuple[float, int]]] = [[] for _ in rows]
    idx = [i for i, n in enumerate(nums) if n > 0]
    if not idx:
        return out
    k = min(max(nums), logprobs.shape[-1])
    values, ids = logprobs[idx].topk(k, dim=-1)
    for i, vals, toks in zip(idx, values.tolist(), ids.tolist(), strict=True):
        out[i] = list(zip(vals[: nums[i]], toks[: nums[i]], strict=True))
    return out
