"""TritonAttention: the attention backend for CUDA, reading K/V straight from the paged pool
through each request's slot table with the kernels in forklm.kernels.triton (no gather, no padding)."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from forklm.kernels.triton.decode_attention import decode_attention
from forklm.kernels.triton.extend_attention import extend_attention
from forklm.kernels.triton.store_kv import store_kv
from forklm.runtime.attention.backends import (
    AttentionLayerSpec,
    TorchAttention,
    TorchAttentionMeta,
    alibi_slopes_of,
    layer_specs,
)
from forklm.runtime.errors import InvalidArgumentError

if TYPE_CHECKING:
    from forklm.runtime.forward.batch import ForwardBatch
    from forklm.runtime.kvcache.pool import KVPool


class TritonAttention:
    """Stores the new K/V with store_kv, then runs decode_attention (every request has one new
    token) or extend_attention (chunks with cached prefixes), with ALiBi's bias where the model
    has it.

    The kernels take a flattened slot table with per-request start offsets; the engine's padded
    slot_table [batch, width] is that table with kv_start[b] = b * width, so prepare() only moves
    the batch's index tensors to the pool's device, once per forward (into the batch's attn_meta).
    """

    def __init__(self, pool: KVPool, num_heads: int, num_kv_heads: int, head_dim: int,
                 layers: Sequence[AttentionLayerSpec] | None = None):
        layers = layer_specs(layers, pool.num_layers)
        if any(spec.softcap is not None for spec in layers):
            raise InvalidArgumentError("attention_backend", "triton",
                                       "the Triton kernels have no soft-capping yet; this model "
                                       "needs attention_backend='torch'")
        self.scales = [spec.scale for spec in layers]
        self.alibi = alibi_slopes_of(layers, pool.device)  # [num_heads] float32 or None
        self.windows = [spec.sliding_window for spec in layers]
        self.sinks = [None if spec.sinks is None else spec.sinks.float().to(pool.device).contiguous()
                      for spec in layers]  # gpt-oss: [num_heads] fp32, or None
        if pool.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise InvalidArgumentError("attention_backend", "triton",
                                       f"needs a CUDA device, the KV pool is on {pool.device} "
                                       "(TRITON_INTERPRET=1 runs it on the CPU, slowly, for tests)")
        self.pool = pool
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        # The kernels' keys end at each query's position: a chunk whose image tokens see their
        # whole image (Gemma 3) runs on SDPA with its mask instead, over the same pool.
        self.wide_keys = TorchAttention(pool, num_heads, num_kv_heads, head_dim, layers)

    def prepare(self, batch: ForwardBatch) -> ForwardBatch:
        if batch.key_ends is not None:
            return self.wide_keys.prepare(batch)
        table = batch.slot_table.contiguous()  # [batch, width]
        width = table.shape[1]
        meta = {
            "kv_indices": table.reshape(-1),  # [batch * width]
            # made where the table is: a captured decode graph must not copy from the host
            "kv_start": torch.arange(batch.batch_size, dtype=torch.int64,
                                     device=table.device) * width,  # [batch]
            "kv_lens": batch.kv_lens,  # [batch]
            "q_start": batch.q_index[:, 0].contiguous(),  # [batch]
            "q_lens": batch.q_lens,  # [batch]
            "out_slots": batch.out_slots,  # [num_tokens]
        }
        device = self.pool.device
        return dataclasses.replace(batch, attn_meta={
            name: t.to(device, torch.int64, non_blocking=True).contiguous()
            for name, t in meta.items()})

    def forward(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                batch: ForwardBatch) -> torch.Tensor:
        """q [num_tokens, num_heads, head_dim], k/v [num_tokens, num_kv_heads, head_dim]
        -> [num_tokens, num_heads * head_dim]."""
        meta = batch.attn_meta
        if isinstance(meta, TorchAttentionMeta):
            return self.wide_keys.forward(layer_id, q, k, v, batch)
        assert isinstance(meta, dict), "run the batch prepare() returned"
        k_buffer = self.pool.k_buffer[layer_id]  # [num_slots, num_kv_heads, head_dim]
        v_buffer = self.pool.v_buffer[layer_id]
        store_kv(k_buffer, v_buffer, meta["out_slots"], k, v)
        if batch.is_decode:
            assert batch.num_tokens == batch.batch_size, "a decode batch has one token per request"
            out = decode_attention(q, k_buffer, v_buffer, meta["kv_indices"], meta["kv_start"],
                                   meta["kv_lens"], sm_scale=self.scales[layer_id],
                                   alibi_slopes=self.alibi, sinks=self.sinks[layer_id],
                                   window=self.windows[layer_id])
        else:
            out = extend_attention(q, k_buffer, v_buffer, meta["q_start"], meta["q_lens"],
                                   meta["kv_indices"], meta["kv_start"], meta["kv_lens"],
                                   batch.max_q_len, sm_scale=self.scales[layer_id],
                                   alibi_slopes=self.alibi, sinks=self.sinks[layer_id],
                                   window=self.windows[layer_id])
        return out.view(q.shape[0], self.num_heads * self.head_dim)
