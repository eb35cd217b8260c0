"""glibc's malloc set for a process that serves: one heap, no mmap per allocation.

Every prefill step allocates and frees activations of tens of MB (a 1B model's gate and up
projections for a 1024-token chunk: [1024, 16384] bf16, 32 MB). By default glibc serves an
allocation of 32 MB or more by a fresh mmap, and each thread but the main one from its own arena,
whose 64 MB heaps are unmapped again once they empty. Either way the next step's tensors are new
pages: the kernel faults them in (and zeroes them) one 4 KiB page at a time while the matmul that
writes them waits. On the 1B, 32 prompts of 400 tokens: 5.4M page faults and 38.4 s; with one
arena and no mmaps, 0.33M faults and 32.3 s (benchmarks/NOTES.md, session 33).

So the commands that serve (`forklm serve`, `run`, `generate`) call `tune_heap` first thing:
one arena (the main heap, which grows in place), no mmaps, the heap's top handed back only past
1 GiB free and grown 64 MiB at a time. Memory freed stays with the process, up to the heap's
peak, as with jemalloc or tcmalloc; an engine holds its peak for its lifetime anyway.

glibc fixes how many arenas it makes when a second thread first allocates, so this is done
only while the process has one thread; it is left alone where the user set any MALLOC_* variable
(their choice), where FORKLM_HEAP_TUNING=0, or where the C library is not glibc.
"""

from __future__ import annotations

import ctypes
import os
import platform
from collections.abc import Mapping

# mallopt's parameters (glibc's malloc.h)
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_MAX, M_ARENA_MAX = -1, -2, -4, -8

SERVING_SETTINGS = {
    M_ARENA_MAX: 1,  # every thread on the main heap, which grows in place
    M_MMAP_MAX: 0,  # no allocation gets its own mapping
    M_TRIM_THRESHOLD: 1 << 30,  # the top handed back only past 1 GiB free
    M_TOP_PAD: 64 << 20,  # and grown 64 MiB at a time
}


def tune_heap(environ: Mapping[str, str] = os.environ) -> bool:
    """Set SERVING_SETTINGS where they can apply (see above); True when they were set."""
    if environ.get("FORKLM_HEAP_TUNING") == "0" or any(k.startswith("MALLOC_") for k in environ):
        return False
    if platform.libc_ver()[0] != "glibc" or _threads() != 1:
        return False
    mallopt = ctypes.CDLL(None).mallopt
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return all([mallopt(param, value) == 1 for param, value in SERVING_SETTINGS.items()])


def _threads() -> int:
    """The process's threads, native ones included (0 where /proc cannot say)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 0
