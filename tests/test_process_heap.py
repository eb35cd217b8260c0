"""runtime/process_heap.py: glibc's malloc set for serving, and left alone where it must be.

What the settings do is checked in fresh interpreters (one thread, nothing allocated by other
threads yet), as `forklm serve` starts: a 64 MiB allocation comes from the heap rather than its
own mapping, and a second thread allocates from the main heap rather than an arena of its own."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

from forklm.runtime.process_heap import tune_heap

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc only")

# Prints {"tuned": ..., "mapped_blocks": ..., "thread_on_main_heap": ...} after an optional
# tune_heap(): mapped_blocks is how many more allocations mallinfo2 counts in their own mappings
# while a 64 MiB block is held; the thread's 1 MiB block lies on the main heap when it sits
# below the program break.
_PROBE = r"""
import ctypes, json, sys, threading
from forklm.runtime.process_heap import tune_heap

tuned = tune_heap() if sys.argv[1] == "tune" else None
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.sbrk.restype, libc.sbrk.argtypes = ctypes.c_void_p, [ctypes.c_ssize_t]

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]

libc.mallinfo2.restype = MallInfo2
before = libc.mallinfo2().hblks
big = libc.malloc(64 << 20)
mapped = libc.mallinfo2().hblks - before
libc.free(big)
held = {}
def allocate():
    held["ptr"] = libc.malloc(1 << 20)
thread = threading.Thread(target=allocate)
thread.start()
thread.join()
on_main = held["ptr"] < libc.sbrk(0)
libc.free(held["ptr"])
print(json.dumps({"tuned": tuned, "mapped_blocks": mapped, "thread_on_main_heap": on_main}))
"""


def _probe(mode: str, env: dict[str, str] | None = None) -> dict:
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith("MALLOC_") and k != "FORKLM_HEAP_TUNING"}
    done = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True,
                          env={**clean, **(env or {})}, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_serving_settings_keep_large_blocks_and_threads_on_the_main_heap():
    untouched = _probe("plain")
    assert untouched == {"tuned": None, "mapped_blocks": 1, "thread_on_main_heap": False}
    assert _probe("tune") == {"tuned": True, "mapped_blocks": 0, "thread_on_main_heap": True}


def test_the_users_malloc_settings_and_the_switch_are_left_alone():
    assert _probe("tune", {"MALLOC_ARENA_MAX": "4"})["tuned"] is False
    off = _probe("tune", {"FORKLM_HEAP_TUNING": "0"})
    assert off == {"tuned": False, "mapped_blocks": 1, "thread_on_main_heap": False}
    # in this process too: both return before anything is set
    assert tune_heap({"MALLOC_TOP_PAD_": "0"}) is False
    assert tune_heap({"FORKLM_HEAP_TUNING": "0"}) is False


_LATE = r"""
import threading, time
from forklm.runtime.process_heap import tune_heap
stop = threading.Event()
threading.Thread(target=stop.wait, daemon=True).start()
print(tune_heap())
stop.set()
"""


def test_too_late_once_a_second_thread_exists():
    """glibc fixes its arena limit when a second thread first allocates: not set after that."""
    done = subprocess.run([sys.executable, "-c", _LATE], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"
