"""Scheduler: picks each step's batch (continuous batching): a prefill batch of waiting requests
within the token budgets, or one decode step for every running request, retracting on KV shortage."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from forklm.runtime.sampling.ngram_draft import NgramDrafter
from forklm.runtime.scheduling.request import FinishReason, Req

if TYPE_CHECKING:
    from forklm.runtime.config import EngineConfig
    from forklm.runtime.kvcache.manager import KVCacheManager

logger = logging.getLogger(__name__)

# A request's future tokens counted when admitting others are clipped to this (SGLang's CLIP).
RESERVE_CLIP = 4096
# Waiting requests that share at least this many uncached tokens with one already in the batch
# wait one step, so they hit the cache instead of computing the shared part again.
IN_BATCH_SHARE_THRESHOLD = 32
# lpm sorts the queue by cached-prefix length; beyond this many waiting requests it is fcfs.
LPM_MAX_QUEUE = 128
# Fraction of a running request's remaining tokens reserved at admission: starts high, decays
# every decode step, and jumps back after a retraction (SGLang's new_token_ratio).
INIT_NEW_TOKEN_RATIO, MIN_NEW_TOKEN_RATIO, NEW_TOKEN_RATIO_DECAY = 0.7, 0.1, 0.001


# What a step computes: "prefill" (new requests' prompts, maybe a chunk), "decode" (one token for
# every running request), or "catch_up" (running requests computing the tokens a jump-forward
# appended, or the last token plus a speculative draft to verify: several per request, like a
# prefill, but they stay in the running set).
Phase = Literal["prefill", "decode", "catch_up"]


@dataclass
class ScheduledBatch:
    reqs: list[Req]
    extend_lens: list[int]  # new tokens computed per request this step (1 each for decode)
    phase: Phase
    # Per request: this step ends its prefill (or is a decode), so a token is sampled for it.
    samples: list[bool]
    # Per request: the speculative draft tokens computed after its last token (their KV is the
    # tail of extend_lens); empty when no request in the batch has one.
    draft_ids: list[list[int]] = field(default_factory=list)
    # Decode steps run back to back (num_continuous_decode_steps): each request's KV slots are
    # taken for all of them, and its tokens are applied after the last.
    steps: int = 1
    # Tokens the requests' computed counts run ahead of this forward: one step of a run of
    # `steps` computes each request's token at num_computed - 1 - behind.
    behind: int = 0

    @classmethod
    def prefill(cls, reqs: list[Req], extend_lens: list[int]) -> ScheduledBatch:
        samples = [r.num_computed == r.fill_len for r in reqs]
        return cls(reqs, extend_lens, "prefill", samples)

    @property
    def is_decode(self) -> bool:
        """One new token per request: the forward may take the decode path."""
        return self.phase == "decode"

    def drafts(self, i: int) -> list[int]:
        return self.draft_ids[i] if self.draft_ids else []

    def part(self, indices: Sequence[int]) -> ScheduledBatch:
        """The requests at `indices`, each with its own length, sample flag and draft."""
        return ScheduledBatch([self.reqs[i] for i in indices],
                              [self.extend_lens[i] for i in indices], self.phase,
                              [self.samples[i] for i in indices],
                              [self.draft_ids[i] for i in indices] if self.draft_ids else [],
                              self.steps, self.behind)

    def step_of_run(self, i: int) -> ScheduledBatch:
        """Step i (from 0) of a batch of `steps` continuous decode steps, as one decode step."""
        return ScheduledBatch(self.reqs, self.extend_lens, self.phase, self.samples,
                              behind=self.steps - 1 - i)


class Scheduler:
    def __init__(self, config: EngineConfig, kv: KVCacheManager):
        self.config, self.kv = config, kv
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.chunked_req: Req | None = None
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO * config.schedule_conservativeness
        self.aborted: list[Req] = []  # requests the scheduler had to give up on (drained by the engine)
        self.drafter = NgramDrafter(config) if config.speculative_algorithm == "NGRAM" else None

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.chunked_req)

    def active_reqs(self) -> list[Req]:
        extra = [self.chunked_req] if self.chunked_req else []
        return self.running + extra

    def schedule(self) -> ScheduledBatch | None:
        """Prefill has priority; otherwise decode every running request."""
        batch = self._schedule_prefill()
        if batch is None and self.running:
            batch = self._schedule_decode()
        return batch

    # -- prefill -------------------------------------------------------------------------------
    def _schedule_prefill(self) -> ScheduledBatch | None:
        if self.config.enable_priority_scheduling and self.waiting:
            self._preempt_for_priority()
        if (not self.waiting or len(self.running) >= self.config.max_running_requests) and self.chunked_req is None:
            return None
        reqs, lens = [], []
        token_budget = self.config.max_prefill_tokens
        if self.chunked_req is not None:
            req, self.chunked_req = self.chunked_req, None
            n = self._chunk_len(req, token_budget)
            if not self._make_room(n):
                self._give_up(req, "out of KV cache memory during chunked prefill")
                return None
            self.kv.extend(req, n)
            reqs.append(req)
            lens.append(n)
            token_budget -= n
            if req.num_computed < req.fill_len:
                self.chunked_req = req
        queue = self._ordered_waiting()
        in_batch: list[list[int]] = []
        adapters = ({r.lora.uid for r in [*self.running, *reqs] if r.lora is not None}
                    if self.config.lora_enabled else set())
        for req, cached in queue:
            full = len(self.running) + len(reqs) >= self.config.max_running_requests
            if full or token_budget <= 0 or self.chunked_req is not None:
                break
            if self._shares_with_batch(req, cached, in_batch):
                continue  # waits one step, then hits the cache
            if (req.lora is not None and req.lora.uid not in adapters
                    and len(adapters) >= self.config.max_loras_per_batch):
                continue  # its adapter joins once one of the batch's is done
            if req.lora is not None:
                adapters.add(req.lora.uid)
            n = self._try_admit(req, token_budget, reqs)
            if n == 0:  # out of KV: stop here, keeping the policy's order for next time
                break
            reqs.append(req)
            lens.append(n)
            in_batch.append(req.cache_key())
            token_budget -= n
            if req.num_computed < req.fill_len:
                self.chunked_req = req
        admitted = {id(r) for r in reqs}
        self.waiting = [r for r, _ in queue if id(r) not in admitted]
        return ScheduledBatch.prefill(reqs, lens) if reqs else None

    def _ordered_waiting(self) -> list[tuple[Req, int]]:
        """Waiting requests in policy order, each with its cached-prefix length (matched once)."""
        queue = sorted(self.waiting, key=lambda r: r.arrival)
        use_cache = self.kv.cache is not None and len(queue) <= LPM_MAX_QUEUE
        pairs = [(r, self.kv.match_len(r) if use_cache else 0) for r in queue]
        if self.config.schedule_policy == "lpm":
            pairs.sort(key=lambda p: -p[1])  # stable: fcfs among equals
        return self._fair_order(pairs)

    def _fair_order(self, pairs: list[tuple[Req, int]]) -> list[tuple[Req, int]]:
        """Priority first (when on), then tenants interleaved: a tenant's k-th waiting request
        ranks k + its running count, so one tenant's flood of requests (queued or running) never
        keeps another's first request waiting behind it. The policy's order holds within a
        tenant and between equal ranks; with one tenant the order is the policy's."""
        running = Counter(r.tenant for r in self.active_reqs())
        seen: Counter[str] = Counter()
        ranks = []
        for req, _ in pairs:
            ranks.append(running[req.tenant] + seen[req.tenant])
            seen[req.tenant] += 1
        order = sorted(range(len(pairs)),
                       key=lambda i: (self._priority_rank(pairs[i][0]), ranks[i], i))
        return [pairs[i] for i in order]

    def _priority_rank(self, req: Req) -> int:
        """Sorts first for the most urgent request: larger priority values (SGLang's default),
        or smaller with schedule_low_priority_values_first; 0 for all when priorities are off."""
        if not self.config.enable_priority_scheduling:
            return 0
        return req.priority if self.config.schedule_low_priority_values_first else -req.priority

    def _preempt_for_priority(self) -> None:
        """With the running set full, a waiting request more urgent than the least urgent running
        one by priority_scheduling_preemption_threshold or more takes its place: that one is
        retracted (its KV kept in the cache) and waits to resume where it was."""
        threshold = self.config.priority_scheduling_preemption_threshold
        while len(self.running) >= self.config.max_running_requests and self.running:
            urgent = min(self.waiting, key=self._priority_rank)
            victim = max(self.running, key=lambda r: (self._priority_rank(r), -r.arrival))
            if self._priority_rank(victim) - self._priority_rank(urgent) < threshold:
                return
            self._retract(victim, f"preempted for {urgent.rid} (priority {urgent.priority})")

    def _shares_with_batch(self, req: Req, cached: int, in_batch: list[list[int]]) -> bool:
        """Whether req shares >= IN_BATCH_SHARE_THRESHOLD uncached tokens with a request admitted
        in this batch (it then waits one step, when that prefix is in the cache)."""
        if self.kv.cache is None:
            return False
        n = cached + IN_BATCH_SHARE_THRESHOLD
        ids = req.cache_key(n)
        return len(ids) >= n and any(len(o) >= n and o[:n] == ids for o in in_batch)

    def _chunk_len(self, req: Req, token_budget: int) -> int:
        """Tokens of req to compute this step: all that remain, or with chunked prefill on, at most
        one chunk and what is left of the step's prefill budget (more where the chunk starts
        inside or at a block of image tokens longer than that: MultimodalPrompt.chunk_end)."""
        n = req.fill_len - req.num_computed
        if self.config.chunked_prefill_size > 0:
            n = max(1, min(n, self.config.chunked_prefill_size, token_budget))
            if req.mm is not None:  # a chunk never cuts a block of image tokens
                n = req.mm.chunk_end(req.num_computed, req.num_computed + n) - req.num_computed
        return n

    def _try_admit(self, req: Req, token_budget: int, batch: list[Req]) -> int:
        """Admit req (lock its cached prefix, allocate its first chunk) if KV allows; returns the
        number of tokens to compute now, or 0 when it must keep waiting."""
        self.kv.admit(req)
        n = self._chunk_len(req, token_budget)
        if n > token_budget and batch:  # no chunking: only a batch's first request may exceed it
            self.kv.release(req)
            return 0
        full = req.num_computed + n == req.fill_len
        # Alone (nothing running, nothing admitted yet) there is no one to wait for: a reserve
        # larger than the whole pool would otherwise keep req waiting forever.
        alone = not self.running and not batch
        need = n + (self._reserve(req) if full and not alone else 0)
        if need > self.kv.available_tokens - self._reserved_for(self.running + batch):
            self.kv.release(req)
            return 0
        if req.num_retractions == 0:
            req.cached_tokens = req.prefix_len
        self.kv.extend(req, n)
        return n

    def _reserve(self, req: Req) -> int:
        return int(min(req.remaining_new_tokens(), RESERVE_CLIP) * self.new_token_ratio)

    def _reserved_for(self, reqs: list[Req]) -> int:
        return sum(self._reserve(r) for r in reqs)

    # -- decode --------------------------------------------------------------------------------
    def _make_room(self, num_tokens: int, keep: int = 0) -> bool:
        """Retract running requests until num_tokens slots are obtainable (keeping at least `keep`
        running); returns whether that worked."""
        while self.kv.available_tokens < num_tokens and len(self.running) > keep:
            self._retract_one()
        return self.kv.available_tokens >= num_tokens

    def _give_up(self, req: Req, message: str) -> None:
        self.abort(req)
        req.finish_reason = FinishReason("abort", message=message)
        self.aborted.append(req)

    def _schedule_decode(self) -> ScheduledBatch | None:
        """Every running request computes its uncomputed tokens: the last sampled one, plus any a
        jump-forward appended after it."""
        while self.kv.available_tokens < self._num_uncomputed() and len(self.running) > 1:
            self._retract_one()
        if self.kv.available_tokens < self._num_uncomputed():  # one request alone does not fit
            self._give_up(self.running[0], "out of KV cache memory")
            return None
        lens = [req.num_uncomputed for req in self.running]
        drafts = self._propose_drafts(self.kv.available_tokens - sum(lens))
        if drafts:
            lens = [n + len(d) for n, d in zip(lens, drafts)]
        phase: Phase = "decode" if all(n == 1 for n in lens) else "catch_up"
        steps = self._continuous_steps() if phase == "decode" else 1
        for _ in range(steps):  # one slot a step, from each request's decode run
            self.kv.extend_all(self.running, lens)
            self._decay_new_token_ratio()
        return ScheduledBatch(list(self.running), lens, phase, [True] * len(lens), drafts, steps)

    def _continuous_steps(self) -> int:
        """How many decode steps to run back to back (num_continuous_decode_steps): 1 while
        requests wait to be prefilled, or where a request's next token depends on its last one
        outside the model (a grammar's mask, penalties, a min_new_tokens ban still pending,
        images' rotary rows, drafts); else as many as every request may still take and the
        free KV slots allow."""
        steps = self.config.num_continuous_decode_steps
        if (steps == 1 or self.waiting or self.chunked_req is not None
                or self.drafter is not None):
            return 1
        for req in self.running:
            params = req.sampling_params
            if (req.grammar is not None or req.mm is not None or params.uses_penalties
                    or len(req.output_ids) < params.min_new_tokens):
                return 1
            steps = min(steps, req.tokens_left())
        return max(1, min(steps, self.kv.available_tokens // len(self.running)))

    def _decay_new_token_ratio(self) -> None:
        self.new_token_ratio = max(
            self.new_token_ratio - NEW_TOKEN_RATIO_DECAY,
            MIN_NEW_TOKEN_RATIO * self.config.schedule_conservativeness,
        )

    # -- overlap (the next decode step, before this one's tokens reach the host) ---------------
    def schedule_ahead(self, batch: ScheduledBatch) -> ScheduledBatch | None:
        """The decode step after `batch` (a decode step whose samples are still on the device),
        scheduled before those samples reach the host: every request of it that may go on
        computes the token it is sampling now. None when the plain order must decide instead:
        requests wait to be prefilled (they have priority), or KV is short (retraction needs
        the outputs). A request whose token now ends it by length is left out; one that stops
        on its token (EOS, a stop string) is found out after this step was launched, and
        `cancel_ahead` returns its slot."""
        if self.waiting or self.chunked_req is not None or batch.draft_ids:
            return None
        reqs = [r for r in batch.reqs if r.tokens_left() > 1]
        if not reqs or self.kv.available_tokens < len(reqs):
            return None
        self.kv.extend_all(reqs, [1] * len(reqs))  # the slots of the tokens being sampled now
        self._decay_new_token_ratio()
        return ScheduledBatch(reqs, [1] * len(reqs), "decode", [True] * len(reqs))

    def cancel_ahead(self, ahead: ScheduledBatch) -> None:
        """The requests of `ahead` that finished on the previous step's token give back the slot
        `schedule_ahead` gave them: its KV is never part of their cached sequence (as without
        overlap)."""
        for req in ahead.reqs:
            if req.finished and req.row is not None and req.num_computed > req.prefix_len:
                self.kv.trim(req, req.num_computed - 1)

    def _propose_drafts(self, spare_slots: int) -> list[list[int]]:
        """Each running request's draft ([] for none) within the spare KV slots: a draft never
        causes a retraction. Returns [] when nothing is drafted (the step stays a plain decode)."""
        if self.drafter is None:
            return []
        drafts = []
        for req in self.running:
            draft = self.drafter.propose(req)[: max(spare_slots, 0)]
            spare_slots -= len(draft)
            drafts.append(draft)
        return drafts if any(drafts) else []

    def _num_uncomputed(self) -> int:
        return sum(req.num_uncomputed for req in self.running)

    def _retract_one(self) -> None:
        """Free the KV of the request with the fewest outputs (longest prompt on ties) and requeue it
        at the front; it re-prefills later (mostly from the cache) and continues where it was."""
        victim = min(self.running, key=lambda r: (len(r.output_ids), -len(r.origin_input_ids)))
        self._retract(victim, "KV short")

    def _retract(self, victim: Req, why: str) -> None:
        self.running.remove(victim)
        self.kv.release(victim)
        victim.num_retractions += 1
        victim.arrival = -1 - victim.num_retractions  # ahead of every new request
        self.waiting.append(victim)
        total_max = sum(r.sampling_params.max_new_tokens for r in self.running) or 1
        decoded = sum(len(r.output_ids) for r in self.running)
        self.new_token_ratio = min(1.0, (decoded + 20 * len(self.running)) / total_max)
        logger.info("retracted %s (%s); %d running", victim.rid, why, len(self.running))

    # -- after the forward ---------------------------------------------------------------------
    def after_step(self, batch: ScheduledBatch) -> None:
        """Finished requests leave (KV to the cache); freshly prefilled ones join the running set."""
        for i, req in enumerate(batch.reqs):
            if batch.drafts(i) and req.row is not None:
                # Valid KV now ends before the last appended token; the rest was rejected drafts.
                self.kv.trim(req, req.fill_len - 1)
            if req.finished:
                assert req.finish_reason is not None
                self.kv.release(req, pin=req.finish_reason.type != "abort")
                if req in self.running:
                    self.running.remove(req)
                if req is self.chunked_req:
                    self.chunked_req = None
                continue
            if batch.phase == "prefill":
                self.kv.cache_unfinished(req)
                if batch.samples[i]:
                    self.running.append(req)

    def abort(self, req: Req) -> None:
        """Remove req wherever it is and release its KV (the caller sets its finish reason)."""
        for queue in (self.waiting, self.running):
            if req in queue:
                queue.remove(req)
        if req is self.chunked_req:
            self.chunked_req = None
        self.kv.release(req)
