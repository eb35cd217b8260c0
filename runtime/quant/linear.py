"""QuantizedLinear: an nn.Linear whose weight stays in GGUF's quantized blocks. Each run of
same-typed parts is one segment: a KQuantMatrix (quant/kquant.py: K-quant records multiplied by
kernels/cpu/kquant_vnni.c with int8 activations, where the CPU has VNNI) or an Int4Matrix
(w = (c - 8) * scale + zero, multiplied by kernels/cpu/int4_gemv.c for decode-sized calls of bf16
rows and torch's int4 groupwise CPU kernel (`_weight_int4pack_mm_for_cpu`) otherwise)."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from gguf import GGMLQuantizationType
from torch import nn

from forklm.kernels.cpu import bindings as native_kernels
from forklm.kernels.cpu.huge_pages import streamed_empty
from forklm.runtime.quant import kquant
from forklm.runtime.quant.gguf_formats import SUPPORTED_TYPES, GGUFWeight, GroupCodes, decode
from forklm.runtime.quant.kquant import KQuantMatrix
from forklm.runtime.quant.records_cache import RecordsCache, entry_for

if TYPE_CHECKING:
    from forklm.runtime.models.onednn_linear import DenseCopyBuild

_Fn = Callable[[torch.Tensor], torch.Tensor]
KERNEL_GROUP = 32  # the smallest group the int4 kernel takes (it accepts 32, 64, 128, 256)
ROW_MULTIPLE = 16  # the packing needs N divisible by 16; other sizes are padded with zero rows
# Rows a load decodes and packs at a time (a multiple of the packing's 64-row blocks): 2048 rows
# of a 2048-wide Q6_K matrix hold ~70 MB of transient codes.
LOAD_CHUNK_ROWS = 2048
KERNEL_DTYPES = (torch.bfloat16, torch.float32)
# From this many rows (prefill chunks) a bf16 matrix is dequantized for the call
# and multiplied by a dense GEMM: torch's int4 kernel is a matrix-vector design whose cost grows
# with every row (3072x576 at 400 rows: 10.7 ms, dequantize + GEMM: 1.2 ms; at 16 rows the
# kernel wins, 0.45 ms; benchmarks/NOTES.md).
DENSE_MIN_ROWS = 128
# ... but not for matrices this large (a vocabulary-sized LM head: dequantizing 49152x1152 codes
# writes 113 MB per call, more than its few logits rows cost in the kernel).
DENSE_MAX_ELEMENTS = 8 * 2**20
# With a dense copy attached (small models, see onednn_linear.plan_dense_copies), calls of this
# many rows or more use it: the int4 kernel is faster below (fewer weight bytes to stream), the
# packed bf16 GEMM above (NOTES.md, "int4 for small batches, a dense copy for the rest"; session
# 12 moved it from 8 to 9: a batch-8 decode step 18.1-23.3 -> 15.5-22.1 ms with int4, batch 10
# 21-23 ms dense vs 24-30 int4). That is torch's int4 kernel; the native one is faster than the
# copy up to the most rows it takes on 4-bit matrices (session 13: batch-16 forward 24.5 vs 30.0
# ms), but split 8- and 6-bit ones (lo_bits) multiply a doubled K and lose from 8 rows (the
# default model's Q8_0 tied head, ms native / copy: 8 rows 2.45 / 1.98, 16 rows 5.29 / 2.66).
# With int8 activations they keep the native kernel up to its 16 rows (session 14, the head:
# 8 rows 1.06 / 1.50 ms, 12 rows 1.57 / 1.82, 16 rows 2.16 / 2.17).
DENSE_COPY_MIN_ROWS = 9
NATIVE_DENSE_COPY_MIN_ROWS = native_kernels.INT4_MAX_ROWS + 1
NATIVE_SPLIT_DENSE_COPY_MIN_ROWS = 8

# How each type's integer codes map onto 4-bit kernel codes. 4-bit types use c = code + shift.
# Other codes (8-bit Q8_0 and the IQ4/MXFP4 codebook values, 5-bit Q5_*, 6-bit Q6_K, and 3-bit
# Q3_K, whose sub-blocks of 16 need Q6_K's layout) are split
# code = hi * 2**lo_bits + lo into two 4-bit codes that sit side by side along a doubled K; the
# activations are repeated to match, the hi copy multiplied by 2**lo_bits (a power of two, so
# exact). Measured in benchmarks/quant_speed.py: this is faster than dequantizing int8 codes in
# row chunks, and exact. A split matrix without offsets is Q8_0's form, which the int8 VNNI
# kernel takes as 8-bit records.
_SHIFT = {GGMLQuantizationType.Q4_0: 8, GGMLQuantizationType.Q4_1: 0, GGMLQuantizationType.Q4_K: 0}
_LO_BITS = {GGMLQuantizationType.Q6_K: 2, GGMLQuantizationType.Q3_K: 2, **dict.fromkeys((
    GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q5_0, GGMLQuantizationType.Q5_1,
    GGMLQuantizationType.Q5_K, GGMLQuantizationType.IQ4_NL, GGMLQuantizationType.IQ4_XS,
    GGMLQuantizationType.MXFP4), 4)}


def supported_gguf_type(ggml_type: GGMLQuantizationType) -> bool:
    """Whether a GGUF tensor of this type can stay quantized in a QuantizedLinear."""
    return ggml_type in SUPPORTED_TYPES


class Int4Matrix(nn.Module):
    """One weight matrix in the int4 kernel's packed layout, rows padded to a multiple of 16.

    `lo_bits` = 0: K' = K, codes are the GGUF codes shifted into 0..15. `lo_bits` > 0: each
    decode group of `chunk` codes becomes [hi codes, lo codes] along K' = 2K, and the kernel sees
    x' = [x_chunk * 2**lo_bits, x_chunk] per chunk."""

    packed: torch.Tensor  # uint8 [padded_out, K' / 2], torch's int4 CPU layout
    scale_zeros: torch.Tensor  # kernel dtype [K' / 32, padded_out, 2]: (scale, zero) per group

    def __init__(self, packed: torch.Tensor, scale_zeros: torch.Tensor, out_features: int,
                 in_features: int, lo_bits: int, chunk: int) -> None:
        super().__init__()
        self.register_buffer("packed", packed)
        self.register_buffer("scale_zeros", scale_zeros)
        self.out_features, self.in_features = out_features, in_features
        self.lo_bits, self.chunk = lo_bits, chunk
        # Multiply decode-sized calls with int8 dot products (x quantized per group of 32; see
        # use_int8_activations): set before the first call
        self.int8_activations = False
        # (packed.data_ptr(), kernels/cpu/int4_gemv.c's matmul and row functions on it or None),
        # built on first use
        self._native: tuple[int, _Fn | None, _Fn | None] | None = None
        # its file's repacked-weights cache and entry (records_cache.py), for the VNNI records
        self.cache_entry: tuple[RecordsCache, str] | None = None

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_native"] = None  # a ctypes closure over this process's pointers
        state["cache_entry"] = None  # a mapped file of this process
        return state

    @classmethod
    def from_gguf(cls, parts: list[GGUFWeight], kernel_dtype: torch.dtype) -> Int4Matrix:
        """The row-stack of same-typed `parts`, decoded and packed LOAD_CHUNK_ROWS rows at a
        time into buffers allocated once: loading never holds a whole matrix's codes (a
        vocabulary-sized table's are gigabytes as the int32 the packing op takes)."""
        ggml_type = parts[0].ggml_type
        out_features, in_features = sum(p.shape[0] for p in parts), parts[0].shape[1]
        lo_bits = _LO_BITS.get(ggml_type, 0)
        k_prime = in_features * (2 if lo_bits else 1)
        padded = out_features + -out_features % ROW_MULTIPLE
        packed_shape, scales_shape = (padded, k_prime // 2), (k_prime // KERNEL_GROUP, padded, 2)
        # the packing's block (64 or 32 rows) follows the CPU's vector width
        cache, key = entry_for(parts, f"int4-{str(kernel_dtype)[6:]}-n{pack_block_n()}")
        if cache is not None and (cached := _cached_packing(cache, key, packed_shape,
                                                            scales_shape, kernel_dtype)):
            chunk = _stack(_row_slices(parts, 0, 1)).group_size  # one row decoded for it
            matrix = cls(*cached, out_features, in_features, lo_bits, chunk)
            matrix.cache_entry = (cache, key)
            return matrix
        packed = streamed_empty(packed_shape, torch.uint8)
        scale_zeros = streamed_empty(scales_shape, kernel_dtype)
        chunk = 0
        for start in range(0, out_features, LOAD_CHUNK_ROWS):
            stop = min(start + LOAD_CHUNK_ROWS, out_features)
            group = _stack(_row_slices(parts, start, stop))
            chunk = group.group_size
            end = padded if stop == out_features else stop
            # each chunk starts on a packing block (LOAD_CHUNK_ROWS is a multiple of 64), so its
            # packed bytes are those rows of the whole matrix's packing
            packed[start:end], scale_zeros[:, start:end] = _pack(group, ggml_type, end - start,
                                                                 kernel_dtype)
        for part in parts:
            if part.release is not None:
                part.release()
        matrix = cls(packed, scale_zeros, out_features, in_features, lo_bits, chunk)
        if cache is not None:
            cache.put(f"{key}/packed", packed)
            cache.put(f"{key}/scale_zeros", scale_zeros)
            matrix.cache_entry = (cache, key)
        return matrix

    @property
    def k_prime(self) -> int:
        return self.in_features * (2 if self.lo_bits else 1)

    @property
    def kernel_dtype(self) -> torch.dtype:
        return self.scale_zeros.dtype

    def dense_copy_min_rows(self) -> int:
        """Rows from which a dense copy (where the model attached one) beats this matrix."""
        if not self.native():
            return DENSE_COPY_MIN_ROWS
        return (NATIVE_SPLIT_DENSE_COPY_MIN_ROWS if self.lo_bits and not self.int8_activations
                else NATIVE_DENSE_COPY_MIN_ROWS)

    def native(self) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """kernels/cpu/int4_gemv.c on this matrix: contiguous bf16 x [M, in] with 1 <= M <=
        INT4_MAX_ROWS -> [M, out] (int8 dot products where int8_activations is set and the CPU
        has them, on 8-bit records for a Q8_0 split; bf16 ones otherwise, on x expanded to K');
        None where it did not build, for an fp32 kernel dtype, and while torch.compile traces
        (its graphs keep torch's op)."""
        if torch.compiler.is_compiling():
            return None
        return self._native_functions()[1]

    def _native_functions(self) -> tuple[int, _Fn | None, _Fn | None]:
        ptr = self.packed.data_ptr()
        if self._native is None or self._native[0] != ptr:  # first call, or buffers replaced
            args = (self.packed, self.scale_zeros, self.out_features, pack_block_n())
            matmul = None
            if self.int8_activations and self.lo_bits == 4 and self.chunk == KERNEL_GROUP:
                matmul = self._vnni(args, eight_bit=True)  # Q8_0: x as it is, 8-bit codes
            if matmul is None:  # the int4 records or codes, over K' (x expanded for a split)
                kernel = (self._vnni(args, eight_bit=False) if self.int8_activations else None
                          ) or native_kernels.int4_gemv(*args)
                matmul = (functools.partial(_on_expanded, self, kernel) if self.lo_bits and kernel
                          else kernel)
            self._native = (ptr, matmul,
                            native_kernels.int4_rows(*args, self.lo_bits, self.chunk))
        return self._native

    def _vnni(self, args: tuple, eight_bit: bool) -> _Fn | None:
        """int8_vnni's (eight_bit) or int4_vnni's call on this matrix, on the records an earlier
        load cached where its file's cache has them (else repacked, and cached for the next)."""
        build = native_kernels.int8_vnni if eight_bit else native_kernels.int4_vnni
        if self.cache_entry is None:
            return build(*args)
        cache, key = self.cache_entry
        key = f"{key}/vnni{8 if eight_bit else 4}"
        cached = cache.get(key, native_kernels.vnni_records_bytes(self.packed.shape[0],
                                                                   self.k_prime, eight_bit))
        call = build(*args, records=cached)
        if call is not None and cached is None:
            cache.put(key, call.records)  # type: ignore[attr-defined]
        return call

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, in] in the kernel dtype -> [M, out] in the kernel dtype."""
        rows = x.shape[0]
        if 0 < rows <= native_kernels.INT4_MAX_ROWS and x.dtype == torch.bfloat16:
            native = self.native()
            if native is not None:
                return native(x.contiguous())
        if self.lo_bits:
            x = self._expand(x)
        if (rows >= DENSE_MIN_ROWS and x.dtype == torch.bfloat16
                and self.packed.numel() * 2 <= DENSE_MAX_ELEMENTS):
            y = x @ self.dense_t()
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, KERNEL_GROUP,
                                                           self.scale_zeros)
        return y if y.shape[1] == self.out_features else y[:, : self.out_features]

    def dense_t(self) -> torch.Tensor:
        """[K', padded_out] in the kernel dtype: the transposed weight, dequantized in four
        passes (nibbles -> one strided copy into the transposed layout -> w = c * s + (z - 8 s))."""
        codes_t = _codes_t(self.packed, self.k_prime).view(self.k_prime // KERNEL_GROUP,
                                                           KERNEL_GROUP, -1)
        scale = self.scale_zeros[:, None, :, 0]  # [K' / 32, 1, N]
        offset = (self.scale_zeros[:, None, :, 1].float() - 8 * scale.float()).to(scale.dtype)
        return torch.addcmul(offset, codes_t, scale).view(self.k_prime, -1)

    def _expand(self, x: torch.Tensor) -> torch.Tensor:
        num_tokens = x.shape[0]
        mult = x.new_tensor([2.0**self.lo_bits, 1.0]).view(1, 1, 2, 1)
        chunks = x.view(num_tokens, -1, 1, self.chunk)  # [M, K / chunk, 1, chunk]
        return (chunks * mult).view(num_tokens, self.k_prime)  # [M, K']

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """float32 [len(ids), in]: the weight rows `ids`, dequantized from the packed codes
        (kernels/cpu/int4_gemv.c where it built: 32 us for 8 ids of the default model's embedding
        instead of 140)."""
        native_rows = self._native_functions()[2]
        if native_rows is not None and ids.device.type == "cpu":
            return native_rows(ids)
        codes = _unpack_rows(self.packed, self.k_prime, ids).float()  # [T, K']
        sz = self.scale_zeros[:, ids].float()  # [K' / 32, T, 2]
        groups = codes.view(len(ids), -1, KERNEL_GROUP) - 8  # [T, K' / 32, 32]
        w = groups * sz[..., 0].T[..., None] + sz[..., 1].T[..., None]
        if not self.lo_bits:
            return w.view(len(ids), self.in_features)
        halves = w.view(len(ids), -1, 2, self.chunk)  # [T, K / chunk, (hi, lo), chunk]
        return (halves[:, :, 0] * 2.0**self.lo_bits + halves[:, :, 1]).view(len(ids), -1)

    @property
    def nbytes(self) -> int:
        return _nbytes(self.packed) + _nbytes(self.scale_zeros)


class QuantizedLinear(nn.Module):
    """Drop-in for nn.Linear over GGUF-quantized weights (CPU only).

    The weight is a row-stack of segments (one per run of same-typed GGUF parts), each a
    KQuantMatrix or an Int4Matrix. forward runs them in `kernel_dtype` and returns x's dtype;
    bf16 is the fast kernel on CPUs (torch's fp32 int4 kernel is exact but 10-30x slower, see
    quant_speed)."""

    bias: torch.Tensor | None  # [out] in `dtype`
    dense: nn.Module | None

    def __init__(self, segments: list[Int4Matrix | KQuantMatrix], bias: torch.Tensor | None,
                 dtype: torch.dtype) -> None:
        super().__init__()
        in_sizes = {s.in_features for s in segments}
        assert len(in_sizes) == 1, f"parts disagree on in_features: {sorted(in_sizes)}"
        self.segments = nn.ModuleList(segments)
        self.in_features = in_sizes.pop()
        self.out_features = sum(s.out_features for s in segments)
        self.dtype = dtype
        assert bias is None or bias.shape == (self.out_features,), f"bias {tuple(bias.shape)}"
        self.register_buffer("bias", None if bias is None else bias.to(dtype))
        # Optional bf16 copy of the weight for calls of dense_copy_min_rows() rows or more;
        # registered empty so that a copy built on a background thread fills an existing entry
        # (iterating the modules meanwhile stays safe)
        self.register_module("dense", None)
        # set while that copy is being built (onednn_linear.DenseCopyBuild): calls it would take
        # wait for it
        self.dense_build: DenseCopyBuild | None = None

    @classmethod
    def from_gguf(cls, parts: list[GGUFWeight], bias: torch.Tensor | None, dtype: torch.dtype,
                  kernel_dtype: torch.dtype = torch.bfloat16,
                  kquant_records: bool = False) -> QuantizedLinear:
        """Row-stack `parts` (e.g. q, k, v) into one layer; adjacent same-typed parts share one
        packed matrix. `dtype` is the model's dtype (bias, embedding rows). `kquant_records`:
        K-quant runs become KQuantMatrix records where the CPU runs them (int8 activations
        for every call); otherwise every run is an Int4Matrix."""
        if kernel_dtype not in KERNEL_DTYPES:
            raise ValueError(f"kernel_dtype={kernel_dtype}: expected one of {KERNEL_DTYPES}")
        for part in parts:
            if not supported_gguf_type(part.ggml_type):
                raise NotImplementedError(f"GGUF type {part.ggml_type.name} cannot stay quantized")
        segments = [KQuantMatrix.from_gguf(run)
                     if kquant_records and kquant.holds(run[0].ggml_type, kernel_dtype)
                     else Int4Matrix.from_gguf(run, kernel_dtype) for run in _same_type_runs(parts)]
        return cls(segments, bias, dtype)

    @property
    def matrices(self) -> list[Int4Matrix | KQuantMatrix]:
        """The segments, top rows first (typed view of the ModuleList)."""
        return [m for m in self.segments if isinstance(m, (Int4Matrix, KQuantMatrix))]

    @property
    def kernel_dtype(self) -> torch.dtype:
        return self.matrices[0].kernel_dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features).to(self.kernel_dtype).contiguous()  # [M, in]
        if x2.shape[0] == 0:
            y = x2.new_empty(0, self.out_features)
        elif (self.has_dense_copy and x2.shape[0] >= self.dense_copy_min_rows()
              and (dense := self._dense_copy()) is not None):
            y = dense(x2.to(torch.bfloat16))
        else:
            outs = [segment.matmul(x2) for segment in self.matrices]
            y = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)  # [M, out]
        y = y.to(x.dtype)
        if self.bias is not None:
            y = y + self.bias.to(x.dtype)
        return y.view(*lead, self.out_features)

    @property
    def has_dense_copy(self) -> bool:
        """Whether forward takes larger calls to a dense copy: attached, or being built."""
        return self.dense is not None or self.dense_build is not None

    def _dense_copy(self) -> nn.Module | None:
        """The dense copy, once its background build is over (None if that build failed:
        forward then keeps to the quantized kernels, which compute the same weights)."""
        build = self.dense_build  # read once: the build clears it when it ends
        if self.dense is None and build is not None:
            build.run()
        return self.dense

    def dense_copy_min_rows(self) -> int:
        """Rows from which forward uses the dense copy (when one is attached)."""
        return min(m.dense_copy_min_rows() for m in self.matrices)

    @property
    def wants_dense_copy(self) -> bool:
        """Whether a packed bf16 copy would speed this layer's larger calls (not for records
        alone: their many-row product is as fast)."""
        return self.dense_copy_min_rows() < kquant.NO_DENSE_COPY

    def direct(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """forward for [M, in] inputs of the model's dtype as a plain function of x (no module
        attribute lookups: ~10 us less a call, which is a third of a small int4 matmul at batch
        1), with forward's exact results. The int4 kernels are called directly for a single plain
        segment without bias whose kernel dtype is the model's; anything else goes through
        forward."""
        matrices = self.matrices
        if len(matrices) != 1 or self.bias is not None or self.kernel_dtype != self.dtype:
            return self.forward
        if isinstance(matrices[0], KQuantMatrix):
            return self._direct_records(matrices[0])
        if matrices[0].lo_bits:
            return self.forward
        packed, scale_zeros, out = matrices[0].packed, matrices[0].scale_zeros, self.out_features
        padded = packed.shape[0] != out
        forward, native = self.forward, matrices[0].native()
        int4_mm = torch.ops.aten._weight_int4pack_mm_for_cpu
        kernel_rows = self._int4_kernel_rows()
        native_rows = self._int4_native_rows() if native else 0

        def call(x: torch.Tensor) -> torch.Tensor:
            rows = x.shape[0]
            if rows >= kernel_rows or rows == 0:
                return forward(x)
            if rows < native_rows:
                return native(x.contiguous())  # type: ignore[misc]
            y = int4_mm(x, packed, KERNEL_GROUP, scale_zeros)
            return y[:, :out] if padded else y

        return call

    def _int4_kernel_rows(self) -> int:
        """Rows at which forward leaves the int4 kernels (the dense copy, or a dequantized GEMM)."""
        return self.dense_copy_min_rows() if self.has_dense_copy else DENSE_MIN_ROWS

    def _int4_native_rows(self) -> int:
        """Rows from which forward leaves int4_gemv.c's kernels (while they are on)."""
        return min(self._int4_kernel_rows(), native_kernels.INT4_MAX_ROWS + 1)

    def native_matmul(self) -> native_kernels.NativeMatmul | None:
        """forward for bf16 [rows, in] inputs of up to `max_rows` rows as C entry points
        (kernels/cpu/cpu_kernels.h's matmul_op_fn), for fused_layer_ops.c's decode runner: the
        kernels forward calls for those rows, each segment's, then the bias as forward adds it.
        None where forward takes another path (a kernel dtype not the model's bf16, a kernel
        that did not build or has no such entry point, more segments than the runner takes)."""
        if self.dtype != torch.bfloat16 or self.kernel_dtype != self.dtype:
            return None
        matrices = self.matrices
        if not 0 < len(matrices) <= native_kernels.DECODE_MAX_SEGMENTS:
            return None
        calls, segments, max_rows = [], [], []
        for matrix in matrices:
            call = matrix.native()
            op = getattr(call, "native_op", None)
            if op is None:
                return None
            calls.append(call)
            segments.append((op[0], op[1], matrix.out_features))
            # (an int4 segment's limit includes forward's dense copy; records keep none)
            max_rows.append(kquant.GEMM_MIN_ROWS - 1 if isinstance(matrix, KQuantMatrix)
                            else self._int4_native_rows() - 1)
        if min(max_rows) < 1:
            return None
        bias = None if self.bias is None else self.bias.to(self.dtype).contiguous()
        return native_kernels.NativeMatmul(tuple(segments), min(max_rows), bias, keep=calls)

    def _direct_records(self, matrix: KQuantMatrix) -> Callable[[torch.Tensor], torch.Tensor]:
        """direct() of one K-quant segment: its decode kernel or its many-row product (AMX tiles
        where they run) for every call."""
        forward, native, gemm = self.forward, matrix.native(), matrix.gemm()
        if native is None or gemm is None:
            return forward
        amx = matrix.amx_gemm()
        gemm_rows = kquant.GEMM_MIN_ROWS
        amx_rows = kquant.AMX_MIN_ROWS if amx is not None else 2**62

        def call(x: torch.Tensor) -> torch.Tensor:
            rows = x.shape[0]
            if rows == 0:
                return forward(x)
            if rows < gemm_rows:
                return native(x.contiguous())
            return amx(x.contiguous()) if rows >= amx_rows else gemm(x.contiguous())

        return call

    def embedding(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the weight ([*ids.shape, in] in `dtype`), dequantizing only those rows."""
        flat = ids.reshape(-1)
        if len(self.segments) == 1:  # no masks to split the ids by segment
            return self.matrices[0].rows(flat).to(self.dtype).view(*ids.shape, self.in_features)
        out = torch.empty(len(flat), self.in_features, dtype=self.dtype)
        start = 0
        for segment in self.matrices:
            hit = (flat >= start) & (flat < start + segment.out_features)
            if hit.any():
                out[hit] = segment.rows(flat[hit] - start).to(self.dtype)
            start += segment.out_features
        return out.view(*ids.shape, self.in_features)

    def dequantize(self) -> torch.Tensor:
        """float32 [out, in]: the weight the kernel multiplies with."""
        parts = [s.rows(torch.arange(s.out_features)) for s in self.matrices]
        return parts[0] if len(parts) == 1 else torch.cat(parts)  # cat would copy a lone part

    @property
    def nbytes(self) -> int:
        """Resident bytes of the weight (packed codes, scales, zeros) and bias."""
        bias = 0 if self.bias is None else _nbytes(self.bias)
        return sum(s.nbytes for s in self.matrices) + bias

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, kernel_dtype={self.kernel_dtype}")


def _same_type_runs(parts: list[GGUFWeight]) -> list[list[GGUFWeight]]:
    runs: list[list[GGUFWeight]] = []
    for part in parts:
        if runs and runs[-1][0].ggml_type == part.ggml_type:
            runs[-1].append(part)
        else:
            runs.append([part])
    return runs


def _cached_packing(cache: RecordsCache, key: str, packed_shape: tuple[int, int],
                    scales_shape: tuple[int, int, int], kernel_dtype: torch.dtype,
                    ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """An earlier load's packed codes and group scales of `key`, both or None."""
    packed = cache.get(f"{key}/packed", math.prod(packed_shape))
    scales = cache.get(f"{key}/scale_zeros", math.prod(scales_shape) * kernel_dtype.itemsize)
    if packed is None or scales is None:
        return None
    return packed.view(packed_shape), scales.view(kernel_dtype).view(scales_shape)


def _row_slices(parts: list[GGUFWeight], start: int, stop: int) -> list[GGUFWeight]:
    """Rows [start, stop) of the row-stack of `parts`, as views of their blocks."""
    out, offset = [], 0
    for part in parts:
        lo, hi = max(start - offset, 0), min(stop - offset, part.shape[0])
        if lo < hi:
            out.append(GGUFWeight(part.data[lo:hi], part.ggml_type, (hi - lo, part.shape[1])))
        offset += part.shape[0]
    return out


def _stack(parts: list[GGUFWeight]) -> GroupCodes:
    decoded = [decode(p) for p in parts]
    offsets = [d.offsets for d in decoded if d.offsets is not None]
    return GroupCodes(
        torch.cat([d.codes for d in decoded]),
        torch.cat([d.scales for d in decoded]),
        torch.cat(offsets) if offsets else None,
        decoded[0].group_size,
    )


def _pack(group: GroupCodes, ggml_type: GGMLQuantizationType, rows: int,
          kernel_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's int4 CPU packing [rows, K' / 2] and (scale, zero) [K' / 32, rows, 2] of `group`,
    its rows padded to `rows` with zero weights."""
    lo_bits = _LO_BITS.get(ggml_type, 0)
    if lo_bits:
        codes, scales, zeros = _split_codes(group, lo_bits)
    else:
        codes, scales, zeros = _shift_codes(group, _SHIFT[ggml_type])
    pad = rows - codes.shape[0]
    if pad:  # code 8 with scale 0 and zero 0 is a zero weight
        codes = nn.functional.pad(codes, (0, 0, 0, pad), value=8)
        scales, zeros = (nn.functional.pad(t, (0, 0, 0, pad)) for t in (scales, zeros))
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.int(), 1)
    return packed, torch.stack([scales, zeros], -1).transpose(0, 1).to(kernel_dtype)


def _shift_codes(group: GroupCodes, shift: int) -> tuple[torch.Tensor, ...]:
    """4-bit codes: c = code + shift, and (c - 8) * s + z = s * code + offset gives z."""
    assert group.group_size == KERNEL_GROUP, f"group {group.group_size}"
    scales = group.scales  # [out, K / 32]
    offsets = torch.zeros_like(scales) if group.offsets is None else group.offsets
    # Q4_1/Q4_K: z = offset + 8 * s is the one rounding the rewrite adds (last float bit)
    zeros = offsets + (8 - shift) * scales
    return group.codes.to(torch.int16) + shift, scales, zeros


def _split_codes(group: GroupCodes, lo_bits: int) -> tuple[torch.Tensor, ...]:
    """Wider codes: hi = code >> lo_bits (-8..7) and lo = code & mask, each a 4-bit kernel code.

    A chunk of 32 (Q8_0) gives two kernel groups, hi (zero 0) and lo (c = lo, zero 8s, plus the
    group's offset where it has one: Q5_1, Q5_K). A chunk of 16 (Q6_K) gives one kernel group
    [hi 16, lo 16] sharing one zero, so lo is stored as lo + 8 (lo <= 3) and the zero is 0."""
    out_features = group.codes.shape[0]
    chunk, codes = group.group_size, group.codes.to(torch.int16)
    codes = codes.view(out_features, -1, 1, chunk)  # [out, K / chunk, 1, chunk]
    lo_shift = 0 if lo_bits == 4 else 8
    hi, lo = (codes >> lo_bits) + 8, (codes & (2**lo_bits - 1)) + lo_shift
    kernel_codes = torch.cat([hi, lo], dim=2).view(out_features, -1)  # [out, 2K]
    s = group.scales  # [out, K / chunk]
    if chunk == KERNEL_GROUP:
        scales = torch.stack([s, s], -1).view(out_features, -1)  # [out, 2K / 32]
        lo_zeros = 8 * s if group.offsets is None else 8 * s + group.offsets
        zeros = torch.stack([torch.zeros_like(s), lo_zeros], -1).view(out_features, -1)
    else:
        assert 2 * chunk == KERNEL_GROUP and lo_shift == 8 and group.offsets is None, (
            f"chunk {chunk}, lo_bits {lo_bits}")
        scales, zeros = s, torch.zeros_like(s)
    return kernel_codes, scales, zeros


# The int8 kernel's records are a second copy of the codes: only where they fit in this.
MAX_INT8_RECORD_BYTES = 1 << 30


def _on_expanded(matrix: Int4Matrix, kernel: _Fn, x: torch.Tensor) -> torch.Tensor:
    """A split matrix's kernel on x repeated along its doubled K' (see Int4Matrix)."""
    return kernel(matrix._expand(x).contiguous())


def use_int8_activations(model: nn.Module, max_bytes: int = MAX_INT8_RECORD_BYTES) -> int:
    """Have the bf16 int4 matrices under `model` multiply decode-sized calls (1-16 rows) with
    int8 dot products (AVX512-VNNI, kernels/cpu/int4_gemv.c), their activations quantized per
    group of 32 to int8 as llama.cpp does: 1.3-1.8x faster than the bf16 dot products
    (benchmarks/NOTES.md), at ~0.5% relative error per matmul instead of bf16's output
    rounding. The repacked records are built here, when all of them fit in `max_bytes`; returns
    their bytes (0: none, also where the CPU lacks the instructions)."""
    matrices = [m for m in model.modules() if isinstance(m, Int4Matrix)
                and m.scale_zeros.dtype == torch.bfloat16]
    total = sum(m.nbytes for m in matrices)
    if not matrices or total > max_bytes or not native_kernels.int4_vnni_available():
        return 0
    for matrix in matrices:
        matrix.int8_activations, matrix._native = True, None
        matrix._native_functions()
    return total


@functools.cache
def pack_block_n() -> int:
    """Rows per block of torch's int4 CPU packing: its vector width decides, 64 where torch runs
    AVX-512 kernels and 32 on AVX2 CPUs. Found once by packing a single code at row 32: in a
    64-row block it is the high nibble of byte 0."""
    codes = torch.zeros(64, 32, dtype=torch.int32)
    codes[32, 0] = 1
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1).view(-1)
    return 64 if int(packed[0]) == 0x10 else 32


def _unpack_rows(packed: torch.Tensor, k_prime: int, ids: torch.Tensor) -> torch.Tensor:
    """uint8 codes [len(ids), K'] of rows `ids`, read from torch's int4 CPU packing.

    Full blocks of B = pack_block_n() rows are stored k-major, B/2 bytes per k: row r of the block
    is byte r % (B/2), nibble r // (B/2). The last N % B rows form one block of N % B / 2 bytes
    per k: row r is byte r // 2, nibble r % 2. tests/test_quant.py checks this against the
    packing op."""
    block = pack_block_n()
    num_rows = packed.shape[0]
    full = num_rows // block * block
    ids = ids.long()
    in_full = ids < full
    start = torch.where(in_full, ids // block * block, full)
    r = ids - start
    half = torch.where(in_full, block, num_rows - full) // 2  # bytes per k
    col = torch.where(in_full, r % half.clamp(min=1), r // 2)
    nibble = torch.where(in_full, r // half.clamp(min=1), r % 2)
    k = torch.arange(k_prime)
    index = (start * (k_prime // 2) + col)[:, None] + k[None, :] * half[:, None]  # [T, K']
    return (packed.view(-1)[index] >> (4 * nibble)[:, None].to(torch.uint8)) & 0x0F


def _codes_t(packed: torch.Tensor, k_prime: int) -> torch.Tensor:
    """bf16 codes [K', padded_out] of every row (the transposed code matrix), read from torch's
    int4 CPU packing (the layout _unpack_rows describes) in whole blocks."""
    block = pack_block_n()
    num_rows = packed.shape[0]
    full = num_rows // block * block
    out = torch.empty(k_prime, num_rows, dtype=torch.bfloat16)
    flat = packed.view(-1)
    if full:  # block b, byte (k, j): row Bb + j in the low nibble, row Bb + B/2 + j in the high
        blocks = flat[: full * k_prime // 2].view(full // block, k_prime, block // 2)
        dest = out[:, :full].view(k_prime, -1, 2, block // 2).permute(1, 0, 2, 3)
        dest[:, :, 0].copy_(blocks & 0x0F)
        dest[:, :, 1].copy_(blocks >> 4)
    if num_rows > full:  # the tail block, byte (k, j): rows 2j (low) and 2j + 1 (high)
        tail = flat[full * k_prime // 2:].view(k_prime, (num_rows - full) // 2)
        dest = out[:, full:].view(k_prime, -1, 2)
        dest[..., 0].copy_(tail & 0x0F)
        dest[..., 1].copy_(tail >> 4)
    return out


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()

