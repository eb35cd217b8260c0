"""float32 linear layers on the CPU whose weights are stored as float16, packed once for FBGEMM.

A batch-1 decode step streams every weight from memory once, so its time is the weights' bytes:
float16 halves them, and FBGEMM's fp16 GEMM widens each weight to float32 in registers and
accumulates in float32, so activations, KV and accumulation stay float32. On an AVX2 CPU
(no native bf16) this is what dtype "auto" gives: the four matmuls of the default model's 30
layers take 2.2x less time at 1 row and 3x less at 16 rows than float32 MKL, and teacher-forced
top-1 agreement with the float32 model is 99.8% with a KL of 1e-6 (benchmarks/NOTES.md).
dtype="float32" keeps float32 weights: that path is token-exact with transformers.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn

from forklm.runtime.models.weights import replace_linears

# A tied LM head gets its own packed copy (the embedding lookup reads the float32 table): pack
# it only while that copy is small next to the rest of the model (57 MiB for the default model).
MAX_TIED_HEAD_BYTES = 512 * 2**20


class Fp16WeightLinear(nn.Module):
    """y = x @ W.T + b for float32 x, with W held as FBGEMM's packed float16 matrix (an opaque
    object, only ever multiplied with) and b in float32."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.packed = torch.ops.quantized.linear_prepack_fp16(
            weight.detach().float(), None if bias is None else bias.detach().float())

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [T, in] float32 -> [T, out]
        return torch.ops.quantized.linear_dynamic_fp16(x, self.packed)

    def direct(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """forward as a plain function of x (no module attribute lookups per call)."""
        linear, packed = torch.ops.quantized.linear_dynamic_fp16, self.packed
        return lambda x: linear(x, packed)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, weight=fp16"


@functools.cache
def fp16_weights_available() -> bool:
    """Whether this torch build multiplies FBGEMM-packed float16 weights (x86 builds do)."""
    if "fbgemm" not in torch.backends.quantized.supported_engines:
        return False
    try:
        packed = torch.ops.quantized.linear_prepack_fp16(torch.ones(16, 16), None)
        out = torch.ops.quantized.linear_dynamic_fp16(torch.ones(1, 16), packed)
    except (RuntimeError, AttributeError):
        return False
    return bool(torch.equal(out, torch.full((1, 16), 16.0)))


def pack_fp16_linears(model: nn.Module) -> int:
    """Replace every float32 linear under `model` by an Fp16WeightLinear; returns how many."""
    return replace_linears(model, torch.float32, Fp16WeightLinear)


def fp16_tied_head(table: torch.Tensor) -> Fp16WeightLinear | None:
    """A packed float16 copy of a tied float32 embedding table for the LM head, or None when it
    is too large to keep beside the table."""
    if table.dtype != torch.float32 or table.numel() * 2 > MAX_TIED_HEAD_BYTES:
        return None
    return Fp16WeightLinear(table, None)
