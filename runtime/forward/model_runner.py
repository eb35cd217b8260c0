"""ModelRunner: turns a ScheduledBatch into a ForwardBatch (positions, KV slots, slot table) and runs
the model, returning the logits rows the engine needs."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from forklm.runtime.forward.batch import ForwardBatch
from forklm.runtime.forward.cuda_graphs import DecodeGraphRunner, Graph

if TYPE_CHECKING:
    from forklm.runtime.attention.backends import AttentionBackend
    from forklm.runtime.kvcache.manager import KVCacheManager
    from forklm.runtime.lora.adapter import LoraWeights
    from forklm.runtime.lora.layers import LoraBatch
    from forklm.runtime.models import CausalLM
    from forklm.runtime.scheduling.request import Req
    from forklm.runtime.scheduling.scheduler import ScheduledBatch

logger = logging.getLogger(__name__)


@dataclass
class LogitsRows:
    """Where one request's logits sit in the returned tensor."""

    input_start: int  # first row of prompt-logprob logits
    input_positions: list[int]  # positions t whose token logprob those rows give (row k -> t = input_positions[k])
    sample_row: int | None  # row to sample the next token from
    # Draft tokens verified: rows sample_row + 1 .. sample_row + num_draft give the distributions
    # after each of them (row sample_row + j follows draft token j).
    num_draft: int = 0
    # An embedding request's packed token rows whose final-normed hidden states this chunk pools
    # (see _pool_positions), and after the forward their sum ([hidden] fp32). pool_restarts: the
    # chunk starts at position 0 (a retracted request's earlier sum is stale).
    pool_rows: tuple[int, ...] = ()  # (no list per request and step: decode never pools)
    pooled: torch.Tensor | None = None
    pool_restarts: bool = False


class ModelRunner:
    def __init__(self, model: CausalLM, attn: AttentionBackend, kv: KVCacheManager,
                 device: str = "cpu"):
        self.model, self.attn, self.kv = model, attn, kv
        self.device = torch.device(device)
        self.graphs: DecodeGraphRunner | None = None  # decode replayed from captured graphs
        # Where the LoRA-wrapped modules read the batch's adapter rows (None: LoRA is off).
        self.lora_batch: LoraBatch | None = None

    def forward(self, batch: ScheduledBatch, input_ids: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, list[LogitsRows]]:
        """-> (logits [num_rows, vocab] fp32 on the model's device, per-request row layout).
        Sampling, grammar masks and logprobs run on that device too (output_processor).

        input_ids: a decode batch's tokens where the previous step sampled them (the overlap
        scheduler runs this step before they reach the host); None = read from the requests."""
        fb, layout = self._build(batch, input_ids)
        if self.lora_batch is not None:
            self._set_lora_batch(self.lora_batch, batch)
        try:
            if any(rows.pool_rows for rows in layout):
                return self._forward_pooling(fb, layout), layout
            if self.graphs is not None and self.graphs.can_run(fb):
                return self.graphs.run(fb), layout
            return self.model(fb.to(self.device), self.attn), layout
        finally:
            if self.lora_batch is not None:
                self.lora_batch.groups, self.lora_batch.row_groups = [], None

    def _set_lora_batch(self, lora: LoraBatch, batch: ScheduledBatch) -> None:
        """Each adapter of the batch with its packed token rows (None: all of them), and with
        several adapters each row's adapter index (-1: the base model)."""
        if all(req.lora is None for req in batch.reqs):
            lora.groups, lora.key, lora.row_groups = [], (), None
            return
        index: dict[int, int] = {}  # id(adapter) -> its group
        rows: list[tuple[LoraWeights, list[int]]] = []
        group_of: list[int] = []
        for req, n in zip(batch.reqs, batch.extend_lens):
            group = -1
            if req.lora is not None:
                group = index.setdefault(id(req.lora), len(rows))
                if group == len(rows):
                    rows.append((req.lora, []))
                rows[group][1].extend(range(len(group_of), len(group_of) + n))
            group_of.extend([group] * n)
        lora.groups = [(weights, None if len(ids) == len(group_of) else
                        torch.tensor(ids, dtype=torch.int64, device=self.device))
                       for weights, ids in rows]
        lora.key = tuple(weights.uid for weights, _ in lora.groups)
        lora.row_groups = (torch.tensor(group_of, dtype=torch.int64, device=self.device)
                           if len(lora.groups) > 1 else None)

    def _forward_pooling(self, fb: ForwardBatch, layout: list[LogitsRows]) -> torch.Tensor:
        """forward for a batch with embedding requests: the logits, and each one's pooled rows
        summed into its LogitsRows.pooled (eager: graphs serve decode, which these never reach)."""
        pool_rows = torch.tensor([r for rows in layout for r in rows.pool_rows], dtype=torch.int64)
        logits, hidden = self.model.forward_with_hidden(fb.to(self.device), self.attn,
                                                        pool_rows.to(self.device))
        first = 0
        for rows in layout:
            if rows.pool_rows:
                rows.pooled = hidden[first : first + len(rows.pool_rows)].sum(dim=0)
                first += len(rows.pool_rows)
        return logits

    def capture_graphs(self, max_bs: int, max_context: int, new_graph: Callable[[], Graph]
                       ) -> None:
        """Capture decode for every bucket up to max_bs (contexts up to max_context); a capture
        that fails leaves every step eager, with a warning (a model or attention path that is
        not capture-safe must not stop the engine)."""
        runner = DecodeGraphRunner(lambda fb: self.model(fb, self.attn), max_bs, max_context,
                                   self.kv.pool.scratch_slot, self.device, new_graph)
        try:
            with torch.inference_mode():
                runner.capture()
        except Exception as e:  # noqa: BLE001 - see above
            logger.warning("decode graph capture failed (%s); decode runs eagerly", e)
            return
        self.graphs = runner
        logger.info("decode graphs captured for batch sizes %s", runner.sizes)

    def check_health(self) -> None:
        """Called by the engine loop between steps; raises WorkerLostError when the forward can
        no longer run (a tensor-parallel rank died). One process: nothing to check."""

    def close(self) -> None:
        """Release what the runner started (tensor-parallel workers); the engine loop calls it
        once, when it ends."""

    def _build(self, batch: ScheduledBatch, input_ids: torch.Tensor | None = None
               ) -> tuple[ForwardBatch, list[LogitsRows]]:
        if batch.is_decode and all(req.mm is None and req.pooling is None
                                   and not req.wants_input_logprobs for req in batch.reqs):
            return self._build_decode(batch, input_ids)
        assert batch.behind == 0, "a step of a continuous run is a plain decode step"
        return self._build_general(batch, input_ids)

    def _build_general(self, batch: ScheduledBatch, input_ids: torch.Tensor | None = None
                       ) -> tuple[ForwardBatch, list[LogitsRows]]:
        ids: list[int] = []
        positions: list[int] = []
        logit_rows: list[int] = []
        layout: list[LogitsRows] = []
        q_lens: list[int] = []
        kv_lens: list[int] = []
        q_index: list[int] = []
        embed_rows: list[torch.Tensor] = []
        embed_values: list[torch.Tensor] = []
        deep_values: list[torch.Tensor] = []  # Qwen3-VL: each image row's deepstack features
        wider: list[tuple[int, int, int]] = []  # packed rows [lo, hi) seeing keys < end
        turned: list[tuple[int, torch.Tensor]] = []  # (first packed row, its M-RoPE rows)
        offset = 0
        for i, (req, n) in enumerate(zip(batch.reqs, batch.extend_lens)):
            start = req.num_computed - n  # KV for [start, start + n) is computed now
            if req.mm is not None and req.mm.rope_positions is not None:
                turned.append((offset, req.mm.rope_rows(start, start + n)))
            if req.mm is not None and start < len(req.origin_input_ids):
                image_positions, features = req.mm.rows_in(start, start + n)
                if len(image_positions):
                    embed_rows.append(image_positions - start + offset)
                    embed_values.append(features)
                    deep = req.mm.deep_in(start, start + n)
                    if deep is not None:
                        deep_values.append(deep)
                wider += [(lo - start + offset, hi - start + offset, end)
                          for lo, hi, end in req.mm.key_ends(start, start + n)]
            draft = batch.drafts(i)  # computed after req's own tokens, not yet part of fill_ids
            if input_ids is None:
                ids.extend(req.fill_slice(start, start + n - len(draft)))
                ids.extend(draft)
            positions.extend(range(start, start + n))
            rows = _input_logprob_positions(req, start, n)
            layout.append(LogitsRows(len(logit_rows), rows, None))
            if req.pooling is not None:
                layout[-1].pool_rows = tuple(offset + t - start
                                             for t in _pool_positions(req, start, n))
                layout[-1].pool_restarts = start == 0
            logit_rows.extend(offset + t - 1 - start for t in rows)
            if batch.samples[i]:
                layout[-1].sample_row, layout[-1].num_draft = len(logit_rows), len(draft)
                logit_rows.extend(range(offset + n - 1 - len(draft), offset + n))
            q_lens.append(n)
            kv_lens.append(req.num_computed)
            q_index.append(offset)
            offset += n
        max_q = max(q_lens)
        q_lens_t = torch.tensor(q_lens)
        rows_t = torch.tensor([r.row for r in batch.reqs])
        kv_lens_t = torch.tensor(kv_lens)
        slot_table = self.kv.req_to_token[rows_t, : max(kv_lens)]
        positions_t = torch.tensor(positions)
        if max_q == 1:  # one token per request (decode): fewer small tensor ops, same tensors
            q_index_t = torch.arange(len(q_lens))[:, None]
            out_rows = rows_t
        else:
            q_index_t = torch.tensor(q_index)[:, None] + torch.arange(max_q)[None, :]
            q_index_t = torch.minimum(q_index_t, (torch.tensor(q_index) + q_lens_t - 1)[:, None])
            out_rows = torch.repeat_interleave(rows_t, q_lens_t)
        rope_positions = None
        if turned:  # text-only requests turn by their positions on all three axes
            rope_positions = positions_t[:, None].repeat(1, 3)
            for first, turns in turned:
                rope_positions[first:first + len(turns)] = turns
        key_ends = None
        if wider:  # every token's own end, then the image blocks' ends
            key_ends = positions_t + 1
            for lo, hi, end in wider:
                key_ends[lo:hi] = end
        # Built on the CPU (the slot rows live there); forward moves it to the model's device.
        fb = ForwardBatch(
            input_ids=torch.tensor(ids) if input_ids is None else input_ids,
            positions=positions_t,
            out_slots=self.kv.req_to_token[out_rows, positions_t],
            q_lens=q_lens_t,
            kv_lens=kv_lens_t,
            slot_table=slot_table,
            q_index=q_index_t,
            logits_indices=torch.tensor(logit_rows, dtype=torch.int64),
            max_q_len=max_q, is_decode=batch.is_decode,
            embed_rows=torch.cat(embed_rows) if embed_rows else None,
            embed_values=torch.cat(embed_values) if embed_values else None,
            deep_values=torch.cat(deep_values, dim=1) if deep_values else None,
            key_ends=key_ends, rope_positions=rope_positions,
        )
        return fb, layout

    def _build_decode(self, batch: ScheduledBatch, input_ids: torch.Tensor | None
                      ) -> tuple[ForwardBatch, list[LogitsRows]]:
        """_build for a plain decode step (one token per request, each sampled; no images,
        pooling or prompt logprobs): the same ForwardBatch and layout, its index tensors made
        in numpy over the slot rows (KVCacheManager.req_to_token_np) instead of by ~10 small
        torch ops, and without the general loop's per-request bookkeeping. A step of a
        continuous run computes each request's token `batch.behind` before its last slot."""
        reqs = batch.reqs
        n = len(reqs)
        rows = np.fromiter((req.row for req in reqs), np.int64, n)
        kv_lens = np.fromiter((req.num_computed for req in reqs), np.int64, n)
        if batch.behind:
            kv_lens -= batch.behind
        positions = kv_lens - 1
        slot_rows = self.kv.req_to_token_np
        everyone = torch.from_numpy(np.arange(n))
        if input_ids is None:
            back = batch.behind + 1
            input_ids = torch.from_numpy(np.fromiter(
                (req.fill_slice(req.num_computed - back, req.num_computed - back + 1)[0]
                 for req in reqs), np.int64, n))
        fb = ForwardBatch(
            input_ids=input_ids, positions=torch.from_numpy(positions),
            out_slots=torch.from_numpy(slot_rows[rows, positions]),
            q_lens=torch.from_numpy(np.ones(n, np.int64)), kv_lens=torch.from_numpy(kv_lens),
            slot_table=torch.from_numpy(slot_rows[rows, : int(kv_lens.max())]),
            q_index=everyone[:, None], logits_indices=everyone, max_q_len=1, is_decode=True)
        return fb, [LogitsRows(i, [], i) for i in range(n)]


def _input_logprob_positions(req: Req, start: int, n: int) -> list[int]:
    """Prompt positions t (>= 1, >= logprob_start_len) whose token logprob the hidden state at t-1,
    computed in this chunk [start, start + n), gives."""
    if not req.wants_input_logprobs:
        return []
    lo = max(start + 1, req.logprob_start_len, 1)
    hi = min(start + n, len(req.origin_input_ids) - 1)
    return list(range(lo, hi + 1))


def _pool_positions(req: Req, start: int, n: int) -> list[int]:
    """Prompt positions, computed in this chunk [start, start + n), whose hidden states an
    embedding request pools: the last one, all (mean, summed chunk by chunk), or the first (cls).
    Mean and cls requests take no cached prefix (Req.max_prefix_len), so they compute them all."""
    prompt_len = len(req.origin_input_ids)
    if req.pooling == "last":
        return [prompt_len - 1] if start <= prompt_len - 1 < start + n else []
    if req.pooling == "cls":
        return [0] if start == 0 else []
    return list(range(start, min(start + n, prompt_len)))
