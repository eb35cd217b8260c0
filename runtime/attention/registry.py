"""The attention backends by name (--attention-backend): the torch one always; native and Triton
imported only when chosen (Triton is never needed on the CPU; the native kernel compiles on first
use)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from forklm.runtime.attention.backends import AttentionBackend, AttentionLayerSpec, TorchAttention
from forklm.runtime.errors import InvalidArgumentError

if TYPE_CHECKING:
    from forklm.runtime.kvcache.pool import KVPool


def _triton_attention(pool: KVPool, num_heads: int, num_kv_heads: int, head_dim: int,
                      layers: Sequence[AttentionLayerSpec] | None = None) -> AttentionBackend:
    # Imported only when chosen: it imports Triton, which the CPU path never needs.
    from forklm.runtime.attention.triton_backend import TritonAttention

    return TritonAttention(pool, num_heads, num_kv_heads, head_dim, layers)


def _native_attention(pool: KVPool, num_heads: int, num_kv_heads: int, head_dim: int,
                      layers: Sequence[AttentionLayerSpec] | None = None) -> AttentionBackend:
    # Imported only when chosen: its first use compiles the C kernel.
    from forklm.runtime.attention.native import NativeAttention

    return NativeAttention(pool, num_heads, num_kv_heads, head_dim, layers)


_BACKENDS = {"torch": TorchAttention, "triton": _triton_attention, "native": _native_attention}


def create_attention_backend(name: str, pool: KVPool, num_heads: int, num_kv_heads: int,
                             head_dim: int,
                             layers: Sequence[AttentionLayerSpec] | None = None) -> AttentionBackend:
    """`layers`: one AttentionLayerSpec per layer (None: plain causal attention everywhere)."""
    if name not in _BACKENDS:
        raise InvalidArgumentError("attention_backend", name,
                                   f"supported here: {', '.join(sorted(_BACKENDS))}")
    return _BACKENDS[name](pool, num_heads, num_kv_heads, head_dim, layers)
