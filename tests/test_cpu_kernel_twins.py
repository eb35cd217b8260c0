"""Every C kernel names its torch twin (kernels/cpu/bindings.py TORCH_TWINS): each entry point
the C sources export has one, and each named twin exists. The comparisons themselves are in the
kernels' own tests (test_native_attention, test_fused_layers, test_int4_gemv, test_sampling)."""

from __future__ import annotations

import pkgutil
import re
from pathlib import Path

from forklm.kernels.cpu import bindings

# Entry points that answer a question about the build, or set how a kernel reads its weights,
# instead of computing a tensor.
QUERY = re.compile(r"_(threads|supports|available|repack|use_streams)$|^fused_max_head_dim$")
EXPORTED = re.compile(r"^(?:__attribute__\S*\s+)?(?:int|void|int64_t)\s+(\w+)\(", re.M)


def _exported_entry_points() -> set[str]:
    names: set[str] = set()
    for source in Path(bindings.__file__).parent.glob("*.c"):
        names |= set(EXPORTED.findall(source.read_text()))
    return {name for name in names if not QUERY.search(name)}


def test_every_exported_kernel_names_a_torch_twin() -> None:
    exported = _exported_entry_points()
    assert "paged_attention" in exported and "greedy_pick" in exported  # the scan finds them
    assert exported == set(bindings.TORCH_TWINS)


def test_every_named_twin_exists() -> None:
    for kernel, twin in bindings.TORCH_TWINS.items():
        assert callable(pkgutil.resolve_name(twin)), f"{kernel}: {twin}"
