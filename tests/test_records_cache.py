"""runtime/quant/records_cache.py: a GGUF's repacked weights (K-quant records, the int4 packing)
written to disk by the first load and mapped by the next ones instead of repacked; a damaged,
short or foreign cache is not trusted; FORKLM_RECORDS_CACHE=0 turns it off; an engine writes
it in its idle time."""

from __future__ import annotations

import json
import logging
import time

import pytest
import torch

from forklm.kernels.cpu import bindings as native_kernels
from forklm.kernels.cpu import huge_pages
from forklm.kernels.cpu.huge_pages import HUGE_PAGE
from forklm.runtime.forward.model_parts import build_model
from forklm.runtime.models import spec_from_config
from forklm.runtime.models.loader import load_model
from forklm.runtime.models.source import default_model_gguf
from forklm.runtime.quant import kquant, linear, records_cache
from forklm.runtime.quant.kquant import KQuantMatrix, kquant_available
from forklm.runtime.quant.linear import Int4Matrix

pytestmark = pytest.mark.skipif(not kquant_available(),
                                reason="K-quant kernel off (no AVX512-VNNI/BW/BF16 or no build)")


@pytest.fixture(scope="module", params=["k-quants", "default model"])
def gguf(request, tmp_path_factory, tokenizer) -> str:
    """A tiny Llama in a Q4_K_M-like mix (Q4_K, Q5_K, Q6_K records; tied head), or the default
    model (Q4_1 matrices in the int4 packing and VNNI records, a Q8_0 embedding and head in
    K-quant records)."""
    from tests.test_gguf_families import write_gguf
    from tests.test_kquant import K_QUANT_CASES
    from tests.tiny_models import build_tiny_model

    if request.param == "default model":
        return str(default_model_gguf())
    tiny, arch, edit, fields, quantizer, _ = K_QUANT_CASES["llama"]
    folder = tmp_path_factory.mktemp("records")
    model = build_tiny_model(tiny, folder / "hf", tokenizer, edit=edit, hidden_size=256,
                             intermediate_size=512, **fields)
    path = str(folder / "k.gguf")
    write_gguf(path, model, arch, quantizer=quantizer)
    return path


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("FORKLM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("FORKLM_RECORDS_CACHE", raising=False)
    return tmp_path / "cache"


class BuildCounter:
    """The buffers loads build for repacked weights (a K-quant matrix's records; an int4
    matrix's packing, group scales and VNNI records), counted, or forbidden."""

    def __init__(self, monkeypatch, allowed: bool = True):
        self.allowed, self.built = allowed, 0
        for module in (kquant, linear):
            monkeypatch.setattr(module, "streamed_empty", self._counted(module.streamed_empty))
        for name in ("int4_vnni", "int8_vnni"):  # an int4 matrix's VNNI records
            monkeypatch.setattr(native_kernels, name, self._vnni(getattr(native_kernels, name)))

    def _counted(self, streamed_empty):
        def build(*args, **kwargs):
            self._count()
            return streamed_empty(*args, **kwargs)
        return build

    def _vnni(self, build):
        def call(*args, records=None):
            if records is None:
                self._count()
            return build(*args, records=records)
        return call

    def _count(self) -> None:
        assert self.allowed, "weights were repacked where the cache should have held them"
        self.built += 1


def _load(path: str):
    loaded = load_model(path)
    model = build_model(loaded, spec_from_config(loaded.config), torch.bfloat16, "cpu", 256,
                        keep_quantized=True, int8_activations=True)
    records = {}
    for name, m in model.named_modules():
        if isinstance(m, KQuantMatrix):
            records[name] = m.records
        elif isinstance(m, Int4Matrix):
            records[f"{name}.packed"], records[f"{name}.scale_zeros"] = m.packed, m.scale_zeros
            records[f"{name}.vnni"] = m._native_functions()[1].records
    assert len(records) > 5
    return loaded, records


def _saved(path: str) -> dict[str, torch.Tensor]:
    """The records of a first load, written to its cache."""
    loaded, records = _load(path)
    cache = loaded.records_cache
    assert cache is not None and not cache.cached and cache.unsaved
    written = list(cache.saving())
    assert written[-1] == sum(r.numel() * r.itemsize for r in records.values())
    assert cache.index_path.is_file() and cache.data_path.is_file()
    return {name: r.clone() for name, r in records.items()}


def _assert_same(records: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert records.keys() == expected.keys()
    for name, r in records.items():
        assert torch.equal(r, expected[name]), name


def test_a_later_load_maps_the_records_the_first_one_wrote(gguf, cache_dir, monkeypatch):
    first = _saved(gguf)
    BuildCounter(monkeypatch, allowed=False)
    loaded, records = _load(gguf)
    cache = loaded.records_cache
    assert cache is not None and cache.cached and not cache.unsaved
    _assert_same(records, first)
    mapping = cache._mapping
    assert mapping is not None
    start = torch.frombuffer(mapping, dtype=torch.uint8, count=1).data_ptr()
    for r in records.values():  # views of the mapped file, not copies
        assert start <= r.data_ptr() < start + len(mapping)
    # every one waits to be moved into huge pages, the small ones too: adjacent entries join,
    # and whole 2 MiB pages of them move (tests/test_huge_pages.py)
    queued = {(p.address, p.nbytes) for p in huge_pages._pending
              if p.file_backed and p.owner() is mapping}
    assert {(r.data_ptr(), r.nbytes) for r in records.values()} <= queued
    sizes = [r.nbytes for r in records.values()]
    assert min(sizes) < HUGE_PAGE <= max(sizes)  # the tied head and embedding is a large one


def test_a_damaged_entry_is_rebuilt_from_the_file(gguf, cache_dir, monkeypatch, caplog):
    """... and the file written again whole, without entries no load asks for any more."""
    first = _saved(gguf)
    cache = load_model(gguf).records_cache
    assert cache is not None
    index = json.loads(cache.index_path.read_text())
    damaged = sorted(index["entries"])[1]  # an int4 matrix's packing on the default model
    with open(cache.data_path, "r+b") as f:  # zeros, as a crash can leave a written file
        f.seek(index["entries"][damaged]["offset"])
        f.write(bytes(4096))
    stale = "records:Q4_K:16x256:an older layout's"
    index["entries"][stale] = index["entries"][sorted(index["entries"])[0]]  # sound bytes
    cache.index_path.write_text(json.dumps(index))
    counter = BuildCounter(monkeypatch)
    with caplog.at_level(logging.WARNING):
        loaded, records = _load(gguf)
    # an int4 matrix's packing and scales, or its VNNI records, or a K-quant matrix's records
    rebuilt = 2 if damaged.endswith(("/packed", "/scale_zeros")) else 1
    assert counter.built == rebuilt and f"entry {damaged} is damaged" in caplog.text
    _assert_same(records, first)
    assert loaded.records_cache is not None
    list(loaded.records_cache.saving())  # the whole file again, the damaged entry replaced
    written = json.loads(cache.index_path.read_text())["entries"]
    assert stale not in written and written.keys() == index["entries"].keys() - {stale}
    counter.allowed = False
    _assert_same(_load(gguf)[1], first)


@pytest.mark.parametrize("fault", ["short file", "other version", "no index"])
def test_a_cache_that_does_not_fit_is_ignored_and_written_again(gguf, cache_dir, monkeypatch,
                                                                 fault):
    first = _saved(gguf)
    cache = load_model(gguf).records_cache
    assert cache is not None
    if fault == "short file":
        with open(cache.data_path, "r+b") as f:
            f.truncate(cache.data_path.stat().st_size - 4096)
    elif fault == "other version":
        index = json.loads(cache.index_path.read_text())
        cache.index_path.write_text(json.dumps({**index, "version": index["version"] + 1}))
    else:
        cache.index_path.unlink()
    counter = BuildCounter(monkeypatch)
    loaded, records = _load(gguf)
    assert counter.built == len(first)  # every matrix repacked from the file
    _assert_same(records, first)
    assert loaded.records_cache is not None and loaded.records_cache.unsaved
    list(loaded.records_cache.saving())  # and written again, whole
    counter.allowed = False
    _assert_same(_load(gguf)[1], first)


def test_the_cache_can_be_turned_off(gguf, cache_dir, monkeypatch):
    monkeypatch.setenv("FORKLM_RECORDS_CACHE", "0")
    loaded, _ = _load(gguf)
    assert loaded.records_cache is None
    assert not list(cache_dir.glob("*/records-*"))


def test_an_engine_writes_the_cache_once_idle_and_the_next_one_maps_it(gguf, cache_dir,
                                                                       monkeypatch):
    from forklm.runtime.engine.engine import Engine
    from forklm.runtime.engine.loop import IDLE_BUILD_AFTER_S
    from tests.tiny_models import ARCHITECTURES

    params = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
    config = {"model_path": gguf, "max_total_tokens": 1024, **ARCHITECTURES["llama3"].engine_config}
    first = Engine(**config)
    try:
        expected = first.generate("The sea is", params)["output_ids"]
        deadline = time.monotonic() + IDLE_BUILD_AFTER_S + 30
        while not list(cache_dir.glob(f"*/records-v{records_cache.FORMAT_VERSION}.json")):
            assert time.monotonic() < deadline, "the idle engine never wrote its records"
            time.sleep(0.05)
        assert first.generate("The sea is", params)["output_ids"] == expected
    finally:
        first.shutdown()
    BuildCounter(monkeypatch, allowed=False)
    second = Engine(**config)
    try:
        assert second.generate("The sea is", params)["output_ids"] == expected
        # once idle, its mapped records move into huge pages under it: the same tokens after
        deadline = time.monotonic() + IDLE_BUILD_AFTER_S + 30
        while second.stats()["idle_work_left"]:
            assert time.monotonic() < deadline, "the idle engine never finished its idle work"
            time.sleep(0.05)
        assert second.generate("The sea is", params)["output_ids"] == expected
    finally:
        second.shutdown()
