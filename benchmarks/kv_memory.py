"""KV memory efficiency measured from a live engine's pool: bytes of KV reserved for requests
divided by the bytes their tokens need, sampled between engine steps while a workload runs.

Reserved = every slot out of the free list (held by running requests or by the radix cache) times
the pool's real bytes per slot (its buffers' size / capacity). Needed = the distinct tokens those
slots stand for: the cache's tokens plus each running request's computed tokens beyond its cached
prefix, times the model's K/V bytes per token. Slots that decoding requests took ahead for their
next tokens (decode runs) count as free, as Engine.stats() counts them: any allocation that would
fall short takes them back. Padding to a maximum length, per-request
over-allocation or pages only partly filled would all show up as a ratio above 1.
"""

from __future__ import annotations

import statistics
import threading
from dataclasses import dataclass
from typing import Any

from benchmarks.workloads import Workload


@dataclass
class KVMemory:
    samples: int
    median_ratio: float
    max_ratio: float
    bytes_per_slot: float
    bytes_per_token: int


def measure_kv_memory(engine: Any, wl: Workload, interval_s: float = 0.05) -> KVMemory:
    """Run wl's prompts through engine.generate (one call) and sample the ratio meanwhile."""
    pool = engine.parts.kv.pool
    # per buffer row (the pool has one scratch row past its capacity, runtime/forward/cuda_graphs.py)
    bytes_per_slot = (pool.k_buffer.nbytes + pool.v_buffer.nbytes) / pool.k_buffer.shape[1]
    bytes_per_token = pool.bytes_per_token(pool.num_layers, pool.num_kv_heads, pool.head_dim,
                                           pool.dtype)
    engine.flush_cache()
    done = threading.Event()
    params = {"temperature": 0, "max_new_tokens": wl.requests[0].max_new_tokens,
              "ignore_eos": True}
    worker = threading.Thread(target=lambda: (engine.generate([r.prompt for r in wl.requests],
                                                              params), done.set()))
    worker.start()
    ratios: list[float] = []
    while not done.wait(interval_s):
        stats = engine.stats()  # read on the engine thread between steps: consistent counts
        reserved, needed = stats["kv_capacity"] - stats["kv_free"], stats["kv_tokens_needed"]
        if needed:
            ratios.append(reserved * bytes_per_slot / (needed * bytes_per_token))
    worker.join()
    if not ratios:
        raise RuntimeError(f"{wl.name}: finished before any sample; use a longer workload")
    return KVMemory(len(ratios), statistics.median(ratios), max(ratios), bytes_per_slot,
                    bytes_per_token)
