"""Buffers for weights that every decode step streams whole, moved to 2 MiB pages after the load.

A batch-1 decode step reads each weight matrix once, front to back, from DRAM. In 4 KiB pages
that is a TLB miss and a page walk every 4 KiB, and the dot products wait on them: a 1B model's
816 MB of Q4_K_M records read in sequence took 38.5 ms a token in 4 KiB pages and 33.8 ms in
2 MiB pages (2 AVX-512 cores).

Asking for them at allocation (madvise MADV_HUGEPAGE before first touch) made the load itself
slow: on these VMs a process's first huge pages fault in at ~4.5 ms each (800 MB: 1.8 s against
0.16 s in 4 KiB pages, no compaction counted; the hypervisor backs fresh memory), and where
memory is fragmented, defrag "madvise" compacts first (2.6-2.8 s measured). So the weights are
loaded in ordinary pages, 2 MiB-aligned, and each buffer is remembered here; once the engine is
idle, `collapse_weights` asks the kernel to move them into huge pages in place (MADV_COLLAPSE,
Linux 6.1+), a page per slice of its idle time (runtime/engine/idle_work.py). Where the kernel
has no MADV_COLLAPSE the buffers are marked MADV_HUGEPAGE instead, for khugepaged to collapse
them in its own time.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import math
import threading
import weakref
from collections.abc import Generator

import torch

HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14  # linux/mman.h
_MADV_COLLAPSE = 25  # linux/mman.h, Linux 6.1+
_EINVAL = 22

# Weight buffers loaded in ordinary pages and not yet collapsed: (the tensor, address, bytes).
_pending: list[tuple[weakref.ref[torch.Tensor], int, int]] = []
_pending_lock = threading.Lock()


@functools.cache
def _madvise() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        fn = ctypes.CDLL(name, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def streamed_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised contiguous CPU tensor that starts on a 2 MiB boundary, remembered for
    `collapse_weights` to move into huge pages. Below one huge page, or where there is no
    madvise (not Linux), it is plain torch.empty. Resident memory is the tensor's own: the
    allocation is one huge page larger so the tensor can start on a 2 MiB boundary, but the
    pages before it are never touched, and its last partial huge page stays in 4 KiB pages."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < HUGE_PAGE or _madvise() is None:
        return torch.empty(shape, dtype=dtype)
    raw = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)
    offset = -raw.data_ptr() % HUGE_PAGE
    buffer = raw[offset:offset + nbytes].view(dtype).view(shape)
    with _pending_lock:
        _pending.append((weakref.ref(buffer), buffer.data_ptr(), nbytes // HUGE_PAGE * HUGE_PAGE))
    return buffer


def pending_bytes() -> int:
    """Bytes of live weight buffers not yet collapsed."""
    with _pending_lock:
        return sum(n for ref, _, n in _pending if ref() is not None)


def collapse_weights() -> Generator[int, None, None]:
    """Steps that move every weight buffer streamed_empty has made so far (and that is still
    alive when its turn comes) into huge pages, one 2 MiB page per step (each yields the bytes
    moved so far), so the caller can do it in slices between other work: a concurrent reader
    of a page waits while it moves (the kernel copies it), and on these VMs a fresh huge page
    takes ~4.5 ms to fault in. Where the kernel has no MADV_COLLAPSE the buffers are marked
    MADV_HUGEPAGE for khugepaged instead; other refusals (no free memory, THP off) leave
    ordinary pages, which are as correct."""
    with _pending_lock:  # taken now: a later engine's buffers are that engine's to move
        pending = list(_pending)
        _pending.clear()
    return _collapse(pending)


def _collapse(pending: list[tuple[weakref.ref[torch.Tensor], int, int]]) -> Generator[int, None, None]:
    madvise = _madvise()
    moved = 0
    for ref, address, nbytes in pending:
        for start in range(address, address + nbytes, HUGE_PAGE):
            buffer = ref()  # held while its page moves
            if buffer is None or madvise is None:
                break
            if madvise(start, HUGE_PAGE, _MADV_COLLAPSE) == 0:
                moved += HUGE_PAGE
            elif ctypes.get_errno() == _EINVAL and start == address:  # no MADV_COLLAPSE here
                madvise(address, nbytes, _MADV_HUGEPAGE)
                break
            del buffer
            yield moved
