"""decode_attention: one query token per request attends to its context in the paged KV pool.

Split-K ("flash decoding") in two launches: stage 1 gives each (request, KV head, split) program a
slice of the context and writes a partial output plus its log-sum-exp; stage 2 merges the splits.
A request's context slots are kv_indices[kv_start[b] : kv_start[b] + kv_lens[b]]: a flattened
table with per-request start offsets (a padded [batch, width] table is the case
kv_start = arange(batch) * width, so the engine passes its slot table without copying).
"""

from __future__ import annotations

import functools
import math

import torch

from forklm.kernels.triton._common import (
    FLOAT_DTYPES,
    check,
    check_alibi,
    check_index,
    check_sinks,
    check_tensor,
    check_triton,
    jit,
    next_power_of_2,
    tl,
)

LOG2E = 1.4426950408889634
BLOCK_N = 64  # context tokens per loop step; each split is a multiple of it
MIN_BLOCK_H = 16  # tl.dot needs >= 16 rows on GPUs: a GQA group is padded up to it and masked


@jit
def _stage1_kernel(Q, K, V, KV_indices, KV_start, KV_lens, Mid_O, Mid_LSE, qk_scale, Alibi,
                   window, stride_qb, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh,
                   GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr,
                   BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                   PRECISION: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """Program (b, kv_head, split): the GROUP query heads sharing kv_head, over one context slice.
    Writes Mid_O[b, head, split] = softmax-weighted V of the slice and Mid_LSE = its base-2 lse.
    HAS_ALIBI: Alibi [num_heads] holds ALiBi's slopes times log2(e) (scores are base 2).
    HAS_WINDOW: the context is the last `window` keys (the splits share those out)."""
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask_h = offs_h < GROUP
    mask_d = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_h  # [BLOCK_H]

    kv_len = tl.load(KV_lens + b).to(tl.int32)
    kv_start = tl.load(KV_start + b).to(tl.int64)
    first = kv_len * 0  # the first key seen
    if HAS_WINDOW:
        first = tl.maximum(kv_len - window, 0)
    split_len = tl.cdiv(tl.cdiv(kv_len - first, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = first + split * split_len
    hi = tl.minimum(lo + split_len, kv_len)

    q_ptrs = Q + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=mask_h[:, None] & mask_d[None, :], other=0.0)  # [BLOCK_H, BLOCK_D]
    m = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    row_sum = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    if HAS_ALIBI:
        slopes = tl.load(Alibi + heads, mask=mask_h, other=0.0)  # [BLOCK_H]
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < hi
        slots = tl.load(KV_indices + kv_start + offs_n, mask=mask_n, other=0).to(tl.int64)
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(K + slots[:, None] * stride_ks + kv_head * stride_kh + offs_d[None, :],
                    mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # [BLOCK_H, BLOCK_N]
        if HAS_ALIBI:  # slope * (key - query position); the query is the last key
            s += slopes[:, None] * (offs_n - (kv_len - 1)).to(tl.float32)[None, :]
        s = tl.where(mask_n[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        row_sum = row_sum * alpha + tl.sum(p, 1)
        v = tl.load(V + slots[:, None] * stride_vs + kv_head * stride_vh + offs_d[None, :],
                    mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m = m_new

    # An empty split (short context) writes lse = -inf and a zero output, which the merge ignores.
    empty = lo >= hi
    sum_safe = tl.where(empty, 1.0, row_sum)
    lse = tl.where(empty, float("-inf"), m + tl.log2(sum_safe))
    mid = (b * GROUP * tl.num_programs(1) + heads) * NUM_SPLITS + split  # [BLOCK_H]
    tl.store(Mid_LSE + mid, lse, mask=mask_h)
    tl.store(Mid_O + mid[:, None] * BLOCK_D + offs_d[None, :], acc / sum_safe[:, None],
             mask=mask_h[:, None])


@jit
def _stage2_kernel(Mid_O, Mid_LSE, Out, Sinks, stride_ob, stride_oh, HEAD_DIM: tl.constexpr,
                   NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
                   HAS_SINKS: tl.constexpr):
    """Program (b, head): Out[b, head] = the splits' partial outputs weighted by exp2(lse).
    HAS_SINKS: Sinks[head] (a natural log) joins the denominator as one more split with no
    value."""
    b = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    mask_s = offs_s < NUM_SPLITS
    mid = (b * tl.num_programs(1) + head) * NUM_SPLITS + offs_s  # [BLOCK_S]
    lse = tl.load(Mid_LSE + mid, mask=mask_s, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)  # all splits empty (kv_len 0): output zeros
    sink_weight = 0.0
    if HAS_SINKS:
        sink = tl.load(Sinks + head).to(tl.float32) * 1.4426950408889634  # base 2, as lse
        m = tl.maximum(m, sink)
        sink_weight = tl.exp2(sink - m)
    w = tl.exp2(lse - m)  # [BLOCK_S]
    parts = tl.load(Mid_O + mid[:, None] * BLOCK_D + offs_d[None, :], mask=mask_s[:, None],
                    other=0.0)  # [BLOCK_S, BLOCK_D]
    denom = tl.sum(w, 0) + sink_weight
    out = tl.sum(w[:, None] * parts, 0) / tl.where(denom == 0.0, 1.0, denom)
    o_ptrs = Out + b.to(tl.int64) * stride_ob + head * stride_oh + offs_d
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=offs_d < HEAD_DIM)


def decode_attention(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                     kv_indices: torch.Tensor, kv_start: torch.Tensor, kv_lens: torch.Tensor,
                     sm_scale: float | None = None, num_kv_splits: int | None = None,
                     alibi_slopes: torch.Tensor | None = None, sinks: torch.Tensor | None = None,
                     window: int | None = None) -> torch.Tensor:
    """q [batch, num_heads, head_dim]; k_buffer/v_buffer [num_slots, num_kv_heads, head_dim] (one
    layer of the pool, same dtype as q); kv_indices [n] slot ids; kv_start, kv_lens [batch].
    -> [batch, num_heads, head_dim] in q's dtype. sm_scale defaults to head_dim ** -0.5.
    alibi_slopes [num_heads] float32: head h's scores get slope_h * (key - query position).
    sinks: [num_heads] fp32 logits that join each head's softmax with no value (gpt-oss); None:
    none. window: a sliding window, the query sees its last `window` keys; None: all."""
    _check_args(q, k_buffer, v_buffer, kv_indices, kv_start, kv_lens)
    check_alibi(alibi_slopes, q.shape[1], q.device)
    check_sinks(sinks, q)
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_buffer.shape[1]
    group = num_heads // num_kv_heads
    splits = num_kv_splits or default_num_kv_splits(batch, num_kv_heads, q.device)
    block_d = max(16, next_power_of_2(head_dim))
    scale = (sm_scale if sm_scale is not None else head_dim ** -0.5) * LOG2E
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if batch == 0:
        return out
    mid_o = torch.empty(batch, num_heads, splits, block_d, dtype=torch.float32, device=q.device)
    mid_lse = torch.empty(batch, num_heads, splits, dtype=torch.float32, device=q.device)
    alibi = q if alibi_slopes is None else alibi_slopes * LOG2E  # q: an unread placeholder
    _stage1_kernel[(batch, num_kv_heads, splits)](
        q, k_buffer, v_buffer, kv_indices, kv_start, kv_lens, mid_o, mid_lse, scale, alibi,
        window or 0,
        q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1),
        v_buffer.stride(0), v_buffer.stride(1),
        GROUP=group, HEAD_DIM=head_dim, NUM_SPLITS=splits,
        BLOCK_H=max(MIN_BLOCK_H, next_power_of_2(group)), BLOCK_D=block_d, BLOCK_N=BLOCK_N,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        HAS_ALIBI=alibi_slopes is not None, HAS_WINDOW=bool(window), num_warps=4, num_stages=2,
    )
    _stage2_kernel[(batch, num_heads)](
        mid_o, mid_lse, out, mid_lse if sinks is None else sinks, out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, NUM_SPLITS=splits, BLOCK_S=next_power_of_2(splits), BLOCK_D=block_d,
        HAS_SINKS=sinks is not None, num_warps=4,
    )
    return out


def decode_attention_ref(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                         kv_indices: torch.Tensor, kv_start: torch.Tensor, kv_lens: torch.Tensor,
                         sm_scale: float | None = None, num_kv_splits: int | None = None,
                         alibi_slopes: torch.Tensor | None = None,
                         sinks: torch.Tensor | None = None, window: int | None = None
                         ) -> torch.Tensor:
    """Torch twin of decode_attention, the same split-K algorithm in fp32 (splits merged by lse,
    a sink as one more lse with no value)."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_buffer.shape[1]
    splits = num_kv_splits or default_num_kv_splits(batch, num_kv_heads, q.device)
    scale = sm_scale if sm_scale is not None else head_dim ** -0.5
    width = max(1, int(kv_lens.max())) if batch else 1
    pos = torch.arange(width, device=q.device)[None, :]  # [1, width]
    first = (kv_lens - window).clamp(min=0) if window else torch.zeros_like(kv_lens)  # [batch]
    valid = (pos < kv_lens[:, None]) & (pos >= first[:, None])  # [batch, width]
    index = torch.where(valid, kv_start[:, None] + pos, 0)
    slots = kv_indices[index.clamp(max=max(kv_indices.numel() - 1, 0))]  # [batch, width]
    k = k_buffer[slots].float().repeat_interleave(num_heads // num_kv_heads, dim=2)
    v = v_buffer[slots].float().repeat_interleave(num_heads // num_kv_heads, dim=2)
    s = torch.einsum("bhd,bnhd->bhn", q.float(), k) * scale  # [batch, heads, width]
    if alibi_slopes is not None:  # key minus query position, the query at kv_len - 1
        s = s + alibi_slopes[None, :, None] * (pos - (kv_lens[:, None] - 1))[:, None, :]
    split_len = _cdiv(_cdiv(kv_lens - first, splits), BLOCK_N) * BLOCK_N  # [batch], as in stage 1
    split_of = (pos - first[:, None]) // split_len.clamp(min=1)[:, None]  # [batch, width]
    parts, lses = [], []
    for i in range(splits):
        keep = (valid & (split_of == i))[:, None, :]  # [batch, 1, width]
        lse = torch.logsumexp(s.masked_fill(~keep, -math.inf), dim=-1)  # [batch, heads]
        p = torch.exp(s - lse[..., None]).masked_fill(~keep, 0.0).nan_to_num(0.0)
        parts.append(torch.einsum("bhn,bnhd->bhd", p, v))
        lses.append(lse)
    if sinks is not None:
        lses.append(sinks.float()[None, :].expand(batch, num_heads))
        parts.append(torch.zeros_like(parts[0]))
    w = torch.softmax(torch.stack(lses), dim=0).nan_to_num(0.0)  # [splits, batch, heads]
    return (w[..., None] * torch.stack(parts)).sum(0).to(q.dtype)


def _cdiv(a: torch.Tensor, b: int) -> torch.Tensor:
    return -(-a // b)


def default_num_kv_splits(batch: int, num_kv_heads: int, device: torch.device) -> int:
    """About 8 (batch, kv head, split) programs per SM, so that enough loads are in flight to
    use the memory bandwidth; 4 off the GPU. Splits beyond a short request's context exit at
    once, so a generous count costs little."""
    if device.type != "cuda":
        return 4
    wanted = -(-8 * _num_sms(device.index) // max(1, batch * num_kv_heads))
    return min(16, next_power_of_2(wanted))


@functools.cache
def _num_sms(device_index: int | None) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _check_args(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                kv_indices: torch.Tensor, kv_start: torch.Tensor, kv_lens: torch.Tensor) -> None:
    check_triton("decode_attention")
    device = q.device
    check_tensor("q", q, (None, None, None), FLOAT_DTYPES, device)
    batch, num_heads, head_dim = q.shape
    check_tensor("k_buffer", k_buffer, (None, None, head_dim), (q.dtype,), device)
    check_tensor("v_buffer", v_buffer, tuple(k_buffer.shape), (q.dtype,), device)
    num_kv_heads = k_buffer.shape[1]
    check(num_kv_heads > 0 and num_heads % num_kv_heads == 0,
          f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    check_index("kv_indices", kv_indices, None, device)
    check_index("kv_start", kv_start, batch, device)
    check_index("kv_lens", kv_lens, batch, device)
