"""Scheduler budgets and policies with a fake model: no forward pass, tokens appended by hand."""

from __future__ import annotations

import pytest
import torch

from forklm.runtime.config import EngineConfig
from forklm.runtime.kvcache.manager import KVCacheManager
from forklm.runtime.kvcache.pool import KVPool
from forklm.runtime.kvcache.radix_cache import RadixCache
from forklm.runtime.sampling.params import SamplingParams
from forklm.runtime.scheduling.request import FinishReason, Req
from forklm.runtime.scheduling.scheduler import ScheduledBatch, Scheduler


def make_scheduler(capacity: int = 4096, **config) -> Scheduler:
    cfg = EngineConfig(max_total_tokens=capacity, **config)
    pool = KVPool(num_layers=1, capacity=capacity, num_kv_heads=1, head_dim=4, dtype=torch.float32)
    cache = None if cfg.disable_radix_cache else RadixCache(pool.allocator)
    kv = KVCacheManager(pool, cache, max_rows=cfg.max_running_requests + 1, max_context=2048)
    return Scheduler(cfg, kv)


def make_req(ids: list[int], max_new_tokens: int = 8) -> Req:
    return Req(rid=str(ids[:4]) + str(len(ids)), origin_input_ids=ids,
               sampling_params=SamplingParams(max_new_tokens=max_new_tokens),
               detokenizer=None, eos_token_ids=frozenset(), sink=lambda out: None,  # type: ignore[arg-type]
               max_total_len=2048)


def fake_step(sched: Scheduler, batch: ScheduledBatch) -> None:
    """What the engine does after a forward: sample a token for each request that samples, finish
    requests that reached max_new_tokens, then hand the batch back to the scheduler."""
    for req, samples in zip(batch.reqs, batch.samples):
        if samples:
            req.output_ids.append(7)
            if len(req.output_ids) >= req.sampling_params.max_new_tokens:
                req.finish_reason = FinishReason("length", length=len(req.output_ids))
    sched.after_step(batch)
    sched.kv.check_invariants(sched.active_reqs())


def run_to_completion(sched: Scheduler, max_steps: int = 1000) -> list[ScheduledBatch]:
    batches = []
    while sched.has_work and len(batches) < max_steps:
        batch = sched.schedule()
        assert batch is not None
        batches.append(batch)
        fake_step(sched, batch)
    assert not sched.has_work
    return batches


def test_prefill_budget_is_respected_and_prefill_comes_first():
    sched = make_scheduler(max_prefill_tokens=250, chunked_prefill_size=-1)
    reqs = [make_req(list(range(i * 1000, i * 1000 + 100))) for i in range(5)]
    sched.waiting.extend(reqs)
    batches = run_to_completion(sched)
    prefills = [b for b in batches if not b.is_decode]
    assert [len(b.reqs) for b in prefills] == [2, 2, 1]
    assert all(sum(b.extend_lens) <= 250 for b in prefills)
    assert all(r.finish_reason.type == "length" and len(r.output_ids) == 8 for r in reqs)
    assert sched.kv.allocator.num_free + sched.kv.cache.total_size == 4096


def test_max_running_requests_caps_the_batch():
    sched = make_scheduler(max_running_requests=3)
    sched.waiting.extend(make_req(list(range(i * 100, i * 100 + 10))) for i in range(7))
    batches = run_to_completion(sched)
    assert max(len(b.reqs) for b in batches) <= 3
    assert max(len(b.reqs) for b in batches if b.is_decode) == 3


def test_long_prompt_is_prefilled_in_chunks():
    sched = make_scheduler(chunked_prefill_size=32)
    req = make_req(list(range(100)), max_new_tokens=2)
    sched.waiting.append(req)
    batches = run_to_completion(sched)
    assert [b.extend_lens for b in batches] == [[32], [32], [32], [4], [1]]
    assert [b.samples for b in batches] == [[False], [False], [False], [True], [True]]


def test_lpm_admits_the_longest_cached_prefix_first():
    sched = make_scheduler(schedule_policy="lpm", max_running_requests=1)
    shared = list(range(500, 560))
    run_to_completion_with(sched, [make_req(shared + [1], max_new_tokens=1)])
    cold, warm = make_req(list(range(900, 960)), 1), make_req(shared + [2], 1)
    sched.waiting.extend([cold, warm])  # cold arrived first
    first = sched.schedule()
    assert first.reqs == [warm] and warm.cached_tokens == 60


def test_fcfs_keeps_arrival_order():
    sched = make_scheduler(schedule_policy="fcfs", max_running_requests=1)
    shared = list(range(500, 560))
    run_to_completion_with(sched, [make_req(shared + [1], max_new_tokens=1)])
    cold, warm = make_req(list(range(900, 960)), 1), make_req(shared + [2], 1)
    sched.waiting.extend([cold, warm])
    assert sched.schedule().reqs == [cold]


def test_requests_sharing_an_uncached_prefix_wait_for_the_first():
    sched = make_scheduler()
    shared = list(range(1000, 1100))
    reqs = [make_req(shared + [i], max_new_tokens=1) for i in range(4)]
    sched.waiting.extend(reqs)
    first = sched.schedule()
    assert first.reqs == [reqs[0]]
    fake_step(sched, first)
    second = sched.schedule()
    assert second.reqs == reqs[1:] and all(r.cached_tokens == 100 for r in reqs[1:])


@pytest.mark.parametrize("disable_radix_cache", [False, True])
def test_kv_shortage_retracts_and_everything_finishes(disable_radix_cache):
    sched = make_scheduler(capacity=300, disable_radix_cache=disable_radix_cache)
    reqs = [make_req(list(range(i * 1000, i * 1000 + 40)), max_new_tokens=40) for i in range(6)]
    sched.waiting.extend(reqs)
    run_to_completion(sched)
    assert sum(r.num_retractions for r in reqs) > 0
    assert all(len(r.output_ids) == 40 and r.finish_reason.type == "length" for r in reqs)
    cached = sched.kv.cache.total_size if sched.kv.cache else 0
    assert sched.kv.allocator.num_free + cached == 300


def run_to_completion_with(sched: Scheduler, reqs: list[Req]) -> None:
    sched.waiting.extend(reqs)
    run_to_completion(sched)
