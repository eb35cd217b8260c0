"""bf16 linear layers on the CPU with their weights pre-reordered into oneDNN's blocked layout.

`F.linear` on a plain [out, in] bf16 weight makes oneDNN reorder (or read strided) the whole
weight on every call; a decode step reads every weight once, so that cost is paid 121 times a
step. Reordered once at load, the same matmuls run 1.5-2x faster at 1-16 rows and give the same
values (benchmarks/NOTES.md, "oneDNN-packed bf16 weights"). float32 stays on plain `F.linear`:
there the packed path is barely faster and rounds differently from the MKL GEMM transformers'
own float32 forward uses, which the token-exact tests compare against.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import nn

from forklm.runtime.models.weights import BUILD_THREADS, replace_linears

# The weight layout is chosen for this many rows; 1 measured best for decode and within a few %
# of the row-count-specific layout for 16-1024-row prefills (NOTES.md).
ROWS_HINT = 1
# A tied LM head needs its own packed copy (the embedding lookup reads the plain table): pack it
# only while that copy is small next to the rest of the model (54 MiB for the default model).
MAX_TIED_HEAD_BYTES = 512 * 2**20
# Quantized models whose bf16 weights fit in this get a packed dense copy of every quantized
# matrix for larger batches (the int4 kernel stays for 1-7 rows): 257 MiB more for the default
# model, whose decode at batch 16 and prefill run 1.3x and 2.5x faster with it. Larger models
# keep only their quantized blocks (quantization="gguf" always does).
MAX_DENSE_COPY_BYTES = 1 * 2**30


class OneDNNLinear(nn.Module):
    """y = x @ W.T + b with W held in oneDNN's packed layout: an opaque tensor, so a
    non-persistent buffer rather than a parameter (it is only ever multiplied with)."""

    packed: torch.Tensor

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(
            weight.detach(), ROWS_HINT), persistent=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def direct(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """forward as a plain function of x (no module attribute lookups per call)."""
        linear, packed, bias = torch.ops.mkldnn._linear_pointwise, self.packed, self.bias
        return lambda x: linear(x, packed, bias, "none", [], "")


def can_pack(dtype: torch.dtype, device: str) -> bool:
    """Whether this torch build and CPU run oneDNN bf16 linears (AVX-512-bf16 or AMX)."""
    if dtype != torch.bfloat16 or device != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    try:
        w = torch.zeros(16, 16, dtype=dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, ROWS_HINT)
        torch.ops.mkldnn._linear_pointwise(torch.zeros(1, 16, dtype=dtype), packed, None,
                                           "none", [], "")
    except (RuntimeError, AttributeError):
        return False
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def pack_linears(model: nn.Module) -> int:
    """Replace every plain bf16 linear under `model` (fused q/k/v and gate/up included) by a
    OneDNNLinear; returns how many."""
    return replace_linears(model, torch.bfloat16, OneDNNLinear)


def packed_tied_head(table: torch.Tensor) -> OneDNNLinear | None:
    """A packed copy of a tied embedding table for the LM head, or None when it is too large to
    keep twice."""
    if table.dtype != torch.bfloat16 or table.numel() * table.element_size() > MAX_TIED_HEAD_BYTES:
        return None
    return OneDNNLinear(table, None)


def attach_dense_copies(model: nn.Module, max_bytes: int = MAX_DENSE_COPY_BYTES) -> int:
    """Give every QuantizedLinear under `model` a packed bf16 copy of its weight (used from
    DENSE_COPY_MIN_ROWS rows) when all of them together fit in `max_bytes`; returns the bytes
    attached (0: none). One fp32 matrix is dequantized at a time."""
    from forklm.runtime.quant.linear import QuantizedLinear

    quantized = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    total = sum(m.out_features * m.in_features * 2 for m in quantized)
    if not quantized or total > max_bytes:
        return 0

    def attach(module: QuantizedLinear) -> None:
        module.dense = OneDNNLinear(module.dequantize().to(torch.bfloat16), None)

    # Two at a time: the dequantization (C), the bf16 rounding and oneDNN's reorder all let go of
    # the GIL (the default model's copies take 0.34 s one by one).
    with ThreadPoolExecutor(BUILD_THREADS, thread_name_prefix="forklm-dense") as pool:
        list(pool.map(attach, quantized))
    return total
