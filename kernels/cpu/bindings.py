"""Native CPU kernels, loaded with ctypes from the library built for this CPU's instruction-set
level when the package was built (native_build.py: wheels and `make setup`), else compiled on
first use with the system C compiler (-march=native) into a cache keyed by the source (with the
headers the sources share), the compiler and the CPU: paged decode attention (kernels/cpu/paged_attention.c) and the fused steps
between a layer's matmuls (kernels/cpu/fused_layer_ops.c, used by runtime/models/fused_layers.py),
the int4 matrix times a few rows (kernels/cpu/int4_gemv.c, used by quant/linear.py's
Int4Matrix), the K-quant matmul (kernels/cpu/kquant_vnni.c, used by quant/kquant.py's
KQuantMatrix), and the sampler's greedy pick (kernels/cpu/greedy_pick.c)."""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from forklm.kernels.cpu import native_build
from forklm.kernels.cpu.openmp import threads_spin

logger = logging.getLogger(__name__)

# The sources; their compiler flags are native_build.LIBRARIES'. __builtin_shufflevector needs
# GCC 12 or clang: an older compiler fails and the engine falls back to TorchAttention.
# int4_gemv.c contracts (without AVX512-BF16 its group sums are fp32 FMAs, like torch's kernel);
# kquant_vnni.c does not (its row lookup rounds where gguf-py's dequantization does).
SOURCE = Path(__file__).with_name("paged_attention.c")
FUSED_SOURCE = Path(__file__).with_name("fused_layer_ops.c")
INT4_SOURCE = Path(__file__).with_name("int4_gemv.c")
INT4_MAX_ROWS = 16  # int4_gemv.c's MAX_CALL_ROWS
KQUANT_SOURCE = Path(__file__).with_name("kquant_vnni.c")
GREEDY_SOURCE = Path(__file__).with_name("greedy_pick.c")
# The last three are KV-pool formats only (--kv-cache-dtype; int8 with a scale per row):
# queries and outputs are one of the first three.
DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.float8_e5m2: 3,
          torch.float8_e4m3fn: 4, torch.int8: 5}

# Multiply-adds above which a call uses all of torch's threads (2 cores, default model). With
# sleeping OpenMP workers (OMP_WAIT_POLICY=PASSIVE) a parallel call pays ~45 us to wake them:
# batch 1 at 2000 keys (1.2M) is still faster on one thread, and a whole batch-1 decode step at
# 450 keys 1 ms faster (26.1 vs 27.2 ms). Spinning workers join at once: two threads win from
# batch 1 at ~450 keys (0.26M: 17 vs 23 us a layer; 100 keys: even). The int4 matmul's
# (weights x rows) agrees: with spinning workers two threads win from the smallest decode matrix
# (576x576 at 1 row, 0.33M: 5.6 vs 7.2 us; benchmarks/int4_gemv.py).
PARALLEL_WORK = 200_000 if threads_spin() else 2_000_000

# Each C entry point's torch twin: the torch code it stands in for, which its tests compare it
# with (tests/test_native_attention.py, test_fused_layers.py, test_int4_gemv.py, test_sampling.py).
# Queries (threads, support, repacking) have none; tests/test_cpu_kernel_twins.py checks the list.
TORCH_TWINS = {
    "paged_attention": "forklm.runtime.attention.backends.TorchAttention",
    "paged_attention_batch": "forklm.runtime.attention.backends.TorchAttention",
    "paged_prefill_bf16": "forklm.runtime.attention.backends.TorchAttention",
    "fused_add_rms_norm": "forklm.runtime.models.layers.RMSNorm",
    "fused_rope_store": "forklm.runtime.models.layers.RotaryEmbedding",
    "fused_silu_mul": "torch.nn.functional.silu",
    "int4_gemv_bf16": "torch.ops.aten._weight_int4pack_mm_for_cpu",
    "int4_vnni_bf16": "torch.ops.aten._weight_int4pack_mm_for_cpu",
    "int8_vnni_bf16": "torch.ops.aten._weight_int4pack_mm_for_cpu",
    "int4_rows_f32": "forklm.runtime.quant.linear.Int4Matrix.rows",
    "kquant_matmul_bf16": "forklm.runtime.quant.kquant.KQuantMatrix.torch_matmul",
    "kquant_rows_f32": "forklm.runtime.quant.gguf_formats.GroupCodes.dequantize",
    "kquant_dequantize_t_bf16": "forklm.runtime.quant.gguf_formats.GroupCodes.dequantize",
    "kquant_gemm_bf16": "forklm.runtime.quant.kquant.KQuantMatrix.torch_matmul",
    "kquant_gemm_fine_bf16": "forklm.runtime.quant.kquant.KQuantMatrix.torch_matmul",
    "kquant_decode_bf16": "forklm.runtime.quant.kquant.KQuantMatrix.torch_matmul",
    "kquant_gemm_amx_bf16": "forklm.runtime.quant.kquant.KQuantMatrix.torch_matmul",
    "greedy_pick": "torch.argmax",
    # the matmuls in the decode runner's form: the same products as above
    "kquant_matmul_op": "forklm.runtime.quant.kquant.KQuantMatrix.torch_matmul",
    "kquant_gemm_fine_op": "forklm.runtime.quant.kquant.KQuantMatrix.torch_matmul",
    "kquant_decode_op": "forklm.runtime.quant.kquant.KQuantMatrix.torch_matmul",
    "int4_gemv_op": "torch.ops.aten._weight_int4pack_mm_for_cpu",
    "int4_vnni_op": "torch.ops.aten._weight_int4pack_mm_for_cpu",
    "int8_vnni_op": "torch.ops.aten._weight_int4pack_mm_for_cpu",
    # a forward's layers: what FusedDecodeLayers' loop runs (tests/test_fused_layers.py)
    "fused_decode_layers": "forklm.runtime.models.fused_layers.FusedDecodeLayers.run_loop",
}

_p, _i64, _f32, _int = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int


@dataclass
class _Loaded:
    """The compiled library, or why there is none; `origin`: where the library came from."""

    lib: ctypes.CDLL | None
    reason: str = ""
    origin: str = ""


# Each library's load, by name, done once (under _lock) on first use.
_loaded: dict[str, _Loaded] = {}
_lock = threading.Lock()


def available(dtype: torch.dtype | None = None, kv_dtype: torch.dtype | None = None) -> bool:
    """True when the kernels compiled and loaded (and handle queries of `dtype` over a pool of
    `kv_dtype`, default `dtype`, if given)."""
    state = _load()
    if state.lib is None or dtype is None:
        return state.lib is not None
    codes = DTYPES.get(dtype, -1), DTYPES.get(kv_dtype or dtype, -1)
    return bool(state.lib.paged_attention_supports(*codes))


def unavailable_reason() -> str:
    """Why available() is False ('' when it is True)."""
    return _load().reason


def num_threads() -> int:
    """The threads the kernels' OpenMP would use from this thread: torch.get_num_threads() when
    they share torch's OpenMP runtime."""
    return int(_load_function("paged_attention_threads")())


class _Batch(ctypes.Structure):
    """pa_batch in paged_attention.c."""

    _fields_ = [("slot_table", _p), ("tok_req", _p), ("tok_end", _p), ("table_stride", _i64),
                ("num_tokens", _i64), ("num_heads", _i64), ("num_kv_heads", _i64),
                ("head_dim", _i64), ("row_stride", _i64), ("parallel_work", _i64)]


@dataclass
class AttentionPlan:
    """One batch's token -> request map in the kernel's form, built once per forward and run
    for every layer (each run is one ctypes call of 9 plain arguments, ~1.5 us)."""

    index: tuple[torch.Tensor, ...]  # what `batch` points into, kept alive with it
    batch: _Batch
    address: int  # of `batch`
    fn: Callable[..., int]  # paged_attention_batch

    def run(self, q: torch.Tensor, k_layer: torch.Tensor, v_layer: torch.Tensor,
            out: torch.Tensor, scale: float, softcap: float, window: int, dtype: int,
            kv_dtype: int, alibi: torch.Tensor | None = None,
            sinks: torch.Tensor | None = None, k_scale: torch.Tensor | None = None,
            v_scale: torch.Tensor | None = None) -> None:
        """out = attention of q over the plan's keys in (k_layer, v_layer). Shapes and dtypes as
        plan() was told, unchecked here: q, out [num_tokens, num_heads, head_dim] contiguous
        (out may be [num_tokens, num_heads * head_dim]); k_layer, v_layer [num_slots,
        num_kv_heads, head_dim] contiguous; q and out of DTYPES code `dtype`, the K/V layers of
        `kv_dtype` (the same, an 8-bit float, or int8 codes whose rows scale by k_scale /
        v_scale [num_slots, num_kv_heads] contiguous float32). softcap 0 / window 0: none.
        alibi: [num_heads] contiguous float32 ALiBi slopes (None: none); sinks: [num_heads]
        contiguous fp32 logits that join each head's softmax (gpt-oss; None: none)."""
        for x in (alibi, sinks):
            assert x is None or (x.dtype == torch.float32 and x.is_contiguous()
                                 and x.numel() == self.batch.num_heads)
        for x in (k_scale, v_scale):
            assert x is None or (x.dtype == torch.float32 and x.is_contiguous()
                                 and x.numel() * self.batch.head_dim == k_layer.numel())
        self.run_addresses(q.data_ptr(), k_layer.data_ptr(), v_layer.data_ptr(), out.data_ptr(),
                           scale, softcap, window, dtype, kv_dtype,
                           0 if alibi is None else alibi.data_ptr(),
                           0 if sinks is None else sinks.data_ptr(),
                           0 if k_scale is None else k_scale.data_ptr(),
                           0 if v_scale is None else v_scale.data_ptr())

    def run_addresses(self, q: int, k_layer: int, v_layer: int, out: int, scale: float,
                      softcap: float, window: int, dtype: int, kv_dtype: int, alibi: int = 0,
                      sinks: int = 0, k_scale: int = 0, v_scale: int = 0) -> None:
        """run() on the tensors' data_ptr()s (the fused decode layers keep them per layer);
        alibi 0: no ALiBi, sinks 0: no sinks, scales 0: none (not an int8 pool)."""
        rc = self.fn(self.address, q, k_layer, v_layer, out, scale, softcap, window, dtype,
                     kv_dtype, alibi or None, sinks or None, k_scale or None, v_scale or None)
        assert rc == 0, (f"paged_attention rejected dtype {dtype} over a pool of {kv_dtype}, "
                         f"head_dim {self.batch.head_dim}")

    def run_prefill(self, q: torch.Tensor, k_layer: torch.Tensor, v_layer: torch.Tensor,
                    out: torch.Tensor, scale: float) -> None:
        """run() for any number of tokens per request (a request's tokens adjacent) through
        paged_prefill_bf16: bf16 q, out and K/V layers, head_dim 64 or 128 (prefill_supported),
        no window, cap, ALiBi or sinks."""
        rc = _load_function("paged_prefill_bf16")(self.address, q.data_ptr(), k_layer.data_ptr(),
                                                   v_layer.data_ptr(), out.data_ptr(), scale)
        assert rc == 0, f"paged_prefill_bf16 rejected head_dim {self.batch.head_dim}"


def prefill_supported(dtype: torch.dtype, kv_dtype: torch.dtype, head_dim: int) -> bool:
    """Whether paged_prefill_bf16 runs here for these dtypes and head_dim (a CPU with
    AVX512-BF16: the library's build has it)."""
    return (dtype == kv_dtype == torch.bfloat16 and head_dim in (64, 128) and available(dtype)
            and bool(_load_function("paged_prefill_available")()))


def plan(slot_table: torch.Tensor, tok_req: torch.Tensor, tok_end: torch.Tensor,
         num_heads: int, num_kv_heads: int, head_dim: int,
         parallel_work: int | None = None) -> AttentionPlan:
    """The plan for tokens t that see keys [start, tok_end[t]) of request tok_req[t], key j in
    slot slot_table[tok_req[t], j]. slot_table [batch, width], tok_req and tok_end [num_tokens]:
    contiguous int64 CPU tensors with tok_end <= width and slots inside the pool (the kernel
    trusts both: the caller checks them once per batch). parallel_work: see PARALLEL_WORK."""
    assert head_dim % 16 == 0, f"head_dim {head_dim} is not a multiple of 16"
    index = (slot_table, tok_req, tok_end)
    for x in index:
        assert x.dtype == torch.int64 and x.is_contiguous() and x.device.type == "cpu"
    batch = _Batch(slot_table.data_ptr(), tok_req.data_ptr(), tok_end.data_ptr(),
                   slot_table.shape[1], tok_req.numel(), num_heads, num_kv_heads, head_dim,
                   num_kv_heads * head_dim,
                   PARALLEL_WORK if parallel_work is None else parallel_work)
    return AttentionPlan(index, batch, ctypes.addressof(batch),
                         _load_function("paged_attention_batch"))


def paged_attention(q: torch.Tensor, k_layer: torch.Tensor, v_layer: torch.Tensor,
                    out: torch.Tensor, slot_table: torch.Tensor, tok_req: torch.Tensor,
                    tok_end: torch.Tensor, scale: float, softcap: float | None,
                    window: int | None, alibi: torch.Tensor | None = None,
                    sinks: torch.Tensor | None = None, k_scale: torch.Tensor | None = None,
                    v_scale: torch.Tensor | None = None) -> None:
    """One call of plan(...).run(...): out[t] = attention of q[t] over keys [start, tok_end[t])
    of request tok_req[t] (start = tok_end - window with a sliding window, else 0), biased by
    ALiBi's slopes `alibi` [num_heads] float32 when given.

    q, out [num_tokens, num_heads, head_dim], k_layer, v_layer [num_slots, num_kv_heads,
    head_dim]: contiguous CPU tensors, q and out of one dtype, the K/V layers of that, an 8-bit
    float, or int8 (with k_scale / v_scale [num_slots, num_kv_heads] float32); index tensors as
    plan() takes them."""
    num_tokens, num_heads, head_dim = q.shape
    for x in (q, out, k_layer, v_layer):
        assert x.is_contiguous() and x.device.type == "cpu"
    assert out.dtype == q.dtype and v_layer.dtype == k_layer.dtype
    assert out.shape == q.shape and k_layer.shape == v_layer.shape
    p = plan(slot_table, tok_req, tok_end, num_heads, k_layer.shape[1], head_dim)
    p.run(q, k_layer, v_layer, out, scale, softcap or 0.0, window or 0, DTYPES[q.dtype],
          DTYPES[k_layer.dtype], alibi, sinks, k_scale, v_scale)


def _load_function(name: str) -> Callable[..., int]:
    state = _load()
    if state.lib is None:
        raise RuntimeError(f"native kernels unavailable: {state.reason}")
    return getattr(state.lib, name)


def _load() -> _Loaded:
    return _load_once("native CPU kernels", _build_and_load)


def fused_ops() -> ctypes.CDLL | None:
    """The fused layer steps' library (fused_layer_ops.c), or None when it did not build; its
    functions take fp32 (0) or bf16 (1) tensors."""
    return _load_once("fused native layer steps", _build_and_load_fused).lib


def fused_unavailable_reason() -> str:
    """Why fused_ops() is None ('' when it is not)."""
    return _load_once("fused native layer steps", _build_and_load_fused).reason


def _address(fn: Callable[..., int]) -> int:
    """A loaded C function's address, for C code that calls it through a pointer."""
    address = ctypes.cast(fn, ctypes.c_void_p).value
    assert address is not None
    return address


@dataclass(frozen=True)
class NativeMatmul:
    """A matmul as C entry points of cpu_kernels.h's matmul_op_fn form, for fused_layer_ops.c's
    decode runner: bf16 x [rows, in] -> bf16 y [rows, out_features] for 1 <= rows <= max_rows,
    as the module's own call computes it: each segment's product (fn, args, its out features),
    side by side, then + bias (bf16) when given."""

    segments: tuple[tuple[int, tuple[int, ...], int], ...]
    max_rows: int
    bias: torch.Tensor | None  # bf16 [out_features], contiguous
    keep: object  # owns what the segments' args point into

    @property
    def out_features(self) -> int:
        return sum(out for _, _, out in self.segments)


DECODE_MAX_SEGMENTS = 4  # fused_layer_ops.c's


class DecodeSegment(ctypes.Structure):
    """decode_segment in fused_layer_ops.c."""

    _fields_ = [("fn", _p), ("args", _i64 * 6), ("n_out", _i64)]


class DecodeMatmul(ctypes.Structure):
    """decode_matmul in fused_layer_ops.c."""

    _fields_ = [("segments", _i64), ("segment", DecodeSegment * DECODE_MAX_SEGMENTS),
                ("bias", _p), ("n_out", _i64)]

    @classmethod
    def of(cls, op: NativeMatmul) -> DecodeMatmul:
        assert len(op.segments) <= DECODE_MAX_SEGMENTS
        segments = (DecodeSegment * DECODE_MAX_SEGMENTS)(
            *(DecodeSegment(fn, (_i64 * 6)(*args), out) for fn, args, out in op.segments))
        return cls(len(op.segments), segments, 0 if op.bias is None else op.bias.data_ptr(),
                   op.out_features)


class DecodeLayer(ctypes.Structure):
    """decode_layer in fused_layer_ops.c."""

    _fields_ = [("qkv", DecodeMatmul), ("o", DecodeMatmul), ("gate_up", DecodeMatmul),
                ("down", DecodeMatmul), ("in_norm", _p), ("post_norm", _p), ("q_norm", _p),
                ("k_norm", _p), ("k_layer", _p), ("v_layer", _p), ("k_scale", _p),
                ("v_scale", _p), ("scale", _f32), ("softcap", _f32), ("window", _i64),
                ("rotary", _i64)]


class DecodeStep(ctypes.Structure):
    """decode_step in fused_layer_ops.c."""

    _fields_ = [("tokens", _i64), ("hidden", _i64), ("heads", _i64), ("kv_heads", _i64),
                ("head_dim", _i64), ("eps", _f32), ("offset", _f32), ("kv_dtype", _i64),
                ("out_slots", _p), ("cos", _p), ("sin", _p), ("attention", _p), ("plan", _p),
                ("residual", _p), ("normed", _p), ("q", _p), ("attn_out", _p), ("qkv", _p),
                ("h", _p), ("gate_up", _p), ("act", _p)]


def attention_batch_address() -> int:
    """paged_attention_batch's address (the decode runner calls it per layer)."""
    return _address(_load_function("paged_attention_batch"))


def greedy_pick(logits: torch.Tensor) -> torch.Tensor | None:
    """int64 [B]: each row's argmax, as torch.argmax picks it, of CPU fp32/bf16 logits [B, V]
    whose rows are contiguous; None where the library did not build or the logits are not of
    that kind."""
    if (logits.device.type != "cpu" or logits.dim() != 2 or logits.stride(1) != 1
            or logits.dtype not in (torch.float32, torch.bfloat16)):
        return None
    lib = _load_once("native greedy pick", _build_and_load_greedy).lib
    if lib is None:
        return None
    ids = torch.empty(logits.shape[0], dtype=torch.int64)
    lib.greedy_pick(logits.shape[0], logits.shape[1], logits.data_ptr(), logits.stride(0),
                    DTYPES[logits.dtype], ids.data_ptr())
    return ids


def _build_and_load_greedy() -> _Loaded:
    lib, reason = _open(GREEDY_SOURCE)
    if lib is None:
        return _Loaded(None, reason)
    lib.greedy_pick.restype = None
    lib.greedy_pick.argtypes = [_i64, _i64, _p, _i64, _int, _p]
    return _Loaded(lib, "", reason)


def _load_once(name: str, build: Callable[[], _Loaded]) -> _Loaded:
    """build() the first time `name` is asked for (logging why it is off when it is), then the
    same result."""
    state = _loaded.get(name)
    if state is None:
        with _lock:
            state = _loaded.get(name)
            if state is None:
                state = _loaded[name] = build()
                if state.lib is None and state.reason.startswith(_BUILD_FAILED):
                    logger.warning("%s off: %s. The torch fallback runs instead, 2-3x slower "
                                   "per token on the CPU; install forklm from a wheel (its "
                                   "kernels are prebuilt) or a C compiler (GCC 12+ or clang); "
                                   "`forklm doctor` says what is native", name, state.reason)
                elif state.lib is None:
                    logger.info("%s off: %s", name, state.reason)
                else:
                    logger.debug("%s: %s", name, state.origin)
    return state


def status() -> dict[str, str]:
    """Each native library: where it came from, or why it is off (loading them all)."""
    loads = {"paged attention": _load, "fused layer steps": lambda: _load_once(
                 "fused native layer steps", _build_and_load_fused),
             "int4 matmul": lambda: _load_once("native int4 matmul", _build_and_load_int4),
             "K-quant matmul": lambda: _load_once("native K-quant matmul", _build_and_load_kquant),
             "greedy pick": lambda: _load_once("native greedy pick", _build_and_load_greedy)}
    out = {}
    for name, load in loads.items():
        state = load()
        out[name] = state.origin if state.lib is not None else f"off: {state.reason}"
    return out


def _build_and_load_fused() -> _Loaded:
    lib, origin = _open(FUSED_SOURCE)
    if lib is None:
        return _Loaded(None, origin)
    lib.fused_add_rms_norm.restype = None
    lib.fused_add_rms_norm.argtypes = [_i64, _i64, _p, _p, _p, _p, _f32, _f32, _int]
    lib.fused_rope_store.restype = None
    lib.fused_rope_store.argtypes = [_i64, _p, _i64, _i64, _i64, _i64, _p, _p, _p, _p, _p, _p,
                                     _p, _p, _p, _p, _f32, _f32, _int, _int]
    lib.fused_max_head_dim.restype = _int
    lib.fused_silu_mul.restype = None
    lib.fused_silu_mul.argtypes = [_i64, _i64, _p, _p, _int]
    lib.fused_decode_layers.restype = _int
    lib.fused_decode_layers.argtypes = [_p, _p, _i64]
    return _Loaded(lib, "", origin)


def int4_ops() -> ctypes.CDLL | None:
    """The int4 library (int4_gemv.c: the matmul of a few bf16 rows and the row lookup), or None
    when it did not build or FORKLM_NATIVE_INT4=0."""
    return _load_once("native int4 matmul", _build_and_load_int4).lib


class _Int4Matrix(ctypes.Structure):
    """int4_matrix in int4_gemv.c."""

    _fields_ = [("packed", _p), ("scale_zeros", _p), ("n_rows", _i64), ("n_out", _i64),
                ("k", _i64), ("block", _i64), ("parallel_work", _i64)]


def _int4_matrix(packed: torch.Tensor, scale_zeros: torch.Tensor, out_features: int, block: int,
                 parallel_work: int | None) -> tuple[ctypes.CDLL, _Int4Matrix] | None:
    """The library and int4_gemv.c's description of a packed matrix (torch's CPU packing in
    blocks of `block` rows, bf16 scale_zeros [K' / 32, rows, 2], cut to its first out_features
    rows); None when the library is off or the scales are not bf16."""
    lib = int4_ops()
    if lib is None or scale_zeros.dtype != torch.bfloat16:
        return None
    assert packed.is_contiguous() and scale_zeros.is_contiguous()
    work = PARALLEL_WORK if parallel_work is None else parallel_work
    return lib, _Int4Matrix(packed.data_ptr(), scale_zeros.data_ptr(), packed.shape[0],
                            out_features, scale_zeros.shape[0] * 32, block, work)


def int4_gemv(packed: torch.Tensor, scale_zeros: torch.Tensor, out_features: int, block: int,
              parallel_work: int | None = None) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """y = x @ W^T for bf16 x [M, K] contiguous, 1 <= M <= INT4_MAX_ROWS (unchecked), W the
    int4-packed matrix (see _int4_matrix); None when the kernel is off. The function keeps
    `packed` and `scale_zeros` alive. parallel_work: see PARALLEL_WORK."""
    found = _int4_matrix(packed, scale_zeros, out_features, block, parallel_work)
    if found is None:
        return None
    lib, matrix = found
    rows, k = matrix.n_rows, matrix.k
    address, fn, empty, bf16 = ctypes.addressof(matrix), lib.int4_gemv_bf16, torch.empty, \
        torch.bfloat16

    def call(x: torch.Tensor, _keep: tuple = (matrix, packed, scale_zeros)) -> torch.Tensor:
        y = empty(x.shape[0], out_features, dtype=bf16)
        rc = fn(address, x.data_ptr(), y.data_ptr(), x.shape[0])
        assert rc == 0, f"int4_gemv_bf16 rejected {tuple(x.shape)} x {rows}x{k} (block {block})"
        return y

    call.native_op = (_address(lib.int4_gemv_op), (address,))  # type: ignore[attr-defined]
    return call


def int4_rows(packed: torch.Tensor, scale_zeros: torch.Tensor, out_features: int, block: int,
              lo_bits: int, chunk: int) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """ids (int64 [n], each < out_features) -> float32 [n, K] weight rows of the int4-packed
    matrix (as int4_gemv takes it; lo_bits/chunk: split 8- or 6-bit codes, see Int4Matrix),
    equal to Int4Matrix.rows; None when the kernel is off."""
    found = _int4_matrix(packed, scale_zeros, out_features, block, 0)
    if found is None:
        return None
    lib, matrix = found
    address, fn, k = ctypes.addressof(matrix), lib.int4_rows_f32, matrix.k // (2 if lo_bits else 1)

    def call(ids: torch.Tensor, _keep: tuple = (matrix, packed, scale_zeros)) -> torch.Tensor:
        ids = ids.to(torch.int64).contiguous()
        out = torch.empty(ids.numel(), k, dtype=torch.float32)
        rc = fn(address, ids.data_ptr(), ids.numel(), lo_bits, chunk, out.data_ptr())
        if rc != 0:
            raise IndexError(f"row ids outside [0, {out_features})")
        return out

    return call


def int4_vnni_available() -> bool:
    """Whether int4_vnni can run here (a CPU with AVX512-VNNI, -BW and -BF16)."""
    lib = int4_ops()
    return lib is not None and bool(lib.int4_vnni_available())


VNNI_RECORD_BYTES = 320  # int4_gemv.c: 16 rows x 32 k of codes + their scale/zero pairs
VNNI8_RECORD_BYTES = 576  # int4_gemv.c: 16 rows x 32 k of 8-bit codes + their fp32 scales


def int4_vnni(packed: torch.Tensor, scale_zeros: torch.Tensor, out_features: int, block: int,
              parallel_work: int | None = None, records: torch.Tensor | None = None,
              ) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """int4_gemv's call with int8 dot products: the matrix repacked once into int4_gemv.c's VNNI
    records (as many bytes as `packed` and `scale_zeros`, kept by the function as its
    `records`; or `records` given, from an earlier repack), x quantized per group of 32 to
    int8 on each call. None where the CPU or the library lacks it."""
    return _vnni_call(packed, scale_zeros, out_features, block, parallel_work, False, records)


def int8_vnni(packed: torch.Tensor, scale_zeros: torch.Tensor, out_features: int, block: int,
              parallel_work: int | None = None, records: torch.Tensor | None = None,
              ) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """int4_vnni for the split 8/4-bit matrices of Q8_0 (Int4Matrix lo_bits 4, chunk 32): their
    codes joined again into 8-bit records (about as many bytes as `packed` and `scale_zeros`),
    so the call takes x [M, K] as it is, not repeated along the doubled K', and does half the
    dot products. None where the CPU or library lacks it, or the matrix is not of that form."""
    return _vnni_call(packed, scale_zeros, out_features, block, parallel_work, True, records)


def vnni_records_bytes(rows: int, k_prime: int, eight_bit: bool) -> int:
    """Bytes of int4_vnni's (or int8_vnni's) records for packed rows [rows, K' / 2]."""
    k = k_prime // (2 if eight_bit else 1)
    return rows // 16 * (k // 32) * (VNNI8_RECORD_BYTES if eight_bit else VNNI_RECORD_BYTES)


def _vnni_call(packed: torch.Tensor, scale_zeros: torch.Tensor, out_features: int, block: int,
               parallel_work: int | None, eight_bit: bool, records: torch.Tensor | None,
               ) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """int4_vnni (int4 records over K') or int8_vnni (8-bit records over K' / 2)."""
    found = _int4_matrix(packed, scale_zeros, out_features, block, parallel_work)
    if found is None or not int4_vnni_available():
        return None
    lib, matrix = found
    rows, k = matrix.n_rows, matrix.k // (2 if eight_bit else 1)
    if eight_bit and matrix.k % 64:
        return None
    repack, fn = ((lib.int8_vnni_repack, lib.int8_vnni_bf16) if eight_bit else
                  (lib.int4_vnni_repack, lib.int4_vnni_bf16))
    nbytes = vnni_records_bytes(rows, matrix.k, eight_bit)
    if records is None or records.numel() != nbytes or records.dtype != torch.uint8:
        records = torch.empty(nbytes, dtype=torch.uint8)
        if repack(ctypes.addressof(matrix), records.data_ptr()) != 0:
            return None
    matrix.packed = matrix.scale_zeros = None  # the call reads the records only
    address, empty, bf16 = ctypes.addressof(matrix), torch.empty, torch.bfloat16
    records_ptr = records.data_ptr()

    def call(x: torch.Tensor, _keep: tuple = (matrix, records)) -> torch.Tensor:
        y = empty(x.shape[0], out_features, dtype=bf16)
        rc = fn(address, records_ptr, x.data_ptr(), y.data_ptr(), x.shape[0])
        assert rc == 0, f"{fn.__name__} rejected {tuple(x.shape)} x {rows}x{k}"
        return y

    call.records = records  # type: ignore[attr-defined]  # (for a cache of them)
    op = lib.int8_vnni_op if eight_bit else lib.int4_vnni_op
    call.native_op = (_address(op), (address, records_ptr))  # type: ignore[attr-defined]
    return call


def _build_and_load_int4() -> _Loaded:
    if os.environ.get("FORKLM_NATIVE_INT4", "1") == "0":
        return _Loaded(None, "disabled by FORKLM_NATIVE_INT4=0")
    lib, origin = _open(INT4_SOURCE)
    if lib is None:
        return _Loaded(None, origin)
    lib.int4_gemv_bf16.restype = _int
    lib.int4_gemv_bf16.argtypes = [_p, _p, _p, _i64]
    lib.int4_rows_f32.restype = _int
    lib.int4_rows_f32.argtypes = [_p, _p, _i64, _int, _i64, _p]
    lib.int4_vnni_available.restype = _int
    lib.int4_vnni_repack.restype = _int
    lib.int4_vnni_repack.argtypes = [_p, _p]
    lib.int4_vnni_bf16.restype = _int
    lib.int4_vnni_bf16.argtypes = [_p, _p, _p, _p, _i64]
    lib.int8_vnni_repack.restype = _int
    lib.int8_vnni_repack.argtypes = [_p, _p]
    lib.int8_vnni_bf16.restype = _int
    lib.int8_vnni_bf16.argtypes = [_p, _p, _p, _p, _i64]
    return _Loaded(lib, "", origin)


def read_streams(vendor: str | None = None, environ: Mapping[str, str] | None = None) -> bool:
    """Whether kquant_vnni.c's per-16 product reads a thread's blocks as several streams at once
    for 1-2 rows of x. Measured faster on an Intel Xeon (the 1B's records 5-7%, session 29) and
    much slower on AMD Zen 5 (the 1B's batch-1 forward 22.4 ms against 13.2 with one stream, the
    0.5B's 7.5 against 6.6, session 32: benchmarks/NOTES.md), so on Intel CPUs only;
    FORKLM_READ_STREAMS=0/1 decides instead. (int4_gemv.c's records keep their streams: there
    they were faster on both, the default model's forward 0.93-0.95x on Zen 5.)"""
    environ = os.environ if environ is None else environ
    chosen = environ.get("FORKLM_READ_STREAMS", "")
    if chosen in ("0", "1"):
        return chosen == "1"
    return (native_build.cpu_vendor() if vendor is None else vendor) == "GenuineIntel"


def kquant_ops() -> ctypes.CDLL | None:
    """The K-quant library (kquant_vnni.c), or None when it did not build, FORKLM_NATIVE_INT4=0,
    or the CPU lacks AVX512-VNNI/BW/BF16 (its matmul needs them; the row lookup alone is no use
    without it)."""
    return _load_once("native K-quant matmul", _build_and_load_kquant).lib


def _build_and_load_kquant() -> _Loaded:
    if os.environ.get("FORKLM_NATIVE_INT4", "1") == "0":
        return _Loaded(None, "disabled by FORKLM_NATIVE_INT4=0")
    lib, origin = _open(KQUANT_SOURCE)
    if lib is None:
        return _Loaded(None, origin)
    if not lib.kquant_available():
        return _Loaded(None, "the CPU lacks AVX512-VNNI, -BW or -BF16")
    lib.kquant_repack.restype = _int
    lib.kquant_repack.argtypes = [_int, _p, _i64, _i64, _i64, _p]
    lib.kquant_rows_f32.restype = _int
    lib.kquant_rows_f32.argtypes = [_int, _p, _i64, _i64, _p, _i64, _p]
    lib.kquant_matmul_bf16.restype = _int
    lib.kquant_matmul_bf16.argtypes = [_int, _p, _i64, _i64, _i64, _i64, _p, _p, _i64]
    lib.kquant_dequantize_t_bf16.restype = _int
    lib.kquant_dequantize_t_bf16.argtypes = [_int, _p, _i64, _i64, _i64, _p]
    lib.kquant_gemm_bf16.restype = _int
    lib.kquant_gemm_bf16.argtypes = [_int, _p, _i64, _i64, _i64, _p, _p, _i64]
    for entry in (lib.kquant_gemm_fine_bf16, lib.kquant_decode_bf16):
        entry.restype = _int
        entry.argtypes = [_int, _p, _i64, _i64, _i64, _i64, _p, _p, _i64]
    lib.kquant_gemm_amx_bf16.restype = _int
    lib.kquant_gemm_amx_bf16.argtypes = [_int, _p, _i64, _i64, _i64, _p, _p, _i64]
    lib.kquant_amx_available.restype = _int
    lib.kquant_use_streams.restype = None
    lib.kquant_use_streams.argtypes = [_int]
    lib.kquant_use_streams(int(read_streams()))
    return _Loaded(lib, "", origin)


def kquant_amx_available() -> bool:
    """Whether kquant_gemm_amx runs here: the K-quant library loaded, the CPU has AMX-TILE and
    AMX-BF16, the OS enabled their state and granted it to this process, and FORKLM_NATIVE_AMX
    is not 0. Some VMs list AMX in /proc/cpuinfo but hold the tiles off: the library asks the
    CPU and the kernel, never cpuinfo."""
    lib = kquant_ops()
    return (lib is not None and os.environ.get("FORKLM_NATIVE_AMX", "1") != "0"
            and bool(lib.kquant_amx_available()))


def kquant_repack(ggml_type: int, row_addresses: torch.Tensor, out_features: int,
                  padded_rows: int, in_features: int, record_bytes: int, record_k: int,
                  out: torch.Tensor) -> torch.Tensor | None:
    """Write into `out` (uint8) the records (kquant_vnni.c's layout: record_bytes for each 16
    rows x record_k) of a matrix whose row r's file bytes start at row_addresses[r] (int64
    [out_features]; the caller keeps them mapped), padded with zero rows to padded_rows (a
    multiple of 16). A 16-row block's records depend on its rows alone, so a matrix may be built
    a run of blocks at a time. Returns `out`; None where the library is off."""
    lib = kquant_ops()
    if lib is None:
        return None
    assert row_addresses.dtype == torch.int64 and row_addresses.numel() == out_features
    num_bytes = padded_rows // 16 * (in_features // record_k) * record_bytes
    assert out.dtype == torch.uint8 and out.numel() == num_bytes and out.is_contiguous()
    rc = lib.kquant_repack(ggml_type, row_addresses.data_ptr(), out_features, padded_rows,
                           in_features, out.data_ptr())
    assert rc == 0, f"kquant_repack rejected type {ggml_type}, {out_features}x{in_features}"
    return out


def kquant_matmul(ggml_type: int, records: torch.Tensor, padded_rows: int, out_features: int,
                  in_features: int, parallel_work: int | None = None,
                  entry: str = "kquant_matmul") -> Callable[[torch.Tensor], torch.Tensor] | None:
    """y = x @ W^T over `records` for contiguous bf16 x [M, in] (any M >= 1) -> bf16 [M, out] by
    kquant_vnni.c's `entry`: kquant_matmul, the per-16 kernel (x quantized per 16 k to int8 on
    each call); kquant_gemm_fine, the fine product (K-quants only: x per 256 k in a power-of-two
    step per 32); kquant_decode, the first for the legacy types, the second for the K-quants.
    OpenMP threads above parallel_work multiply-adds. None where the library is off."""
    lib = kquant_ops()
    if lib is None:
        return None
    fn, op = getattr(lib, f"{entry}_bf16"), getattr(lib, f"{entry}_op")
    empty, bf16 = torch.empty, torch.bfloat16
    ptr = records.data_ptr()
    work = PARALLEL_WORK if parallel_work is None else parallel_work

    def call(x: torch.Tensor, _keep: torch.Tensor = records) -> torch.Tensor:
        y = empty(x.shape[0], out_features, dtype=bf16)
        rc = fn(ggml_type, ptr, padded_rows, out_features, in_features, work, x.data_ptr(),
                y.data_ptr(), x.shape[0])
        assert rc == 0, f"kquant_matmul rejected {tuple(x.shape)} x {out_features}x{in_features}"
        return y

    call.native_op = (_address(op),  # type: ignore[attr-defined]
                      (ggml_type, ptr, padded_rows, out_features, in_features, work))
    return call


def kquant_gemm(ggml_type: int, records: torch.Tensor, padded_rows: int, out_features: int,
                in_features: int) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The many-row product on the records: contiguous bf16 x [M, in] -> bf16 [M, out], x
    quantized to int8 per 256 k (K-quants) or per 32 (Q4_0, Q5_0, Q8_0) (prefill chunks;
    OpenMP threads); None where the library is off."""
    lib = kquant_ops()
    if lib is None:
        return None
    return _records_product(lib.kquant_gemm_bf16, "kquant_gemm", ggml_type, records, padded_rows,
                            out_features, in_features)


def kquant_gemm_amx(ggml_type: int, records: torch.Tensor, padded_rows: int, out_features: int,
                    in_features: int) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The many-row product on AMX tiles: contiguous bf16 x [M, in] -> bf16 [M, out], the
    records dequantized to bf16 a tile at a time and multiplied with x as it is (fp32 sums;
    OpenMP threads); None where AMX does not run here (kquant_amx_available)."""
    lib = kquant_ops()
    if lib is None or not kquant_amx_available():
        return None
    return _records_product(lib.kquant_gemm_amx_bf16, "kquant_gemm_amx", ggml_type, records,
                            padded_rows, out_features, in_features)


def _records_product(fn: Callable[..., int], name: str, ggml_type: int, records: torch.Tensor,
                     padded_rows: int, out_features: int, in_features: int
                     ) -> Callable[[torch.Tensor], torch.Tensor]:
    """x -> y by entry point `fn` (type, records, padded rows, out, in, x, y, M) on the records."""
    empty, bf16, ptr = torch.empty, torch.bfloat16, records.data_ptr()

    def call(x: torch.Tensor, _keep: torch.Tensor = records) -> torch.Tensor:
        y = empty(x.shape[0], out_features, dtype=bf16)
        rc = fn(ggml_type, ptr, padded_rows, out_features, in_features, x.data_ptr(),
                y.data_ptr(), x.shape[0])
        assert rc == 0, f"{name} rejected {tuple(x.shape)} x {out_features}x{in_features}"
        return y

    return call


def kquant_dequantize_t(ggml_type: int, records: torch.Tensor, padded_rows: int,
                        out_features: int, in_features: int,
                        out: torch.Tensor | None = None) -> torch.Tensor:
    """bf16 [in, out]: the transposed weight, dequantized from the records (OpenMP threads),
    into `out` (contiguous bf16 of that shape) when given."""
    lib = kquant_ops()
    assert lib is not None, "kquant_dequantize_t needs the K-quant library"
    wt = torch.empty(in_features, out_features, dtype=torch.bfloat16) if out is None else out
    assert wt.shape == (in_features, out_features) and wt.dtype == torch.bfloat16
    assert wt.is_contiguous()
    rc = lib.kquant_dequantize_t_bf16(ggml_type, records.data_ptr(), padded_rows, out_features,
                                      in_features, wt.data_ptr())
    assert rc == 0, f"kquant_dequantize_t rejected {out_features}x{in_features}"
    return wt


def kquant_rows(ggml_type: int, records: torch.Tensor, out_features: int, in_features: int,
                ids: torch.Tensor) -> torch.Tensor:
    """float32 [len(ids), in]: weight rows `ids` (int64 CPU, in range) from the records."""
    lib = kquant_ops()
    assert lib is not None, "kquant_rows needs the K-quant library"
    ids = ids.to(torch.int64).contiguous()
    out = torch.empty(ids.numel(), in_features, dtype=torch.float32)
    rc = lib.kquant_rows_f32(ggml_type, records.data_ptr(), out_features, in_features,
                             ids.data_ptr(), ids.numel(), out.data_ptr())
    if rc != 0:
        raise IndexError(f"row ids outside 0..{out_features - 1}")
    return out


# How an _open failure's reason starts when no library could be had at all (the WARNING case).
_BUILD_FAILED = "no native library: "


def _open(source: Path) -> tuple[ctypes.CDLL | None, str]:
    """(the loaded library of `source`, where it came from), or (None, why there is none):
    the prebuilt library of this CPU's level, else one compiled here (-march=native; first with
    FORKLM_NATIVE_BUILD=native)."""
    if os.environ.get("FORKLM_NATIVE_KERNELS", "1") == "0":
        return None, "disabled by FORKLM_NATIVE_KERNELS=0"
    stem = source.stem
    prebuilt = None if _prefer_native_build() else native_build.prebuilt_library(stem)
    if prebuilt is not None:
        path, level = prebuilt
        try:
            return ctypes.CDLL(str(path)), f"prebuilt for {level}"
        except OSError as e:
            logger.warning("prebuilt %s did not load (%s); compiling it here", path.name, e)
    try:
        return ctypes.CDLL(str(_compiled_library(source))), "compiled here (-march=native)"
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        why = ("FORKLM_NATIVE_BUILD=native" if _prefer_native_build() else
               "none prebuilt for this CPU from these sources" if prebuilt is None
               else "the prebuilt one did not load")
        return None, f"{_BUILD_FAILED}{why}, and compiling one failed: {e}"


def _prefer_native_build() -> bool:
    return os.environ.get("FORKLM_NATIVE_BUILD", "") == "native"


def _build_and_load() -> _Loaded:
    lib, origin = _open(SOURCE)
    if lib is None:
        return _Loaded(None, origin)
    lib.paged_attention_batch.restype = _int
    lib.paged_attention_batch.argtypes = [_p, _p, _p, _p, _p, _f32, _f32, _i64, _int, _int, _p,
                                          _p, _p, _p]
    lib.paged_attention_threads.restype = _int
    lib.paged_prefill_bf16.restype = _int
    lib.paged_prefill_bf16.argtypes = [_p, _p, _p, _p, _p, _f32]
    lib.paged_prefill_available.restype = _int
    lib.paged_attention_supports.restype = _int
    lib.paged_attention_supports.argtypes = [_int, _int]
    return _Loaded(lib, "", origin)


def _compiled_library(source_path: Path) -> Path:
    """The cached -march=native .so for this source, flags, compiler and CPU, compiling it if
    missing (the key reads `cc --version`: this path is a source checkout's, not a wheel's)."""
    cc = os.environ.get("CC", "cc")
    if shutil.which(cc) is None:
        raise RuntimeError(f"no C compiler ({cc!r} not on PATH)")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    flags = " ".join(sorted(native_build.cpu_flags()))
    key = hashlib.sha256("\0".join([native_build.source_key(source_path, NATIVE_TARGET),
                                    version, flags]).encode())
    cache = Path(os.environ.get("FORKLM_CACHE_DIR") or Path.home() / ".cache/forklm/native")
    target = cache / f"{source_path.stem}-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    native_build.compile_library(cc, source_path, [*native_build.LIBRARIES[source_path.stem],
                                                   *NATIVE_TARGET], target)
    return target


NATIVE_TARGET = ["-march=native"]

