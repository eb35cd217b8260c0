"""Traces the simulator replays: sessions of turns, each turn's prompt the whole conversation so
far (earlier prompts and answers) plus its own new text, and a synthetic agent trace generator."""

from __future__ import annotations

import random
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Turn:
    text: str  # appended to the conversation: a question, or a tool's output
    max_new_tokens: int = 64
    # Wait after the previous turn's answer before this turn is sent (user think time, a tool's
    # round trip); ignored for a session's first turn, which arrives at the session's start.
    delay_s: float = 0.0


@dataclass(frozen=True)
class Session:
    """Turns sent in order: turn k's prompt = turn k-1's prompt + its answer + `separator` +
    turn k's text (the benchmark client's multi-turn rule, benchmarks/runners.py `drive`)."""

    start_s: float
    turns: tuple[Turn, ...]
    separator: str = "\n"


@dataclass(frozen=True)
class Trace:
    """Sessions and the client's gate: with max_in_flight, at most that many requests are
    outstanding and the rest wait first-come first-served (a closed-loop benchmark client);
    None sends every turn when it arrives (open loop)."""

    name: str
    sessions: tuple[Session, ...]
    max_in_flight: int | None = None
    meta: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.sessions:
            raise ValueError(f"trace {self.name!r}: no sessions")
        if self.max_in_flight is not None and self.max_in_flight < 1:
            raise ValueError(f"trace {self.name!r}: max_in_flight={self.max_in_flight}: "
                             "expected >= 1 or None")
        for s in self.sessions:
            if not s.turns or s.start_s < 0:
                raise ValueError(f"trace {self.name!r}: a session needs turns and start_s >= 0")

    @property
    def num_requests(self) -> int:
        return sum(len(s.turns) for s in self.sessions)


@dataclass(frozen=True)
class AgentTraceConfig:
    """Agent sessions arriving as a Poisson process; each starts from one of a few shared system
    prompts (tool descriptions), then alternates model calls with tool round trips whose output
    is appended, so the context grows every turn."""

    num_sessions: int = 64
    sessions_per_s: float = 1.0  # Poisson arrival rate
    num_system_prompts: int = 4  # distinct agent definitions sharing traffic
    system_prompt_words: int = 600
    task_words: int = 40
    min_turns: int = 2
    max_turns: int = 6
    tool_output_words: tuple[int, int] = (40, 200)  # uniform range per tool call
    tool_latency_s: tuple[float, float] = (0.2, 2.0)  # uniform range per tool round trip
    max_new_tokens: int = 48
    seed: int = 0

    def __post_init__(self) -> None:
        checks = [("num_sessions", self.num_sessions >= 1), ("sessions_per_s", self.sessions_per_s > 0),
                  ("num_system_prompts", self.num_system_prompts >= 1),
                  ("min_turns", 1 <= self.min_turns <= self.max_turns),
                  ("max_new_tokens", self.max_new_tokens >= 1)]
        for name, ok in checks:
            if not ok:
                raise ValueError(f"AgentTraceConfig.{name}={getattr(self, name)!r} is out of range")


# Filler vocabulary for synthetic text: each " word" is about one token with common tokenizers.
_WORDS = ("call tool result file read write search query answer error value list item user "
          "task step plan check test code line name data table row field open close send get "
          "set run stop start time date page link note text json http path type key map").split()


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(n))


def agent_trace(config: AgentTraceConfig, name: str = "agent") -> Trace:
    """Open-loop agent sessions (deterministic for a seed)."""
    rng = random.Random(config.seed)
    systems = [f"System: agent {i}. Tools:\n{_words(rng, config.system_prompt_words)}\n"
               for i in range(config.num_system_prompts)]
    sessions, t = [], 0.0
    for _ in range(config.num_sessions):
        t += rng.expovariate(config.sessions_per_s)
        first = Turn(rng.choice(systems) + f"User: {_words(rng, config.task_words)}\nAssistant:",
                     config.max_new_tokens)
        turns = [first] + [
            Turn(f"Tool: {_words(rng, rng.randint(*config.tool_output_words))}\nAssistant:",
                 config.max_new_tokens, delay_s=rng.uniform(*config.tool_latency_s))
            for _ in range(rng.randint(config.min_turns, config.max_turns) - 1)]
        sessions.append(Session(t, tuple(turns)))
    return Trace(name, tuple(sessions), meta={"agent": config})
