"""store_kv: write the new tokens' K and V rows into one layer of the paged KV pool, all heads of
both tensors in one launch."""

from __future__ import annotations

import torch

from forklm.kernels.triton._common import (
    FLOAT_DTYPES,
    check_index,
    check_tensor,
    check_triton,
    jit,
    next_power_of_2,
    tl,
)


@jit
def _store_kv_kernel(K, V, Slots, K_buf, V_buf,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_kbs, stride_kbh, stride_vbs, stride_vbh,
                     NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                     BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """One program per new token: copy its [num_kv_heads, head_dim] K and V rows to its slot."""
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(Slots + t).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)
    k = tl.load(K + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(V + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    k_dst = K_buf + slot * stride_kbs + offs_h[:, None] * stride_kbh + offs_d[None, :]
    v_dst = V_buf + slot * stride_vbs + offs_h[:, None] * stride_vbh + offs_d[None, :]
    tl.store(k_dst, k.to(K_buf.dtype.element_ty), mask=mask)
    tl.store(v_dst, v.to(V_buf.dtype.element_ty), mask=mask)


def store_kv(k_buffer: torch.Tensor, v_buffer: torch.Tensor, slots: torch.Tensor,
             k: torch.Tensor, v: torch.Tensor) -> None:
    """k_buffer[slots] = k and v_buffer[slots] = v, in place, cast to the buffer dtype.

    k_buffer/v_buffer [num_slots, num_kv_heads, head_dim] (one layer of the pool); slots [n] int32
    or int64, distinct and in range (not checked: that would need a device sync); k/v
    [n, num_kv_heads, head_dim], rows may be strided (e.g. views of a fused qkv projection).
    """
    _check_args(k_buffer, v_buffer, slots, k, v)
    n, num_kv_heads, head_dim = k.shape
    if n == 0:
        return
    _store_kv_kernel[(n,)](
        k, v, slots, k_buffer, v_buffer,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_H=next_power_of_2(num_kv_heads), BLOCK_D=next_power_of_2(head_dim),
    )


def store_kv_ref(k_buffer: torch.Tensor, v_buffer: torch.Tensor, slots: torch.Tensor,
                 k: torch.Tensor, v: torch.Tensor) -> None:
    """Torch twin of store_kv."""
    index = slots.to(torch.int64)
    k_buffer.index_copy_(0, index, k.to(k_buffer.dtype))
    v_buffer.index_copy_(0, index, v.to(v_buffer.dtype))


def _check_args(k_buffer: torch.Tensor, v_buffer: torch.Tensor, slots: torch.Tensor,
                k: torch.Tensor, v: torch.Tensor) -> None:
    check_triton("store_kv")
    device = k_buffer.device
    check_tensor("k_buffer", k_buffer, (None, None, None), FLOAT_DTYPES, device)
    _, num_kv_heads, head_dim = k_buffer.shape
    check_tensor("v_buffer", v_buffer, tuple(k_buffer.shape), (k_buffer.dtype,), device)
    check_tensor("k", k, (None, num_kv_heads, head_dim), FLOAT_DTYPES, device)
    check_tensor("v", v, tuple(k.shape), FLOAT_DTYPES, device)
    check_index("slots", slots, k.shape[0], device)
