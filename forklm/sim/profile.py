"""Measured profiles for the cost model: the real model's forward timed in isolation over a grid of
batch shapes (decode: requests x context; prefill: new tokens x cached prefix), and the engine's
time outside the forward read from its stats."""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from forklm.runtime.attention.registry import create_attention_backend
from forklm.runtime.config import resolved_dtype_name
from forklm.runtime.forward.batch import ForwardBatch
from forklm.runtime.forward.model_parts import build_model
from forklm.runtime.kvcache.pool import KVPool
from forklm.runtime.models import spec_from_config
from forklm.runtime.models.loader import load_model
from forklm.sim.cost_model import StepShape, TimedStep

# Grids around the benchmark workloads' shapes (contexts up to ~1k, batches up to 32, prefill
# steps up to the 4096-token budget), sized for a 135M model on 2 CPU cores (~1 min per thread
# count on a quiet machine); a GPU or a longer-context trace wants larger ones.
DECODE_GRID = [(b, c) for b in (1, 4, 8, 16, 32) for c in (128, 512, 1024)]  # (requests, context)
PREFILL_GRID = [(1, n, p) for n in (32, 128, 512, 1024) for p in (0, 512)] + [
    (4, 128, 0), (4, 512, 0), (4, 1024, 0)]
# (requests, new tokens each, cached prefix each)
# Slots of the timing pool; larger batches reuse slots (the values do not matter, only the reads).
POOL_SLOTS = 16384


@dataclass(frozen=True)
class ProfileConfig:
    model_path: str = "SmolLM2-135M-Instruct"
    dtype: str = "auto"
    num_threads: int = 2
    repeats: int = 3  # median of this many timed forwards, after one warm-up


def profile_forward(config: ProfileConfig) -> list[TimedStep]:
    """Time the model's forward (no sampling, no scheduling) at every grid shape."""
    loaded = load_model(config.model_path)
    spec = spec_from_config(loaded.config)
    dtype = getattr(torch, resolved_dtype_name(config.dtype))
    model = build_model(loaded, spec, dtype, "cpu", max_positions=4096)
    num_layers, num_kv_heads, head_dim = spec.kv_pool_shape
    pool = KVPool(num_layers, POOL_SLOTS, num_kv_heads, head_dim, dtype)
    attn = create_attention_backend("torch", pool, spec.num_heads, num_kv_heads, head_dim,
                                    model.attention_layers)
    previous = torch.get_num_threads()
    torch.set_num_threads(config.num_threads)
    try:
        with torch.inference_mode():
            shapes = [_decode(b, c) for b, c in DECODE_GRID] + [
                prefill_step(b, n, p) for b, n, p in PREFILL_GRID]
            return [TimedStep(shape, _median_time(lambda fb=fb: model(fb, attn), config.repeats))
                    for shape, fb in shapes]
    finally:
        torch.set_num_threads(previous)


def _median_time(run: Any, repeats: int) -> float:
    run()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _decode(batch: int, ctx: int) -> tuple[StepShape, ForwardBatch]:
    """One new token per request after ctx - 1 cached ones, each request's slots contiguous."""
    table = torch.arange(batch * ctx).view(batch, ctx) % POOL_SLOTS  # [batch, ctx]
    fb = ForwardBatch(
        input_ids=torch.randint(0, 1000, (batch,)), positions=torch.full((batch,), ctx - 1),
        out_slots=table[:, -1].clone(), q_lens=torch.ones(batch, dtype=torch.int64),
        kv_lens=torch.full((batch,), ctx), slot_table=table,
        q_index=torch.arange(batch)[:, None], logits_indices=torch.arange(batch), max_q_len=1,
        is_decode=True)
    return StepShape(True, batch, batch, batch * ctx, batch * ctx), fb


def prefill_step(batch: int, new: int, prefix: int) -> tuple[StepShape, ForwardBatch]:
    """`new` tokens per request after a cached prefix of `prefix` (a radix hit or a chunk)."""
    kv = prefix + new
    table = torch.arange(batch * kv).view(batch, kv)  # [batch, kv]
    q_index = torch.arange(batch * new).view(batch, new)  # [batch, new]
    fb = ForwardBatch(
        input_ids=torch.randint(0, 1000, (batch * new,)),
        positions=torch.arange(prefix, kv).repeat(batch), out_slots=table[:, prefix:].flatten(),
        q_lens=torch.full((batch,), new), kv_lens=torch.full((batch,), kv), slot_table=table,
        q_index=q_index, logits_indices=q_index[:, -1].clone(), max_q_len=new, is_decode=False)
    pairs = batch * (new * prefix + new * (new + 1) // 2)
    return StepShape(False, batch, batch * new, batch * kv, pairs), fb


@dataclass(frozen=True)
class OverheadSample:
    """An engine's counters over one run: steps, request-steps (a request in a step; each such
    produced a token, so the generated-token count stands for it) and seconds outside the forward."""

    steps: int
    request_steps: int
    overhead_s: float
    forward_s: float


def overhead_between(before: Iterable[dict[str, Any]], after: Iterable[dict[str, Any]]
                     ) -> OverheadSample:
    """From Engine.stats() snapshots (one per replica) taken before and after a run."""
    steps = req_steps = 0
    overhead = forward = 0.0
    for b, a in zip(before, after):
        steps += a["steps"] - b["steps"]
        req_steps += a["generated_tokens"] - b["generated_tokens"]
        overhead += (a["overhead_ms_per_step"] * a["steps"]
                     - b["overhead_ms_per_step"] * b["steps"]) / 1000
        forward += (a["forward_ms_per_step"] * a["steps"]
                    - b["forward_ms_per_step"] * b["steps"]) / 1000
    return OverheadSample(steps, req_steps, overhead, forward)
