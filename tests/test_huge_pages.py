"""streamed_empty: weight buffers that start on a 2 MiB boundary, loaded in ordinary pages and
moved into transparent huge pages afterwards, a page per step (kernels/cpu/huge_pages.py)."""

from __future__ import annotations

import ctypes
import os
import pathlib

import pytest
import torch

from forklm.kernels.cpu import huge_pages
from forklm.kernels.cpu.huge_pages import HUGE_PAGE, collapse_weights, streamed_empty

THP = pathlib.Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _collapse_supported() -> bool:
    release = tuple(int(x) for x in os.uname().release.split(".")[:2])
    return THP.exists() and "[never]" not in THP.read_text() and release >= (6, 1)


@pytest.mark.parametrize("shape,dtype", [((3 * HUGE_PAGE + 100,), torch.uint8),
                                          ((640, 2048, 3), torch.bfloat16)])
def test_large_buffers_start_on_a_huge_page_and_keep_their_shape(shape, dtype) -> None:
    t = streamed_empty(shape, dtype)
    assert t.shape == shape and t.dtype == dtype and t.is_contiguous()
    assert t.data_ptr() % HUGE_PAGE == 0
    t.fill_(1)  # every byte is the tensor's to write
    assert int(t.sum()) == t.numel()


class MadviseSpy:
    """madvise, the real one or a stand-in, with the calls it got inside one buffer's range
    (collapse_weights also moves what the other tests' models left pending)."""

    def __init__(self, monkeypatch, madvise) -> None:
        self.madvise, self.calls, self.watched = madvise, [], range(0)
        monkeypatch.setattr(huge_pages, "_madvise", lambda: self)

    def watch(self, t: torch.Tensor) -> None:
        self.watched = range(t.data_ptr(), t.data_ptr() + t.numel() * t.itemsize)

    def __call__(self, address: int, nbytes: int, advice: int) -> int:
        result = self.madvise(address, nbytes, advice)
        if address in self.watched:
            self.calls.append((address - self.watched.start, nbytes, advice, result))
        return result


@pytest.mark.skipif(not _collapse_supported(),
                    reason="no transparent huge pages or no MADV_COLLAPSE (Linux < 6.1)")
def test_live_buffers_move_into_huge_pages_a_page_per_step(monkeypatch) -> None:
    spy = MadviseSpy(monkeypatch, huge_pages._madvise())
    t = streamed_empty((4 * HUGE_PAGE + 100,), torch.uint8)
    spy.watch(t)
    t.fill_(3)
    dead = streamed_empty((2 * HUGE_PAGE,), torch.uint8)
    del dead  # gone before its turn: skipped
    assert spy.calls == []  # ordinary pages until moved
    moved = list(collapse_weights())
    assert all(0 <= b - a <= HUGE_PAGE for a, b in zip([0, *moved], moved))  # a page a step
    # each whole 2 MiB page of the buffer moved (the kernel said yes), its last partial one not
    assert spy.calls == [(i * HUGE_PAGE, HUGE_PAGE, huge_pages._MADV_COLLAPSE, 0)
                         for i in range(4)]
    assert moved[-1] >= 4 * HUGE_PAGE
    assert int(t.sum()) == 3 * t.numel()  # the same bytes
    assert not list(collapse_weights())  # each buffer is moved once


def test_without_madv_collapse_buffers_are_marked_for_khugepaged(monkeypatch) -> None:
    def madvise(address: int, nbytes: int, advice: int) -> int:
        if advice == huge_pages._MADV_COLLAPSE:  # as a kernel before 6.1 answers
            ctypes.set_errno(huge_pages._EINVAL)
            return -1
        return 0

    spy = MadviseSpy(monkeypatch, madvise)
    t = streamed_empty((3 * HUGE_PAGE,), torch.uint8)
    spy.watch(t)
    assert list(collapse_weights()) == []
    assert spy.calls == [(0, HUGE_PAGE, huge_pages._MADV_COLLAPSE, -1),
                         (0, 3 * HUGE_PAGE, huge_pages._MADV_HUGEPAGE, 0)]


def test_small_buffers_are_plain() -> None:
    pending = len(huge_pages._pending)
    t = streamed_empty((1000, 10), torch.float32)
    assert t.shape == (1000, 10) and t.untyped_storage().nbytes() == 40000
    assert len(huge_pages._pending) == pending  # nothing to move
