"""EngineStats: the engine's counters since start (tokens, steps, time per phase), updated on the
engine thread, and the snapshot Engine.stats() returns."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from forklm.runtime.engine.output_processor import StepTokens
    from forklm.runtime.kvcache.manager import KVCacheManager
    from forklm.runtime.scheduling.request import Req
    from forklm.runtime.scheduling.scheduler import ScheduledBatch, Scheduler


@dataclass
class EngineStats:
    prompt_tokens: int = 0  # of finished requests
    cached_tokens: int = 0  # of those, served from the radix cache
    generated_tokens: int = 0
    steps: int = 0
    step_s: float = 0.0  # whole steps: scheduling, forward, sampling, streaming
    forward_s: float = 0.0  # model forwards only
    decode_steps: int = 0  # decode and catch-up steps
    decode_tokens: int = 0
    decode_s: float = 0.0
    prefill_tokens: int = 0  # prompt tokens computed (cache hits excluded)
    prefill_s: float = 0.0
    spec_verified: int = 0  # drafts verified (one per drafted request and step)
    spec_draft_tokens: int = 0  # draft tokens verified
    spec_accepted_tokens: int = 0  # of those, accepted (appended without a step of their own)
    cpu_threads: int | None = None  # threads the forwards use now, when a ThreadGovernor picks

    def record_step(self, batch: ScheduledBatch, step_s: float, forward_s: float,
                    tokens: StepTokens) -> None:
        self.steps += 1
        self.step_s += step_s
        self.forward_s += forward_s
        self.generated_tokens += tokens.generated
        self.spec_verified += tokens.verified
        self.spec_draft_tokens += tokens.drafted
        self.spec_accepted_tokens += tokens.accepted
        if batch.phase == "prefill":
            self.prefill_tokens += sum(batch.extend_lens)
            self.prefill_s += step_s
        else:
            self.decode_steps += 1
            self.decode_tokens += tokens.generated
            self.decode_s += step_s

    def record_finished(self, req: Req) -> None:
        self.prompt_tokens += len(req.origin_input_ids)
        self.cached_tokens += req.cached_tokens

    def snapshot(self, sched: Scheduler, kv: KVCacheManager) -> dict[str, Any]:
        """Engine.stats(): requests and KV slots now, and the counters as totals and rates."""
        cached = kv.cache.total_size if kv.cache else 0
        # Decode runs (slots requests took ahead for their next tokens) count as free: any
        # allocation that would fall short takes them back (runtime/kvcache/manager.py).
        free = kv.allocator.num_free + kv.num_in_runs
        return {
            "running": len(sched.running) + (1 if sched.chunked_req else 0),
            "waiting": len(sched.waiting),
            "kv_capacity": kv.allocator.capacity,
            "kv_free": free,
            "kv_cached": cached,
            "kv_used": kv.allocator.capacity - free - cached,
            "kv_in_decode_runs": kv.num_in_runs,
            # distinct tokens the reserved slots stand for (cache + running requests' own tokens)
            "kv_tokens_needed": cached + sum(r.num_computed - r.prefix_len
                                             for r in sched.active_reqs() if r.row is not None),
            "prompt_tokens": self.prompt_tokens,
            "cache_hit_tokens": self.cached_tokens,
            "open_sessions": len(kv.pins.sessions) if kv.pins else 0,
            "pinned_tokens": kv.pins.pinned_tokens if kv.pins else 0,
            "cache_hit_rate": self.cached_tokens / max(self.prompt_tokens, 1),
            "generated_tokens": self.generated_tokens,
            "decode_tokens_per_s": _rate(self.decode_tokens, self.decode_s),
            "prefill_tokens_per_s": _rate(self.prefill_tokens, self.prefill_s),
            "steps": self.steps,
            "overhead_ms_per_step": 1000 * (self.step_s - self.forward_s) / max(self.steps, 1),
            "forward_ms_per_step": 1000 * self.forward_s / max(self.steps, 1),
            "cpu_threads": self.cpu_threads,
            "spec_draft_tokens": self.spec_draft_tokens,
            "spec_accepted_tokens": self.spec_accepted_tokens,
            "spec_accept_rate": self.spec_accepted_tokens / max(self.spec_draft_tokens, 1),
            # tokens a verified draft yields, the sample after it included (SGLang's accept length)
            "spec_accept_length": (self.spec_accepted_tokens / self.spec_verified + 1
                                   if self.spec_verified else 0.0),
        }


def _rate(num: int, seconds: float) -> float:
    return num / seconds if seconds else 0.0
