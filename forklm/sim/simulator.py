"""Simulator: replays a trace on N simulated replicas behind the real router policy, on a virtual
clock (a heap of timed events; nothing sleeps). The client side follows the benchmark client:
each session's turns in order, the trace's max_in_flight gate first-come first-served."""

from __future__ import annotations

import heapq
import itertools
import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from forklm.router.policies import POLICIES, make_policy
from forklm.router.prompts import prompt_text
from forklm.runtime.config import EngineConfig
from forklm.runtime.engine.engine_request import EngineRequest
from forklm.runtime.engine.intake import RequestIntake
from forklm.runtime.sampling.params import SamplingParams
from forklm.runtime.scheduling.request import Req, ReqOutput
from forklm.sim.cost_model import CostModel
from forklm.sim.replica import SimReplica
from forklm.sim.report import RequestRecord, SimResult
from forklm.sim.traces import Session, Trace


@dataclass(frozen=True)
class ModelFacts:
    """What the simulator needs of the served model: its tokenizer (prompts are tokenized for
    real, so lengths and shared prefixes are real), EOS ids, logits width and context length."""

    tokenizer: Any
    eos_token_ids: frozenset[int]
    vocab_size: int
    context_len: int

    @classmethod
    def load(cls, model_path: str = "SmolLM2-135M-Instruct") -> ModelFacts:
        from forklm.runtime.models import spec_from_config
        from forklm.runtime.models.loader import load_model

        loaded = load_model(model_path)  # config and tokenizer; weights are not read
        spec = spec_from_config(loaded.config)
        return cls(loaded.tokenizer, frozenset(loaded.eos_token_ids), spec.vocab_size,
                   loaded.config.max_position_embeddings)


@dataclass(frozen=True)
class SimConfig:
    num_replicas: int = 1
    policy: str = "cache_aware"  # a router load-balance method (forklm/router/policies.py)
    # Each replica's engine knobs (scheduler budgets, KV capacity, radix cache on/off);
    # max_total_tokens must be set: it is the simulated KV pool's size.
    engine: EngineConfig = field(default_factory=lambda: EngineConfig(max_total_tokens=16384))
    check_invariants: bool = False  # the KV accounting checked after every step (tests)
    # Each step's duration times a uniform factor in [1 - step_jitter, 1 + step_jitter] (seeded):
    # real steps vary, and without it identical replicas finish in lockstep, so the router sees
    # ties a real fleet never shows (its load signal then decides by tie-breaking).
    step_jitter: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.num_replicas, bool) or not isinstance(self.num_replicas, int) \
                or self.num_replicas < 1:
            raise ValueError(f"num_replicas={self.num_replicas!r}: expected an int >= 1")
        if self.policy not in POLICIES:
            raise ValueError(f"policy={self.policy!r}: expected one of {', '.join(POLICIES)}")
        if not 0.0 <= self.step_jitter < 1.0:
            raise ValueError(f"step_jitter={self.step_jitter!r}: expected a number in [0, 1)")
        if self.engine.max_total_tokens is None:
            raise ValueError("engine.max_total_tokens=None: the simulated KV pool needs a size")


@dataclass
class _Pending:
    """A turn waiting for the client's gate."""

    session: int
    turn: int
    prompt: str


@dataclass
class _Live:
    record: RequestRecord
    prompt: str
    replica: SimReplica
    text: list[str] = field(default_factory=list)


class Simulation:
    """One run of a trace (a Simulation is used once): `Simulation(config, cost, model)
    .run(trace)` -> SimResult."""

    def __init__(self, config: SimConfig, cost: CostModel, model: ModelFacts):
        self.config, self.cost, self.model = config, cost, model
        capacity = config.engine.max_total_tokens
        assert capacity is not None
        self.replicas = [SimReplica(i, config.engine, cost, model.context_len,
                                    config.check_invariants) for i in range(config.num_replicas)]
        self.policy = make_policy(config.policy, config.num_replicas)
        self.intake = RequestIntake(model.tokenizer, model.vocab_size, model.context_len,
                                    capacity, model.eos_token_ids, config.engine.random_seed)
        self.now = 0.0
        self._rng = random.Random(config.seed)
        # (time, order, seq, action): at equal times arrivals (order 0) come before the steps
        # that idle replicas start (order 1), so requests sent together are batched together.
        self._events: list[tuple[float, int, int, Callable[[], None]]] = []
        self._starting: set[int] = set()  # idle replicas with a step start queued
        self._seq = itertools.count()
        self._gate: deque[_Pending] = deque()
        self._in_flight = 0
        self._records: list[RequestRecord] = []
        self._done: list[_Live] = []  # finished during the current step, handled after it

    def run(self, trace: Trace) -> SimResult:
        self.trace = trace
        for i, session in enumerate(trace.sessions):
            self._at(session.start_s, self._first_turn(i))
        while self._events:
            self.now, _, _, action = heapq.heappop(self._events)
            action()
        unfinished = [r for r in self._records if r.finish_s is None]
        assert not unfinished, f"{len(unfinished)} requests never finished"
        return SimResult(trace.name, self.config.policy, self.config.num_replicas,
                         self._records, [r.stats for r in self.replicas],
                         [r.capacity for r in self.replicas])

    def _first_turn(self, session: int) -> Callable[[], None]:
        return lambda: self._arrive(session, 0, self.trace.sessions[session].turns[0].text)

    # -- events --------------------------------------------------------------------------------
    def _at(self, when: float, action: Callable[[], None], order: int = 0) -> None:
        heapq.heappush(self._events, (when, order, next(self._seq), action))

    def _arrive(self, session: int, turn: int, prompt: str) -> None:
        """A turn is ready: sent now, or queued behind the client's gate."""
        limit = self.trace.max_in_flight
        if limit is not None and self._in_flight >= limit:
            self._gate.append(_Pending(session, turn, prompt))
            return
        self._in_flight += 1
        self._send(session, turn, prompt)

    def _send(self, session: int, turn: int, prompt: str) -> None:
        spec = self.trace.sessions[session].turns[turn]
        alive = list(range(len(self.replicas)))
        loads = [r.stats.in_flight for r in self.replicas]
        # The routing key the router takes from a /v1/completions body.
        key = prompt_text("/v1/completions", {"prompt": prompt})
        replica = self.replicas[self.policy.choose(key, alive, loads).replica]
        params = SamplingParams(temperature=0.0, max_new_tokens=spec.max_new_tokens,
                                ignore_eos=True)
        group = self.intake.build(EngineRequest(prompt, sampling_params=params,
                                                rid=f"s{session}-t{turn}"))
        req = group.reqs[0]
        record = RequestRecord(session, turn, replica.index, self.now,
                               prompt_tokens=len(req.origin_input_ids))
        live = _Live(record, prompt, replica)
        req.sink = lambda out: self._on_output(live, out)
        self._records.append(record)
        replica.submit(req)
        if not replica.busy and replica.index not in self._starting:
            self._starting.add(replica.index)
            self._at(self.now, lambda: self._kick(replica), order=1)

    def _kick(self, replica: SimReplica) -> None:
        """Start the replica's next step now if it is idle and has work; then the client hears
        of the requests that finished (in the step before, or aborted by this schedule)."""
        self._starting.discard(replica.index)
        if not replica.busy and replica.scheduler.has_work:
            seconds = replica.start_step()
            if seconds is not None:
                jitter = self.config.step_jitter
                seconds *= 1 + self._rng.uniform(-jitter, jitter) if jitter else 1
                self._at(self.now + seconds, lambda: self._step_done(replica))
        done, self._done = self._done, []
        for live in done:
            self._after_request(live)

    def _step_done(self, replica: SimReplica) -> None:
        replica.finish_step()
        self._kick(replica)  # the next step starts before the client can answer

    def _on_output(self, live: _Live, out: ReqOutput) -> None:
        """A request's event, sent during its replica's finish_step (the step's end)."""
        record = live.record
        if out.delta_ids and record.first_token_s is None:
            record.first_token_s = self.now
        live.text.append(out.delta_text)
        if out.finished:
            req: Req = out.req
            record.finish_s = self.now
            record.output_tokens = len(req.output_ids)
            record.cached_tokens = req.cached_tokens
            record.finish_reason = req.finish_reason.type if req.finish_reason else "?"
            live.replica.request_done()
            self._done.append(live)

    def _after_request(self, live: _Live) -> None:
        """Free the gate for the next waiting turn; the session's next turn arrives after its
        delay, its prompt the conversation so far."""
        if self._gate:  # the freed place passes to the first waiting turn
            waiting = self._gate.popleft()
            self._at(self.now, lambda: self._send(waiting.session, waiting.turn, waiting.prompt))
        else:
            self._in_flight -= 1
        session: Session = self.trace.sessions[live.record.session]
        turn = live.record.turn + 1
        if turn < len(session.turns):
            nxt = session.turns[turn]
            prompt = live.prompt + "".join(live.text) + session.separator + nxt.text
            self._at(self.now + nxt.delay_s,
                     lambda: self._arrive(live.record.session, turn, prompt))
