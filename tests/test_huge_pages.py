"""streamed_empty: weight buffers that start on a 2 MiB boundary, loaded in ordinary pages and
moved into transparent huge pages afterwards, a page per step (kernels/cpu/huge_pages.py)."""

from __future__ import annotations

import contextlib
import ctypes
import mmap
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


def _anon_huge_bytes(lo: int, hi: int) -> int:
    """AnonHugePages of this process's mappings that lie inside [lo, hi)."""
    total, inside = 0, False
    for line in pathlib.Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:  # a mapping's first line: start-end perms ...
            start, end = (int(x, 16) for x in head.split("-"))
            inside = lo <= start and end <= hi
        elif inside and head == "AnonHugePages:":
            total += int(line.split()[1]) << 10
    return total


@pytest.fixture
def mapped_file(tmp_path):
    """A private copy-on-write mapping of a 7.5 MiB file of random bytes, and those bytes."""
    data = torch.randint(0, 256, (15 * HUGE_PAGE // 2,), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(0))
    path = tmp_path / "records.bin"
    path.write_bytes(data.numpy().tobytes())
    with open(path, "rb") as f:
        mapping = mmap.mmap(f.fileno(), data.numel(), access=mmap.ACCESS_COPY)
    yield mapping, data
    with contextlib.suppress(BufferError):  # a view a failed test left
        mapping.close()


@pytest.mark.skipif(not _collapse_supported(),
                    reason="no transparent huge pages or no MADV_COLLAPSE (Linux < 6.1)")
def test_mapped_weights_move_into_anonymous_huge_pages_at_the_same_address(mapped_file) -> None:
    mapping, data = mapped_file
    view = torch.frombuffer(mapping, dtype=torch.uint8)
    base = view.data_ptr()
    # two entries with padding between them (the second starts on a page): their whole 2 MiB
    # pages move, the one they share included, and nothing outside them
    lo, hi = 5 * 4096, len(mapping) - 3 * 4096
    cut = 2 * HUGE_PAGE + 10 * 4096 - base % HUGE_PAGE
    huge_pages.remember_file_pages(mapping, base + lo, cut - 100 - lo)
    huge_pages.remember_file_pages(mapping, base + cut, hi - cut)
    pages = [a for a in range(base + lo + -(base + lo) % HUGE_PAGE, base + hi, HUGE_PAGE)
             if a + HUGE_PAGE <= base + hi]
    assert len(pages) >= 2 and _anon_huge_bytes(base, base + len(mapping)) == 0
    moved = list(collapse_weights())
    assert moved[-1] == len(pages) * HUGE_PAGE
    assert _anon_huge_bytes(base, base + len(mapping)) == len(pages) * HUGE_PAGE
    assert view.data_ptr() == base and torch.equal(view, data)  # the same bytes in place
    assert not list(collapse_weights())


def test_mapped_weights_stay_where_the_page_calls_are_refused(monkeypatch, mapped_file) -> None:
    mapping, data = mapped_file
    view = torch.frombuffer(mapping, dtype=torch.uint8)
    monkeypatch.setattr(huge_pages, "_page_calls", lambda: None)  # no mremap here
    huge_pages.remember_file_pages(mapping, view.data_ptr(), len(mapping))
    assert list(collapse_weights()) == []
    assert torch.equal(view, data)


def test_a_mapping_closed_or_gone_before_its_turn_is_skipped(mapped_file, tmp_path) -> None:
    mapping, _ = mapped_file
    address = torch.frombuffer(mapping, dtype=torch.uint8).data_ptr()  # its view is gone
    huge_pages.remember_file_pages(mapping, address, len(mapping))
    mapping.close()  # the range is unmapped: moving it would read unmapped memory
    with open(tmp_path / "records.bin", "rb") as f:
        gone = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    huge_pages.remember_file_pages(gone, torch.frombuffer(gone, dtype=torch.uint8).data_ptr(),
                                   len(gone))
    del gone
    assert list(collapse_weights()) == []
