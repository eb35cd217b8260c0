"""KV pool sizing from device memory (runtime/kvcache/sizing.py), on given memory figures."""

from __future__ import annotations

import pytest

from forklm.runtime.config import EngineConfig
from forklm.runtime.errors import InvalidArgumentError
from forklm.runtime.kvcache.pool import KVPool
from forklm.runtime.kvcache.sizing import GIB, DeviceMemory, capped, cpu_kv_tokens, gpu_kv_tokens

# The default model in bf16: 30 layers x 3 KV heads x 64 dims x (K + V) x 2 bytes
SMOL_BF16 = 30 * 3 * 64 * 2 * 2


def test_bytes_per_token_is_what_the_pool_allocates():
    import torch

    assert KVPool.bytes_per_token(30, 3, 64, torch.bfloat16) == SMOL_BF16


def test_an_h200_gives_the_kv_what_is_left_of_its_static_fraction():
    # 141 GiB device, the weights (0.3 GiB) and the CUDA context (0.5 GiB) already resident
    memory = DeviceMemory(total_bytes=141 * GIB, free_bytes=int(140.2 * GIB))
    tokens = gpu_kv_tokens(memory, 0.85, SMOL_BF16)
    expected_bytes = 141 * GIB * 0.85 - 0.8 * GIB
    assert tokens == int(expected_bytes) // SMOL_BF16
    assert tokens * SMOL_BF16 <= 0.85 * 141 * GIB - 0.8 * GIB  # never past the budget
    assert tokens > 100 * GIB // SMOL_BF16  # about 118 GiB of KV, not host RAM x 0.1


def test_memory_used_by_others_counts_against_the_budget():
    alone = gpu_kv_tokens(DeviceMemory(24 * GIB, 23 * GIB), 0.9, SMOL_BF16)
    shared = gpu_kv_tokens(DeviceMemory(24 * GIB, 13 * GIB), 0.9, SMOL_BF16)
    assert abs((alone - shared) - 10 * GIB // SMOL_BF16) <= 1  # 10 GiB fewer, to the token


def test_a_budget_the_weights_already_fill_is_a_clear_error():
    # an 8 GiB GPU holding 7 GiB of weights at a 0.8 fraction
    with pytest.raises(InvalidArgumentError, match="mem_fraction_static") as e:
        gpu_kv_tokens(DeviceMemory(8 * GIB, 1 * GIB), 0.8, SMOL_BF16)
    assert "7.00 GiB of the device's 8.00 GiB" in str(e.value)


def test_cpu_sizing_and_the_cap():
    assert cpu_kv_tokens(20 * GIB, 0.1, SMOL_BF16) == int(2 * GIB) // SMOL_BF16
    assert cpu_kv_tokens(1000, 0.1, SMOL_BF16) == 16
    assert capped(10**9, max_running_requests=64, context_len=8192) == 64 * 8192
    assert capped(5, 1, 1) == 16


@pytest.mark.parametrize("kwargs", [{"mem_fraction_static": 0.85},
                                    {"mem_fraction_static": 1.5, "device": "cuda"}])
def test_mem_fraction_static_is_checked(kwargs):
    with pytest.raises(InvalidArgumentError, match="mem_fraction_static"):
        EngineConfig(**kwargs)
    assert EngineConfig(mem_fraction_static=0.8, device="cuda").mem_fraction_static == 0.8
