"""quant/kquant.py's KQuantMatrix and kernels/cpu/kquant_vnni.c (K-quants, and the legacy Q4_0, Q5_0
and Q8_0 in records of 32 k): the records hold the file's weight
exactly (rows equal gguf-py's dequantization), each matmul computes what it promises (x quantized
to int8 per 16, per 256 in fine steps, per 256 or per 32; exact integer sums, fp32 scaling, one
bf16 rounding) for any number of rows, a row's result does not depend on the call it is in, and QuantizedLinear and a whole
engine use the records for K-quant GGUF matrices."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize
from gguf.quants import quantize as gguf_quantize

from forklm.kernels.cpu import bindings as native_kernels
from forklm.runtime.quant.gguf_formats import GGUFWeight
from forklm.runtime.quant.kquant import RECORD_BYTES, RECORD_K, KQuantMatrix, kquant_available
from forklm.runtime.quant.linear import Int4Matrix, QuantizedLinear
from tests.kquant_blocks import quantize
from tests.test_quant import make_weight

pytestmark = pytest.mark.skipif(not kquant_available(),
                                reason="K-quant kernel off (no AVX512-VNNI/BW/BF16 or no build)")

TYPES = [T.Q4_K, T.Q5_K, T.Q6_K, T.Q4_0, T.Q5_0, T.Q8_0]
LEGACY = (T.Q4_0, T.Q5_0, T.Q8_0)  # one fp16 step per 32 weights; gguf-py quantizes them


def weight_of(ggml_type: T, out_features: int, in_features: int = 512, seed: int = 0,
              realistic: bool = True) -> GGUFWeight:
    """Blocks of a trained-like matrix (tests/kquant_blocks), or random bytes with realistic
    fp16 steps (every code, scale and min pattern: tests/test_quant.make_weight)."""
    if not realistic:
        return make_weight(ggml_type, out_features, in_features, seed=seed)
    w = np.random.default_rng(seed).standard_normal((out_features, in_features)) * 0.02
    blocks = (gguf_quantize(w.astype(np.float32), ggml_type) if ggml_type in LEGACY
              else quantize(w, ggml_type))
    return GGUFWeight(blocks, ggml_type, (out_features, in_features))


def reference_product(x: torch.Tensor, weight: GGUFWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """What the kernel computes, in float64: x quantized per group of 32 (d = max|x| / 127,
    xq = rint(x / d)) times the exact weight, the min terms of Q4_K/Q5_K on the exact fp32 sum of
    x instead; and the sum of the terms' magnitudes (the scale of fp32 rounding)."""
    w = torch.from_numpy(dequantize(weight.data, weight.ggml_type)).double()  # [N, K]
    x_int8 = quantized_x(x).double()  # what the integer dots see
    if weight.ggml_type not in (T.Q4_K, T.Q5_K):  # w = s (c - mid): all on int8 x
        terms = x_int8[:, None, :] * w[None]
        return terms.sum(-1), terms.abs().sum(-1)
    # w = s (c - mid) + (mid s - mn) per group: the first part on int8 x, the second on exact x
    mid = 16 if weight.ggml_type == T.Q5_K else 8
    scale, mn = (t.double() for t in _group_scales_mins(weight))  # [N, K / 32] each
    offset = mid * scale - mn
    xf = x.double().view(x.shape[0], -1, 32)
    centred = x_int8[:, None, :] * (w - offset.repeat_interleave(32, 1))[None]
    offsets = xf.sum(-1)[:, None, :] * offset[None]
    return centred.sum(-1) + offsets.sum(-1), centred.abs().sum(-1) + offsets.abs().sum(-1)


def quantized_x(x: torch.Tensor) -> torch.Tensor:
    """x [rows, k] as the kernel's int8 dots see it, fp32: steps d = max|x| / 127 per 16,
    xq = rint(x / d) (one IEEE division for 127 / max|x|, as the kernel's), xq d."""
    xf = x.float().view(x.shape[0], -1, 16)
    amax = xf.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    return (torch.round(xf * inv) * (amax / 127.0)).view(x.shape)


def _group_scales_mins(weight: GGUFWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """d sc and dmin m of each group of 32 (the decoder's scales and -offsets)."""
    from forklm.runtime.quant.gguf_formats import decode

    decoded = decode(weight)
    return decoded.scales, -decoded.offsets


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("realistic", [True, False], ids=["trained", "random-bytes"])
def test_records_hold_the_file_weight_exactly(ggml_type, realistic):
    weight = weight_of(ggml_type, 40, seed=3, realistic=realistic)  # 40 rows: a padded block
    matrix = KQuantMatrix.from_gguf([weight])
    expected = torch.from_numpy(dequantize(weight.data, ggml_type))
    assert torch.equal(matrix.rows(torch.arange(40)), expected)
    assert torch.equal(matrix.rows(torch.tensor([39, 0, 17, 17])), expected[[39, 0, 17, 17]])
    with pytest.raises(IndexError):
        matrix.rows(torch.tensor([40]))


@pytest.mark.parametrize("ggml_type", [T.Q4_K, T.Q6_K, T.Q8_0], ids=lambda t: t.name)
@pytest.mark.parametrize("repack_rows", [16, 32, 48])
def test_records_built_a_run_of_rows_at_a_time_equal_the_whole(ggml_type, repack_rows,
                                                                monkeypatch):
    """Rows repacked REPACK_ROWS at a time (runs crossing parts, the last one padded) give the
    records of one pass, and every row of a part is let go exactly once: a whole-tensor part
    run by run, another once its last rows are in."""
    import dataclasses

    from forklm.runtime.quant import kquant

    parts = [weight_of(ggml_type, 40, seed=11), weight_of(ggml_type, 24, seed=12),
             weight_of(ggml_type, 9, seed=13)]  # 73 rows: the last block padded
    released: list[list[tuple[int, int]]] = [[], [], []]
    tracked = [dataclasses.replace(part, release_rows=lambda first, count, log=log:
                                   log.append((first, count)))
               for part, log in zip(parts, released)]
    tracked[2] = dataclasses.replace(parts[2], release=lambda: released[2].append((0, 9)))
    whole = KQuantMatrix.from_gguf(parts)
    monkeypatch.setattr(kquant, "REPACK_ROWS", repack_rows)
    in_runs = KQuantMatrix.from_gguf(tracked)
    assert torch.equal(in_runs.records, whole.records)
    for part, log in zip(parts, released):
        rows = [r for first, count in log for r in range(first, first + count)]
        assert sorted(rows) == list(range(part.shape[0]))


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_records_are_about_the_file_size(ggml_type):
    weight = weight_of(ggml_type, 64, in_features=1024)
    matrix = KQuantMatrix.from_gguf([weight])
    assert matrix.nbytes == 64 // 16 * 1024 // RECORD_K[ggml_type] * RECORD_BYTES[ggml_type]
    # 4.63 / 5.63 / 6.63 bits against 4.5 / 5.5 / 6.56; Q4_0, Q5_0, Q8_0: the file's 4.5 / 5.5 / 8.5
    assert matrix.nbytes <= weight.nbytes * (1.0 if ggml_type in LEGACY else 1.03)


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("out_features", [16, 40, 200])
@pytest.mark.parametrize("parallel", [False, True], ids=["serial", "parallel"])
def test_matmul_computes_the_int8_product(ggml_type, out_features, parallel):
    weight = weight_of(ggml_type, out_features, seed=out_features, realistic=False)
    matrix = KQuantMatrix.from_gguf([weight])
    matmul = native_kernels.kquant_matmul(int(ggml_type), matrix.records, matrix.padded_rows,
                                          out_features, 512, 0 if parallel else 2**62)
    exact = torch.from_numpy(dequantize(weight.data, ggml_type)).double()
    gen = torch.Generator().manual_seed(out_features)
    for rows in (1, 2, 3, 7, 8, 9, 16, 17, 40):
        x = torch.randn(rows, 512, generator=gen).bfloat16()
        x[:, 3] *= 50  # an outlier channel: its group's step grows, the others' do not
        y = matmul(x)
        assert y.dtype == torch.bfloat16 and y.shape == (rows, out_features)
        expected, magnitude = reference_product(x, weight)
        # one bf16 rounding of the result, plus fp32 rounding of the sum of its terms
        err = (y.double() - expected).abs()
        assert (err <= 2.0**-8 * expected.abs() + 2.0**-20 * magnitude).all(), rows
        # and near the exact product: int8 steps of x, not a different weight
        reference = x.double() @ exact.T
        rms = reference.pow(2).mean(-1, keepdim=True).sqrt()
        assert ((y.double() - reference).abs() / rms).mean() < 2e-2, rows  # measured ~6e-3


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_a_rows_result_does_not_depend_on_its_call(ggml_type):
    """Alone, among 40 rows, or split over threads: bit-identical within each kernel (radix-cached
    prefixes and batched requests must see the same logits as a lone one): the per-16 kernel,
    the K-quants' fine product and the many-row product. The decode kernel (native()) is the
    first for the legacy types, the second for the K-quants."""
    weight = weight_of(ggml_type, 200, seed=1)
    matrix = KQuantMatrix.from_gguf([weight])
    args = (int(ggml_type), matrix.records, matrix.padded_rows, 200, 512)
    per_16, per_16_serial = (native_kernels.kquant_matmul(*args, work) for work in (0, 2**62))
    fine, fine_serial = (None, None) if ggml_type in LEGACY else (
        native_kernels.kquant_matmul(*args, work, entry="kquant_gemm_fine") for work in (0, 2**62))
    x = torch.randn(40, 512).bfloat16()
    for kernel in (per_16, fine, matrix.gemm()):
        if kernel is None:  # the legacy types have no fine product
            continue
        together = kernel(x)
        assert torch.equal(together, torch.cat([kernel(x[i:i + 1]) for i in range(40)]))
        assert torch.equal(together[5:22], kernel(x[5:22]))
    assert torch.equal(per_16(x), per_16_serial(x))
    batches = per_16 if fine is None else fine
    if fine is not None:
        assert torch.equal(fine(x), fine_serial(x))
    assert torch.equal(matrix.native()(x[:1]), batches(x[:1]))
    assert torch.equal(matrix.native()(x), batches(x))
    big = torch.randn(300, 512).bfloat16()  # two chunks of the many-row product's rows
    if matrix.gemm() is not None:
        assert torch.equal(matrix.gemm()(big)[260:], matrix.gemm()(big[260:]))


@pytest.mark.parametrize("ggml_type", [T.Q4_K, T.Q6_K, T.Q5_0])
def test_streams_and_one_stream_give_the_same_bits(ggml_type):
    """The per-16 product reads a thread's blocks as 3 streams (on Intel CPUs) or as one: the same
    blocks and sums in another order, so the same result. 400 rows: 13 blocks a thread."""
    weight = weight_of(ggml_type, 400, seed=2)
    kernel, lib = KQuantMatrix.from_gguf([weight]).native(), native_kernels.kquant_ops()
    x = torch.randn(2, 512).bfloat16()
    try:
        results = []
        for streams in (1, 0):
            lib.kquant_use_streams(streams)
            results.append((kernel(x[:1]), kernel(x)))
    finally:
        lib.kquant_use_streams(int(native_kernels.read_streams()))
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_streams_are_read_on_intel_cpus_unless_the_environment_decides():
    assert native_kernels.read_streams("GenuineIntel", {})
    assert not native_kernels.read_streams("AuthenticAMD", {})
    assert not native_kernels.read_streams("", {})
    assert native_kernels.read_streams("AuthenticAMD", {"FORKLM_READ_STREAMS": "1"})
    assert not native_kernels.read_streams("GenuineIntel", {"FORKLM_READ_STREAMS": "0"})


def reference_gemm(x: torch.Tensor, weight: GGUFWeight, fine: bool = False
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """What the many-row product computes, in float64: x quantized per 256 k for the K-quants,
    per 32 for the legacy types (d = max|x| / 127, xq = rint(x / d)), times the exact weight;
    and the sum of the terms' magnitudes. `fine`: each group of 32 of a super-block in the
    finest step d / 2^sh (sh <= 3) its own max |x| fits in 127 of."""
    w = torch.from_numpy(dequantize(weight.data, weight.ggml_type)).double()
    xf = x.float().view(x.shape[0], -1, 32 if weight.ggml_type in LEGACY else 256)
    amax = xf.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    step = (amax / 127.0).expand_as(xf)
    if fine:
        groups = xf.view(x.shape[0], -1, 8, 32)
        group_max = groups.abs().amax(-1, keepdim=True)
        top = amax[..., None]
        sh = torch.zeros_like(group_max)
        for _ in range(3):
            sh += (sh < 3) & (group_max * 2.0 ** (sh + 1) <= top)
        inv = (inv[..., None] * 2.0**sh).expand_as(groups).reshape(xf.shape)
        step = (step.view(groups.shape) / 2.0**sh).reshape(xf.shape)
    x_int8 = (torch.round(xf * inv).double() * step.double()).view(x.shape)
    terms = x_int8[:, None, :] * w[None]
    return terms.sum(-1), terms.abs().sum(-1)


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize(("out_features", "in_features"), [(16, 256), (40, 512), (200, 2560)])
def test_many_row_product_computes_the_int8_product(ggml_type, out_features, in_features):
    """kquant_gemm_bf16: exact integer sums per super-block (per group of 32 for the legacy
    types), fp32 scaling, one bf16 rounding, for tiles cut short, rows past a chunk of 256, k
    past a run of 2048, padded blocks."""
    weight = weight_of(ggml_type, out_features, in_features, seed=out_features,
                       realistic=False)
    matrix = KQuantMatrix.from_gguf([weight])
    gemm = matrix.gemm()
    exact = torch.from_numpy(dequantize(weight.data, ggml_type)).double()
    gen = torch.Generator().manual_seed(in_features)
    for rows in (1, 7, 8, 9, 17, 263):
        x = torch.randn(rows, in_features, generator=gen).bfloat16()
        x[:, 3] *= 50  # an outlier channel: its super-block's step grows
        x[rows // 2] = 0  # a zero row: step 0, no division by it
        y = gemm(x)
        assert y.dtype == torch.bfloat16 and y.shape == (rows, out_features)
        expected, magnitude = reference_gemm(x, weight)
        err = (y.double() - expected).abs()
        assert (err <= 2.0**-8 * expected.abs() + 2.0**-20 * magnitude).all(), rows
        assert not y[rows // 2].any()
        reference = x.double() @ exact.T
        rms = reference.pow(2).mean(-1, keepdim=True).sqrt().clamp(min=1e-9)
        assert ((y.double() - reference).abs() / rms).mean() < 4e-2, rows  # measured ~2e-2


K_TYPES = [t for t in TYPES if t not in LEGACY]


@pytest.mark.parametrize("ggml_type", K_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize(("out_features", "in_features"), [(16, 256), (200, 2560)])
@pytest.mark.parametrize("parallel", [False, True], ids=["serial", "parallel"])
def test_fine_product_computes_the_int8_product(ggml_type, out_features, in_features, parallel):
    """kquant_gemm_fine_bf16 (the K-quants' decode kernel): the many-row product's exact integer
    sums with each group of 32 of x in the finest power-of-two step under its super-block's,
    shifted into that step's units; what reference_gemm(fine=True) computes, for 1 to 17 rows,
    a zero row, groups 8 and more times below their super-block's largest |x|."""
    weight = weight_of(ggml_type, out_features, in_features, seed=out_features,
                       realistic=False)
    matrix = KQuantMatrix.from_gguf([weight])
    fine = native_kernels.kquant_matmul(int(ggml_type), matrix.records, matrix.padded_rows,
                                        out_features, in_features, 0 if parallel else 2**62,
                                        entry="kquant_gemm_fine")
    gen = torch.Generator().manual_seed(in_features)
    for rows in (1, 2, 9, 17):
        x = torch.randn(rows, in_features, generator=gen).bfloat16()
        x[:, 3] *= 50  # an outlier channel: the other groups of its super-block take finer steps
        x[:, 40:64] *= 4  # a group between: a step 2^1 or 2^2 under the super-block's
        x[rows // 2] = 0
        y = fine(x)
        assert y.dtype == torch.bfloat16 and y.shape == (rows, out_features)
        expected, magnitude = reference_gemm(x, weight, fine=True)
        err = (y.double() - expected).abs()
        assert (err <= 2.0**-8 * expected.abs() + 2.0**-20 * magnitude).all(), rows
        assert not y[rows // 2].any()


@pytest.mark.parametrize("ggml_type", K_TYPES, ids=lambda t: t.name)
def test_fine_steps_keep_the_per_16_accuracy_where_x_has_outliers(ggml_type):
    """Against the exact product, where one channel in 256 of x is 50 times the rest: the
    many-row product's one step per 256 k loses the small channels' precision (rms error 0.101
    here), the fine steps keep most of it (0.039; the per-16 kernel 0.025-0.027)."""
    weight = weight_of(ggml_type, 64, 2048, seed=3)
    matrix = KQuantMatrix.from_gguf([weight])
    exact = torch.from_numpy(dequantize(weight.data, ggml_type)).double()
    x = torch.randn(8, 2048, generator=torch.Generator().manual_seed(3)).bfloat16()
    x[:, 5::256] *= 50
    reference = x.double() @ exact.T

    def error(kernel) -> float:
        return float((kernel(x).double() - reference).pow(2).mean().sqrt())

    args = (int(ggml_type), matrix.records, matrix.padded_rows, 64, 2048, 2**62)
    per_16 = error(native_kernels.kquant_matmul(*args))
    fine = error(native_kernels.kquant_matmul(*args, entry="kquant_gemm_fine"))
    coarse = error(matrix.gemm())
    assert fine < 1.75 * per_16 and coarse > 2 * fine, (per_16, fine, coarse)


@pytest.mark.parametrize("ggml_type", LEGACY, ids=lambda t: t.name)
@pytest.mark.parametrize("in_features", [96, 896])
def test_legacy_records_take_rows_of_any_multiple_of_32(ggml_type, in_features):
    """Qwen2.5-0.5B's 896-long rows (why its Q4_K_M file holds Q5_0 and Q8_0 matrices): the
    records hold the weight exactly, dequantize it exactly, and multiply as promised."""
    weight = weight_of(ggml_type, 40, in_features, seed=in_features)
    matrix = KQuantMatrix.from_gguf([weight])
    exact = torch.from_numpy(dequantize(weight.data, ggml_type))
    assert torch.equal(matrix.rows(torch.arange(40)), exact)
    assert torch.equal(matrix.dense_t(), exact.T.bfloat16())
    x = torch.randn(9, in_features).bfloat16()
    expected, magnitude = reference_product(x, weight)
    err = (matrix.matmul(x).double() - expected).abs()
    assert (err <= 2.0**-8 * expected.abs() + 2.0**-20 * magnitude).all()
    x = torch.randn(20, in_features).bfloat16()  # the many-row product
    expected, magnitude = reference_gemm(x, weight)
    err = (matrix.matmul(x).double() - expected).abs()
    assert (err <= 2.0**-8 * expected.abs() + 2.0**-20 * magnitude).all()


def test_quantized_linear_keeps_k_quant_runs_as_records():
    """q, k, v in Q4_K, Q4_K, Q6_K and an extra Q4_1 part: two record segments and an int4 one,
    whose forward, direct() and embedding rows match the parts' own."""
    parts = [weight_of(T.Q4_K, 64, seed=1), weight_of(T.Q4_K, 32, seed=2),
             weight_of(T.Q6_K, 32, seed=3), make_weight(T.Q4_1, 16, 512, seed=4)]
    linear = QuantizedLinear.from_gguf(parts, None, torch.bfloat16, kquant_records=True)
    kinds = [type(m) for m in linear.matrices]
    assert kinds == [KQuantMatrix, KQuantMatrix, Int4Matrix]
    assert [m.out_features for m in linear.matrices] == [96, 32, 16]
    exact = torch.cat([torch.from_numpy(dequantize(p.data, p.ggml_type)) for p in parts])
    # the records exactly; the int4 segment holds Q4_1's steps and mins in bf16
    assert torch.equal(linear.dequantize()[:128], exact[:128])
    # (bf16 steps and mins: the error is relative to the block's range, not to each weight)
    torch.testing.assert_close(linear.dequantize()[128:], exact[128:], rtol=2**-8,
                               atol=2**-8 * float(exact[128:].abs().max()))
    ids = torch.tensor([[0, 95], [96, 127]])
    assert torch.equal(linear.embedding(ids).float(), exact[ids].bfloat16().float())
    x = torch.randn(5, 512).bfloat16()
    y = linear(x)
    reference = x.double() @ exact.double().T
    assert ((y.double() - reference).abs().mean() / reference.abs().mean()) < 2e-2
    # without records every run is an Int4Matrix
    plain = QuantizedLinear.from_gguf(parts, None, torch.bfloat16)
    assert all(isinstance(m, Int4Matrix) for m in plain.matrices)


def test_direct_calls_the_records_for_every_row_count():
    linear = QuantizedLinear.from_gguf([weight_of(T.Q5_K, 48, seed=5)], None, torch.bfloat16,
                                       kquant_records=True)
    direct = linear.direct()
    assert direct != linear.forward  # a plain function of x
    for rows in (1, 16, 17, 130):
        x = torch.randn(rows, 512).bfloat16()
        assert torch.equal(direct(x), linear(x))
    assert direct(torch.empty(0, 512, dtype=torch.bfloat16)).shape == (0, 48)


# The tiny Llama's tensors as a Q4_K_M-like mix: Q6_K embedding (tied head) and down
# projections, Q5_K values, Q4_K the rest.
def _k_mix(name: str, array: np.ndarray):
    if array.ndim not in (2, 3) or array.shape[-1] % 256:
        return None
    ggml_type = (T.Q6_K if name.startswith("token_embd") or "ffn_down" in name
                 else T.Q5_K if "attn_v" in name else T.Q4_K)
    rows = array.reshape(-1, array.shape[-1])  # an expert stack: each expert's rows
    return quantize(rows, ggml_type).reshape(*array.shape[:-1], -1), ggml_type


# The same model in the legacy types: Q8_0 embedding (tied head), Q5_0 attention, Q4_0 the rest
def _legacy_mix(name: str, array: np.ndarray):
    if array.ndim not in (2, 3) or array.shape[-1] % 32:
        return None
    ggml_type = (T.Q8_0 if name.startswith("token_embd") else T.Q5_0 if "attn" in name
                 else T.Q4_0)
    rows = array.reshape(-1, array.shape[-1]).astype(np.float32)
    return gguf_quantize(rows, ggml_type).reshape(*array.shape[:-1], -1), ggml_type


def _wider_moe(config) -> None:
    config.head_dim, config.moe_intermediate_size = 64, 256


# tiny_models architecture, GGUF architecture, config edit, config fields, quantizer, types the
# records must include: a plain Llama (tied head) in K-quants and in the legacy types, Phi-3's
# fused qkv and gate_up matrices (16 heads: the tiny model's rope factors are for head_dim 16),
# Qwen3-MoE's expert stacks
K_QUANT_CASES = {"llama": ("llama3", "llama", None, {}, _k_mix, {T.Q4_K, T.Q6_K}),
                 "llama-legacy": ("llama3", "llama", None, {}, _legacy_mix, set(LEGACY)),
                 "phi3": ("phi3_short", "phi3", None, {"num_attention_heads": 16}, _k_mix,
                          {T.Q4_K, T.Q6_K}),
                 "qwen3_moe": ("qwen3_moe", "qwen3moe", _wider_moe, {}, _k_mix,
                               {T.Q4_K, T.Q6_K})}


@pytest.mark.parametrize("case", list(K_QUANT_CASES))
def test_an_engine_serves_a_k_quant_gguf_from_records(case, tokenizer, tmp_path, monkeypatch):
    """A GGUF in K-quants: the engine holds every matrix as records (embedding, head, fused
    matrices and experts too), its prompt logprobs are about as near the dequantized float32
    model's as the dequantized bf16 model's are (bf16 and int8 activations, not a misplaced
    row), and a request's greedy tokens are the same alone and batched."""
    from forklm.runtime.engine.engine import Engine
    from tests.test_gguf_families import PROMPT_TEXTS, write_gguf
    from tests.tiny_models import ARCHITECTURES, build_tiny_model

    monkeypatch.setenv("FORKLM_CACHE_DIR", str(tmp_path / "cache"))
    tiny, arch, edit, fields, quantizer, kept_types = K_QUANT_CASES[case]
    model = build_tiny_model(tiny, tmp_path / "hf", tokenizer, edit=edit, hidden_size=256,
                             intermediate_size=512, **fields)
    path = str(tmp_path / "k.gguf")
    write_gguf(path, model, arch, quantizer=quantizer)
    prompts = [tokenizer.encode(text) for text in PROMPT_TEXTS]
    logprobs = {}
    for mode, dtype in (("gguf", "bfloat16"), ("none", "bfloat16"), ("none", "float32")):
        engine = Engine(model_path=path, dtype=dtype, quantization=mode, max_total_tokens=1024,
                        **ARCHITECTURES[tiny].engine_config)
        try:
            if mode == "gguf":
                records = [m for m in engine.parts.runner.model.modules()
                           if isinstance(m, KQuantMatrix)]
                # (Phi-3's fused attn_qkv has no attn_v of its own to be Q5_K)
                assert kept_types <= {m.ggml_type for m in records} <= set(TYPES)
                assert not any(isinstance(m, Int4Matrix)
                               for m in engine.parts.runner.model.modules())
                params = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
                batched = engine.generate(input_ids=prompts, sampling_params=params)
                alone = [engine.generate(input_ids=ids, sampling_params=params)
                         for ids in prompts]
                assert [o["output_ids"] for o in batched] == [o["output_ids"] for o in alone]
            res = engine.generate(input_ids=prompts[1], sampling_params={"max_new_tokens": 0},
                                  return_logprob=True, logprob_start_len=0)
            logprobs[mode, dtype] = torch.tensor(
                [lp for lp, _, _ in res["meta_info"]["input_token_logprobs"][1:]])
        finally:
            engine.shutdown()
    exact = logprobs["none", "float32"]
    records = (logprobs["gguf", "bfloat16"] - exact).abs()
    bf16 = (logprobs["none", "bfloat16"] - exact).abs()
    # measured, mean |difference| records / bf16: llama 0.090 / 0.056 (the int4 path with int8
    # activations 0.087), phi3 0.099 / 0.073, qwen3_moe 0.20 / 0.094 (an expert choice flips at
    # one position): models with sharp logits, so absolute differences are large for both
    assert records.mean() < 2.5 * bf16.mean() + 0.02, (records, bf16)


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_calls_above_16_rows_take_the_many_row_product(ggml_type):
    """Decode batches up to 16 rows take the decode kernel (native()); from GEMM_MIN_ROWS rows the
    many-row product, direct() as forward, and record layers plan no dense bf16 copy (the
    product is as fast as one or faster)."""
    from forklm.runtime.models.onednn_linear import plan_dense_copies
    from forklm.runtime.quant import kquant

    linear = QuantizedLinear.from_gguf([weight_of(ggml_type, 48, seed=9)], None,
                                       torch.bfloat16, kquant_records=True)
    matrix = linear.matrices[0]
    direct = linear.direct()
    amx = matrix.amx_gemm()
    assert (amx is not None) == native_kernels.kquant_amx_available()
    for rows in (kquant.GEMM_MIN_ROWS - 1, kquant.GEMM_MIN_ROWS, kquant.AMX_MIN_ROWS - 1,
                 kquant.AMX_MIN_ROWS, 200):
        x = torch.randn(rows, 512).bfloat16()
        kernel = (matrix.native() if rows < kquant.GEMM_MIN_ROWS
                  else amx if amx is not None and rows >= kquant.AMX_MIN_ROWS else matrix.gemm())
        assert matrix.kernel_for(rows) is kernel
        assert torch.equal(linear(x), kernel(x))
        assert torch.equal(direct(x), kernel(x))
    assert plan_dense_copies(torch.nn.Sequential(linear)) is None


def test_amx_off_by_environment_leaves_the_int8_product(monkeypatch):
    monkeypatch.setenv("FORKLM_NATIVE_AMX", "0")
    assert not native_kernels.kquant_amx_available()
    matrix = KQuantMatrix.from_gguf([weight_of(T.Q4_K, 48, seed=9)])
    assert matrix.amx_gemm() is None and matrix.kernel_for(200) is matrix.gemm()


needs_amx = pytest.mark.skipif(not native_kernels.kquant_amx_available(),
                               reason="AMX tiles do not run on this machine")


@needs_amx
@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize(("out_features", "in_features"), [(16, 256), (40, 768), (200, 1280)])
def test_amx_product_is_the_bf16_weight_product(ggml_type, out_features, in_features):
    """kquant_gemm_amx_bf16: the file's weight rounded to bf16 times x as it is, fp32 sums, one
    bf16 rounding; for blocks of a pair missing (40, 200 rows: 3 and 13 blocks), k past a run of
    512 (768, 1280), rows short of a 16-row tile, past a chunk of 512, a zero row."""
    weight = weight_of(ggml_type, out_features, in_features, seed=out_features,
                       realistic=False)
    matrix = KQuantMatrix.from_gguf([weight])
    amx = matrix.amx_gemm()
    w = torch.from_numpy(dequantize(weight.data, ggml_type)).float()
    w_bf16 = w.bfloat16().double()
    gen = torch.Generator().manual_seed(in_features)
    for rows in (1, 15, 17, 33, 530):
        x = torch.randn(rows, in_features, generator=gen).bfloat16()
        x[:, 3] *= 50  # an outlier channel costs bf16 nothing
        x[rows // 2] = 0
        y = amx(x)
        assert y.dtype == torch.bfloat16 and y.shape == (rows, out_features)
        expected = x.double() @ w_bf16.T
        magnitude = x.double().abs() @ w_bf16.abs().T
        # the output's rounding, and a weight whose fp32 value (an FMA in the kernel) rounds
        # to the neighbouring bf16
        err = (y.double() - expected).abs()
        assert (err <= 2.0**-8 * expected.abs() + 2.0**-12 * magnitude).all(), rows
        assert not y[rows // 2].any()
    x = torch.randn(530, in_features, generator=gen).bfloat16()
    assert torch.equal(amx(x)[500:], amx(x[500:]))  # a row's result is its own
    assert torch.equal(amx(x)[7:8], amx(x[7:8]))
