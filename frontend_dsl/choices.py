"""Ways to pick one of select's choices from their token logprobs (SGLang's calling convention).

Every method is called with keyword arguments `choices`, `normalized_prompt_logprobs`,
`input_token_logprobs`, `output_token_logprobs` and `unconditional_token_logprobs`; logprob entries
are `[logprob, token_id, text]` and a `None` logprob (a sequence's first token) is skipped.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

Entries = list[list[Any]]


@dataclass
class ChoicesDecision:
    decision: str
    meta_info: dict[str, Any] = field(default_factory=dict)


def mean_logprob(entries: Entries) -> float:
    """Mean logprob of one choice's tokens, skipping None; -inf for a choice with no scored token."""
    values = [e[0] for e in entries if e[0] is not None]
    return sum(values) / len(values) if values else float("-inf")


def _argmax(values: list[float]) -> int:
    return max(range(len(values)), key=lambda i: (values[i], -i))  # the first maximum


class ChoicesSamplingMethod:
    """Base of the choice methods; subclass and implement `__call__` to pass your own."""

    requires_unconditional_logprobs = False

    def __call__(self, *, choices: list[str], normalized_prompt_logprobs: list[float],
                 input_token_logprobs: list[Entries], output_token_logprobs: list[Entries],
                 unconditional_token_logprobs: list[Entries] | None = None) -> ChoicesDecision:
        raise NotImplementedError(f"{type(self).__name__} must implement __call__")

    def __repr__(self) -> str:
        return type(self).__name__


class TokenLengthNormalized(ChoicesSamplingMethod):
    """The choice with the highest mean logprob over its tokens (biased to long, predictable ones)."""

    def __call__(self, *, choices, normalized_prompt_logprobs, input_token_logprobs,
                 output_token_logprobs, unconditional_token_logprobs=None) -> ChoicesDecision:
        best = _argmax(normalized_prompt_logprobs)
        return ChoicesDecision(choices[best], {
            "normalized_prompt_logprobs": normalized_prompt_logprobs,
            "input_token_logprobs": input_token_logprobs,
            "output_token_logprobs": output_token_logprobs,
        })


class GreedyTokenSelection(ChoicesSamplingMethod):
    """Compare the choices token by token, keeping those tied for the best logprob at each position;
    a shorter choice is padded with its own mean logprob."""

    def __call__(self, *, choices, normalized_prompt_logprobs, input_token_logprobs,
                 output_token_logprobs, unconditional_token_logprobs=None) -> ChoicesDecision:
        rows = [[e[0] for e in entries if e[0] is not None] for entries in input_token_logprobs]
        width = max((len(r) for r in rows), default=0)
        matrix = [r + [normalized_prompt_logprobs[i]] * (width - len(r)) for i, r in enumerate(rows)]
        remaining = list(range(len(choices)))
        for col in range(width):
            best = max(matrix[i][col] for i in remaining)
            remaining = [i for i in remaining if matrix[i][col] == best]
            if len(remaining) == 1:
                break
        return ChoicesDecision(choices[remaining[0]], {
            "normalized_prompt_logprobs": normalized_prompt_logprobs,
            "input_token_logprobs": input_token_logprobs,
            "output_token_logprobs": output_token_logprobs,
            "greedy_logprob_matrix": matrix,
        })


class UnconditionalLikelihoodNormalized(ChoicesSamplingMethod):
    """The choice with the highest mean of (conditional - unconditional) logprob per token: how much
    the prompt raises the choice above its prior. The first unconditional logprob (None) counts 0."""

    requires_unconditional_logprobs = True

    def __call__(self, *, choices, normalized_prompt_logprobs, input_token_logprobs,
                 output_token_logprobs, unconditional_token_logprobs=None) -> ChoicesDecision:
        if unconditional_token_logprobs is None:
            raise ValueError("unconditional_likelihood_normalized needs unconditional_token_logprobs")
        scores = []
        for i, (cond, uncond) in enumerate(zip(input_token_logprobs, unconditional_token_logprobs)):
            cond_values = [e[0] for e in cond if e[0] is not None]
            if len(cond_values) != len(uncond):
                raise ValueError(f"choice {choices[i]!r}: {len(cond_values)} conditional vs "
                                 f"{len(uncond)} unconditional token logprobs")
            diffs = [c - (u[0] or 0.0) for c, u in zip(cond_values, uncond)]
            scores.append(sum(diffs) / len(diffs) if diffs else float("-inf"))
        best = _argmax(scores)
        return ChoicesDecision(choices[best], {
            "normalized_prompt_logprobs": normalized_prompt_logprobs,
            "input_token_logprobs": input_token_logprobs,
            "output_token_logprobs": output_token_logprobs,
            "unconditional_token_logprobs": unconditional_token_logprobs,
            "normalized_unconditional_prompt_logprobs": scores,
        })


token_length_normalized = TokenLengthNormalized()
greedy_token_selection = GreedyTokenSelection()
unconditional_likelihood_normalized = UnconditionalLikelihoodNormalized()

# The built-in methods by the names a graph's JSON uses for them.
BUILTIN_METHODS: dict[str, ChoicesSamplingMethod] = {
    "token_length_normalized": token_length_normalized,
    "greedy_token_selection": greedy_token_selection,
    "unconditional_likelihood_normalized": unconditional_likelihood_normalized,
}


def builtin_name(method: Any) -> str | None:
    """The name of a built-in method object (or of a name already), None for any other."""
    if isinstance(method, str):
        return method
    return next((name for name, m in BUILTIN_METHODS.items() if m is method), None)


def resolve(method: str | ChoicesSamplingMethod) -> ChoicesSamplingMethod:
    """The method object a select runs: a built-in's by name, or the object it holds."""
    return BUILTIN_METHODS[method] if isinstance(method, str) else method
