"""EngineConfig's dtype "auto": bf16 only where the hardware multiplies bf16 natively."""

from __future__ import annotations

import pathlib

import pytest

from forklm.runtime import config as config_module
from forklm.runtime.config import EngineConfig, resolved_dtype_name


@pytest.mark.parametrize("native_bf16, expected", [(True, "bfloat16"), (False, "float32")])
def test_auto_dtype_follows_the_cpus_bf16_support(monkeypatch, native_bf16, expected):
    monkeypatch.setattr(config_module, "cpu_has_native_bf16", lambda: native_bf16)
    assert EngineConfig().torch_dtype_name == expected
    assert resolved_dtype_name("auto") == expected
    assert EngineConfig(device="cuda").torch_dtype_name == "bfloat16"


def test_an_explicit_dtype_is_kept(monkeypatch):
    monkeypatch.setattr(config_module, "cpu_has_native_bf16", lambda: False)
    assert EngineConfig(dtype="bfloat16").torch_dtype_name == "bfloat16"
    assert resolved_dtype_name("float16", "cuda") == "float16"


def test_native_bf16_is_read_from_the_cpu_flags():
    flags = pathlib.Path("/proc/cpuinfo").read_text()
    expected = "avx512_bf16" in flags or "amx_bf16" in flags
    assert config_module.cpu_has_native_bf16() is expected
