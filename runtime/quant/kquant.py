"""KQuantMatrix: a Q4_K, Q5_K or Q6_K GGUF matrix (or a legacy Q4_0, Q5_0 or Q8_0 one) in
kernels/cpu/kquant_vnni.c's compact records, the only copy of its weight, multiplied there with
int8 activations for any number of rows.

The int4 path (quant/linear.py's Int4Matrix) holds these types in torch's int4 packing with bf16
group scales: Q4_K at 5 bits a weight, Q5_K and Q6_K split along a doubled K at 10, a second
record copy for the int8 kernel, and prefill calls either dequantizing whole matrices to bf16
or running torch's int4 kernel, whose cost grows with every row. The records hold the file's own
codes, integer scales and fp16 steps (4.6 / 5.6 / 6.6 bits a weight), so decode streams about the
file's bytes, and prefill chunks multiply the blocks with int8 activations as llama.cpp does (the
many-row product: no dequantized copy, no dense bf16 copy beside the records). The legacy types'
records are the file's own size (4.5 / 5.5 / 8.5 bits; the int4 path holds Q5_0 split at 9): Qwen2.5-0.5B's
Q4_K_M file (44% Q5_0, 37% Q8_0 bytes) decodes at batch 1 in 18.6-19.1 ms against 23.5-24.3 (the
int4 path), at batch 16 in 65-70 ms against 61 (Q5_0 at 16 rows: 1.1x the int4 path's time;
benchmarks/kquant_matmul.py). Used where the CPU has
AVX512-VNNI (kquant_available) and the model runs bf16 with int8 activations allowed."""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np
import torch
from gguf import GGMLQuantizationType
from torch import nn

from forklm.kernels.cpu import bindings as native_kernels
from forklm.kernels.cpu.huge_pages import streamed_empty
from forklm.runtime.quant.gguf_formats import GGUFWeight
from forklm.runtime.quant.records_cache import entry_for

ROWS = 16  # weight rows per record block
REPACK_ROWS = 2048  # rows repacked at a time at load (a multiple of ROWS)
_K_TYPES = (GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q6_K)
# kquant_vnni.c's records: K-quants 16 rows x 256 k (a 320-byte header, 8 groups of codes), the
# legacy types 16 rows x 32 k (the rows' 16 fp16 steps, one group of codes)
RECORD_K = {**dict.fromkeys(_K_TYPES, 256), GGMLQuantizationType.Q4_0: 32,
            GGMLQuantizationType.Q5_0: 32, GGMLQuantizationType.Q8_0: 32}
RECORD_BYTES = {GGMLQuantizationType.Q4_K: 320 + 8 * 256, GGMLQuantizationType.Q5_K: 320 + 8 * 320,
                GGMLQuantizationType.Q6_K: 320 + 8 * 384, GGMLQuantizationType.Q4_0: 32 + 256,
                GGMLQuantizationType.Q5_0: 32 + 320, GGMLQuantizationType.Q8_0: 32 + 512}
KQUANT_TYPES = frozenset(RECORD_BYTES)
# From this many rows every call takes kquant_vnni.c's many-row product (kquant_gemm_bf16: x
# quantized per 256 k for the K-quants, a super-block's integer sums joined before any float
# work; per 32 for the legacy types), with no dequantized copy. benchmarks/kquant_matmul.py,
# session 25 (AMD EPYC Zen 5, 2 cores), 8192x2048 and 2048x8192: Q4_K 0.62-0.7x the per-16
# kernel's time at 16 rows, 0.5x dequantize + bf16 GEMM's at 512 (~650 G multiply-adds a second
# against oneDNN's ~430 in bf16); Q6_K 0.85-1.0x at 16 rows, 0.57-0.61x at 512. Q4_0/Q5_0/Q8_0,
# 4864x896 and 896x4864: 0.9-1.0x the per-16 kernel, 0.37-0.69x the packed bf16 copy at 8-64
# rows and 0.9-1.1x at 256-512, 0.7-0.9x dequantize + GEMM. Decode batches up to 16 rows take
# native(): for the K-quants the fine product (the same loop with each group of 32 of x in a
# power-of-two step under its super-block's), whose error is 2.6x smaller where x has outlier
# channels (a step per 256 k is set by the largest |x| in it, as llama.cpp's Q8_K); for the
# legacy types the per-16 kernel.
GEMM_MIN_ROWS = 17
# From this many rows the many-row product runs on AMX tiles where they run (kquant_gemm_amx:
# the records dequantized to bf16 a tile at a time, x as it is, fp32 sums). Session 26 (Intel
# Xeon with AMX, 2 cores), Q4_K/Q5_0/Q6_K/Q8_0 8192x2048 and 2048x8192: ~1000 G multiply-adds a
# second from 128 rows (2.8x the int8 product's ~360 on that CPU), 0.7x its time at 32 rows,
# 1.2x at 17 (a 16-row tile of x is padded whole); dequantizing the weights costs ~1 ms a
# 16M-weight matrix, so up to 16 rows it only ties the per-16 kernel.
AMX_MIN_ROWS = 24
# dense_copy_min_rows() of a matrix that has no use for a dense copy
NO_DENSE_COPY = 2**62


def kquant_available() -> bool:
    """Whether KQuantMatrix can run here (the library built; a CPU with AVX512-VNNI/BW/BF16)."""
    return native_kernels.kquant_ops() is not None


def holds(ggml_type: GGMLQuantizationType, kernel_dtype: torch.dtype) -> bool:
    """Whether a run of `ggml_type` parts multiplied in `kernel_dtype` becomes a KQuantMatrix."""
    return ggml_type in KQUANT_TYPES and kernel_dtype == torch.bfloat16 and kquant_available()


class KQuantMatrix(nn.Module):
    """One weight matrix (a row-stack of same-typed GGUF parts) in kquant_vnni.c's records."""

    records: torch.Tensor  # uint8, padded_rows / 16 blocks of in / RECORD_K records each

    def __init__(self, records: torch.Tensor, ggml_type: GGMLQuantizationType,
                 out_features: int, in_features: int) -> None:
        super().__init__()
        self.register_buffer("records", records)
        self.ggml_type, self.out_features, self.in_features = ggml_type, out_features, in_features
        self.padded_rows = out_features + -out_features % ROWS
        # (records.data_ptr(), the matmul on them), built on first use: the decode kernel and
        # the many-row product
        self._native: tuple[int, Callable[[torch.Tensor], torch.Tensor] | None] | None = None
        self._gemm: tuple[int, Callable[[torch.Tensor], torch.Tensor] | None] | None = None
        self._amx: tuple[int, Callable[[torch.Tensor], torch.Tensor] | None] | None = None

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_native"] = state["_gemm"] = state["_amx"] = None  # ctypes closures over this process's pointers
        return state

    @classmethod
    def from_gguf(cls, parts: list[GGUFWeight]) -> KQuantMatrix:
        """The row-stack of `parts`, repacked straight from their file bytes (no decoded codes
        in between: the records are the only allocation), each part's pages let go after."""
        ggml_type = parts[0].ggml_type
        assert all(p.ggml_type == ggml_type for p in parts) and ggml_type in KQUANT_TYPES
        in_features = parts[0].shape[1]
        out_features = sum(p.shape[0] for p in parts)
        padded = out_features + -out_features % ROWS
        block_bytes = in_features // RECORD_K[ggml_type] * RECORD_BYTES[ggml_type]  # 16 rows'
        nbytes = padded // ROWS * block_bytes
        cache, key = entry_for(parts, "records")
        if cache is not None and (cached := cache.get(key, nbytes)) is not None:
            return cls(cached, ggml_type, out_features, in_features)
        addresses = torch.from_numpy(np.concatenate([_row_addresses(p) for p in parts]))
        records = streamed_empty((nbytes,), torch.uint8)
        part_starts = np.cumsum([0] + [p.shape[0] for p in parts])
        # A run of rows at a time, each part's pages let go as soon as its rows in the run are
        # repacked: the file's bytes are not held beside the records (a 1B model's 215 MB
        # embedding would otherwise be, at the top of the load's RSS).
        for start in range(0, out_features, REPACK_ROWS):
            stop = min(start + REPACK_ROWS, out_features)
            run_padded = (padded if stop == out_features else stop) - start
            done = native_kernels.kquant_repack(
                int(ggml_type), addresses[start:stop], stop - start, run_padded, in_features,
                RECORD_BYTES[ggml_type], RECORD_K[ggml_type],
                out=records[start // ROWS * block_bytes:(start + run_padded) // ROWS * block_bytes])
            assert done is not None, "KQuantMatrix needs the K-quant library (see holds())"
            for part, first in zip(parts, part_starts):
                lo, hi = max(start, first), min(stop, first + part.shape[0])
                if part.release_rows is not None and lo < hi:
                    part.release_rows(lo - first, hi - lo)
                elif part.release is not None and lo < hi == first + part.shape[0]:
                    part.release()  # its last rows are in: all of it
        if cache is not None:
            cache.put(key, records)
        return cls(records, ggml_type, out_features, in_features)

    @property
    def kernel_dtype(self) -> torch.dtype:
        return torch.bfloat16

    def native(self) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """The decode kernel on this matrix (batches below GEMM_MIN_ROWS, kquant_decode_bf16):
        kquant_vnni.c's fine product for the K-quants, its per-16 kernel for the legacy types;
        contiguous bf16 x [M, in], any M >= 1 -> bf16 [M, out]."""
        return self._bound("_native", functools.partial(native_kernels.kquant_matmul,
                                                         entry="kquant_decode"))

    def gemm(self) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """kquant_vnni.c's many-row product on this matrix: contiguous bf16 x [M, in] -> bf16
        [M, out] (None where the library is off)."""
        return self._bound("_gemm", native_kernels.kquant_gemm)

    def amx_gemm(self) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """kquant_vnni.c's many-row product on AMX tiles (bf16 weights dequantized a tile at a
        time, x as it is): contiguous bf16 x [M, in] -> bf16 [M, out]; None where AMX does not
        run here."""
        return self._bound("_amx", native_kernels.kquant_gemm_amx)

    def kernel_for(self, rows: int) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """The kernel a call of `rows` rows takes: the decode kernel (native()) below
        GEMM_MIN_ROWS, AMX tiles from AMX_MIN_ROWS where they run, else the int8 many-row
        product."""
        if rows < GEMM_MIN_ROWS:
            return self.native()
        return (rows >= AMX_MIN_ROWS and self.amx_gemm()) or self.gemm()

    def _bound(self, slot: str, bind: Callable[..., Callable[[torch.Tensor], torch.Tensor] | None]
               ) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """`bind`'s call on the records, kept in attribute `slot` with the records' address
        (built on first use, and again where the buffers were replaced)."""
        ptr = self.records.data_ptr()
        held = getattr(self, slot)
        if held is None or held[0] != ptr:
            held = (ptr, bind(int(self.ggml_type), self.records, self.padded_rows,
                              self.out_features, self.in_features))
            setattr(self, slot, held)
        return held[1]

    def dense_copy_min_rows(self) -> int:
        # the many-row product is as fast as a packed bf16 copy or faster: no copy is kept
        return NO_DENSE_COPY

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, in] bf16 -> [M, out] bf16 by kernel_for(M)."""
        kernel = self.kernel_for(x.shape[0])
        assert kernel is not None, "KQuantMatrix needs the K-quant library"
        return kernel(x.contiguous())

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """float32 [len(ids), in]: weight rows `ids`, equal to gguf-py's dequantization."""
        return native_kernels.kquant_rows(int(self.ggml_type), self.records, self.out_features,
                                          self.in_features, ids.cpu())

    def dense_t(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """bf16 [in, out]: the transposed weight, dequantized (into `out` when given)."""
        return native_kernels.kquant_dequantize_t(int(self.ggml_type), self.records,
                                                  self.padded_rows, self.out_features,
                                                  self.in_features, out)

    def torch_matmul(self, x: torch.Tensor) -> torch.Tensor:
        """The product the kernel approximates, in fp32 torch ops on the dequantized weight
        (its tests' reference: the kernel adds int8 steps of x and a bf16 rounding)."""
        return x.float() @ self.rows(torch.arange(self.out_features)).T

    @property
    def nbytes(self) -> int:
        return self.records.numel()

    def extra_repr(self) -> str:
        return f"{self.ggml_type.name}, out_features={self.out_features}, " \
               f"in_features={self.in_features}"


def _row_addresses(part: GGUFWeight) -> np.ndarray:
    """int64 [rows]: where each row of `part`'s blocks starts in memory."""
    data = part.data
    assert data.strides[1] == 1, "a part's rows must be contiguous bytes"
    base = data.__array_interface__["data"][0]
    return base + np.arange(data.shape[0], dtype=np.int64) * data.strides[0]


def keep_matmul_out_of_compiled_graphs() -> None:
    """Make compiled graphs break around KQuantMatrix.matmul (a ctypes call). Done when
    torch.compile is turned on rather than by a decorator: torch.compiler.disable imports
    torch._dynamo, ~0.5 s of every start-up."""
    if not getattr(KQuantMatrix.matmul, "_forklm_eager_only", False):
        eager = torch.compiler.disable(KQuantMatrix.matmul)
        eager._forklm_eager_only = True  # type: ignore[attr-defined]
        KQuantMatrix.matmul = eager  # type: ignore[method-assign]
