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

Weights mapped from a file (the records cache, runtime/quant/records_cache.py) are page cache,
which this kernel maps in 4 KiB pages and cannot collapse (no read-only THP for ext4): the 1B's
decode ran at 33.6-34.0 ms a token from the mapped cache against 31.6-31.9 in collapsed
anonymous pages. `remember_file_pages` queues such ranges too: each of their whole 2 MiB pages
is copied into an anonymous huge page that mremap then puts at the same address, so the
pointers the kernels keep stay valid. The cost is the cache's sharing between processes: each
engine then holds its own copy, as it does when it repacks the weights itself.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import math
import mmap
import threading
import weakref
from collections.abc import Generator
from typing import NamedTuple

import torch

HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14  # linux/mman.h
_MADV_COLLAPSE = 25  # linux/mman.h, Linux 6.1+
_MREMAP_MAYMOVE, _MREMAP_FIXED = 1, 2  # linux/mman.h
_EINVAL = 22
_PAGE = mmap.PAGESIZE


class _Pending(NamedTuple):
    """Weights not yet in huge pages: `address` and `nbytes` (whole 2 MiB pages of a
    streamed_empty buffer, or any range of a file mapping), what keeps them alive (a weak
    reference), and whether they are file pages to copy (else anonymous ones to collapse)."""

    owner: weakref.ref
    address: int
    nbytes: int
    file_backed: bool = False


_pending: list[_Pending] = []
_pending_lock = threading.Lock()


@functools.cache
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        return ctypes.CDLL(name, use_errno=True)
    except OSError:
        return None


@functools.cache
def _madvise() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    return _function("madvise", [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int)


def _function(name: str, argtypes: list, restype: type) -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    libc = _libc()
    fn = getattr(libc, name, None) if libc is not None else None
    if fn is None:
        return None
    fn.argtypes, fn.restype = argtypes, restype
    return fn


@functools.cache
def _page_calls() -> tuple[ctypes._CFuncPtr, ...] | None:  # type: ignore[name-defined]
    """libc's mmap, munmap and mremap, or None where one is missing (not Linux)."""
    calls = (_function("mmap", [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                                ctypes.c_int, ctypes.c_long], ctypes.c_void_p),
             _function("munmap", [ctypes.c_void_p, ctypes.c_size_t], ctypes.c_int),
             _function("mremap", [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t,
                                  ctypes.c_int, ctypes.c_void_p], ctypes.c_void_p))
    return None if None in calls else calls


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
        _pending.append(_Pending(weakref.ref(buffer), buffer.data_ptr(),
                                 nbytes // HUGE_PAGE * HUGE_PAGE))
    return buffer


def remember_file_pages(mapping: mmap.mmap, address: int, nbytes: int) -> None:
    """Queue [address, address + nbytes), weights in `mapping` (a private, copy-on-write file
    mapping that nothing writes), for `collapse_weights` to move its whole 2 MiB pages into
    anonymous huge pages, for as long as the mapping is alive."""
    with _pending_lock:
        _pending.append(_Pending(weakref.ref(mapping), address, nbytes, file_backed=True))


def pending_bytes() -> int:
    """Bytes of live weight buffers not yet collapsed."""
    with _pending_lock:
        return sum(p.nbytes for p in _pending if p.owner() is not None)


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


def _collapse(pending: list[_Pending]) -> Generator[int, None, None]:
    madvise = _madvise()
    moved = 0
    for owner, address, nbytes, file_backed in _joined(pending):
        first = address + -address % HUGE_PAGE  # the range's whole 2 MiB pages
        for start in range(first, address + nbytes - HUGE_PAGE + 1, HUGE_PAGE):
            alive = owner()  # held while its page moves
            if alive is None or madvise is None or getattr(alive, "closed", False):
                break
            if file_backed:
                with memoryview(alive):  # a mapping cannot close while a view is out
                    if not _copy_to_huge_page(start, madvise):
                        break
                moved += HUGE_PAGE
            elif madvise(start, HUGE_PAGE, _MADV_COLLAPSE) == 0:
                moved += HUGE_PAGE
            elif ctypes.get_errno() == _EINVAL and start == address:  # no MADV_COLLAPSE here
                madvise(address, nbytes, _MADV_HUGEPAGE)
                break
            del alive
            yield moved


def _joined(pending: list[_Pending]) -> list[_Pending]:
    """`pending` with the ranges of one file mapping that touch joined (a file's entries are
    page-aligned, so a page of padding may sit between them): a 2 MiB page across two
    entries moves too."""
    joined: list[_Pending] = []
    for p in sorted(pending, key=lambda p: (not p.file_backed, id(p.owner()), p.address)):
        last = joined[-1] if joined else None
        if (p.file_backed and last is not None and last.file_backed
                and last.owner() is p.owner() and p.address - (last.address + last.nbytes) < _PAGE):
            end = max(last.address + last.nbytes, p.address + p.nbytes)
            joined[-1] = last._replace(nbytes=end - last.address)
        else:
            joined.append(p)
    return joined


def _copy_to_huge_page(address: int, madvise: ctypes._CFuncPtr) -> bool:  # type: ignore[name-defined]
    """Put an anonymous huge page holding the same bytes at `address`, a 2 MiB page of a private
    file mapping: the page is filled elsewhere, then mremap moves it over the file's pages
    (readers see the same bytes before and after). False where a call is refused (no
    mremap, no huge page to be had): the file's pages then stay."""
    calls = _page_calls()
    if calls is None:
        return False
    mmap_, munmap, mremap = calls
    raw = mmap_(None, 2 * HUGE_PAGE, mmap.PROT_READ | mmap.PROT_WRITE,
                mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
    if raw is None or raw == ctypes.c_void_p(-1).value:
        return False
    page = raw + -raw % HUGE_PAGE
    moved = False
    try:
        madvise(page, HUGE_PAGE, _MADV_HUGEPAGE)
        ctypes.memmove(page, address, HUGE_PAGE)
        # 0 where the copy's faults took a huge page or the kernel could make one now
        if madvise(page, HUGE_PAGE, _MADV_COLLAPSE) == 0:
            moved = mremap(page, HUGE_PAGE, HUGE_PAGE, _MREMAP_MAYMOVE | _MREMAP_FIXED,
                           address) == address
    finally:  # the reservation's margins, and the page itself where it did not move
        moved_away = HUGE_PAGE if moved else 0  # mremap took it: no longer ours to unmap
        for start, end in ((raw, page), (page + moved_away, raw + 2 * HUGE_PAGE)):
            if end > start:
                munmap(start, end - start)
    return moved
