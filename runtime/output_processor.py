"""After each forward: prompt logprobs, grammar masks, sampling, finish checks (stop ids, stop
strings, grammar end, length), and the events streamed back to callers."""

from __future__ import annotations

import logging

import torch

from forklm.runtime.constrained import GrammarBackend
from forklm.runtime.model_runner import LogitsRows
from forklm.runtime.request import FinishReason, Req, ReqOutput
from forklm.runtime.sampler import sample
from forklm.runtime.scheduler import ScheduledBatch

logger = logging.getLogger(__name__)


def process_logits(batch: ScheduledBatch, logits: torch.Tensor, layout: list[LogitsRows],
                   grammar: GrammarBackend | None = None) -> int:
    """Consume one step's logits for every request in the batch; returns tokens generated.
    Constrained requests need `grammar`, which masks their rows before sampling."""
    for req, rows in zip(batch.reqs, layout):
        if rows.input_positions or (req.wants_input_logprobs and rows.sample_row is not None):
            _record_input_logprobs(req, logits, rows)
    samplers = [(req, rows.sample_row) for req, rows in zip(batch.reqs, layout)
                if rows.sample_row is not None]
    for req, _ in samplers:
        if req.wants_input_logprobs:
            req.input_logprobs_done = True
    to_sample = [(req, row) for req, row in samplers if not _finish_without_sampling(req)]
    if not to_sample:
        return 0
    rows_t = torch.tensor([row for _, row in to_sample])
    reqs = [req for req, _ in to_sample]
    rows_logits = logits[rows_t]  # [B, V], a copy: masking and sampling modify it
    if any(req.grammar is not None for req in reqs):
        assert grammar is not None, "constrained requests need the grammar backend"
        grammar.mask_logits(rows_logits, [req.grammar for req in reqs])
    result = sample(rows_logits, reqs)
    num_generated = len(reqs)
    for k, req in enumerate(reqs):
        top = result.top_logprobs[k] if req.top_logprobs_num else None
        append_token(req, result.token_ids[k], result.logprobs[k], top)
        if grammar is not None and grammar.jump_forward:
            num_generated += _jump_forward(req, grammar)
    return num_generated


def _record_input_logprobs(req: Req, logits: torch.Tensor, rows: LogitsRows) -> None:
    if req.logprob_start_len == 0 and not req.input_token_logprobs:
        req.input_token_logprobs.append([None, req.origin_input_ids[0]])
        if req.top_logprobs_num:
            req.input_top_logprobs.append([])
    if not rows.input_positions:
        return
    n = len(rows.input_positions)
    logprobs = torch.log_softmax(logits[rows.input_start : rows.input_start + n], dim=-1)
    token_ids = torch.tensor([req.origin_input_ids[t] for t in rows.input_positions])
    chosen = logprobs.gather(1, token_ids[:, None]).squeeze(1).tolist()
    req.input_token_logprobs.extend([lp, tid] for lp, tid in zip(chosen, token_ids.tolist()))
    if req.top_logprobs_num:
        values, indices = logprobs.topk(req.top_logprobs_num, dim=-1)
        for v, i in zip(values.tolist(), indices.tolist()):
            req.input_top_logprobs.append(list(zip(v, i)))


def _finish_without_sampling(req: Req) -> bool:
    """max_new_tokens == 0 asks for prefill/scoring only."""
    if req.sampling_params.max_new_tokens == 0:
        finish(req, FinishReason("length", length=0))
        return True
    return False


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


def finish(req: Req, reason: FinishReason) -> None:
    """Finish req for a reason found outside sampling (abort, score-only), sending the final event."""
    req.finish_reason = reason
    tail = req.detokenizer.flush()
    _send(req, ReqOutput(req.rid, tail, [], True, req))


def _send(req: Req, out: ReqOutput) -> None:
    """Hand the caller its event. A caller that went away (a cancelled future, a closed event
    loop) makes its sink raise; that must not fail the step, and so every other request."""
    try:
        req.sink(out)
    except Exception:
        logger.exception("could not deliver an event of request %s (caller gone?)", req.rid)
