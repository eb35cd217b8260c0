"""How many tokens of KV the pool gets, from the memory of the device it lives on.

GPU (SGLang's --mem-fraction-static): weights + KV pool may use `mem_fraction_static` of the
device's total memory; the rest is left for activations, CUDA graphs and the allocator's slack.
Measured after the weights are loaded, so whatever else holds memory on the device (another
process, the CUDA context) is counted against the budget, never overcommitted.
CPU: `max_total_tokens_fraction` of the RAM available at start.
Either way capped by what `max_running_requests` full-context requests could ever use.
"""

from __future__ import annotations

from dataclasses import dataclass

from forklm.runtime.errors import InvalidArgumentError

GIB = 2**30
MIN_KV_TOKENS = 16
# SGLang's default for large GPUs; the rest (15%) holds activations of a max_prefill_tokens
# forward, sampling buffers and CUDA graphs.
DEFAULT_MEM_FRACTION_STATIC = 0.85


@dataclass(frozen=True)
class DeviceMemory:
    total_bytes: int  # the device's memory
    free_bytes: int  # free now, after the weights are loaded


def gpu_kv_tokens(memory: DeviceMemory, mem_fraction_static: float, bytes_per_token: int) -> int:
    """KV tokens that fit in what is left of total * mem_fraction_static once everything already
    on the device (weights, other processes) is counted. Raises InvalidArgumentError naming the
    flag when not even MIN_KV_TOKENS fit."""
    used = memory.total_bytes - memory.free_bytes
    budget = int(memory.total_bytes * mem_fraction_static) - used
    tokens = max(budget, 0) // bytes_per_token
    if tokens < MIN_KV_TOKENS:
        raise InvalidArgumentError(
            "mem_fraction_static", mem_fraction_static,
            f"leaves {max(budget, 0) / GIB:.2f} GiB for the KV cache: {used / GIB:.2f} GiB of the "
            f"device's {memory.total_bytes / GIB:.2f} GiB are in use after loading the weights; "
            "raise it, or free the device")
    return tokens


def cpu_kv_tokens(available_ram_bytes: int, fraction: float, bytes_per_token: int) -> int:
    return max(MIN_KV_TOKENS, int(available_ram_bytes * fraction) // bytes_per_token)


def capped(tokens: int, max_running_requests: int, context_len: int) -> int:
    """More KV than every running request at full context could use is never needed."""
    return max(MIN_KV_TOKENS, min(tokens, max_running_requests * context_len))
