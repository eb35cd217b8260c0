"""Deterministic benchmark workloads (see shared/workloads.md): raw prompts from a fixed word list,
seeded, greedy with ignore_eos so every system generates the same number of tokens."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

# ~200 common English words; with the default tokenizer one " word" is about one token.
WORDS = """the of and to in is you that it he was for on are as with his they at be this have from
or one had by word but not what all were we when your can said there use an each which she do how
their if will up other about out many then them these so some her would make like him into time has
look two more write go see number no way could people my than first water been call who oil its now
find long down day did get come made may part over new sound take only little work know place year
live me back give most very after thing our just name good sentence man think say great where help
through much before line right too mean old any same tell boy follow came want show also around form
three small set put end does another well large must big even such because turn here why ask went
men read need land different home us move try kind hand picture again change off play spell air away
animal house point page letter mother answer found study still learn should america world""".split()


@dataclass
class Request:
    prompt: str
    max_new_tokens: int = 64
    ignore_eos: bool = True
    json_schema: dict | None = None  # W4: generate under this schema
    conversation: int | None = None  # W3: requests of one conversation run in turn order
    turn: int = 0


@dataclass
class Workload:
    name: str
    requests: list[Request]
    max_in_flight: int = 16
    multi_turn: bool = False
    meta: dict = field(default_factory=dict)


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def shared_prefix(num_requests: int = 64, seed: int = 0) -> Workload:
    """W1: one ~400-token few-shot prefix (instruction + 8 Q/A pairs) + a distinct question."""
    rng = random.Random(seed)
    shots = "".join(f"Q: {_words(rng, 14)}?\nA: {_words(rng, 25)}.\n\n" for _ in range(8))
    prefix = "Answer each question in one short sentence.\n\n" + shots
    reqs = [Request(prefix + f"Q: {_words(rng, 18)}?\nA:") for _ in range(num_requests)]
    return Workload("W1 shared prefix", reqs)


def no_sharing(num_requests: int = 64, seed: int = 1) -> Workload:
    """W2: distinct random ~400-token prompts."""
    rng = random.Random(seed)
    return Workload("W2 no sharing", [Request(_words(rng, 400)) for _ in range(num_requests)])


def multi_turn(num_conversations: int = 16, num_turns: int = 4, seed: int = 2) -> Workload:
    """W3: each turn's prompt is the previous prompt + its answer + a new question. The runner
    fills in answers as turns finish; here each request holds the question of its turn."""
    rng = random.Random(seed)
    reqs = [Request(f"Q: {_words(rng, 18)}?\nA:", conversation=c, turn=t)
            for c in range(num_conversations) for t in range(num_turns)]
    return Workload("W3 multi-turn", reqs, multi_turn=True)


PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"},
        "email": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "city", "email", "tags", "active"],
}


def json_people(num_requests: int = 32, constrained: bool = True) -> Workload:
    """W4: "Describe person #i as JSON:", 128 tokens at most, EOS allowed; with the schema
    constraint (W4) or without it (W4-free, the same prompts)."""
    reqs = [Request(f"Describe person #{i} as JSON:", max_new_tokens=128, ignore_eos=False,
                    json_schema=PERSON_SCHEMA if constrained else None)
            for i in range(num_requests)]
    return Workload("W4 JSON" + ("" if constrained else " (no constraint)"), reqs)


def shared_prefix_64() -> Workload:
    """W1 with all 64 requests in flight (larger decode batches; not in workloads.md's W1)."""
    wl = shared_prefix()
    wl.name, wl.max_in_flight = "W1 shared prefix, 64 in flight", 64
    return wl


def single_stream(num_requests: int = 8) -> Workload:
    """S1: W2's distinct prompts one at a time: per-token decode speed (ms/token) and TTFT at
    batch 1, where batching and caching cannot help (issue 15's parity target)."""
    wl = no_sharing(num_requests)
    wl.name, wl.max_in_flight = "S1 single stream", 1
    return wl


# P1's prompt in words: 2,000 tokens with the default model's BPE vocabulary (a token a word),
# short enough that prompt and answer fit one of llama-server's 2048-token slots.
LONG_PROMPT_WORDS = 2000


def long_prompt(num_requests: int = 4, seed: int = 3) -> Workload:
    """P1: distinct ~2,000-token prompts one at a time, 8 new tokens each: the time to first token
    of a long prompt, where all of it must be computed (issue 34's TTFT target)."""
    rng = random.Random(seed)
    reqs = [Request(_words(rng, LONG_PROMPT_WORDS), max_new_tokens=8) for _ in range(num_requests)]
    return Workload("P1 2000-token prompt", reqs, max_in_flight=1)


WORKLOADS = {
    "W1": shared_prefix, "W1-64": shared_prefix_64, "W2": no_sharing, "W3": multi_turn,
    "W4": json_people, "W4-free": lambda: json_people(constrained=False), "S1": single_stream,
    "P1": long_prompt,
}
