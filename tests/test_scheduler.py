"""Scheduler budgets and policies with a fake model: no forward pass, tokens appended by hand."""

from __future__ import annotations

import pytest
import torch

from forklm.runtime.config import EngineConfig
from forklm.runtime.kvcache.manager import DECODE_RUN, KVCacheManager
from forklm.runtime.kvcache.pool import KVPool
from forklm.runtime.kvcache.radix_cache import RadixCache
from forklm.runtime.sampling.params import SamplingParams
from forklm.runtime.scheduling.request import FinishReason, Req
from forklm.runtime.scheduling.scheduler import ScheduledBatch, Scheduler


def make_scheduler(capacity: int = 4096, decode_run: int = DECODE_RUN, **config) -> Scheduler:
    cfg = EngineConfig(max_total_tokens=capacity, **config)
    pool = KVPool(num_layers=1, capacity=capacity, num_kv_heads=1, head_dim=4, dtype=torch.float32)
    cache = None if cfg.disable_radix_cache else RadixCache(pool.allocator)
    kv = KVCacheManager(pool, cache, max_rows=cfg.max_running_requests + 1, max_context=2048,
                        decode_run=decode_run)
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


def test_decoding_requests_take_their_slots_in_runs():
    """Four requests decoding together: each one's generated tokens sit in runs of consecutive
    slots (DECODE_RUN, then what it has left), not interleaved with the others'."""
    sched = make_scheduler()
    reqs = [make_req(list(range(i * 1000, i * 1000 + 20)), max_new_tokens=45) for i in range(4)]
    sched.waiting.extend(reqs)
    decode_slots: dict[str, list[int]] = {r.rid: [] for r in reqs}
    while sched.has_work:
        batch = sched.schedule()
        assert batch is not None
        if batch.is_decode:
            for req in batch.reqs:
                decode_slots[req.rid].append(int(sched.kv.req_to_token[req.row, req.num_computed - 1]))
        fake_step(sched, batch)
    for slots in decode_slots.values():
        # the first sampled token's slot comes with the prefill; 44 decode steps: runs of 32, 12
        assert len(slots) == 44
        runs = [slots[:DECODE_RUN], slots[DECODE_RUN:]]
        assert all(run == list(range(run[0], run[0] + len(run))) for run in runs)
    assert sched.kv.runs == {} and sched.kv.num_in_runs == 0


@pytest.mark.parametrize("capacity", [130, 150, 170, 200, 260])
def test_decode_runs_never_cause_a_retraction(capacity):
    """However tight the pool, taking slots in runs retracts no more than one slot at a time does:
    a run is only taken when the pool has room for it, and runs are available to everyone."""
    def retractions(decode_run: int) -> list[int]:
        sched = make_scheduler(capacity=capacity, decode_run=decode_run, disable_radix_cache=True)
        reqs = [make_req(list(range(i * 1000, i * 1000 + 30)), max_new_tokens=25)
                for i in range(5)]
        run_to_completion_with(sched, reqs)
        assert all(len(r.output_ids) == 25 for r in reqs)
        assert sched.kv.allocator.num_free == capacity
        return [r.num_retractions for r in reqs]

    assert retractions(DECODE_RUN) == retractions(1)


def test_a_prefill_takes_back_decode_runs_when_the_pool_is_short():
    """Slots held in a decode run count as available: a prompt that needs them gets them."""
    sched = make_scheduler(capacity=64, disable_radix_cache=True)
    kv = sched.kv
    a, b = make_req(list(range(10)), max_new_tokens=40), make_req(list(range(100, 130)))
    kv.admit(a)
    kv.extend(a, 10)
    kv.extend_all([a], [1])
    assert kv.num_in_runs == 31 and kv.allocator.num_free == 64 - 11 - 31
    assert kv.available_tokens == 64 - 11
    kv.admit(b)
    kv.extend(b, 30)  # more than the 22 free slots
    assert kv.num_in_runs == 0 and kv.allocator.num_free == 64 - 11 - 30
    kv.extend_all([a, b], [1, 1])  # no room for runs of 32 and 8: a slot each
    assert kv.num_in_runs == 0 and kv.allocator.num_free == 64 - 11 - 30 - 2
    kv.check_invariants([a, b])


def run_to_completion_with(sched: Scheduler, reqs: list[Req]) -> None:
    sched.waiting.extend(reqs)
    run_to_completion(sched)
