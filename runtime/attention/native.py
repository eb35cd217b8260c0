"""NativeAttention: decode and short extends on the CPU through the C kernel that reads the paged
KV pool in place (kernels/cpu/paged_attention.c), prefill through its flash-attention kernel
where the model allows (bf16, no window, cap, ALiBi or sinks); everything else as
TorchAttention."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from forklm.kernels.cpu import bindings as native_kernels
from forklm.runtime.attention.backends import AttentionLayerSpec, TorchAttention

if TYPE_CHECKING:
    from forklm.runtime.forward.batch import ForwardBatch
    from forklm.runtime.kvcache.pool import KVPool

# Batches with at most this many new tokens per request take the kernel (decode is 1; a
# speculative verify 1 + draft). The kernel reads each K/V row once per query token, so its lead
# over SDPA's blocked GEMMs shrinks with q_len: per layer at 450 keys, 1.3-2.7x at 8 tokens,
# 1.1-2.4x at 16, 1.1-2.0x at 32 (benchmarks/native_attention.py, 2 AVX-512 cores). Such batches
# also take the fused decode layers: the whole forward of short extends (a chat turn's new
# question, a question after a shared few-shot prefix) at 32 instead of 16, 16 requests x 20
# tokens after 400 cached: 0.78x the time; x 32 tokens, nothing cached: 0.86x; 1 x 32 after
# 400: 0.84x (session 14, default model).
NATIVE_MAX_Q_LEN = 32


@dataclass(frozen=True)
class NativeAttentionMeta:
    """NativeAttention's per-batch state: the kernel's token -> request map."""

    plan: native_kernels.AttentionPlan


@dataclass(frozen=True)
class NativePrefillMeta:
    """The same for a prefill batch (paged_prefill_bf16; not a NativeAttentionMeta, so the fused
    decode layers leave such batches alone)."""

    plan: native_kernels.AttentionPlan


class NativeAttention(TorchAttention):
    """TorchAttention with the decode-like batches (max_q_len <= NATIVE_MAX_Q_LEN, CPU tensors,
    a pool dtype the kernel handles: the model's, or an 8-bit format) run by the native kernel:
    no K/V gather, no padding, the GQA group's query heads scored together against each K/V row.
    Prefill, and a chunk whose image tokens see past themselves, stays on SDPA."""

    def __init__(self, pool: KVPool, num_heads: int, num_kv_heads: int, head_dim: int,
                 layers: Sequence[AttentionLayerSpec] | None = None):
        super().__init__(pool, num_heads, num_kv_heads, head_dim, layers)
        self.enabled = (pool.device.type == "cpu" and head_dim % 16 == 0
                        and native_kernels.available(pool.dtype, pool.kv_dtype))
        self.dtype_code = native_kernels.DTYPES.get(pool.dtype, -1)
        self.kv_dtype_code = native_kernels.DTYPES.get(pool.kv_dtype, -1)
        # Per layer: the pool's views (indexing per call costs ~1 us) and the kernel's arguments.
        self.k_layers, self.v_layers = pool.k_buffer.unbind(0), pool.v_buffer.unbind(0)
        # Per layer, an int8 pool's K and V row scales ((None, None): not int8).
        self.layer_scales: list[tuple[torch.Tensor | None, torch.Tensor | None]] = (
            [(None, None)] * pool.num_layers if pool.k_scale is None or pool.v_scale is None
            else list(zip(pool.k_scale.unbind(0), pool.v_scale.unbind(0))))
        self.kernel_specs = [(scale, spec.softcap or 0.0, spec.sliding_window or 0)
                             for scale, spec in zip(self.scales, self.layers)]
        self.sinks = [None if spec.sinks is None else spec.sinks.float().contiguous()
                      for spec in self.layers]  # gpt-oss: [num_heads] fp32, or None
        # Prefill through the flash kernel: 0.13-0.24x SDPA's time on 512-2048 token prompts
        # (benchmarks/prefill_attention.py)
        self.prefill_enabled = (
            self.enabled and self.alibi is None and not self.windows and not self.softcapped
            and native_kernels.prefill_supported(pool.dtype, pool.kv_dtype, head_dim))

    def prepare(self, batch: ForwardBatch) -> ForwardBatch:
        prefill = batch.max_q_len > NATIVE_MAX_Q_LEN
        if (not self.enabled or (prefill and not self.prefill_enabled)
                or batch.q_lens.device.type != "cpu" or batch.key_ends is not None):
            return super().prepare(batch)  # the kernel's keys end at each query's position
        table = batch.slot_table.contiguous()
        # Never read outside the table row or the pool: the kernel trusts both bounds (checked
        # in numpy: the torch ops took ~80 us of a default-model decode step).
        assert batch.kv_lens.numpy().max() <= table.shape[1], "kv_lens past the slot table"
        # ... nor write outside the pool (the fused decode layers store K/V at out_slots in C).
        slots = np.concatenate((table.numpy().reshape(-1), batch.out_slots.numpy().reshape(-1)))
        assert slots.min() >= 0 and slots.max() < self.pool.k_buffer.shape[1], \
            "slot outside the pool"
        tok_req, tok_end = _token_map(batch)
        plan = native_kernels.plan(table, tok_req, tok_end, self.num_heads, self.num_kv_heads,
                                   self.head_dim)
        meta = NativePrefillMeta(plan) if prefill else NativeAttentionMeta(plan)
        return dataclasses.replace(batch, attn_meta=meta)

    def forward(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                batch: ForwardBatch) -> torch.Tensor:
        meta = batch.attn_meta
        if not isinstance(meta, (NativeAttentionMeta, NativePrefillMeta)):
            return super().forward(layer_id, q, k, v, batch)
        self.pool.store(layer_id, batch.out_slots, k, v)
        assert q.dtype == self.pool.dtype, f"q {q.dtype} vs pool {self.pool.dtype}"
        out = q.new_empty(q.shape[0], self.num_heads * self.head_dim)  # [num_tokens, heads * d]
        if isinstance(meta, NativePrefillMeta):
            meta.plan.run_prefill(q.contiguous(), self.k_layers[layer_id],
                                  self.v_layers[layer_id], out, self.scales[layer_id])
            return out
        scale, softcap, window = self.kernel_specs[layer_id]
        meta.plan.run(q.contiguous(), self.k_layers[layer_id], self.v_layers[layer_id], out,
                      scale, softcap, window, self.dtype_code, self.kv_dtype_code, self.alibi,
                      self.sinks[layer_id], *self.scales_of(layer_id))
        return out

    def scales_of(self, layer_id: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Layer `layer_id`'s K and V row scales of an int8 pool; (None, None) otherwise."""
        return self.layer_scales[layer_id]


def _token_map(batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """tok_req, tok_end [num_tokens] int64: each packed token's request and the end of the keys
    it sees. Request b's i-th new token sits at position kv_len_b - q_len_b + i and sees keys
    [0, kv_len_b - q_len_b + i + 1) (the kernel narrows that to a sliding window itself)."""
    if batch.is_decode:
        return torch.arange(batch.batch_size), batch.kv_lens.contiguous()
    tok_req = torch.repeat_interleave(torch.arange(batch.batch_size), batch.q_lens)
    first = torch.cumsum(batch.q_lens, 0) - batch.q_lens  # [batch] packed index of token 0
    i = torch.arange(tok_req.numel()) - first[tok_req]  # [num_tokens] index within its request
    return tok_req, (batch.kv_lens - batch.q_lens)[tok_req] + i + 1
