"""Families forklm knows it cannot serve, and the mechanism each one needs that it lacks: named in
the refusal, so a user reads why rather than only that. Keys are Hugging Face model_types and
GGUF architecture names."""

from __future__ import annotations

_STATE_SPACE = "state-space (recurrent) layers"
_ENCODER_DECODER = "an encoder-decoder (forklm serves decoder-only models)"
MISSING_MECHANISMS = {
    "gemma3n": "per-layer input embeddings, AltUp and layers that share another layer's KV",
    "mamba": _STATE_SPACE,
    "mamba2": _STATE_SPACE,
    "falcon_mamba": _STATE_SPACE,
    "falcon_h1": f"hybrid attention and {_STATE_SPACE}",
    "falcon-h1": f"hybrid attention and {_STATE_SPACE}",
    "jamba": f"hybrid attention and {_STATE_SPACE}",
    "rwkv": _STATE_SPACE,
    "rwkv6": _STATE_SPACE,
    "rwkv7": _STATE_SPACE,
    "recurrent_gemma": _STATE_SPACE,
    "lfm2": "short convolution layers",
    "t5": _ENCODER_DECODER,
    "t5encoder": _ENCODER_DECODER,
    "umt5": _ENCODER_DECODER,
    "bart": _ENCODER_DECODER,
    "whisper": _ENCODER_DECODER,
}


def missing_mechanism(name: str) -> str:
    """' (it needs X, which forklm does not implement)' for a known family, else ''."""
    what = MISSING_MECHANISMS.get(name)
    return f" (it needs {what}, which forklm does not implement)" if what else ""
