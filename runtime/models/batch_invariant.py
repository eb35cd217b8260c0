"""Batch-invariant matmuls for deterministic inference (SGLang's --enable-deterministic-inference).

A CPU GEMM's result for one row depends on how many rows it is given: MKL and FBGEMM pick
different kernels and remainder paths by M (on an AVX2 CPU, row i of a 576x1536 product differs
in its last bits between M=1, 2, 3, 5, 7 and M=64). So a request's logits change with the batch
it runs in, and under bf16 or float16 weights a greedy token can flip. Every call with the same
shape, though, computes a row the same wherever it sits in the call. So in this mode every linear
layer, the LM head and each expert of a mixture multiply fixed tiles of TILE_ROWS rows (the last
tile zero-padded): a row's result no longer depends on its neighbours, on the batch size, on
prefill chunking or on whether its prefix came from the radix cache.

Elementwise ops and per-row reductions (RMSNorm, softmax, argmax) are already row-invariant on
the CPU; attention has its own batch-invariant backend (attention_invariant.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

# Rows per matmul call: a batch-1 step pays for TILE_ROWS rows, a batch of 16 makes 16/TILE_ROWS
# calls. The default model's 30 layers of float16-weight matmuls on an AVX2 CPU take 10 ms at
# 1 row, 19 at 4, 38 at 8 and 54 at 16; whole engine, deterministic vs not, side by side: 4-row
# tiles 1.9x slower at batch 1 and 2.0x at batch 16, 8-row tiles 2.1x and 1.6x (NOTES.md).
TILE_ROWS = 8


def tiled_rows(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
               rows: int = TILE_ROWS) -> torch.Tensor:
    """fn applied to x [M, in] in calls of exactly `rows` rows -> [M, out]."""
    m = x.shape[0]
    if m == 0:  # no rows to tile (a prefill chunk that needs no logits)
        return fn(x)
    pad = -m % rows
    if pad:
        x = torch.cat((x, x.new_zeros(pad, *x.shape[1:])))
    x = x.contiguous()
    outs = [fn(x[i:i + rows]) for i in range(0, m + pad, rows)]
    out = outs[0] if len(outs) == 1 else torch.cat(outs)
    return out[:m] if pad else out


class RowTiled(nn.Module):
    """A linear-like module (anything called on [T, in]) run in fixed tiles of rows."""

    def __init__(self, inner: nn.Module, rows: int = TILE_ROWS):
        super().__init__()
        self.inner, self.rows = inner, rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return tiled_rows(self.inner, x, self.rows)


def make_batch_invariant(model: nn.Module, rows: int = TILE_ROWS) -> int:
    """Wrap every linear-like module under `model` in RowTiled, and give the model's LM head
    and mixtures' experts the same tiling;
    returns how many modules were wrapped. Call after the weights are loaded and packed."""
    # The embedding's lookup is per-row already; a CausalLM tiles its whole head itself (a tied
    # head may be a plain F.linear on the embedding table).
    skip = [getattr(getattr(model, "model", None), "embed_tokens", None)]
    if hasattr(model, "head_tile_rows"):
        setattr(model, "head_tile_rows", rows)  # noqa: B010 (nn.Module typing)
        skip += [getattr(model, "lm_head", None), getattr(model, "tied_head", None)]
    targets: list[tuple[nn.Module, str]] = []

    def visit(parent: nn.Module) -> None:
        for name, child in parent.named_children():
            if any(child is s for s in skip) or isinstance(child, RowTiled):
                continue
            if _is_linear_like(child):
                targets.append((parent, name))  # its inner parts are reached through it
            else:
                visit(child)

    visit(model)
    for parent, name in targets:
        setattr(parent, name, RowTiled(getattr(parent, name), rows))
    for module in model.modules():
        if hasattr(module, "expert_linear"):
            setattr(module, "expert_linear", functools.partial(tiled_linear, rows=rows))  # noqa: B010
    return len(targets)


def tiled_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 rows: int = TILE_ROWS) -> torch.Tensor:
    """F.linear in fixed tiles of rows."""
    return tiled_rows(lambda tile: F.linear(tile, weight, bias), x, rows)


def _is_linear_like(module: nn.Module) -> bool:
    # nn.Linear (and FusedLinear), Fp16WeightLinear, OneDNNLinear, QuantizedLinear: all carry
    # in/out feature counts and multiply [T, in].
    return hasattr(module, "in_features") and hasattr(module, "out_features")
