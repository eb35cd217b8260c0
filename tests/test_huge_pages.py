"""streamed_empty: weight buffers that start on a 2 MiB boundary and are marked for transparent
huge pages before first touch (kernels/cpu/huge_pages.py)."""

from __future__ import annotations

import pathlib

import pytest
import torch

from forklm.kernels.cpu.huge_pages import HUGE_PAGE, streamed_empty

THP = pathlib.Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _vm_flags(address: int) -> list[str]:
    """VmFlags of this process' mapping that holds `address`."""
    inside = False
    for line in pathlib.Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside and line.startswith("VmFlags:"):
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.parametrize("shape,dtype", [((3 * HUGE_PAGE + 100,), torch.uint8),
                                          ((640, 2048, 3), torch.bfloat16)])
def test_large_buffers_start_on_a_huge_page_and_keep_their_shape(shape, dtype) -> None:
    t = streamed_empty(shape, dtype)
    assert t.shape == shape and t.dtype == dtype and t.is_contiguous()
    assert t.data_ptr() % HUGE_PAGE == 0
    t.fill_(1)  # every byte is the tensor's to write
    assert int(t.sum()) == t.numel()


@pytest.mark.skipif(not THP.exists() or "[never]" in THP.read_text(),
                    reason="this kernel has no transparent huge pages to ask for")
def test_large_buffers_are_marked_for_huge_pages() -> None:
    t = streamed_empty((4 * HUGE_PAGE,), torch.uint8)
    assert "hg" in _vm_flags(t.data_ptr())  # MADV_HUGEPAGE took


def test_small_buffers_are_plain() -> None:
    t = streamed_empty((1000, 10), torch.float32)
    assert t.shape == (1000, 10) and t.untyped_storage().nbytes() == 40000

