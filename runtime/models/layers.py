"""Layers shared by every decoder family: RMSNorm (with Gemma's +1 offset), LayerNorm (with
Nemotron's), rotary embeddings (every static rope scaling transformers defines, and none: NoPE
layers), ALiBi's slopes (BLOOM's and MPT's), activations and tanh soft-capping."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

NO_ROPE = "none"  # the rope_type of layers without positions (SmolLM3's NoPE layers)

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
    "relu2": lambda x: torch.square(F.relu(x)),  # Nemotron's squared ReLU
}


class RMSNorm(nn.Module):
    """RMSNorm over the last axis. offset=0: Llama's weight * norm(x).to(dtype); offset=1:
    Gemma's (norm(x) * (1 + weight)).to(dtype), each rounding exactly where transformers does."""

    def __init__(self, dim: int, eps: float, offset: float = 0.0):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps, self.offset = eps, offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            return (xf * (self.offset + self.weight.float())).to(x.dtype)
        return self.weight * xf.to(x.dtype)


class LayerNorm(nn.Module):
    """LayerNorm over the last axis, with a bias or without. `weight` may be [..., dim] (one row per
    head: StableLM's q/k norms), then the affine part is applied after the normalisation.
    offset=1: Nemotron's LayerNorm1P, which stores w - 1 and normalises with w + 1."""

    def __init__(self, shape: int | tuple[int, ...], eps: float, offset: float = 0.0,
                 bias: bool = True):
        super().__init__()
        shape = (shape,) if isinstance(shape, int) else shape
        self.weight = nn.Parameter(torch.ones(shape))
        self.bias = nn.Parameter(torch.zeros(shape)) if bias else None
        self.eps, self.offset = eps, offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight + self.offset if self.offset else self.weight
        dim = (x.shape[-1],)
        if weight.dim() == 1:
            return F.layer_norm(x, dim, weight, self.bias, self.eps)
        out = F.layer_norm(x, dim, None, None, self.eps) * weight
        return out if self.bias is None else out + self.bias


def alibi_slopes(num_heads: int) -> tuple[float, ...]:
    """ALiBi's per-head slopes (Press et al., as BLOOM computes them): 2^(-8i/n) for i = 1..n, n
    the largest power of two <= num_heads; the heads past n take the odd-numbered slopes of 2n
    heads, 2^(-4i/n) for i = 1, 3, 5, ..."""
    n = 1 << (num_heads.bit_length() - 1)
    slopes = [2.0 ** (-8.0 * i / n) for i in range(1, n + 1)]
    return tuple(slopes + [2.0 ** (-4.0 * i / n) for i in range(1, 2 * (num_heads - n), 2)])


def mpt_alibi_slopes(num_heads: int, bias_max: float) -> tuple[float, ...]:
    """MPT's ALiBi slopes: 2^(-i * bias_max / n) for i = 1..n, n the smallest power of two >=
    num_heads; with fewer heads, the even-numbered slopes then the odd ones, the first num_heads
    of them."""
    n = 1 << (num_heads - 1).bit_length()
    slopes = [2.0 ** (-i * bias_max / n) for i in range(1, n + 1)]
    return tuple(slopes if n == num_heads else (slopes[1::2] + slopes[::2])[:num_heads])


def soft_cap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    return x if cap is None else torch.tanh(x / cap) * cap


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position up to max_positions, from one set of rope parameters.

    Phi-3's longrope has two frequency sets; transformers switches between them by the length of
    the sequence at hand, which would give one cached prefix two different keys. Here the choice
    is made once from the engine's context length: long factors when it exceeds the model's
    original context, else short ones (the same as transformers for any sequence on the same side
    of that length).
    """

    def __init__(self, config: Any, rope: dict[str, Any], head_dim: int, max_positions: int,
                 layer_type: str | None = None):
        super().__init__()
        # Gemma 4's "proportional" rope turns whole heads, its later frequencies zero.
        partial = 1.0 if rope["rope_type"] == "proportional" else rope.get("partial_rotary_factor", 1.0)
        self.rotary_dim = int(head_dim * partial)
        with torch.device("cpu"):  # real tables even while the model is built on "meta"
            if rope["rope_type"] == NO_ROPE:
                # cos 1, sin 0: q * 1 + rotated(q) * 0 is q bit for bit, so a NoPE layer runs the
                # same steps (compiled, fused) as its neighbours with no switch of its own.
                self.cos = torch.ones(max_positions, self.rotary_dim)
                self.sin = torch.zeros(max_positions, self.rotary_dim)
            else:
                inv_freq, scaling = _inv_freq(config, rope, self.rotary_dim, max_positions,
                                              layer_type)
                freqs = torch.arange(max_positions).float()[:, None] * inv_freq[None, :]
                emb = torch.cat((freqs, freqs), dim=-1)  # [max_positions, rotary_dim]
                # Plain attributes, not buffers: module.to(bfloat16) must not round fp32 tables.
                self.cos = emb.cos() * scaling
                self.sin = emb.sin() * scaling
            # M-RoPE (Qwen-VL): frequency j of each half turns by position axis section[j]
            # (temporal, height, width); None: one axis.
            sections = rope.get("mrope_section")
            self.section: torch.Tensor | None = None
            if sections:
                axis = _mrope_axes(sections, self.rotary_dim // 2,
                                   bool(rope.get("mrope_interleaved")))
                self.section = torch.cat((axis, axis))  # [rotary_dim]
        self._rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        # The tables rounded to a forward's dtype, kept per dtype: a decode step then gathers its
        # rows in that dtype (2 small ops) instead of gathering fp32 rows and rounding them (6).
        self._typed: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}

    def rotate(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """q [T, heads, d], k [T, kv_heads, d] -> rotated copies (the first rotary_dim dims), with
        cos/sin this forward's table rows (tables_for): a pure function of its tensors, which is
        what lets torch.compile trace it (tables_for keeps per-forward state)."""
        if self.rotary_dim == q.shape[-1]:
            # q and k rotated as one tensor: half the small ops of a layer's rotary (same values)
            qk = _rotate(torch.cat((q, k), dim=1), cos, sin)
            return qk[:, : q.shape[1]], qk[:, q.shape[1]:]
        r = self.rotary_dim
        return (torch.cat((_rotate(q[..., :r], cos, sin), q[..., r:]), dim=-1),
                torch.cat((_rotate(k[..., :r], cos, sin), k[..., r:]), dim=-1))

    def tables_for(self, positions: torch.Tensor, dtype: torch.dtype):
        """cos/sin rows [T, 1, d] for this forward's positions ([T], or [T, 3] M-RoPE positions:
        ForwardBatch.rotary_positions), looked up once for all layers."""
        if self._rows is None or self._rows[0] is not positions:
            cos_table, sin_table = self._tables_in(dtype, positions.device)
            if positions.dim() == 1:
                cos, sin = cos_table[positions], sin_table[positions]
            else:  # column j read at the position of its axis: [T, d] rows of the same tables
                assert self.section is not None, "3-D positions for a model without M-RoPE"
                section = self.section.to(positions.device)
                at = positions[:, section]  # [T, rotary_dim]
                cos, sin = cos_table.gather(0, at), sin_table.gather(0, at)
            self._rows = (positions, cos[:, None, :], sin[:, None, :])
        return self._rows[1], self._rows[2]

    def _tables_in(self, dtype: torch.dtype, device: torch.device
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """The cos/sin tables on `device` rounded to `dtype` (rounding commutes with the gather:
        the rows are the fp32 rows rounded)."""
        if self.cos.device != device:  # the tables follow the model's device
            self.cos, self.sin = self.cos.to(device), self.sin.to(device)
            self._typed.clear()
        typed = self._typed.get(dtype)
        if typed is None:
            typed = self._typed[dtype] = (self.cos.to(dtype), self.sin.to(dtype))
        return typed


def _mrope_axes(sections: list[int], half: int, interleaved: bool) -> torch.Tensor:
    """[half] int64: the position axis (0 temporal, 1 height, 2 width) of each frequency. In
    blocks of mrope_section's counts (Qwen2.5-VL), or interleaved (Qwen3-VL): frequency j is a
    height one for j % 3 == 1 below 3 x its count, a width one for j % 3 == 2 below 3 x its
    count, the rest temporal."""
    assert sum(sections) == half, f"mrope_section {sections} must cover {half} frequencies"
    if not interleaved:
        return torch.repeat_interleave(torch.arange(len(sections)), torch.tensor(sections))
    j = torch.arange(half)
    axis = torch.zeros(half, dtype=torch.int64)
    for a in (1, 2):
        axis[(j % 3 == a) & (j < 3 * sections[a])] = a
    return axis


def _inv_freq(config: Any, rope: dict[str, Any], dim: int, max_positions: int,
              layer_type: str | None) -> tuple[torch.Tensor, float]:
    kind = rope.get("rope_type", "default")
    if kind == "default":
        inv_freq = 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2).float() / dim))
        if rope.get("freq_factors"):  # a GGUF's rope_freqs tensor (Llama 3 scaling, precomputed)
            inv_freq = inv_freq / torch.tensor(rope["freq_factors"], dtype=torch.float32)
        return inv_freq, 1.0
    kwargs: dict[str, Any] = {"layer_type": layer_type} if layer_type else {}
    if kind == "longrope" and max_positions > rope["original_max_position_embeddings"]:
        kwargs["seq_len"] = rope["original_max_position_embeddings"] + 1
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[kind](config, torch.device("cpu"), **kwargs)
    return inv_freq.float(), float(scaling)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin
