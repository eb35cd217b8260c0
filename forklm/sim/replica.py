"""SimReplica: one engine replica made of the real scheduler, KV cache manager, radix cache and KV
pool, whose model forward is replaced by a cost model's duration and logits that pick a token."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from forklm.runtime.config import EngineConfig
from forklm.runtime.engine.builder import build_kv_manager
from forklm.runtime.engine.output_processor import finish, process_logits
from forklm.runtime.forward.model_runner import LogitsRows
from forklm.runtime.kvcache.pool import KVPool
from forklm.runtime.scheduling.request import FinishReason, Req
from forklm.runtime.scheduling.scheduler import ScheduledBatch, Scheduler
from forklm.sim.cost_model import CostModel, StepShape


@dataclass
class ReplicaStats:
    steps: int = 0
    prefill_steps: int = 0
    busy_s: float = 0.0
    forward_s: float = 0.0  # of busy_s, the cost model's forward part
    routed: int = 0
    in_flight: int = 0  # requests sent and not finished (the router's load signal)
    peak_kv_used: int = 0  # slots held by requests or locked prefixes (not reclaimable)
    kv_used_sum: float = 0.0  # per step, for the mean
    peak_kv_cached: int = 0


class SimReplica:
    """A step is start_step (schedule, and the cost model's duration) then, that long later on
    the simulator's clock, finish_step (sample, finish checks, radix insertion) — the engine
    loop's schedule -> forward -> process_logits -> after_step with the forward's time modelled.
    Requests may be submitted at any time; like the engine's inbox, they join the next step."""

    def __init__(self, index: int, config: EngineConfig, cost: CostModel, context_len: int,
                 check_invariants: bool = False):
        assert config.max_total_tokens is not None, "a simulated replica needs max_total_tokens"
        self.index, self.config, self.cost = index, config, cost
        self.check_invariants = check_invariants
        # One layer, one head, head_dim 1: the slot accounting is real, the K/V values never read.
        pool = KVPool(1, config.max_total_tokens, 1, 1, torch.float16)
        self.kv = build_kv_manager(config, pool, context_len)  # as the engine builds it
        self.scheduler = Scheduler(config, self.kv)
        self.stats = ReplicaStats()
        self._batch: ScheduledBatch | None = None

    @property
    def busy(self) -> bool:
        return self._batch is not None

    @property
    def capacity(self) -> int:
        return self.kv.allocator.capacity

    def submit(self, req: Req) -> None:
        self.stats.routed += 1
        self.stats.in_flight += 1
        self.scheduler.waiting.append(req)

    def start_step(self) -> float | None:
        """Schedule the next batch; returns its duration in seconds, or None when there is
        nothing to run (the replica idles until a request arrives)."""
        assert self._batch is None, f"replica {self.index}: a step is already running"
        batch = self.scheduler.schedule()
        self._finish_aborted()
        if batch is None:
            return None
        self._batch = batch
        shape = StepShape.of(batch)
        seconds = self.cost.step_s(shape)
        self.stats.forward_s += self.cost.forward_s(shape)
        self.stats.steps += 1
        self.stats.prefill_steps += batch.phase == "prefill"
        self.stats.busy_s += seconds
        return seconds

    def finish_step(self) -> None:
        """The step's end: its tokens are sampled (sinks hear of them now), finished requests
        leave through the real release path, and the KV use is sampled."""
        batch, self._batch = self._batch, None
        assert batch is not None, f"replica {self.index}: no step to finish"
        logits, layout = echo_logits(batch)
        process_logits(batch, logits, layout)
        self.scheduler.after_step(batch)
        if self.check_invariants:
            self.kv.check_invariants(self.scheduler.active_reqs())
        self._sample_kv()

    def request_done(self) -> None:
        self.stats.in_flight -= 1

    def _finish_aborted(self) -> None:
        while self.scheduler.aborted:
            req = self.scheduler.aborted.pop()
            finish(req, req.finish_reason or FinishReason("abort"))

    def _sample_kv(self) -> None:
        cache = self.kv.cache
        evictable = cache.evictable_size if cache else 0
        used = self.capacity - self.kv.allocator.num_free - evictable
        self.stats.peak_kv_used = max(self.stats.peak_kv_used, used)
        self.stats.kv_used_sum += used
        if cache is not None:
            self.stats.peak_kv_cached = max(self.stats.peak_kv_cached, cache.total_size)


# Echoed tokens are taken among ids below this (most word tokens of a BPE vocabulary are), so the
# fake logits stay narrow: the sampler's cost grows with their width, the model's vocabulary.
ECHO_MAX_ID = 8192


def echo_logits(batch: ScheduledBatch) -> tuple[torch.Tensor, list[LogitsRows]]:
    """Logits for the batch's sampled rows whose argmax is the next token of the prompt read
    from its start (skipping EOS ids and ids >= ECHO_MAX_ID), so greedy sampling yields
    plausible, non-final text and finishing is by length, as with ignore_eos in the benchmarks.
    Returns (logits [rows, V], the per-request layout ModelRunner.forward would give)."""
    layout: list[LogitsRows] = []
    choices: list[int] = []
    for req, sampled in zip(batch.reqs, batch.samples):
        layout.append(LogitsRows(len(choices), [], len(choices) if sampled else None))
        if sampled:
            choices.append(_echo_token(req))
    width = max(choices, default=0) + 1
    logits = torch.zeros(len(choices), width)  # [rows, V]
    logits[torch.arange(len(choices)), torch.tensor(choices, dtype=torch.int64)] = 1.0
    return logits, layout


def _echo_token(req: Req) -> int:
    prompt = req.origin_input_ids
    for k in range(len(req.output_ids), len(req.output_ids) + len(prompt)):
        token = prompt[k % len(prompt)]
        if token < ECHO_MAX_ID and token not in req.eos_token_ids:
            return token
    # no such token: any non-EOS one of the prompt, or one past the EOS ids
    return next((t for t in prompt if t not in req.eos_token_ids),
                max(req.eos_token_ids, default=0) + 1)
