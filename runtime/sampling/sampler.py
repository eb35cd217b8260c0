"""The batched sampler, run once per engine step on the rows of the requests that sample.

Pipeline per step, vectorized over the rows of `logits` [B, V]:
  1. penalties: repetition (HF/CTRL style) over prompt + output ids, then frequency and presence
     (OpenAI style) over output ids only; skipped when no row uses a penalty.
  2. logit_bias: each row's {token: bias} is added (OpenAI's logit_bias, after the penalties).
     min-new-tokens: `min_tokens_stop_ids` get -inf while len(output_ids) < min_new_tokens
     (also with ignore_eos, as SGLang and transformers do).
  3. temperature: sampled rows are divided by their temperature; greedy rows are left as they are.
  4. logprobs = log_softmax of those logits, i.e. *before* top-k/top-p/min-p truncation. The chosen
     token's logprob and the top logprobs are read from it for every row (one log_softmax pass).
  5. greedy rows (temperature ~ 0 or top_k == 1) take the argmax. Sampled rows apply top-k, then
     top-p over the top-k-renormalized distribution (smallest prefix whose mass reaches top_p; the
     top token is always kept), then min-p (drop p < min_p * p_max), and draw by inverse CDF with
     one uniform from the row's own generator, so a row's sample depends only on its own seed.
Rows with top-k/top-p work on the top candidates (torch.topk, widened until every row's top-p set
fits) instead of sorting the whole vocabulary, which costs ~30x more on CPU; on a GPU the whole
vocabulary is sorted at once, so that no host sync decides the width.

Everything stays on the logits' device (`sample_on_device`): the chosen ids and their logprobs
cross to the host in one copy (`DeviceSamples.to_host`), the engine's one sync per step; top
logprobs, asked for by few requests, cost a second one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple, Protocol

import torch

from forklm.kernels.cpu import bindings as native_kernels

if TYPE_CHECKING:
    from forklm.runtime.sampling.params import SamplingParams

# First candidate count for top-p rows without a smaller top_k; a peaked LLM distribution
# usually reaches top_p=0.95 well inside 64 tokens, and topk(64) is ~30x cheaper than a sort.
_MIN_CANDIDATES = 64
_CANDIDATE_GROWTH = 8


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


class DeviceSamples(NamedTuple):
    """A step's samples before they cross to the host: the next step may feed token_ids to the
    model straight from the device (the overlap scheduler)."""

    token_ids: torch.Tensor  # [B] int64, on the logits' device
    logprobs: torch.Tensor  # [B] float32, the chosen tokens' logprobs
    top_logprobs: list[list[tuple[float, int]]]

    def to_host(self) -> SampleResult:
        """Ids and logprobs in one device-to-host copy (float64 holds every token id exactly); on
        the CPU each read as it is (no copy to make, and 4 small ops cost ~40 us of a step)."""
        if _host_reads_are_free(self.token_ids):
            return SampleResult(self.token_ids.tolist(), self.logprobs.tolist(), self.top_logprobs)
        ids, logprobs = torch.stack([self.token_ids.double(), self.logprobs.double()]).tolist()
        return SampleResult([int(t) for t in ids], logprobs, self.top_logprobs)


def sample(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> SampleResult:
    """Pick one token per row of `logits` [B, V] (float32, modified in place; another dtype is
    first copied to float32, since bf16 log-probabilities are too coarse to report)."""
    return sample_on_device(logits, rows).to_host()


def sample_on_device(logits: torch.Tensor, rows: Sequence[SamplingRow],
                     chosen_logprobs: bool = True) -> DeviceSamples:
    """`sample` without the copy to the host: no host sync unless a row asks for top logprobs
    (or, on the CPU, a top-p row's candidates must widen). chosen_logprobs=False: no row reads
    its chosen token's logprob (the returned ones may then be NaN)."""
    assert logits.dim() == 2 and logits.shape[0] == len(rows), (tuple(logits.shape), len(rows))
    params = [r.sampling_params for r in rows]
    picked = _plain_greedy(logits, rows, params, chosen_logprobs)
    if picked is not None:
        return picked
    logits = writable(logits.float())
    apply_penalties(logits, rows)
    _add_logit_bias(logits, params)
    _mask_min_new_tokens(logits, rows)
    _scale_by_temperature(logits, params)
    logprobs = torch.log_softmax(logits, dim=-1)  # [B, V]
    token_ids = _choose_tokens(logprobs, rows, params)  # [B]
    chosen = logprobs.gather(1, token_ids[:, None]).squeeze(1)
    return DeviceSamples(token_ids, chosen, _top_logprobs(logprobs, rows))


def writable(logits: torch.Tensor) -> torch.Tensor:
    """logits, or a copy where they are an inference tensor (a forward's own output), which
    nothing may modify in place outside inference mode."""
    return logits.clone() if logits.is_inference() else logits


def _plain_greedy(logits: torch.Tensor, rows: Sequence[SamplingRow],
                  params: Sequence[SamplingParams], chosen_logprobs: bool) -> DeviceSamples | None:
    """Each row's argmax in one native pass over the logits, where every row is greedy with
    nothing that edits its logits first (penalties, logit_bias, a pending min_new_tokens ban)
    and no top logprobs; None elsewhere, or where the kernel is off. torch's argmax and the
    log_softmax before it cost ~0.7 ms of a batch-16 step on the CPU, so the log_softmax runs
    only when a row reads its chosen logprob (then as the general path computes it: decode and
    prefill logprobs stay bit-equal)."""
    if logits.device.type != "cpu" or not all(
            p.is_greedy and p.repetition_penalty == 1.0 and not p.frequency_penalty
            and not p.presence_penalty and not p.logit_bias for p in params):
        return None
    if any(r.top_logprobs_num or (r.min_tokens_stop_ids
                                  and len(r.output_ids) < r.sampling_params.min_new_tokens)
           for r in rows):
        return None
    token_ids = native_kernels.greedy_pick(logits.contiguous())
    if token_ids is None:
        return None
    if chosen_logprobs:
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        chosen = logprobs.gather(1, token_ids[:, None]).squeeze(1)
    else:
        chosen = torch.full((len(rows),), float("nan"))
    return DeviceSamples(token_ids, chosen, [[] for _ in rows])


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


def _add_logit_bias(logits: torch.Tensor, params: Sequence[SamplingParams]) -> None:
    """logits[i, t] += params[i].logit_bias[t], in one scatter for the whole batch."""
    entries = [(i, t, b) for i, p in enumerate(params) if p.logit_bias
               for t, b in p.logit_bias.items()]
    if not entries:
        return
    rows, toks, biases = zip(*entries, strict=True)
    index = (torch.tensor(rows, device=logits.device), torch.tensor(toks, device=logits.device))
    logits.index_put_(index, torch.tensor(biases, dtype=logits.dtype, device=logits.device),
                      accumulate=True)


def _mask_min_new_tokens(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """Ban the stop ids of rows short of min_new_tokens, except in a row where they are all that
    is left (a complete grammar that allows only its end): that row may stop."""
    pairs = [(i, t) for i, r in enumerate(rows)
             if len(r.output_ids) < r.sampling_params.min_new_tokens
             for t in r.min_tokens_stop_ids]
    if not pairs:
        return
    row_idx, tok_idx = torch.tensor(pairs, device=logits.device).unbind(1)
    saved = logits[row_idx, tok_idx]  # [P], a copy
    logits[row_idx, tok_idx] = float("-inf")
    dead = ~torch.isfinite(logits).any(dim=-1)  # [B]
    # Written back unconditionally (no host sync to ask whether any row died).
    logits[row_idx, tok_idx] = torch.where(dead[row_idx], saved, logits[row_idx, tok_idx])


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
    top_k = _column([min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params], logprobs)
    top_p = _column([p.top_p for p in params], logprobs)
    min_p = _column([p.min_p for p in params], logprobs)
    k = min(vocab, max([_MIN_CANDIDATES] + [p.top_k for p in params]))
    if not _host_reads_are_free(logprobs):
        k = vocab  # a GPU sorts the vocabulary fast; widening would cost a host sync per step
    while True:
        cand_logprobs, cand_ids = _top_candidates(logprobs, k)  # [R, k], sorted desc
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
    keep[:, 0] = True  # also when top_p * mass rounds to 0 in float32 (top_p=1e-50)
    pos = _inverse_cdf(probs * keep, u)
    return cand_ids.gather(1, pos[:, None]).squeeze(1)


def _top_candidates(logprobs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k most likely tokens of each row, by logprob descending and, among equal logprobs,
    by token id: topk orders ties as its kernel happens to (differently for another k or batch),
    and logits from a bf16 head tie often, so one uniform could map to either of two tokens
    depending on the batch neighbours."""
    values, ids = logprobs.topk(k, dim=-1)
    ids, by_id = ids.sort(dim=-1)
    values = values.gather(1, by_id)
    values, by_value = values.sort(dim=-1, descending=True, stable=True)
    return values, ids.gather(1, by_value)


def _inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Index drawn from each row of non-negative `weights` [R, N] with uniforms `u` [R]."""
    cdf = weights.cumsum(-1)  # [R, N]
    target = u[:, None].to(cdf.dtype) * cdf[:, -1:]
    pos = torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=weights.shape[-1] - 1)
    # u * total can round up to total, running past the last positive weight: take that one. On
    # the CPU only for the rows that need it; on a GPU for every row, since asking costs a sync.
    bad = weights.gather(1, pos[:, None]).squeeze(1) <= 0
    if _host_reads_are_free(weights):
        if bool(bad.any()):
            pos[bad] = weights.shape[-1] - 1 - _last_positive(weights[bad])
        return pos
    return torch.where(bad, weights.shape[-1] - 1 - _last_positive(weights), pos)


def _host_reads_are_free(t: torch.Tensor) -> bool:
    """On the CPU, reading a tensor's value from Python costs no sync (a GPU waits for its queue)."""
    return t.device.type == "cpu"


def _last_positive(weights: torch.Tensor) -> torch.Tensor:
    """Per row, how far from the end the last positive weight is."""
    return (weights > 0).flip(-1).to(torch.int8).argmax(-1)


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
