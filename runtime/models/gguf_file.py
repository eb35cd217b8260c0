"""A GGUF file's metadata and tensor index, read in one pass over its header; tensor data stay in
the memory-mapped file. gguf-py's GGUFReader builds a numpy view per array element, which takes
~10 s for a 128k-token vocabulary (three arrays of that length) on every load; this reads the
same header in a fraction of a second. Tensors come as gguf-py's reader gives them (`data` typed
for float formats, uint8 rows of blocks for the quantized ones), so gguf-py's dequantize and
runtime/quant read them unchanged."""

from __future__ import annotations

import mmap
import pathlib
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32
# GGUF metadata value types -> struct format of one scalar (8: string, 9: array)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
            11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_LENGTH = struct.Struct("<Q")  # a string's byte length
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32,
          6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
# Unquantized tensor types and their element dtype (the others are rows of blocks, as uint8).
_TENSOR_DTYPES = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
                  GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
                  GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
                  GGMLQuantizationType.I64: np.int64}


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF's order: the fastest-varying dimension first
    data: np.ndarray  # read-only view of the mapped file, in numpy's (reversed) dimension order
    offset: int  # where data starts in the file


class GGUFFile:
    """`fields`: metadata key -> value (int, float, bool, str, or a list / numpy array for
    arrays); `tensors`: the tensor index in file order. Raises ValueError for a file that is not
    a well-formed GGUF (version 2 or 3)."""

    def __init__(self, path: str | pathlib.Path):
        self.path = pathlib.Path(path)
        with open(self.path, "rb") as f:
            self._mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._map = np.frombuffer(self._mmap, dtype=np.uint8)
        self._buf = memoryview(self._mmap)
        self._pos = len(_MAGIC)
        if bytes(self._buf[:4]) != _MAGIC:
            raise ValueError(f"{self.path}: not a GGUF file (no GGUF magic)")
        version, num_tensors, num_fields = self._unpack("<IQQ")
        if version not in (2, 3):
            raise ValueError(f"{self.path}: GGUF version {version} is not supported (2 or 3)")
        self.fields: dict[str, Any] = {}
        for _ in range(num_fields):
            key = self._string()
            (kind,) = self._unpack("<I")
            self.fields[key] = self._value(kind)
        infos = []
        for _ in range(num_tensors):
            name = self._string()
            (num_dims,) = self._unpack("<I")
            dims = self._unpack(f"<{num_dims}Q")
            kind, offset = self._unpack("<IQ")
            infos.append((name, tuple(int(d) for d in dims), GGMLQuantizationType(kind), offset))
        alignment = int(self.fields.get("general.alignment", _DEFAULT_ALIGNMENT))
        start = -(-self._pos // alignment) * alignment
        self.tensors = [self._tensor(name, dims, kind, start + offset)
                        for name, dims, kind, offset in infos]

    def _unpack(self, fmt: str) -> tuple:
        size = struct.calcsize(fmt)
        if self._pos + size > len(self._buf):
            raise ValueError(f"{self.path}: header ends early (truncated file?)")
        values = struct.unpack_from(fmt, self._buf, self._pos)
        self._pos += size
        return values

    def _string(self) -> str:
        (length,) = self._unpack("<Q")
        if self._pos + length > len(self._buf):
            raise ValueError(f"{self.path}: header ends early (truncated file?)")
        text = bytes(self._buf[self._pos:self._pos + length]).decode("utf-8", errors="replace")
        self._pos += length
        return text

    def _value(self, kind: int) -> Any:
        if kind == _STRING:
            return self._string()
        if kind in _SCALARS:
            return self._unpack(_SCALARS[kind])[0]
        if kind != _ARRAY:
            raise ValueError(f"{self.path}: unknown metadata value type {kind}")
        item_kind, count = self._unpack("<IQ")
        if item_kind in _NUMPY:  # numbers: one view of the mapped bytes
            dtype = np.dtype(_NUMPY[item_kind]).newbyteorder("<")
            end = self._pos + count * dtype.itemsize
            if end > len(self._buf):
                raise ValueError(f"{self.path}: header ends early (truncated file?)")
            array = np.frombuffer(self._buf[self._pos:end], dtype=dtype)
            self._pos = end
            return array
        if item_kind == _STRING:
            return self._strings(count)
        return [self._value(item_kind) for _ in range(count)]

    def _strings(self, count: int) -> list[str]:
        """An array of `count` strings: _string's loop inlined (a vocabulary and its merges are
        ~100k strings for the default model, read at every start)."""
        data, pos, size = self._mmap, self._pos, len(self._buf)
        length_at = _LENGTH.unpack_from
        strings = []
        for _ in range(count):
            (length,) = length_at(data, pos) if pos + 8 <= size else (size,)
            pos += 8
            if pos + length > size:
                raise ValueError(f"{self.path}: header ends early (truncated file?)")
            strings.append(data[pos:pos + length].decode("utf-8", errors="replace"))
            pos += length
        self._pos = pos
        return strings

    def _tensor(self, name: str, dims: tuple[int, ...], kind: GGMLQuantizationType,
                start: int) -> GGUFTensor:
        elements = int(np.prod(dims))
        block_size, type_size = GGML_QUANT_SIZES[kind]
        num_bytes = elements // block_size * type_size
        if start + num_bytes > len(self._map):
            raise ValueError(f"{self.path}: tensor {name!r} runs past the end of the file")
        raw = self._map[start:start + num_bytes]
        numpy_dims = dims[::-1]
        if kind in _TENSOR_DTYPES:
            data = raw.view(_TENSOR_DTYPES[kind]).reshape(numpy_dims)
        else:  # rows of blocks: [..., row bytes]
            data = raw.reshape(*numpy_dims[:-1], numpy_dims[-1] // block_size * type_size)
        return GGUFTensor(name, kind, dims, data, start)

    def release(self, tensor: GGUFTensor, first: int = 0, count: int | None = None) -> None:
        """Drop the tensor's pages (of its sub-arrays [first, first + count) along its outermost
        dimension: one expert of a stack) from this process' resident memory. They stay in the
        page cache, and a later read maps them again: a load that converts each tensor then
        holds the converted weights, not the file as well."""
        outer = tensor.data.shape[0] if tensor.data.ndim else 1
        step = tensor.data.nbytes // max(outer, 1)
        count = outer - first if count is None else count
        page = mmap.PAGESIZE
        start = (tensor.offset + first * step) // page * page
        end = tensor.offset + (first + count) * step
        self._mmap.madvise(mmap.MADV_DONTNEED, start, end - start)
