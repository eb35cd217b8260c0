"""RecordsCache: the CPU kernels' repacked weights of a GGUF (runtime/quant/kquant.py's K-quant
records, quant/linear.py's int4 packing and group scales) kept on disk beside its cached config
and tokenizer, so that later loads map them instead of repacking the file.

Repacking is the bulk of loading a GGUF: a 1B Q4_K_M's 718 MB of records took 0.4 s of two
cores and ~200,000 page faults at every start, the default model's int4 packing ~0.2 s
(benchmarks/startup.py). The first load's
engine writes them in its idle time to `records-v<FORMAT_VERSION>.bin` in the GGUF's cache
folder, with an index; a later
load maps that file copy-on-write (nothing is ever written to it) and each matrix's records are
a view of the mapping. Its pages are the kernel's page cache, which this kernel maps in 4 KiB
pages: once the engine is idle, the entries (adjacent ones joined) are copied into anonymous
2 MiB pages at the same addresses (kernels/cpu/huge_pages.py; the 1B decoded 6% faster, the
default model's layers 3%), so from then on each process holds its own copy of them, as it does
of weights it repacked.

The folder is named by the GGUF's path, size and mtime (gguf_loader._cache_dir_for), so a
changed file gets a new one. A matrix's entry is named by its tensors, type and shape, and a
checksum of its first and last page guards against a file that a crash left zero-filled or short.
Set FORKLM_RECORDS_CACHE=0 to neither read nor write it (the disk it takes is about the
GGUF's size; 1.7x for the default model, whose int4 matrices keep the packing and the VNNI
records built from it).
"""

from __future__ import annotations

import contextlib
import json
import logging
import mmap
import os
import pathlib
import shutil
import tempfile
import threading
import zlib
from collections.abc import Generator, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, BinaryIO

import torch

from forklm.kernels.cpu import huge_pages

if TYPE_CHECKING:
    from forklm.runtime.quant.gguf_formats import GGUFWeight

logger = logging.getLogger(__name__)

# Bump when the records' layout (kernels/cpu/kquant_vnni.c) or the loader's row order (the
# permuted q/k of gguf_loader) changes: an older cache is then ignored.
FORMAT_VERSION = 1
_ALIGN = 4096  # each entry starts on a page
_CHECKED_BYTES = 4096  # checksummed at each end of an entry
_FREE_MARGIN = 1 << 30  # disk left free after writing
_WRITE_CHUNK = 4 << 20  # bytes written per step of `saving`


def enabled() -> bool:
    """Whether GGUF loads read and write the cache (FORKLM_RECORDS_CACHE=0: neither)."""
    return os.environ.get("FORKLM_RECORDS_CACHE", "1") != "0"


@dataclass(frozen=True)
class RecordsOrigin:
    """Where a GGUFWeight comes from, for the cache: its file's cache and its tensor's name
    (set only on parts that are a whole tensor of the file, or its reordered rows)."""

    cache: RecordsCache
    name: str


class RecordsCache:
    """One GGUF's cached records: `get` what an earlier load wrote, `put` what this load built
    (nothing, where everything was cached), then `saving` writes a new file with both."""

    def __init__(self, folder: pathlib.Path) -> None:
        self.folder = folder
        self.index_path = folder / f"records-v{FORMAT_VERSION}.json"
        self.data_path = folder / f"records-v{FORMAT_VERSION}.bin"
        self._entries: dict[str, dict] = {}
        self._mapping: mmap.mmap | None = None
        self._built: dict[str, torch.Tensor] = {}
        self._used: set[str] = set()  # entries this load read from the file
        self._lock = threading.Lock()  # put is called from the weight builder's threads
        self._open()

    @property
    def cached(self) -> bool:
        return self._mapping is not None

    def _open(self) -> None:
        try:
            index = json.loads(self.index_path.read_text())
            with open(self.data_path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if index.get("version") != FORMAT_VERSION or index.get("bytes") != size:
                    raise ValueError(f"index of {index.get('bytes')} bytes, file {size}")
                mapping = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
        except FileNotFoundError:
            return
        except (OSError, ValueError, AttributeError) as exc:
            logger.warning("ignoring the records cache %s (%s)", self.data_path, exc)
            return
        self._entries, self._mapping = index["entries"], mapping

    def get(self, key: str, nbytes: int) -> torch.Tensor | None:
        """The cached bytes of `key` (uint8 [nbytes], a view of the mapped file), or None.
        They are queued to move into huge pages in the engine's idle time (kernels/cpu/
        huge_pages.py: decode streams them every step), as streamed_empty's are. Entries of
        any size: adjacent ones join, so a model of small matrices (the default model's are all
        under 2 MiB) moves too."""
        records = self._read(key, nbytes)
        if records is not None and self._mapping is not None:
            huge_pages.remember_file_pages(self._mapping, records.data_ptr(), nbytes)
        return records

    def _read(self, key: str, nbytes: int) -> torch.Tensor | None:
        entry = self._entries.get(key)
        if entry is None or self._mapping is None:
            return None
        offset = entry["offset"]
        if entry["bytes"] != nbytes or offset + nbytes > len(self._mapping):
            logger.warning("records cache %s: entry %s does not fit; rebuilding it",
                           self.data_path, key)
            return None
        records = torch.frombuffer(self._mapping, dtype=torch.uint8, count=nbytes, offset=offset)
        if _checksum(records) != entry["crc"]:
            logger.warning("records cache %s: entry %s is damaged; rebuilding it",
                           self.data_path, key)
            return None
        with self._lock:
            self._used.add(key)
        return records

    def put(self, key: str, built: torch.Tensor) -> None:
        """A contiguous tensor this load built, for `saving` (read back as its bytes)."""
        with self._lock:
            self._built[key] = built.view(-1).view(torch.uint8)

    @property
    def unsaved(self) -> bool:
        """Whether this load built records that `saving` would write."""
        return bool(self._built)

    def saving(self) -> Generator[int, None, None]:
        """Write what this load built, with the cached entries it read, a chunk per step
        (yielding the bytes written so far): an engine does it in its idle time, since writing
        a 1B model's 800 MB of new page cache took ~3 s. A cache without some entries, or with
        a damaged one, is written whole again; entries no longer asked for (an older layout's)
        are left out. The file is written whole under a temporary name, then renamed, and the
        index after it: a reader sees all of it or nothing, and a write cut short leaves
        nothing behind."""
        with self._lock:
            built, self._built = self._built, {}
        if not built:
            return
        for key in self._used - built.keys():
            kept = self._read(key, self._entries[key]["bytes"])
            if kept is not None:
                built[key] = kept
        layout, end = {}, 0
        for key in sorted(built):
            nbytes = built[key].numel()
            layout[key] = {"offset": end, "bytes": nbytes, "crc": _checksum(built[key])}
            end += nbytes + -nbytes % _ALIGN
        written = 0
        try:
            if shutil.disk_usage(self.folder).free < end + _FREE_MARGIN:
                logger.info("not caching the records of %s: too little free disk", self.folder)
                return
            with _replacing(self.data_path) as f:
                for key, entry in layout.items():
                    f.seek(entry["offset"])
                    data = built.pop(key).numpy().data
                    for start in range(0, len(data), _WRITE_CHUNK):
                        written += f.write(data[start:start + _WRITE_CHUNK])
                        yield written
                f.truncate(end)
            with _replacing(self.index_path) as f:
                f.write(json.dumps({"version": FORMAT_VERSION, "bytes": end,
                                    "entries": layout}).encode())
            logger.info("cached %d MB of records in %s", end >> 20, self.data_path)
        except OSError as exc:
            logger.warning("not caching the records in %s (%s)", self.folder, exc)


@contextlib.contextmanager
def _replacing(target: pathlib.Path) -> Iterator[BinaryIO]:
    """A file written under a temporary name beside `target`, renamed to it once the block
    ends; removed instead where the block raises (or the generator writing it is closed)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def entry_for(parts: list[GGUFWeight], layout: str) -> tuple[RecordsCache | None, str]:
    """The cache of `parts`' file and the name of their entry in `layout` there, where every
    part is a whole tensor of the same cached file (else None: a slice or a copy made
    elsewhere). `layout` names what is built from them and anything it depends on beyond
    the parts (the kernel dtype, the packing's block)."""
    origins = [p.origin for p in parts]
    if any(o is None for o in origins) or len({id(o.cache) for o in origins}) != 1:
        return None, ""
    first = parts[0]
    out_features = sum(p.shape[0] for p in parts)
    names = "+".join(o.name for o in origins)
    return (origins[0].cache,
            f"{layout}:{first.ggml_type.name}:{out_features}x{first.shape[1]}:{names}")


def _checksum(records: torch.Tensor) -> int:
    head, tail = records[:_CHECKED_BYTES], records[-_CHECKED_BYTES:]
    return zlib.crc32(tail.numpy().data, zlib.crc32(head.numpy().data))
