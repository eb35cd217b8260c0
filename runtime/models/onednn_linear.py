"""bf16 linear layers on the CPU with their weights pre-reordered into oneDNN's blocked layout.

`F.linear` on a plain [out, in] bf16 weight makes oneDNN reorder (or read strided) the whole
weight on every call; a decode step reads every weight once, so that cost is paid 121 times a
step. Reordered once at load, the same matmuls run 1.5-2x faster at 1-16 rows and give the same
values (benchmarks/NOTES.md, "oneDNN-packed bf16 weights"). float32 stays on plain `F.linear`:
there the packed path is barely faster and rounds differently from the MKL GEMM transformers'
own float32 forward uses, which the token-exact tests compare against.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch
from torch import nn

from forklm.runtime.models.weights import BUILD_THREADS, replace_linears

if TYPE_CHECKING:
    from forklm.runtime.quant.linear import QuantizedLinear

logger = logging.getLogger(__name__)

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


def plan_dense_copies(model: nn.Module, max_bytes: int = MAX_DENSE_COPY_BYTES
                        ) -> DenseCopyBuild | None:
    """Plan a packed bf16 copy of the weight of every QuantizedLinear under `model` (used from
    dense_copy_min_rows() rows) when all of them together fit in `max_bytes`: the build, to be
    run or started (None: no copies)."""
    from forklm.runtime.quant.linear import QuantizedLinear

    quantized = [m for m in model.modules()
                 if isinstance(m, QuantizedLinear) and m.wants_dense_copy]
    nbytes = sum(m.out_features * m.in_features * 2 for m in quantized)
    return DenseCopyBuild(quantized, nbytes) if quantized and nbytes <= max_bytes else None


class DenseCopyBuild:
    """The dense copies of some QuantizedLinears, built one fp32 matrix at a time on two
    threads (the dequantization (C), the bf16 rounding and oneDNN's reorder all let go of the
    GIL: the default model's copies take 0.34 s one by one). An engine leaves them to its idle
    time (~0.2 s off its start): `start` builds them in the background, and a forward call that
    needs a copy first (its rows at or above dense_copy_min_rows()) builds them itself, or waits
    for the background build. Every call multiplies by the same weights the same way whenever
    it comes."""

    def __init__(self, modules: list[QuantizedLinear], nbytes: int) -> None:
        self.modules, self.nbytes = modules, nbytes
        self.done = threading.Event()
        self._lock = threading.Lock()
        self._claimed = False  # by the one caller that builds them
        for module in modules:
            module.dense_build = self

    def run(self) -> None:
        """Build them here and now unless a build has begun (a forward call that needs a copy
        first, or an engine that does not defer them), then return once they are built."""
        if self._claim():
            self._build()
        self.done.wait()

    def start(self) -> None:
        """Build them in the background (unless a build has begun), on threads of the lowest CPU
        priority: requests keep the cores they need, the copies take what is left."""
        if self._claim():
            threading.Thread(target=self._build, args=(_lowest_priority,),
                             name="forklm-dense-copies", daemon=True).start()

    def run_slice(self) -> bool:
        """As an engine's IdleWork (runtime/engine/idle_work.py): started in the background, and
        nothing left for the engine's thread."""
        self.start()
        return False

    def close(self) -> None:
        """As IdleWork: the engine is shutting down. A build under way finishes first (its
        threads are inside oneDNN); one not begun never will."""
        if self._claim():  # never begun: calls keep the quantized kernels
            for module in self.modules:
                module.dense_build = None
            self.done.set()
        else:
            self.done.wait()

    def _claim(self) -> bool:
        with self._lock:
            claimed, self._claimed = self._claimed, True
            return not claimed

    def _build(self, initializer: Callable[[], None] | None = None) -> None:
        try:
            with ThreadPoolExecutor(BUILD_THREADS, thread_name_prefix="forklm-dense",
                                    initializer=initializer) as pool:
                list(pool.map(_attach, self.modules))
        except Exception:  # each module keeps its quantized kernels, which stay correct
            logger.exception("building the dense bf16 copies failed; larger batches run on "
                             "the quantized kernels")
        finally:
            for module in self.modules:
                module.dense_build = None
            self.done.set()


def _lowest_priority() -> None:
    """The calling thread (and the OpenMP workers it starts, which inherit it) at nice 19."""
    with contextlib.suppress(OSError):  # not Linux, or not allowed: the build just competes
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)


def _attach(module: QuantizedLinear) -> None:
    module.dense = OneDNNLinear(module.dequantize().to(torch.bfloat16), None)
