"""Quantized weights kept in their packed form: GGUF block formats and the linear layers that
multiply with them."""

from __future__ import annotations


def quantized_is_faster(device: str) -> bool:
    """Whether a GGUF's quantized blocks decode faster at batch 1 than dequantized weights on
    this device (measured in benchmarks/quant_speed.py; see the README)."""
    return False
