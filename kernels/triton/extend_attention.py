"""extend_attention: each request's chunk of new query tokens attends to its cached prefix and,
causally, to the chunk itself, all read from the paged KV pool (store_kv runs first).

Ragged batches: request b's queries are rows q_start[b] : q_start[b] + q_lens[b] of the packed q,
and its context slots (prefix then chunk, kv_lens[b] in all) are
kv_indices[kv_start[b] : kv_start[b] + kv_lens[b]], as in decode_attention.
"""

from __future__ import annotations

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
    triton,
)

LOG2E = 1.4426950408889634


@jit
def _extend_kernel(Q, K, V, Out, Q_start, Q_lens, KV_indices, KV_start, KV_lens, Sinks, qk_scale,
                   Alibi, window, stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh,
                   stride_ot, stride_oh,
                   GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr,
                   HAS_ALIBI: tl.constexpr, HAS_SINKS: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """Program (m_block, b, head): BLOCK_M of request b's new queries for one head, flash-style
    over context positions [0, end of the tile's causal reach). HAS_ALIBI: Alibi [num_heads]
    holds ALiBi's slopes times log2(e) (scores are base 2). HAS_SINKS: Sinks[head] (a natural
    log) joins each row's softmax denominator. HAS_WINDOW: a query at position p sees keys
    (p - window, p], and the loop starts at the tile's first row's first key."""
    m_block = tl.program_id(0)
    b = tl.program_id(1)
    head = tl.program_id(2)
    kv_head = head // GROUP
    q_len = tl.load(Q_lens + b).to(tl.int32)
    if m_block * BLOCK_M >= q_len:
        return
    q_start = tl.load(Q_start + b).to(tl.int64)
    kv_len = tl.load(KV_lens + b).to(tl.int32)
    kv_start = tl.load(KV_start + b).to(tl.int64)
    prefix = kv_len - q_len

    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask_m = offs_m < q_len
    mask_d = offs_d < HEAD_DIM
    q_rows = q_start + offs_m  # [BLOCK_M] packed token rows
    q = tl.load(Q + q_rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
                mask=mask_m[:, None] & mask_d[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]
    q_pos = prefix + offs_m  # [BLOCK_M] context position of each query

    m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    row_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    if HAS_ALIBI:
        slope = tl.load(Alibi + head)
    # Without a window key 0 is visible to every row, so each row's max is finite after the first
    # block; with one, a row may see no key of a block before its own window starts.
    hi = tl.minimum(kv_len, prefix + (m_block + 1) * BLOCK_M)
    lo = hi * 0
    if HAS_WINDOW:
        lo = tl.maximum(prefix + m_block * BLOCK_M - window + 1, 0)
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < hi
        slots = tl.load(KV_indices + kv_start + offs_n, mask=mask_n, other=0).to(tl.int64)
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(K + slots[:, None] * stride_ks + kv_head * stride_kh + offs_d[None, :],
                    mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
        if HAS_ALIBI:  # slope * (key - query position)
            s += slope * (offs_n[None, :] - q_pos[:, None]).to(tl.float32)
        visible = mask_n[None, :] & (offs_n[None, :] <= q_pos[:, None])
        if HAS_WINDOW:
            visible = visible & (offs_n[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        m_ref = m_new  # what the exponents subtract: finite even for a row that saw no key yet
        if HAS_WINDOW:
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_ref)
        p = tl.exp2(s - m_ref[:, None])
        row_sum = row_sum * alpha + tl.sum(p, 1)
        v = tl.load(V + slots[:, None] * stride_vs + kv_head * stride_vh + offs_d[None, :],
                    mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m = m_new

    if HAS_SINKS:  # one more score, with no value: it rescales the row, adds to its sum
        sink = tl.load(Sinks + head).to(tl.float32) * 1.4426950408889634  # base 2, as s
        m_new = tl.maximum(m, sink)
        row_sum = row_sum * tl.exp2(m - m_new) + tl.exp2(sink - m_new)
        acc = acc * tl.exp2(m - m_new)[:, None]
    out = acc / row_sum[:, None]
    o_ptrs = Out + q_rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])


def extend_attention(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                     q_start: torch.Tensor, q_lens: torch.Tensor, kv_indices: torch.Tensor,
                     kv_start: torch.Tensor, kv_lens: torch.Tensor, max_q_len: int,
                     sm_scale: float | None = None, alibi_slopes: torch.Tensor | None = None,
                     sinks: torch.Tensor | None = None, window: int | None = None
                     ) -> torch.Tensor:
    """q [num_tokens, num_heads, head_dim] packed new tokens; k_buffer/v_buffer
    [num_slots, num_kv_heads, head_dim] (one layer, same dtype as q, chunk K/V already stored);
    q_start, q_lens, kv_start, kv_lens [batch]; max_q_len >= every q_lens[b] (a host int, so the
    grid needs no device sync). -> [num_tokens, num_heads, head_dim] in q's dtype; rows no request
    covers are left uninitialized. alibi_slopes [num_heads] float32: head h's scores get
    slope_h * (key - query position). sinks: [num_heads] fp32 logits that join each head's
    softmax as a score with no value (gpt-oss); None: none. window: a sliding window, a query
    sees itself and the window - 1 keys before it; None: all before it."""
    _check_args(q, k_buffer, v_buffer, q_start, q_lens, kv_indices, kv_start, kv_lens)
    check_alibi(alibi_slopes, q.shape[1], q.device)
    check_sinks(sinks, q)
    num_tokens, num_heads, head_dim = q.shape
    batch = q_lens.shape[0]
    group = num_heads // k_buffer.shape[1]
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if batch == 0 or max_q_len == 0:
        return out
    block_d = max(16, next_power_of_2(head_dim))
    # fp32 tiles are twice the bytes: smaller blocks keep shared memory within bounds on GPUs.
    block = 32 if q.dtype == torch.float32 else 64
    scale = (sm_scale if sm_scale is not None else head_dim ** -0.5) * LOG2E
    grid = (triton.cdiv(max_q_len, block), batch, num_heads)
    alibi = q if alibi_slopes is None else alibi_slopes * LOG2E  # q: an unread placeholder
    _extend_kernel[grid](
        q, k_buffer, v_buffer, out, q_start, q_lens, kv_indices, kv_start, kv_lens,
        q if sinks is None else sinks, scale, alibi, window or 0,
        q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1),
        v_buffer.stride(0), v_buffer.stride(1), out.stride(0), out.stride(1),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_M=block, BLOCK_N=block, BLOCK_D=block_d,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        HAS_ALIBI=alibi_slopes is not None, HAS_SINKS=sinks is not None, HAS_WINDOW=bool(window),
        num_warps=4 if block_d <= 64 else 8, num_stages=2,
    )
    return out


def extend_attention_ref(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                         q_start: torch.Tensor, q_lens: torch.Tensor, kv_indices: torch.Tensor,
                         kv_start: torch.Tensor, kv_lens: torch.Tensor, max_q_len: int,
                         sm_scale: float | None = None,
                         alibi_slopes: torch.Tensor | None = None,
                         sinks: torch.Tensor | None = None, window: int | None = None
                         ) -> torch.Tensor:
    """Torch twin of extend_attention: gather into a padded batch, one masked softmax in fp32."""
    num_tokens, num_heads, head_dim = q.shape
    group = num_heads // k_buffer.shape[1]
    scale = sm_scale if sm_scale is not None else head_dim ** -0.5
    out = torch.zeros_like(q)
    if q_lens.numel() == 0 or max_q_len == 0:
        return out
    width = max(1, int(kv_lens.max()))
    qi = torch.arange(max_q_len, device=q.device)[None, :]  # [1, max_q]
    q_valid = qi < q_lens[:, None]  # [batch, max_q]
    q_rows = torch.where(q_valid, q_start[:, None] + qi, 0)
    kn = torch.arange(width, device=q.device)[None, :]  # [1, width]
    kv_valid = kn < kv_lens[:, None]  # [batch, width]
    slots = kv_indices[torch.where(kv_valid, kv_start[:, None] + kn, 0)]  # [batch, width]
    k = k_buffer[slots].float().repeat_interleave(group, dim=2)  # [batch, width, heads, d]
    v = v_buffer[slots].float().repeat_interleave(group, dim=2)
    s = torch.einsum("bmhd,bnhd->bhmn", q[q_rows].float(), k) * scale
    q_pos = (kv_lens - q_lens)[:, None] + qi  # [batch, max_q]
    visible = kv_valid[:, None, :] & (kn[:, None, :] <= q_pos[:, :, None])  # [batch, max_q, width]
    if alibi_slopes is not None:  # slope * (key - query position)
        s = s + alibi_slopes[None, :, None, None] * (kn[:, None, :] - q_pos[:, :, None])[:, None]
    if window:
        visible &= kn[:, None, :] > q_pos[:, :, None] - window
    s = s.masked_fill(~visible[:, None], -math.inf)
    if sinks is not None:  # one more column per head, dropped after the softmax
        sink = sinks.float()[None, :, None, None].expand(*s.shape[:3], 1)
        s = torch.cat((s, sink), dim=-1)
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)[..., :width]
    o = torch.einsum("bhmn,bnhd->bmhd", p, v).to(q.dtype)  # [batch, max_q, heads, d]
    out[q_rows[q_valid]] = o[q_valid]
    return out


def _check_args(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                q_start: torch.Tensor, q_lens: torch.Tensor, kv_indices: torch.Tensor,
                kv_start: torch.Tensor, kv_lens: torch.Tensor) -> None:
    check_triton("extend_attention")
    device = q.device
    check_tensor("q", q, (None, None, None), FLOAT_DTYPES, device)
    num_heads, head_dim = q.shape[1:]
    check_tensor("k_buffer", k_buffer, (None, None, head_dim), (q.dtype,), device)
    check_tensor("v_buffer", v_buffer, tuple(k_buffer.shape), (q.dtype,), device)
    num_kv_heads = k_buffer.shape[1]
    check(num_kv_heads > 0 and num_heads % num_kv_heads == 0,
          f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    check_index("q_lens", q_lens, None, device)
    batch = q_lens.shape[0]
    check_index("q_start", q_start, batch, device)
    check_index("kv_indices", kv_indices, None, device)
    check_index("kv_start", kv_start, batch, device)
    check_index("kv_lens", kv_lens, batch, device)
