"""Quantized weights kept in their packed form: GGUF block formats (gguf_formats.py) and the
linear layer that multiplies with them through torch's int4 CPU kernel (linear.py)."""

from __future__ import annotations

from forklm.runtime.config import cpu_flags


def quantized_is_faster(device: str) -> bool:
    """Whether a GGUF's quantized blocks decode faster at batch 1 than dequantized float32
    weights here. Measured (benchmarks/gguf_decode.py, benchmarks/RESULTS.md): on an AVX-512 CPU
    the default model decodes 1.12x faster at batch 1 and 1.26x at batch 16 quantized; on an
    AVX2-only CPU torch's int4 kernel measured slower than fp32 (session 3), and the kernel is
    CPU-only, so everywhere else the weights are dequantized."""
    return device == "cpu" and "avx512f" in cpu_flags()
