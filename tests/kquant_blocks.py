"""Q4_K, Q5_K and Q6_K blocks of a float matrix, for tests and benchmarks: gguf-py dequantizes these
types but cannot quantize them. A plain round-to-nearest quantizer (llama.cpp's searches for
better scales; the format is the same), checked against gguf-py's dequantization in
tests/test_kquant.py."""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as T

QK = 256


def quantize(w: np.ndarray, ggml_type: T) -> np.ndarray:
    """uint8 [rows, in / 256 * block bytes]: the rows of float `w` [rows, in] as blocks."""
    rows, in_features = w.shape
    assert in_features % QK == 0, f"in_features {in_features} is not a multiple of {QK}"
    blocks = w.astype(np.float32).reshape(-1, QK)
    out = _q6_k(blocks) if ggml_type == T.Q6_K else _q45_k(blocks, ggml_type == T.Q5_K)
    return out.reshape(rows, -1)


def _f16_bytes(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).reshape(-1, 1).view(np.uint8)


def _q45_k(blocks: np.ndarray, five_bit: bool) -> np.ndarray:
    """w = d sc q - dmin m per group of 32, q in 0..15 (0..31), sc and m 6-bit."""
    levels = 31 if five_bit else 15
    groups = blocks.reshape(len(blocks), 8, 32)
    low = np.minimum(groups.min(-1), 0.0)  # the offset only ever lowers: m >= 0
    step = (groups.max(-1) - low) / levels
    d = (step.max(-1) / 63).astype(np.float16).astype(np.float32)
    dmin = (-low.min(-1) / 63).astype(np.float16).astype(np.float32)
    sc = np.where(d[:, None] > 0, np.rint(step / np.where(d > 0, d, 1)[:, None]), 0)
    m = np.where(dmin[:, None] > 0, np.rint(-low / np.where(dmin > 0, dmin, 1)[:, None]), 0)
    sc, m = np.clip(sc, 0, 63).astype(np.uint8), np.clip(m, 0, 63).astype(np.uint8)
    scale = d[:, None] * sc
    q = np.rint((groups + (dmin[:, None] * m)[..., None]) / np.where(scale > 0, scale, 1)[..., None])
    q = np.clip(q, 0, levels).astype(np.uint8).reshape(len(blocks), QK)
    packed = np.zeros((len(blocks), 12), np.uint8)  # get_scale_min_k4's layout
    packed[:, 0:4] = sc[:, 0:4] | (sc[:, 4:8] >> 4) << 6
    packed[:, 4:8] = m[:, 0:4] | (m[:, 4:8] >> 4) << 6
    packed[:, 8:12] = (sc[:, 4:8] & 15) | (m[:, 4:8] & 15) << 4
    quarters = q.reshape(len(blocks), 4, 2, 32)  # 64 codes each: low nibbles, then high
    qs = ((quarters[:, :, 0] & 15) | (quarters[:, :, 1] & 15) << 4).reshape(len(blocks), 128)
    parts = [_f16_bytes(d), _f16_bytes(dmin), packed]
    if five_bit:  # bit 2p of qh[l]: code 64p + l's fifth bit, bit 2p + 1: code 64p + 32 + l's
        high = quarters >> 4  # [blocks, 4, 2, 32]
        qh = np.zeros((len(blocks), 32), np.uint8)
        for p in range(4):
            qh |= (high[:, p, 0] << (2 * p)) | (high[:, p, 1] << (2 * p + 1))
        parts.append(qh)
    return np.concatenate([*parts, qs], axis=1)


def _q6_k(blocks: np.ndarray) -> np.ndarray:
    """w = d sc (q - 32) per sub-block of 16, q in 0..63, sc int8."""
    subs = blocks.reshape(len(blocks), 16, 16)
    step = np.abs(subs).max(-1) / 31
    d = (step.max(-1) / 127).astype(np.float16).astype(np.float32)
    sc = np.clip(np.rint(step / np.where(d > 0, d, 1)[:, None]), -128, 127).astype(np.int8)
    scale = d[:, None] * sc
    q = np.rint(subs / np.where(scale != 0, scale, 1)[..., None]) + 32
    q = np.clip(q, 0, 63).astype(np.uint8).reshape(len(blocks), 2, 4, 32)  # [n, quarter, l]
    ql = np.concatenate([(q[:, :, 0] & 15) | (q[:, :, 2] & 15) << 4,
                         (q[:, :, 1] & 15) | (q[:, :, 3] & 15) << 4], axis=-1)  # [n, 2, 64]
    qh = (q[:, :, 0] >> 4) | (q[:, :, 1] >> 4) << 2 | (q[:, :, 2] >> 4) << 4 | (q[:, :, 3] >> 4) << 6
    return np.concatenate([ql.reshape(len(blocks), 128), qh.reshape(len(blocks), 64),
                           sc.view(np.uint8), _f16_bytes(d)], axis=1)
