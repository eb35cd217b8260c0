"""runtime/models/gguf_file.py reads what gguf-py's GGUFReader reads: the same metadata values
and the same tensor views, on the default model and on a file with every metadata value type."""

from __future__ import annotations

import time

import gguf
import numpy as np
import pytest

from forklm.runtime.models.gguf_file import GGUFFile
from forklm.runtime.models.source import default_model_gguf


def _assert_same(path) -> GGUFFile:
    ours, theirs = GGUFFile(path), gguf.GGUFReader(path)
    assert list(ours.fields) == [k for k in theirs.fields if not k.startswith("GGUF.")]
    for key, value in ours.fields.items():
        expected = theirs.fields[key].contents()
        got = value.tolist() if isinstance(value, np.ndarray) else value
        assert got == expected, key
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for mine, ref in zip(ours.tensors, theirs.tensors, strict=True):
        assert mine.tensor_type == ref.tensor_type and mine.shape == tuple(ref.shape.tolist())
        assert mine.data.dtype == ref.data.dtype and mine.data.shape == ref.data.shape
        assert np.array_equal(mine.data, ref.data), mine.name
    return ours


def test_default_model_reads_as_gguf_py_reads_it_and_fast():
    t0 = time.perf_counter()
    ours = GGUFFile(default_model_gguf())
    elapsed = time.perf_counter() - t0
    assert len(ours.fields["tokenizer.ggml.tokens"]) == 49152
    _assert_same(default_model_gguf())
    assert elapsed < 5, f"header read took {elapsed:.1f} s"


def test_every_value_type_and_tensor_type(tmp_path):
    path = tmp_path / "all.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_uint8("t.u8", 7)
    writer.add_int8("t.i8", -7)
    writer.add_uint16("t.u16", 60000)
    writer.add_int16("t.i16", -30000)
    writer.add_uint32("t.u32", 4_000_000_000)
    writer.add_int32("t.i32", -2_000_000_000)
    writer.add_float32("t.f32", 0.1)
    writer.add_uint64("t.u64", 2**60)
    writer.add_int64("t.i64", -(2**60))
    writer.add_float64("t.f64", 0.1)
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "héllo ✓")
    writer.add_array("t.ints", [1, 2, 3])
    writer.add_array("t.floats", [0.5, 1.5])
    writer.add_array("t.strs", ["a", "", "ü"])
    writer.add_array("t.bools", [True, False])
    rng = np.random.default_rng(0)
    writer.add_tensor("f32", rng.standard_normal((3, 8)).astype(np.float32))
    writer.add_tensor("f16", rng.standard_normal((4, 32)).astype(np.float16))
    q = gguf.quants.quantize(rng.standard_normal((2, 64)).astype(np.float32),
                             gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("q8", q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    ours = _assert_same(path)
    assert ours.fields["t.str"] == "héllo ✓" and ours.fields["t.strs"] == ["a", "", "ü"]


def test_a_truncated_or_foreign_file_is_an_error_not_a_crash(tmp_path):
    data = default_model_gguf().read_bytes()[:100_000]  # the header is longer than this
    (tmp_path / "cut.gguf").write_bytes(data)
    with pytest.raises(ValueError, match="ends early"):
        GGUFFile(tmp_path / "cut.gguf")
    (tmp_path / "not.gguf").write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(ValueError, match="not a GGUF"):
        GGUFFile(tmp_path / "not.gguf")
