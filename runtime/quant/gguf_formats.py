"""GGUF block formats decoded into integer codes and per-group scales/offsets, vectorised over all
blocks: w = scale * code + offset per group, equal to `gguf.quants.dequantize` bit for bit."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gguf_quants  # the codebooks of the IQ4 and MXFP4 formats

if TYPE_CHECKING:
    from forklm.runtime.quant.records_cache import RecordsOrigin

QK_K = 256  # elements in a K-quant super-block


@dataclass(frozen=True)
class GGUFWeight:
    """One quantized GGUF matrix as stored in the file."""

    data: np.ndarray  # uint8 [out_rows, row_bytes], as gguf.GGUFReader's tensor.data gives it
    ggml_type: GGMLQuantizationType
    shape: tuple[int, int]  # (out_features, in_features)
    # Called once the blocks are converted: lets go of a memory-mapped file's pages (their
    # data stay readable; see gguf_file.GGUFFile.release)
    release: Callable[[], None] | None = field(default=None, compare=False, repr=False)
    # release_rows(first, count): the same for rows [first, first + count) only, where the
    # matrix is a whole tensor of the file (a converter then lets go of it as it goes)
    release_rows: Callable[[int, int], None] | None = field(default=None, compare=False,
                                                            repr=False)
    # The file's cache and this tensor's name, where the part is a whole tensor of a GGUF (or
    # its reordered rows): what the CPU kernels repack from it is cached on disk
    # (records_cache.py)
    origin: RecordsOrigin | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        block_size, type_size = GGML_QUANT_SIZES[self.ggml_type]
        out_features, in_features = self.shape
        assert in_features % block_size == 0, f"in_features {in_features} not a multiple of {block_size}"
        row_bytes = in_features // block_size * type_size
        assert self.data.dtype == np.uint8 and self.data.shape == (out_features, row_bytes), (
            f"{self.ggml_type.name} {self.shape}: data {self.data.dtype} {self.data.shape}, "
            f"expected uint8 {(out_features, row_bytes)}")

    @classmethod
    def from_tensor(cls, tensor) -> GGUFWeight:
        """From a `gguf.ReaderTensor` (whose `shape` lists the innermost dimension first)."""
        in_features, out_features = (int(n) for n in tensor.shape)
        return cls(np.asarray(tensor.data), tensor.tensor_type, (out_features, in_features))

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)


class GroupCodes(NamedTuple):
    """w[n, g*group_size + i] = scales[n, g] * codes[n, g*group_size + i] + offsets[n, g]."""

    codes: torch.Tensor  # int8 [out, in]
    scales: torch.Tensor  # float32 [out, in // group_size]
    offsets: torch.Tensor | None  # float32 [out, in // group_size]; None = 0
    group_size: int

    def dequantize(self) -> torch.Tensor:
        """The float32 [out, in] weight (same operation order as gguf, so bit-identical)."""
        out, in_features = self.codes.shape
        groups = self.codes.view(out, -1, self.group_size).float() * self.scales[..., None]
        if self.offsets is not None:
            groups = groups + self.offsets[..., None]
        return groups.view(out, in_features)


def decode(weight: GGUFWeight) -> GroupCodes:
    """Integer codes and fp32 group scales/offsets of a matrix of a SUPPORTED_TYPES format."""
    if weight.ggml_type not in _DECODERS:
        raise NotImplementedError(f"no decoder for GGUF type {weight.ggml_type.name}")
    _, type_size = GGML_QUANT_SIZES[weight.ggml_type]
    out_features = weight.shape[0]
    blocks = weight.data.reshape(out_features, -1, type_size)  # [out, num_blocks, type_size]
    codes, scales, offsets, group_size = _DECODERS[weight.ggml_type](blocks)
    return GroupCodes(
        torch.from_numpy(np.ascontiguousarray(codes).reshape(out_features, -1)),
        torch.from_numpy(np.ascontiguousarray(scales, dtype=np.float32).reshape(out_features, -1)),
        None if offsets is None else torch.from_numpy(
            np.ascontiguousarray(offsets, dtype=np.float32).reshape(out_features, -1)),
        group_size,
    )


_Decoded = tuple[np.ndarray, np.ndarray, "np.ndarray | None", int]


def _f16(raw: np.ndarray) -> np.ndarray:
    """Little-endian fp16 bytes [..., 2] -> float32 [...]."""
    return raw.copy().view(np.float16)[..., 0].astype(np.float32)


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """[..., n] bytes -> [..., 2n] codes: all low nibbles first, then all high nibbles."""
    return np.concatenate([packed & 0x0F, packed >> 4], axis=-1)


def _decode_q8_0(blocks: np.ndarray) -> _Decoded:
    # block: fp16 d, 32 x int8 q; w = d * q
    return blocks[..., 2:].view(np.int8), _f16(blocks[..., :2]), None, 32


def _decode_q4_0(blocks: np.ndarray) -> _Decoded:
    # block: fp16 d, 16 bytes of nibbles; w = d * (q - 8)
    codes = (_nibbles(blocks[..., 2:]).astype(np.int8) - 8).astype(np.int8)
    return codes, _f16(blocks[..., :2]), None, 32


def _decode_q4_1(blocks: np.ndarray) -> _Decoded:
    # block: fp16 d, fp16 m, 16 bytes of nibbles; w = d * q + m
    codes = _nibbles(blocks[..., 4:]).astype(np.int8)
    return codes, _f16(blocks[..., :2]), _f16(blocks[..., 2:4]), 32


def _q4_k_scale_min(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """12 bytes -> eight 6-bit scales and eight 6-bit mins ([..., 8] each)."""
    lo, hi, mixed = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    # sub-blocks 0-3 sit in the low 6 bits of bytes 0-7; 4-7 take 4 bits from bytes 8-11 and
    # their top 2 bits from the spare top bits of bytes 0-7.
    scale = np.concatenate([lo & 0x3F, (mixed & 0x0F) | ((lo >> 6) << 4)], axis=-1)
    minimum = np.concatenate([hi & 0x3F, (mixed >> 4) | ((hi >> 6) << 4)], axis=-1)
    return scale, minimum


def _decode_q4_k(blocks: np.ndarray) -> _Decoded:
    # super-block: fp16 d, fp16 dmin, 12 bytes of scales/mins, 128 bytes of nibbles (4 chunks
    # of 32 bytes: low nibbles are sub-block 2c, high nibbles 2c+1); w = d*sc*q - dmin*m
    d, dmin = _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])  # [out, nb]
    scale, minimum = _q4_k_scale_min(blocks[..., 4:16])  # [out, nb, 8]
    qs = blocks[..., 16:].reshape(*blocks.shape[:-1], 4, 1, 32)
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-2).astype(np.int8)  # [out, nb, 4, 2, 32]
    scales = d[..., None] * scale.astype(np.float32)  # [out, nb, 8]
    offsets = -(dmin[..., None] * minimum.astype(np.float32))
    return codes, scales, offsets, 32


def _decode_q6_k(blocks: np.ndarray) -> _Decoded:
    # super-block: 128 bytes low nibbles, 64 bytes 2-bit highs, 16 int8 scales, fp16 d.
    # Each half of 128 values: ql bytes [64], qh bytes [32]; value t*32 + l (t = 0..3) takes
    # nibble t // 2 of ql[(t % 2) * 32 + l] and bits 2t..2t+1 of qh[l]; w = d * sc * (q - 32)
    lead = blocks.shape[:-1]
    ql = blocks[..., :128].reshape(*lead, 2, 1, 64)
    low = np.concatenate([ql & 0x0F, ql >> 4], axis=-2).reshape(*lead, 2, 4, 32)
    qh = blocks[..., 128:192].reshape(*lead, 2, 1, 32)
    high = (qh >> np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]) & 0x03  # [.., 2, 4, 32]
    codes = ((low | (high << 4)).astype(np.int16) - 32).astype(np.int8)
    scales = _f16(blocks[..., 208:210])[..., None] * blocks[..., 192:208].view(np.int8)
    return codes, scales, None, 16


def _decode_q3_k(blocks: np.ndarray) -> _Decoded:
    # super-block: 32 bytes of third bits (hmask), 64 bytes of 2-bit lows, 12 bytes of sixteen
    # 6-bit scales (low nibbles in bytes 0-7, two high bits each in bytes 8-11), fp16 d;
    # w = d * (sc - 32) * (low - 4 * (1 - high)), in sub-blocks of 16
    lead = blocks.shape[:-1]
    packed = blocks[..., 96:108]
    low_bits = (packed[..., None, 0:8] >> np.array([[0], [4]], dtype=np.uint8)) & 0x0F
    high_bits = (packed[..., None, 8:12] >> np.array([[0], [2], [4], [6]], dtype=np.uint8)) & 3
    sc = (low_bits.reshape(*lead, 16) | (high_bits.reshape(*lead, 16) << 4)).astype(np.int8) - 32
    scales = _f16(blocks[..., 108:110])[..., None] * sc.astype(np.float32)  # [out, nb, 16]
    shifts = np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]
    low = (blocks[..., 32:96].reshape(*lead, 2, 1, 32) >> shifts) & 3  # [out, nb, 2, 4, 32]
    high = (blocks[..., None, 0:32] >> np.arange(8, dtype=np.uint8)[:, None]) & 1  # [.., 8, 32]
    codes = low.reshape(*lead, 16, 16).astype(np.int8) - (
        ((high.reshape(*lead, 16, 16) ^ 1) << 2).astype(np.int8))
    return codes, scales, None, 16


def _five_bit(qh: np.ndarray, qs: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1 codes 0..31 of a block of 32: nibbles as Q4's, and bit i of the little-endian
    32-bit qh the fifth bit of value i."""
    return _nibbles(qs) | (np.unpackbits(qh, axis=-1, bitorder="little") << 4)


def _decode_q5_0(blocks: np.ndarray) -> _Decoded:
    # block: fp16 d, 4 bytes of fifth bits, 16 bytes of nibbles; w = d * (q - 16)
    codes = (_five_bit(blocks[..., 2:6], blocks[..., 6:]).astype(np.int8) - 16).astype(np.int8)
    return codes, _f16(blocks[..., :2]), None, 32


def _decode_q5_1(blocks: np.ndarray) -> _Decoded:
    # block: fp16 d, fp16 m, 4 bytes of fifth bits, 16 bytes of nibbles; w = d * q + m
    codes = _five_bit(blocks[..., 4:8], blocks[..., 8:]).astype(np.int8)
    return codes, _f16(blocks[..., :2]), _f16(blocks[..., 2:4]), 32


def _decode_q5_k(blocks: np.ndarray) -> _Decoded:
    # super-block: Q4_K's d, dmin and 12 bytes of scales/mins, 32 bytes of fifth bits (bit s of
    # byte l: value l of sub-block s), 128 bytes of nibbles laid out as Q4_K's
    d, dmin = _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])
    scale, minimum = _q4_k_scale_min(blocks[..., 4:16])
    qs = blocks[..., 48:].reshape(*blocks.shape[:-1], 4, 1, 32)
    low = np.concatenate([qs & 0x0F, qs >> 4], axis=-2)  # [out, nb, 4, 2, 32]
    fifth = (blocks[..., 16:48, None] >> np.arange(8, dtype=np.uint8)) & 1  # [out, nb, 32, 8]
    high = np.moveaxis(fifth, -1, -2).reshape(low.shape)
    codes = (low | (high << 4)).astype(np.int8)
    scales = d[..., None] * scale.astype(np.float32)
    offsets = -(dmin[..., None] * minimum.astype(np.float32))
    return codes, scales, offsets, 32


def _codebook(nibbles: np.ndarray, values: tuple[int, ...]) -> np.ndarray:
    return np.asarray(values, dtype=np.int8)[nibbles]


def _decode_iq4_nl(blocks: np.ndarray) -> _Decoded:
    # block: fp16 d, 16 bytes of nibbles indexing a non-linear int8 codebook; w = d * value
    codes = _codebook(_nibbles(blocks[..., 2:]), gguf_quants.IQ4_NL.kvalues)
    return codes, _f16(blocks[..., :2]), None, 32


def _decode_iq4_xs(blocks: np.ndarray) -> _Decoded:
    # super-block: fp16 d, 2 + 4 bytes of 6-bit sub-block scales (low nibbles in bytes 4-7, two
    # high bits each in the uint16 at 2-3), 8 x 16 bytes of IQ4_NL nibbles; w = d * (ls - 32) * v
    lead = blocks.shape[:-1]
    low_bits = np.stack([blocks[..., 4:8] & 0x0F, blocks[..., 4:8] >> 4], -1).reshape(*lead, 8)
    high_word = blocks[..., 2:4].copy().view(np.uint16)  # [out, nb, 1]
    high_bits = (high_word >> np.arange(0, 16, 2, dtype=np.uint16)) & 3  # [out, nb, 8]
    ls = (low_bits | (high_bits.astype(np.uint8) << 4)).astype(np.int8) - np.int8(32)
    scales = _f16(blocks[..., :2])[..., None] * ls.astype(np.float32)
    qs = blocks[..., 8:].reshape(*lead, 8, 16)
    codes = _codebook(_nibbles(qs), gguf_quants.IQ4_NL.kvalues)  # [out, nb, 8, 32]
    return codes, scales, None, 32


def _decode_mxfp4(blocks: np.ndarray) -> _Decoded:
    # block: an E8M0 exponent byte, 16 bytes of nibbles indexing FP4 (E2M1) values doubled to
    # integers; w = 2**(e - 128) * value
    scales = gguf_quants.MXFP4.e8m0_to_fp32_half(blocks[..., 0])
    return _codebook(_nibbles(blocks[..., 1:]), gguf_quants.MXFP4.kvalues), scales, None, 32


_DECODERS = {
    GGMLQuantizationType.Q8_0: _decode_q8_0,
    GGMLQuantizationType.Q4_0: _decode_q4_0,
    GGMLQuantizationType.Q4_1: _decode_q4_1,
    GGMLQuantizationType.Q4_K: _decode_q4_k,
    GGMLQuantizationType.Q6_K: _decode_q6_k,
    GGMLQuantizationType.Q3_K: _decode_q3_k,
    GGMLQuantizationType.Q5_0: _decode_q5_0,
    GGMLQuantizationType.Q5_1: _decode_q5_1,
    GGMLQuantizationType.Q5_K: _decode_q5_k,
    GGMLQuantizationType.IQ4_NL: _decode_iq4_nl,
    GGMLQuantizationType.IQ4_XS: _decode_iq4_xs,
    GGMLQuantizationType.MXFP4: _decode_mxfp4,
}
SUPPORTED_TYPES = frozenset(_DECODERS)
