"""Shared by the kernel modules: the guarded Triton import and the launchers' argument checks (a
wrong shape, dtype, device or stride raises a ValueError naming the argument, instead of a crash
or silent garbage inside a kernel)."""

from __future__ import annotations

import torch

try:  # the launchers need Triton; the `_ref` twins do not
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None
    tl = None

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)


def jit(fn):
    """triton.jit where Triton is installed; else the plain function (its launcher then refuses)."""
    return fn if triton is None else triton.jit(fn)


def check_triton(op: str) -> None:
    check(triton is not None, f"{op} needs Triton; use {op}_ref without it")


def check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def check_tensor(name: str, t: torch.Tensor, shape: tuple[int | None, ...],
                 dtypes: tuple[torch.dtype, ...], device: torch.device) -> None:
    """`shape` entries of None match any size; the last dim must have stride 1 (rows may be
    strided: the kernels take the other strides as arguments)."""
    check(isinstance(t, torch.Tensor), f"{name}: expected a tensor, got {type(t).__name__}")
    check(t.dim() == len(shape), f"{name}: expected {len(shape)} dims, got shape {tuple(t.shape)}")
    for i, (got, want) in enumerate(zip(t.shape, shape)):
        check(want is None or got == want,
              f"{name}: dim {i} is {got}, expected {want} (shape {tuple(t.shape)})")
    check(t.dtype in dtypes, f"{name}: dtype {t.dtype} not in {dtypes}")
    check(t.device == device, f"{name}: on {t.device}, expected {device}")
    check(t.numel() == 0 or t.shape[-1] == 1 or t.stride(-1) == 1,
          f"{name}: last dim must be contiguous, strides {t.stride()}")


def check_index(name: str, t: torch.Tensor, size: int | None, device: torch.device) -> None:
    """A 1-D contiguous int32/int64 index vector."""
    check_tensor(name, t, (size,), INDEX_DTYPES, device)


def check_alibi(slopes: torch.Tensor | None, num_heads: int, device: torch.device) -> None:
    """ALiBi's slopes: None, or [num_heads] contiguous float32 on the kernel's device."""
    if slopes is not None:
        check_tensor("alibi_slopes", slopes, (num_heads,), (torch.float32,), device)


def next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def check_sinks(sinks: torch.Tensor | None, q: torch.Tensor) -> None:
    """sinks: None, or [num_heads] fp32 on q's device (one logit per query head)."""
    if sinks is not None:
        check_tensor("sinks", sinks, (q.shape[1],), (torch.float32,), q.device)
