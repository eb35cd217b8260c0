"""kernels/cpu/int4_gemv.c vs the float64 product with the dequantized weight and vs torch's int4
kernel, on the packed matrices QuantizedLinear builds (4-bit GGUF types, blocks and tails)."""

from __future__ import annotations

import ctypes
import os
import platform

import pytest
import torch
from gguf import GGMLQuantizationType as T

from forklm.kernels.cpu import bindings as native_kernels
from forklm.kernels.cpu import native_build
from forklm.runtime.quant.linear import KERNEL_GROUP, QuantizedLinear, pack_block_n
from tests.test_quant import in_features_for, make_weight

pytestmark = pytest.mark.skipif(native_kernels.int4_ops() is None,
                                reason="native int4 kernel did not build or is switched off")

TYPES = [T.Q4_0, T.Q4_1, T.Q4_K]  # the lo_bits == 0 types of test_quant.TYPES


def assert_within_one_ulp(y: torch.Tensor, expected: torch.Tensor) -> None:
    """One bf16 ulp (2^-7 relative), or fp32 noise where a sum cancels to near zero."""
    atol = 1e-5 * expected.abs().max().item()
    torch.testing.assert_close(y, expected, rtol=2**-7, atol=atol)


def kernels(linear: QuantizedLinear, parallel_work: int | None = None):
    matrix = linear.matrices[0]
    native = native_kernels.int4_gemv(matrix.packed, matrix.scale_zeros, linear.out_features,
                                      pack_block_n(), parallel_work)
    assert native is not None

    def torch_kernel(x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, matrix.packed, KERNEL_GROUP,
                                                       matrix.scale_zeros)
        return y[:, : linear.out_features]

    return native, torch_kernel


# 48, 80: a tail block only / a block + tail, both padded from 48 and 80 to 48 and 96 rows in
# 64-row blocks; 192: whole blocks; 200 (-> 208): blocks, tail, padding.
@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("out_features", [16, 48, 80, 192, 200])
@pytest.mark.parametrize("parallel", [False, True], ids=["serial", "parallel"])
def test_native_matches_dequantized_product_and_torch(ggml_type, out_features, parallel):
    weight = make_weight(ggml_type, out_features, in_features_for(ggml_type), seed=out_features)
    linear = QuantizedLinear.from_gguf([weight], None, torch.bfloat16)
    native, torch_kernel = kernels(linear, 0 if parallel else 2**62)
    w = linear.dequantize().double()  # [out, in]
    gen = torch.Generator().manual_seed(out_features)
    for rows in range(1, native_kernels.INT4_MAX_ROWS + 1):
        x = torch.randn(rows, weight.shape[1], generator=gen).bfloat16()
        y = native(x)
        assert y.dtype == torch.bfloat16 and y.shape == (rows, out_features)
        exact = x.double() @ w.T
        # fp32 sums rounded once to bf16: half an ulp (at most 2^-8 relative) plus fp32 noise
        err = (y.double() - exact).abs()
        assert (err <= 2.0**-8 * exact.abs() + 1e-6 * exact.abs().max()).all(), rows
        assert_within_one_ulp(y, torch_kernel(x))  # torch's kernel sums in another order


@pytest.mark.parametrize("in_features", [32, 96, 1536])
def test_native_k_sizes(in_features):
    weight = make_weight(T.Q4_1, 128, in_features)
    linear = QuantizedLinear.from_gguf([weight], None, torch.bfloat16)
    native, torch_kernel = kernels(linear)
    x = torch.randn(3, in_features, generator=torch.Generator().manual_seed(1)).bfloat16()
    assert_within_one_ulp(native(x), torch_kernel(x))


@pytest.mark.parametrize("rows", [1, 5, native_kernels.INT4_MAX_ROWS])
def test_forward_and_direct_use_the_native_kernel(rows):
    weight = make_weight(T.Q4_1, 96, 64)
    linear = QuantizedLinear.from_gguf([weight], None, torch.bfloat16)
    native, _ = kernels(linear)
    x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(2)).bfloat16()
    assert torch.equal(linear(x), native(x))
    assert torch.equal(linear.direct()(x), native(x))
    assert torch.equal(linear.direct()(x.T.contiguous().T), native(x))  # a strided x is copied


@pytest.mark.parametrize("block", [32, 64])
def test_kernel_rejects_what_it_does_not_take(block):
    lib = native_kernels.int4_ops()
    packed = torch.zeros(48, 16, dtype=torch.uint8)
    scale_zeros = torch.zeros(1, 48, 2, dtype=torch.bfloat16)
    matrix = native_kernels._Int4Matrix(packed.data_ptr(), scale_zeros.data_ptr(), 48, 48, 32,
                                        block, 0)
    too_many = native_kernels.INT4_MAX_ROWS + 1
    x = torch.zeros(too_many, 32, dtype=torch.bfloat16)
    y = torch.zeros(too_many, 48, dtype=torch.bfloat16)
    assert lib.int4_gemv_bf16(ctypes.addressof(matrix), x.data_ptr(), y.data_ptr(),
                              too_many) == -1
    assert lib.int4_gemv_bf16(ctypes.addressof(matrix), x.data_ptr(), y.data_ptr(), 0) == -1
    assert lib.int4_gemv_bf16(ctypes.addressof(matrix), x.data_ptr(), y.data_ptr(), 1) == 0


def pack(codes: torch.Tensor, block: int) -> torch.Tensor:
    """uint8 [N, K / 2]: torch's int4 CPU packing of codes [N, K] in blocks of `block` rows (the
    layout _unpack_rows reads), so an AVX2 torch's 32-row layout can be tested on any build."""
    n, k = codes.shape
    full = n // block * block
    c = codes.to(torch.uint8)
    blocks = c[:full].view(-1, 2, block // 2, k).permute(0, 3, 2, 1)  # [blocks, k, B/2, 2]
    tail = c[full:].view(-1, 2, k).permute(2, 0, 1)  # [k, rows / 2, 2]
    both = [blocks.reshape(-1, 2), tail.reshape(-1, 2)]
    return torch.cat([b[:, 0] | (b[:, 1] << 4) for b in both]).view(n, k // 2)


def test_pack_reproduces_torch_packing():
    codes = torch.randint(0, 16, (208, 96), generator=torch.Generator().manual_seed(5))
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.int(), 1)
    assert torch.equal(pack(codes, pack_block_n()), packed)


# This CPU (AVX512-BF16 dot products where it has them), AVX-512 (16-float FMAs), AVX2 (8) and
# plain x86-64 (GCC's lowering of the vector code), in both packings: wherever this CPU runs what
# they compile to.
# The prebuilt instruction-set levels (kernels/cpu/native_build.py) and -march=native.
TARGETS = {"native": (("-march=native",), frozenset()),
           **{level.name: (level.target, level.needs) for level in native_build.X86_LEVELS}}


@pytest.mark.parametrize("target", list(TARGETS))
@pytest.mark.parametrize("block", [32, 64])
def test_builds_for_other_cpus_and_packings(target, block, tmp_path):
    flags, needs = TARGETS[target]
    if platform.machine() not in ("x86_64", "AMD64") or not needs <= native_build.cpu_flags():
        pytest.skip(f"not an x86 CPU that runs {target}")
    library = tmp_path / "int4.so"
    native_build.compile_library(os.environ.get("CC", "cc"), native_kernels.INT4_SOURCE,
                                 [*native_build.LIBRARIES["int4_gemv"], *flags], library)
    lib = ctypes.CDLL(str(library))
    gen = torch.Generator().manual_seed(block)
    n, k, n_out = 208, 96, 200  # blocks, a 16-row tail, padding
    codes = torch.randint(0, 16, (n, k), generator=gen)
    scale_zeros = (torch.randn(k // 32, n, 2, generator=gen) * 0.01).bfloat16()
    scale, zero = scale_zeros[..., 0].float().T, scale_zeros[..., 1].float().T  # [N, K / 32]
    w = (codes.double().view(n, -1, 32) - 8) * scale[..., None] + zero[..., None]  # [N, K/32, 32]
    packed = pack(codes, block)
    for parallel_work in (0, 2**62):
        matrix = native_kernels._Int4Matrix(packed.data_ptr(), scale_zeros.data_ptr(), n, n_out, k,
                                            block, parallel_work)
        for rows in range(1, native_kernels.INT4_MAX_ROWS + 1):
            x = torch.randn(rows, k, generator=gen).bfloat16()
            y = torch.empty(rows, n_out, dtype=torch.bfloat16)
            assert lib.int4_gemv_bf16(ctypes.c_void_p(ctypes.addressof(matrix)),
                                      ctypes.c_void_p(x.data_ptr()), ctypes.c_void_p(y.data_ptr()),
                                      ctypes.c_int64(rows)) == 0
            exact = x.double() @ w.view(n, k)[:n_out].T
            err = (y.double() - exact).abs()
            assert (err <= 2.0**-8 * exact.abs() + 1e-6 * exact.abs().max()).all(), rows


SPLIT_TYPES = [T.Q8_0, T.Q6_K, T.Q5_0, T.Q5_1, T.Q5_K, T.IQ4_NL, T.IQ4_XS, T.MXFP4, T.Q3_K]


@pytest.mark.parametrize("ggml_type", [*TYPES, *SPLIT_TYPES], ids=lambda t: t.name)
@pytest.mark.parametrize("out_features", [16, 80, 200])  # tail only, block + tail, with padding
def test_native_rows_equal_the_torch_dequantization(ggml_type, out_features):
    """The embedding's rows (int4_rows_f32) bit for bit as Int4Matrix.rows' torch ops give them,
    split 8/6-bit codes included."""
    weight = make_weight(ggml_type, out_features, in_features_for(ggml_type), seed=3)
    matrix = QuantizedLinear.from_gguf([weight], None, torch.bfloat16).matrices[0]
    ids = torch.tensor([0, out_features - 1, out_features // 2, 0, 15])
    native = matrix.rows(ids)
    matrix._native = (matrix.packed.data_ptr(), None, None)  # as where the library did not build
    assert torch.equal(native, matrix.rows(ids))
    rows = native_kernels.int4_rows(matrix.packed, matrix.scale_zeros, out_features,
                                    pack_block_n(), matrix.lo_bits, matrix.chunk)
    with pytest.raises(IndexError, match="row ids"):
        rows(torch.tensor([out_features]))


needs_vnni = pytest.mark.skipif(not native_kernels.int4_vnni_available(),
                                reason="no AVX512-VNNI/BW/BF16 on this CPU")


def quantize_like_the_kernel(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, k] quantized per group of 32 as the int8 kernels do: (xq [rows, k / 32, 32],
    d [rows, k / 32, 1]) with d = max|x| / 127, xq = rint(x / d), in fp32."""
    xf = x.float().view(x.shape[0], -1, 32)
    amax = xf.abs().amax(-1, keepdim=True)
    # tensor / tensor: one IEEE division, as the kernel's (a scalar / tensor is computed as a
    # reciprocal times the scalar, which moves a few x / d onto the other side of a .5)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    return torch.round(xf * inv), amax / 127.0  # round half to even, like cvtps2dq


def int8_reference(x: torch.Tensor, linear: QuantizedLinear) -> tuple[torch.Tensor, torch.Tensor]:
    """What the int8 kernel computes, in float64: x quantized per group of 32 (d = max|x| / 127,
    xq = rint(x / d)), integer sums of (c - 8) xq, then scale d isum + zero * sum(x) per group;
    and the sum of those terms' magnitudes (the scale of the kernel's fp32 rounding)."""
    matrix = linear.matrices[0]
    xf = x.float().view(x.shape[0], -1, 32)
    xq, d = quantize_like_the_kernel(x)
    codes = _unpack_codes(matrix).float().view(matrix.packed.shape[0], -1, 32)  # [N, G, 32]
    isum = torch.einsum("mgk,ngk->mng", xq.double(), codes.double() - 8)  # exact integers
    scale = matrix.scale_zeros[..., 0].float().T  # [N, G]
    zero = matrix.scale_zeros[..., 1].float().T
    terms = (isum * (scale[None] * d.squeeze(-1)[:, None, :]).double(),
             zero[None].double() * xf.sum(-1)[:, None, :].double())
    y = (terms[0] + terms[1]).sum(-1)
    magnitude = (terms[0].abs() + terms[1].abs()).sum(-1)
    return y[:, : linear.out_features], magnitude[:, : linear.out_features]


def _unpack_codes(matrix) -> torch.Tensor:
    from forklm.runtime.quant.linear import _unpack_rows

    return _unpack_rows(matrix.packed, matrix.k_prime, torch.arange(matrix.packed.shape[0]))


@needs_vnni
@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("out_features", [16, 80, 200])  # a tail block, padding
@pytest.mark.parametrize("parallel", [False, True], ids=["serial", "parallel"])
def test_int8_kernel_computes_the_quantized_product(ggml_type, out_features, parallel):
    weight = make_weight(ggml_type, out_features, in_features_for(ggml_type), seed=out_features)
    linear = QuantizedLinear.from_gguf([weight], None, torch.bfloat16)
    matrix = linear.matrices[0]
    int8 = native_kernels.int4_vnni(matrix.packed, matrix.scale_zeros, out_features,
                                    pack_block_n(), 0 if parallel else 2**62)
    exact = linear.dequantize().double()
    gen = torch.Generator().manual_seed(out_features)
    for rows in range(1, native_kernels.INT4_MAX_ROWS + 1):
        x = torch.randn(rows, weight.shape[1], generator=gen).bfloat16()
        x[:, 3] *= 50  # an outlier channel: its group's step grows, the others' do not
        y = int8(x)
        assert y.dtype == torch.bfloat16 and y.shape == (rows, out_features)
        expected, magnitude = int8_reference(x, linear)
        # one bf16 rounding of the result, plus fp32 rounding of the sum of its terms
        err = (y.double() - expected).abs()
        assert (err <= 2.0**-8 * expected.abs() + 2.0**-20 * magnitude).all(), rows
        # and near the exact product: int8 steps of x, not a different weight
        reference = x.double() @ exact.T
        rms = reference.pow(2).mean(-1, keepdim=True).sqrt()
        assert ((y.double() - reference).abs() / rms).mean() < 2e-2, rows  # measured <= 1.1e-2


@needs_vnni
def test_int8_activations_switch_the_matrices_within_the_budget():
    from torch import nn

    from forklm.runtime.quant.linear import use_int8_activations

    weights = [make_weight(T.Q4_K, 64, 256), make_weight(T.Q8_0, 48, 256)]
    model = nn.Sequential(*(QuantizedLinear.from_gguf([w], None, torch.bfloat16) for w in weights))
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(7)).bfloat16()
    before = [layer(x) for layer in model]
    assert use_int8_activations(model, max_bytes=1) == 0  # too large: left as they were
    assert all(torch.equal(layer(x), y) for layer, y in zip(model, before))
    total = use_int8_activations(model)
    assert total == sum(layer.matrices[0].nbytes for layer in model)
    for layer, y in zip(model, before):
        assert layer.matrices[0].int8_activations
        int8_y = layer(x)
        assert not torch.equal(int8_y, y)  # x is quantized now
        assert torch.equal(layer.direct()(x), int8_y)  # the fused layers' call agrees
        torch.testing.assert_close(int8_y.float(), y.float(), rtol=0.05,
                                   atol=0.05 * y.float().abs().max().item())


@needs_vnni
@pytest.mark.parametrize("out_features", [16, 80, 200])  # a tail block, padding
@pytest.mark.parametrize("parallel", [False, True], ids=["serial", "parallel"])
def test_int8_kernel_on_q8_0_records_computes_the_quantized_product(out_features, parallel):
    """Q8_0's split matrix joined into 8-bit records: x quantized per group of 32 as in the int4
    records' kernel, integer sums of code * xq, then scale * d per group."""
    weight = make_weight(T.Q8_0, out_features, 256, seed=out_features)
    linear = QuantizedLinear.from_gguf([weight], None, torch.bfloat16)
    matrix = linear.matrices[0]
    int8 = native_kernels.int8_vnni(matrix.packed, matrix.scale_zeros, out_features,
                                    pack_block_n(), 0 if parallel else 2**62)
    assert int8 is not None
    w = linear.dequantize().double()  # s * code: exact, s in bf16
    gen = torch.Generator().manual_seed(out_features)
    for rows in range(1, native_kernels.INT4_MAX_ROWS + 1):
        x = torch.randn(rows, 256, generator=gen).bfloat16()
        x[:, 3] *= 50  # an outlier channel
        y = int8(x)
        assert y.dtype == torch.bfloat16 and y.shape == (rows, out_features)
        xq, d = quantize_like_the_kernel(x)
        terms = torch.einsum("mgk,ngk->mng", xq.double() * d.double(),
                             w.view(out_features, -1, 32))
        expected, magnitude = terms.sum(-1), terms.abs().sum(-1)
        err = (y.double() - expected).abs()
        assert (err <= 2.0**-8 * expected.abs() + 2.0**-20 * magnitude).all(), rows
        reference = x.double() @ w.T
        rms = reference.pow(2).mean(-1, keepdim=True).sqrt()
        assert ((y.double() - reference).abs() / rms).mean() < 2e-2, rows


@needs_vnni
def test_int8_activations_on_split_matrices():
    """Q8_0 takes the 8-bit records (x as it is), Q6_K the int4 records on x expanded to K';
    forward, direct() and the kernel agree, within int8 steps of the bf16-dot result."""
    from torch import nn

    from forklm.runtime.quant.linear import use_int8_activations

    weights = [make_weight(T.Q8_0, 48, 512, seed=1), make_weight(T.Q6_K, 48, 512, seed=2)]
    model = nn.Sequential(*(QuantizedLinear.from_gguf([w], None, torch.bfloat16) for w in weights))
    x = torch.randn(6, 512, generator=torch.Generator().manual_seed(3)).bfloat16()
    before = [layer(x) for layer in model]
    assert use_int8_activations(model) > 0
    q8, q6 = (layer.matrices[0] for layer in model)
    q8_records = native_kernels.int8_vnni(q8.packed, q8.scale_zeros, 48, pack_block_n())
    assert q8_records is not None and torch.equal(model[0](x), q8_records(x))
    assert native_kernels.int8_vnni(q6.packed, q6.scale_zeros, 48, pack_block_n()) is None
    for layer, y in zip(model, before):
        int8_y = layer(x)
        assert torch.equal(layer.direct()(x), int8_y)
        torch.testing.assert_close(int8_y.float(), y.float(), rtol=0.05,
                                   atol=0.05 * y.float().abs().max().item())


@needs_vnni
@pytest.mark.parametrize("ggml_type", SPLIT_TYPES[2:], ids=lambda t: t.name)
def test_int8_activations_on_the_five_bit_and_codebook_types(ggml_type):
    """Split types without offsets in chunks of 32 (Q5_0, IQ4_NL, IQ4_XS, MXFP4) take Q8_0's 8-bit
    records; those with offsets (Q5_1, Q5_K) or sub-blocks of 16 (Q3_K, as Q6_K) are refused
    there and take the int4 records. Either way the result stays within int8 steps of the
    bf16-dot one."""
    from torch import nn

    from forklm.runtime.quant.linear import use_int8_activations

    layer = QuantizedLinear.from_gguf([make_weight(ggml_type, 48, 512, seed=4)], None,
                                      torch.bfloat16)
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(5)).bfloat16()
    before = layer(x)
    assert use_int8_activations(nn.Sequential(layer)) > 0
    matrix = layer.matrices[0]
    records = native_kernels.int8_vnni(matrix.packed, matrix.scale_zeros, 48, pack_block_n())
    assert (records is None) == (ggml_type in (T.Q5_1, T.Q5_K, T.Q3_K))
    int8_y = layer(x)
    assert torch.equal(layer.direct()(x), int8_y)
    torch.testing.assert_close(int8_y.float(), before.float(), rtol=0.05,
                               atol=0.05 * before.float().abs().max().item())
