"""After each forward: prompt logprobs, grammar masks, sampling (and verifying speculative drafts),
finish checks (stop ids, stop strings, grammar end, length), and the events streamed to callers."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from forklm.runtime.sampling.sampler import (
    DeviceSamples,
    SampleResult,
    SamplingRow,
    sample_on_device,
    writable,
)
from forklm.runtime.scheduling.request import FinishReason, Req, ReqOutput

if TYPE_CHECKING:
    from forklm.runtime.forward.model_runner import LogitsRows, ModelRunner
    from forklm.runtime.sampling.constraints import GrammarBackend
    from forklm.runtime.sampling.params import SamplingParams
    from forklm.runtime.scheduling.scheduler import ScheduledBatch

logger = logging.getLogger(__name__)


class StepTokens(NamedTuple):
    generated: int  # tokens appended: sampled, accepted drafts, jump-forward
    verified: int  # requests that had a draft verified
    drafted: int  # speculative draft tokens verified
    accepted: int  # of those, the ones the target model's samples agreed with


@dataclass
class StepSamples:
    """A step's batched results, computed before any request changes: prompt logprobs, the
    samples (still on the logits' device), and the RNG states drafts replay from."""

    prompt_logprobs: list[_PromptLogprobs | None]
    sampled: list[bool]  # per request: whether it drew a token this step
    on_device: DeviceSamples | None  # rows in batch order: 1 + len(draft) per sampled request
    states: list[torch.Tensor | None]

    def next_input_ids(self) -> torch.Tensor:
        """The sampled requests' tokens, in batch order, where the model reads them (a decode
        batch without drafts: one row each)."""
        assert self.on_device is not None and all(self.sampled), "a decode step samples all"
        return self.on_device.token_ids


def process_logits(batch: ScheduledBatch, logits: torch.Tensor, layout: list[LogitsRows],
                   grammar: GrammarBackend | None = None) -> StepTokens:
    """Consume one step's logits for every request in the batch. Constrained requests need
    `grammar`, which masks their rows before sampling.

    In two phases, so that one request cannot fail the others: the batched work (sample_step:
    prompt logprobs, grammar masks, sampling) changes no request, and if it raises, seeded
    generators are rewound and the caller may rerun the step on part of the batch; then each
    request takes its results (apply_step), and one whose own update raises is aborted alone
    (`fail`)."""
    return apply_step(batch, layout, sample_step(batch, logits, layout, grammar), grammar)


def run_decode_steps(runner: ModelRunner, batch: ScheduledBatch,
                     grammar: GrammarBackend | None = None) -> StepTokens:
    """Run `batch.steps` continuous decode steps (num_continuous_decode_steps): each step's
    samples feed the next forward where they are, and the requests take them one step after
    another once the last has run. A request that finishes on a step (a stop token or string,
    its length) takes nothing after it; releasing it drops the KV computed past its end
    (KVCacheManager.release). If a step raises, no request has changed and the seeded
    generators are rewound, so the caller may rerun the batch or its parts (as process_logits)."""
    seeded = _seeded_states(batch.reqs)
    ids, results = None, []
    try:
        for i in range(batch.steps):
            step = batch.step_of_run(i)
            logits, layout = runner.forward(step, ids)
            on_device = sample_step(step, logits, layout, grammar).on_device
            assert on_device is not None, "a decode step samples every request"
            results.append(on_device)
            ids = on_device.token_ids
    except Exception:
        _rewind(seeded)
        raise
    generated = 0
    for on_device in results:
        result = on_device.to_host()
        for k, req in enumerate(batch.reqs):
            if req.finished:
                continue
            try:
                _append_sampled(req, result, k)
                generated += 1
            except Exception as e:
                logger.exception("request %s failed in its step", req.rid)
                fail(req, f"engine error: {e!r}")
    return StepTokens(generated, 0, 0, 0)


def sample_step(batch: ScheduledBatch, logits: torch.Tensor, layout: list[LogitsRows],
                grammar: GrammarBackend | None = None) -> StepSamples:
    """The batched phase: changes no request, and leaves the samples on the device (the overlap
    scheduler feeds them to the next forward before they reach the host)."""
    prompt_logprobs = [_prompt_logprobs(req, logits, rows) for req, rows in zip(batch.reqs, layout)]
    sampled = [rows.sample_row is not None and req.sampling_params.max_new_tokens > 0
               for req, rows in zip(batch.reqs, layout)]
    to_sample = [(req, rows.sample_row, batch.drafts(i))
                 for i, (req, rows) in enumerate(zip(batch.reqs, layout)) if sampled[i]]
    on_device, states = _sample(to_sample, logits, grammar)
    return StepSamples(prompt_logprobs, sampled, on_device, states)


def apply_step(batch: ScheduledBatch, layout: list[LogitsRows], samples: StepSamples,
               grammar: GrammarBackend | None = None) -> StepTokens:
    """The per-request phase: the samples cross to the host (the step's one sync), and each
    request appends its tokens, runs its finish checks and sends its events."""
    result = samples.on_device.to_host() if samples.on_device is not None else None
    sampled, next_state = samples.sampled, iter(samples.states)
    total, first = StepTokens(0, 0, 0, 0), 0  # first: the request's first row in result
    for i, (req, rows) in enumerate(zip(batch.reqs, layout)):
        draft, state = batch.drafts(i), next(next_state) if sampled[i] else None
        try:
            _record_prompt_logprobs(req, samples.prompt_logprobs[i])
            if rows.pooled is not None:
                _record_pooled(req, rows)
            if rows.sample_row is not None:
                req.input_logprobs_done = req.input_logprobs_done or req.wants_input_logprobs
                if not sampled[i]:  # max_new_tokens == 0 asks for prefill/scoring only
                    finish(req, FinishReason("length", length=0))
            if sampled[i]:
                assert result is not None
                tokens = _take_samples(req, draft, result, first, state, grammar)
                total = StepTokens(*(a + b for a, b in zip(total, tokens)))
        except Exception as e:
            logger.exception("request %s failed in its step", req.rid)
            fail(req, f"engine error: {e!r}")
        first += len(draft) + 1 if sampled[i] else 0
    return total


def _sample(to_sample: list[tuple[Req, int, list[int]]], logits: torch.Tensor,
            grammar: GrammarBackend | None
            ) -> tuple[DeviceSamples | None, list[torch.Tensor | None]]:
    """(the samples of to_sample's rows, each request's RNG state for replaying a draft). Changes
    no request: if it raises, the seeded generators it drew from are rewound first."""
    if not to_sample:
        return None, []
    # One logits row per request, or 1 + len(draft) consecutive rows for a verified draft.
    rows = [r for _, row, d in to_sample for r in range(row, row + len(d) + 1)]
    sampling_rows = [v for req, _, d in to_sample for v in _verify_rows(req, d)]
    states = [_generator_state(req, d) for req, _, d in to_sample]
    seeded = _seeded_states([req for req, _, _ in to_sample])
    try:
        rows_logits = _rows_of(logits, rows)
        if any(req.grammar is not None for req, _, _ in to_sample):
            assert grammar is not None, "constrained requests need the grammar backend"
            rows_logits = writable(rows_logits)
            grammar.mask_logits(rows_logits, [req.grammar for req, _, d in to_sample
                                              for _ in range(len(d) + 1)])
        chosen_logprobs = any(req.return_logprob for req, _, _ in to_sample)
        return sample_on_device(rows_logits, sampling_rows, chosen_logprobs), states
    except Exception:
        _rewind(seeded)
        raise


def _seeded_states(reqs: list[Req]) -> list[tuple[torch.Generator, torch.Tensor]]:
    """The generator states a failed step rewinds to: seeded sampled requests' only (unseeded
    ones need no rewind: a rerun just draws other random numbers)."""
    return [(req.generator, req.generator.get_state()) for req in reqs
            if req.generator is not None and req.sampling_params.seed is not None
            and not req.sampling_params.is_greedy]


def _rewind(seeded: list[tuple[torch.Generator, torch.Tensor]]) -> None:
    for generator, state in seeded:
        generator.set_state(state)


def _rows_of(logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """logits' rows `rows`: the forward's own tensor where they are all of it in order (a decode
    step), else a copy (index_select: 0.2x the time of logits[rows] on the CPU). The forward's
    tensor is an inference tensor, which only a copy may modify (`writable`): plain greedy
    sampling reads it as it is, and the copy of a 128k-vocabulary row cost ~0.1 ms of a 1B
    model's single-stream token."""
    if rows == list(range(logits.shape[0])):
        return logits
    return logits.index_select(0, torch.tensor(rows, device=logits.device))


def _take_samples(req: Req, draft: list[int], result: SampleResult, first: int,
                  state: torch.Tensor | None, grammar: GrammarBackend | None) -> StepTokens:
    """Append req's samples (rows from `first`): a verified draft's accepted part, or one token
    and what its grammar forces next."""
    if draft:
        num_appended, num_accepted = _accept_draft(req, draft, result, first)
        _replay_generator(req, state, num_appended)
        return StepTokens(num_appended, 1, len(draft), num_accepted)
    _append_sampled(req, result, first)
    jumped = _jump_forward(req, grammar) if grammar is not None and grammar.jump_forward else 0
    return StepTokens(1 + jumped, 0, 0, 0)


def _append_sampled(req: Req, result: SampleResult, k: int) -> None:
    top = result.top_logprobs[k] if req.top_logprobs_num else None
    append_token(req, result.token_ids[k], result.logprobs[k], top)


@dataclass
class _DraftRow:
    """A request as the sampler sees it at one verify position: after the draft tokens before it
    (penalties and min_new_tokens count them, as plain decoding would have)."""

    sampling_params: SamplingParams
    generator: torch.Generator | None
    origin_input_ids: list[int]
    output_ids: list[int]
    min_tokens_stop_ids: list[int]
    top_logprobs_num: int


def _verify_rows(req: Req, draft: list[int]) -> list[SamplingRow]:
    if not draft:
        return [req]
    stop_ids = req.min_tokens_stop_ids
    return [_DraftRow(req.sampling_params, req.generator, req.origin_input_ids,
                      req.output_ids + draft[:j], stop_ids, req.top_logprobs_num)
            for j in range(len(draft) + 1)]


def _accept_draft(req: Req, draft: list[int], result: SampleResult, first: int) -> tuple[int, int]:
    """Append req's samples at its verify rows in order, up to and including the first that
    differs from its draft token (a valid sample all the same), or until req finishes.
    Returns (tokens appended, draft tokens accepted)."""
    for j in range(len(draft) + 1):
        _append_sampled(req, result, first + j)
        matched = j < len(draft) and result.token_ids[first + j] == draft[j]
        if req.finished or not matched:
            return j + 1, j + int(matched)
    raise AssertionError("unreachable: the last verify row has no draft token to match")


def _generator_state(req: Req, draft: list[int]) -> torch.Tensor | None:
    """The RNG state before a drafted sampled request's rows draw (None when nothing is replayed)."""
    if not draft or req.generator is None or req.sampling_params.is_greedy:
        return None
    return req.generator.get_state()


def _replay_generator(req: Req, state: torch.Tensor | None, num_appended: int) -> None:
    """Each verify row drew one uniform; plain decoding draws one per appended token. Rewind and
    draw that many, so a seeded request's random stream (and output) is as without drafts."""
    if state is None or req.generator is None:
        return
    req.generator.set_state(state)
    for _ in range(num_appended):
        torch.rand((), generator=req.generator, device=req.generator.device)


class _PromptLogprobs(NamedTuple):
    """A step's prompt logprobs of one request, computed before any request is changed."""

    token_logprobs: list[list[Any]]  # [logprob, token_id] per position; the first token: None
    top_logprobs: list[list[tuple[float, int]]] | None  # None unless top_logprobs_num


def _prompt_logprobs(req: Req, logits: torch.Tensor, rows: LogitsRows) -> _PromptLogprobs | None:
    if not (rows.input_positions or (req.wants_input_logprobs and rows.sample_row is not None)):
        return None
    token_logprobs: list[list[Any]] = []
    tops: list[list[tuple[float, int]]] = []
    if req.logprob_start_len == 0 and not req.input_token_logprobs:
        token_logprobs.append([None, req.origin_input_ids[0]])
        tops.append([])
    if rows.input_positions:
        n = len(rows.input_positions)
        logprobs = torch.log_softmax(logits[rows.input_start : rows.input_start + n], dim=-1)
        token_ids = torch.tensor([req.origin_input_ids[t] for t in rows.input_positions],
                                 device=logits.device)
        chosen = logprobs.gather(1, token_ids[:, None]).squeeze(1).tolist()
        token_logprobs.extend([lp, tid] for lp, tid in zip(chosen, token_ids.tolist()))
        if req.top_logprobs_num:
            k = min(req.top_logprobs_num, logprobs.shape[-1])
            values, indices = logprobs.topk(k, dim=-1)
            tops.extend(list(zip(v, i)) for v, i in zip(values.tolist(), indices.tolist()))
    return _PromptLogprobs(token_logprobs, tops if req.top_logprobs_num else None)


def _record_prompt_logprobs(req: Req, logprobs: _PromptLogprobs | None) -> None:
    if logprobs is not None:
        req.input_token_logprobs.extend(logprobs.token_logprobs)
        if logprobs.top_logprobs is not None:
            req.input_top_logprobs.extend(logprobs.top_logprobs)


def _record_pooled(req: Req, rows: LogitsRows) -> None:
    """Add an embedding request's pooled rows of this chunk to its sum (mean pooling spans
    chunks; a chunk from position 0 starts it afresh)."""
    assert rows.pooled is not None
    if req.pooled_sum is None or rows.pool_restarts:
        req.pooled_sum = rows.pooled.float().cpu()
    else:
        req.pooled_sum += rows.pooled.float().cpu()


def append_token(req: Req, token_id: int, logprob: float, top: list | None) -> None:
    """Add one sampled token, run the finish checks, and send the caller its event."""
    req.output_ids.append(token_id)
    if req.return_logprob:
        req.output_token_logprobs.append([logprob, token_id])
        if top is not None:
            req.output_top_logprobs.append(top)
    params = req.sampling_params
    # A terminated grammar (it accepted its stop token, an EOS) ends the request even with
    # ignore_eos: nothing may follow.
    grammar_end = req.grammar is not None and _advance_grammar(req, token_id)
    stop_id = grammar_end or token_id in (params.stop_token_ids or ()) or (
        not params.ignore_eos and token_id in req.eos_token_ids)
    # A matched stop token's text is left out of the output unless no_stop_trim (as SGLang does).
    step = req.detokenizer.add([] if stop_id and not params.no_stop_trim else [token_id])
    reason = None
    if stop_id:
        reason = FinishReason("stop", matched=token_id)
    elif step.matched_stop is not None:
        reason = FinishReason("stop", matched=step.matched_stop)
    elif len(req.output_ids) >= params.max_new_tokens or req.fill_len >= req.max_total_len:
        reason = FinishReason("length", length=len(req.output_ids))
    if reason is None:
        _send(req, ReqOutput(req.rid, step.delta, [token_id], False, req))
        return
    tail = "" if step.matched_stop is not None else req.detokenizer.flush()
    req.finish_reason = reason
    _send(req, ReqOutput(req.rid, step.delta + tail, [token_id], True, req))


def _jump_forward(req: Req, grammar: GrammarBackend) -> int:
    """Append the tokens req's grammar forces next, unsampled (their KV is computed by the next
    step); returns how many. Requests wanting logprobs sample every token."""
    if req.grammar is None or req.finished or req.return_logprob:
        return 0
    num = 0
    for token_id in grammar.jump_forward_ids(req.grammar, req.output_ids[-1]):
        append_token(req, token_id, 0.0, None)
        num += 1
        if req.finished:  # a stop string or the length limit
            break
    return num


def _advance_grammar(req: Req, token_id: int) -> bool:
    """Feed the sampled token to req's matcher; returns whether the grammar has terminated."""
    assert req.grammar is not None
    accepted = req.grammar.accept_token(token_id)
    assert accepted, f"request {req.rid}: the grammar rejected token {token_id} its mask allowed"
    return req.grammar.is_terminated()


def fail(req: Req, message: str) -> None:
    """Abort req after an error in its own part of a step, sending the final event. Its held-back
    text is dropped, not flushed: the detokenizer may be what failed. Does nothing if req has
    finished already (its final event is sent)."""
    if req.finished:
        return
    req.finish_reason = FinishReason("abort", message=message)
    _send(req, ReqOutput(req.rid, "", [], True, req))


def finish(req: Req, reason: FinishReason) -> None:
    """Finish req for a reason found outside sampling (abort, score-only), sending the final event."""
    req.finish_reason = reason
    tail = req.detokenizer.flush()
    _send(req, ReqOutput(req.rid, tail, [], True, req))


def _send(req: Req, out: ReqOutput) -> None:
    """Hand the caller its event. A caller that went away (a cancelled future, a closed event
    loop) makes its sink raise; that must not fail the step, and so every other request."""
    out.num_output = len(req.output_ids)
    try:
        req.sink(out)
    except Exception:
        logger.exception("could not deliver an event of request %s (caller gone?)", req.rid)
