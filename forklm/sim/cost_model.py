"""CostModel: the simulated duration of one engine step (forward plus the engine's own work around
it) as a linear function of the batch's shape, fitted from measured steps or given for a GPU."""

from __future__ import annotations

import dataclasses
import json
import pathlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from forklm.runtime.scheduling.scheduler import ScheduledBatch


class StepShape(NamedTuple):
    """What a step computes, as the cost model sees it. Prefill and catch-up steps compute
    several tokens per request; decode computes one per running request."""

    is_decode: bool
    num_reqs: int
    new_tokens: int  # tokens whose KV is computed this step (sum of extend_lens)
    context_tokens: int  # sum over requests of the context attended (prefix + new tokens)
    attended_pairs: int  # sum over new tokens of the keys each attends (causal)

    @classmethod
    def of(cls, batch: ScheduledBatch) -> StepShape:
        """The shape of a scheduled batch (after the scheduler extended its requests' KV)."""
        context = pairs = 0
        for req, n in zip(batch.reqs, batch.extend_lens):
            kv_len = req.num_computed  # prefix + this step's n tokens
            context += kv_len
            pairs += n * (kv_len - n) + n * (n + 1) // 2
        return cls(batch.is_decode, len(batch.reqs), sum(batch.extend_lens), context, pairs)


@dataclass(frozen=True)
class CostModel:
    """Seconds per step:
      overhead_s + overhead_per_req_s * num_reqs                      (scheduling, sampling, streaming)
      + prefill_base_s + prefill_per_token_s * new_tokens + prefill_per_pair_s * attended_pairs
      or decode_base_s + decode_per_req_s * num_reqs + decode_per_context_s * context_tokens."""

    prefill_base_s: float
    prefill_per_token_s: float
    prefill_per_pair_s: float
    decode_base_s: float
    decode_per_req_s: float
    decode_per_context_s: float
    overhead_s: float = 0.0
    overhead_per_req_s: float = 0.0
    description: str = ""  # where the numbers come from (machine, dtype, threads)

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "description":
                if not isinstance(value, str):
                    raise ValueError(f"cost model: description={value!r}: expected a string")
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise ValueError(f"cost model: {f.name}={value!r}: expected a number >= 0")

    def forward_s(self, shape: StepShape) -> float:
        if shape.is_decode:
            return (self.decode_base_s + self.decode_per_req_s * shape.num_reqs
                    + self.decode_per_context_s * shape.context_tokens)
        return (self.prefill_base_s + self.prefill_per_token_s * shape.new_tokens
                + self.prefill_per_pair_s * shape.attended_pairs)

    def step_s(self, shape: StepShape) -> float:
        return self.overhead_s + self.overhead_per_req_s * shape.num_reqs + self.forward_s(shape)

    def with_overhead(self, overhead_s: float, overhead_per_req_s: float) -> CostModel:
        return dataclasses.replace(self, overhead_s=overhead_s,
                                   overhead_per_req_s=overhead_per_req_s)

    def scaled_forward(self, factor: float) -> CostModel:
        """The forward coefficients times `factor` (the overhead kept): isolated forwards give
        the shape of the cost, a live engine's measured forward time its level."""
        names = [f.name for f in dataclasses.fields(self)
                 if f.name.startswith(("prefill_", "decode_"))]
        return dataclasses.replace(self, **{n: getattr(self, n) * factor for n in names})

    # -- persistence ---------------------------------------------------------------------------
    def to_json(self, path: str | pathlib.Path) -> None:
        pathlib.Path(path).write_text(json.dumps(dataclasses.asdict(self), indent=2) + "\n")

    @classmethod
    def from_json(cls, path: str | pathlib.Path) -> CostModel:
        try:
            data = json.loads(pathlib.Path(path).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"cost model file {str(path)!r}: {e}") from e
        return cls.from_dict(data, f"cost model file {str(path)!r}")

    @classmethod
    def from_dict(cls, data: object, where: str = "cost model") -> CostModel:
        if not isinstance(data, dict):
            raise ValueError(f"{where}: expected a JSON object of coefficients")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"{where}: unknown field(s) {unknown}; expected {sorted(names)}")
        try:
            return cls(**data)
        except (TypeError, ValueError) as e:  # a coefficient missing, or not a number >= 0
            raise ValueError(f"{where}: {e}") from e

    @classmethod
    def from_spec(cls, spec: str) -> CostModel:
        """A model from "name=value,..." (seconds), e.g. a GPU's coefficients on the command line;
        fields not given are 0."""
        values: dict[str, object] = {f.name: 0.0 for f in dataclasses.fields(cls)}
        values["description"] = f"given: {spec}"
        for item in filter(None, (s.strip() for s in spec.split(","))):
            name, _, value = item.partition("=")
            if name.strip() not in values or name.strip() == "description":
                raise ValueError(f"--cost {spec!r}: unknown coefficient {name.strip()!r}")
            try:
                values[name.strip()] = float(value)
            except ValueError:
                raise ValueError(f"--cost {spec!r}: {name.strip()}={value!r} is not a number") from None
        return cls.from_dict(values, f"--cost {spec!r}")


class TimedStep(NamedTuple):
    shape: StepShape
    seconds: float


def fit_forward(samples: Sequence[TimedStep], description: str = "") -> CostModel:
    """Least-squares fit of the forward coefficients, per phase, from timed forwards; a term whose
    coefficient comes out negative (noise) is dropped and the rest refitted, so costs never fall
    as a batch grows. Needs samples of both phases."""
    prefill = [s for s in samples if not s.shape.is_decode]
    decode = [s for s in samples if s.shape.is_decode]
    if len(prefill) < 3 or len(decode) < 3:
        raise ValueError(f"fit_forward: need >= 3 samples of each phase, got {len(prefill)} "
                         f"prefill and {len(decode)} decode")
    p = _fit_nonnegative([[1.0, s.shape.new_tokens, s.shape.attended_pairs] for s in prefill],
                         [s.seconds for s in prefill])
    d = _fit_nonnegative([[1.0, s.shape.num_reqs, s.shape.context_tokens] for s in decode],
                         [s.seconds for s in decode])
    return CostModel(prefill_base_s=p[0], prefill_per_token_s=p[1], prefill_per_pair_s=p[2],
                     decode_base_s=d[0], decode_per_req_s=d[1], decode_per_context_s=d[2],
                     description=description)


def fit_overhead(runs: Sequence[tuple[int, int, float]]) -> tuple[float, float]:
    """(overhead_s, overhead_per_req_s) from runs of (steps, request-steps, overhead seconds):
    the engine's time outside the forward, per step and per request in a step."""
    return tuple(_fit_nonnegative([[float(s), float(r)] for s, r, _ in runs],  # type: ignore[return-value]
                                  [t for _, _, t in runs]))


def _fit_nonnegative(rows: list[list[float]], targets: list[float]) -> list[float]:
    """Least squares of the relative error (steps differ in length by 100x: each one counts
    alike), columns scaled to unit size; negative coefficients dropped, the rest refitted."""
    weight = 1 / torch.tensor(targets, dtype=torch.float64).clamp_min(1e-9)[:, None]
    x = torch.tensor(rows, dtype=torch.float64) * weight
    y = torch.tensor(targets, dtype=torch.float64)[:, None] * weight
    active = list(range(x.shape[1]))
    while True:
        cols = x[:, active]
        scale = cols.abs().amax(dim=0).clamp_min(1e-12)
        coef = torch.linalg.lstsq(cols / scale, y).solution[:, 0] / scale
        negative = [a for a, c in zip(active, coef.tolist()) if c < 0]
        if not negative:
            out = [0.0] * x.shape[1]
            for a, c in zip(active, coef.tolist()):
                out[a] = c
            return out
        active.remove(min(negative, key=lambda a: coef[active.index(a)].item()))
        if not active:
            return [0.0] * x.shape[1]
