"""After each forward: prompt logprobs, sampling, finish checks (stop ids, stop strings, length),
and the events streamed back to callers."""

from __future__ import annotations

import logging

import torch

from forklm.runtime.model_runner import LogitsRows
from forklm.runtime.request import FinishReason, Req, ReqOutput
from forklm.runtime.sampling import sample
from forklm.runtime.scheduler import ScheduledBatch

logger = logging.getLogger(__name__)


def process_logits(batch: ScheduledBatch, logits: torch.Tensor, layout: list[LogitsRows]) -> int:
    """Consume one step's logits for every request in the batch; returns tokens generated."""
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
    result = sample(logits[rows_t], reqs)
    for k, req in enumerate(reqs):
        top = result.top_logprobs[k] if req.top_logprobs_num else None
        append_token(req, result.token_ids[k], result.logprobs[k], top)
    return len(reqs)


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
    stop_id = token_id in (params.stop_token_ids or ()) or (
        not params.ignore_eos and token_id in req.eos_token_ids)
    # A matched stop token's text is left out of the output unless no_stop_trim (as SGLang does).
    step = req.detokenizer.add([] if stop_id and not params.no_stop_trim else [token_id])
    reason = None
    if stop_id:
        reason = FinishReason("stop", matched=token_id)
    elif step.matched_stop is not None:
        reason = FinishReason("stop", matched=step.matched_stop)
    elif len(req.output_ids) >= params.max_new_tokens or len(req.fill_ids) >= req.max_total_len:
        reason = FinishReason("length", length=len(req.output_ids))
    if reason is None:
        _send(req, ReqOutput(req.rid, step.delta, [token_id], False, req))
        return
    tail = "" if step.matched_stop is not None else req.detokenizer.flush()
    req.finish_reason = reason
    _send(req, ReqOutput(req.rid, step.delta + tail, [token_id], True, req))


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
