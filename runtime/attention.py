"""Attention backends over the paged KV pool, chosen by name through a small registry."""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from forklm.runtime.errors import InvalidArgumentError
from forklm.runtime.forward_batch import ForwardBatch
from forklm.runtime.kv_pool import KVPool


class AttentionBackend(Protocol):
    """Stores the new tokens' K/V into the pool, then attends over each request's context."""

    def prepare(self, batch: ForwardBatch) -> None:
        """Called once per forward, before the layers, to build per-batch state (masks)."""

    def forward(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                batch: ForwardBatch) -> torch.Tensor:
        """q [num_tokens, num_heads, head_dim], k/v [num_tokens, num_kv_heads, head_dim]
        -> [num_tokens, num_heads * head_dim]."""
        ...


class TorchAttention:
    """Pure-torch paged attention: gather each request's K/V from the pool into a padded batch
    and run one SDPA call for the whole batch, with the GQA group folded into the query length so
    K/V are never expanded to all query heads."""

    def __init__(self, pool: KVPool, num_heads: int, num_kv_heads: int, head_dim: int):
        self.pool = pool
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.group = num_heads // num_kv_heads
        self.mask: torch.Tensor | None = None
        self.packed_rows: torch.Tensor | None = None

    def prepare(self, batch: ForwardBatch) -> None:
        # Query i of request b sits at position prefix_b + i and sees keys j <= prefix_b + i.
        prefix = (batch.kv_lens - batch.q_lens)[:, None, None]  # [batch, 1, 1]
        device = batch.q_lens.device
        q_pos = torch.arange(batch.max_q_len, device=device)[None, :, None] + prefix  # [batch, max_q, 1]
        k_pos = torch.arange(batch.slot_table.shape[1], device=device)[None, None, :]  # [1, 1, max_kv]
        mask = k_pos <= q_pos  # [batch, max_q, max_kv]; padded queries still see key 0
        # The GQA group is folded into the query axis: row g * max_q + i.
        self.mask = mask.repeat(1, self.group, 1)[:, None]  # [batch, 1, group*max_q, max_kv]
        self.packed_rows = None if batch.is_decode else _packed_rows(batch)

    def forward(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                batch: ForwardBatch) -> torch.Tensor:
        self.pool.store(layer_id, batch.out_slots, k, v)
        bsz, max_q = batch.batch_size, batch.max_q_len
        kvh, g, d = self.num_kv_heads, self.group, self.head_dim
        k_ctx = self.pool.k_buffer[layer_id][batch.slot_table]  # [batch, max_kv, kvh, d]
        v_ctx = self.pool.v_buffer[layer_id][batch.slot_table]
        # [batch, max_q, heads, d]; a decode batch is already in that order (one token each)
        q_pad = q.view(bsz, 1, -1, d) if batch.is_decode else q[batch.q_index]
        q_pad = q_pad.view(bsz, max_q, kvh, g, d).permute(0, 2, 3, 1, 4).reshape(bsz, kvh, g * max_q, d)
        out = F.scaled_dot_product_attention(
            q_pad, k_ctx.transpose(1, 2), v_ctx.transpose(1, 2), attn_mask=self.mask
        )  # [batch, kvh, g*max_q, d]
        out = out.view(bsz, kvh, g, max_q, d).permute(0, 3, 1, 2, 4).reshape(bsz * max_q, kvh * g * d)
        return out if self.packed_rows is None else out[self.packed_rows]


def _packed_rows(batch: ForwardBatch) -> torch.Tensor:
    """Rows of the flattened [batch * max_q] output that hold real (non-padding) tokens, in order."""
    i = torch.arange(batch.max_q_len, device=batch.q_lens.device)[None, :]
    keep = i < batch.q_lens[:, None]  # [batch, max_q]
    return keep.flatten().nonzero().squeeze(1)


def _triton_attention(pool: KVPool, num_heads: int, num_kv_heads: int,
                      head_dim: int) -> AttentionBackend:
    # Imported only when chosen: it imports Triton, which the CPU path never needs.
    from forklm.runtime.attention_triton import TritonAttention

    return TritonAttention(pool, num_heads, num_kv_heads, head_dim)


_BACKENDS = {"torch": TorchAttention, "triton": _triton_attention}


def create_attention_backend(name: str, pool: KVPool, num_heads: int, num_kv_heads: int,
                             head_dim: int) -> AttentionBackend:
    if name not in _BACKENDS:
        raise InvalidArgumentError("attention_backend", name,
                                   f"supported here: {', '.join(sorted(_BACKENDS))}")
    return _BACKENDS[name](pool, num_heads, num_kv_heads, head_dim)
