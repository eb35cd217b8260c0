"""W5: structured programs through the DSL on the in-process engine, `run_batch` against the same
programs run one at a time. (a) a few-shot `select` program, (b) a 4-way fork/join program."""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import forklm as sgl
from benchmarks.runners import Metrics, _metrics
from benchmarks.workloads import WORDS, Workload

LABELS = ["sports", "food", "music", "travel"]
_EXAMPLES = [
    ("The team won the final match after extra time.", "sports"),
    ("She baked fresh bread and a lemon cake this morning.", "food"),
    ("The band played three new songs at the concert.", "music"),
    ("We took a night train across the mountains to the coast.", "travel"),
    ("He scored twice in the second half of the game.", "sports"),
]
FEW_SHOT = "Label the topic of each sentence.\n\n" + "".join(
    f"Sentence: {text}\nTopic: {label}\n\n" for text, label in _EXAMPLES)


@sgl.function
def classify(s, sentence):
    """W5a: 5 labelled examples, then a sentence; `select` one of 4 labels."""
    s += FEW_SHOT + f"Sentence: {sentence}\nTopic:"
    s += sgl.select("label", choices=[" " + label for label in LABELS])


@sgl.function
def brainstorm(s, topic):
    """W5b: a prompt, fork(4) branches of a 48-token idea each, join, a 32-token summary."""
    s += f"Here are four short ideas about {topic}.\n"
    branches = s.fork(4)
    branches += lambda i: f"Idea {i + 1}:" + sgl.gen("idea", max_tokens=48, ignore_eos=True)
    branches.join()
    s += "".join(f"Idea {i + 1}:{idea}\n" for i, idea in enumerate(s["idea"]))
    s += "Summary:" + sgl.gen("summary", max_tokens=32, ignore_eos=True)


def select_items(num: int = 64, seed: int = 5) -> list[dict[str, str]]:
    rng = random.Random(seed)
    return [{"sentence": " ".join(rng.choice(WORDS) for _ in range(12)).capitalize() + "."}
            for _ in range(num)]


def fork_items(num: int = 16, seed: int = 6) -> list[dict[str, str]]:
    rng = random.Random(seed)
    return [{"topic": f"the {rng.choice(WORDS)} and the {rng.choice(WORDS)}"} for _ in range(num)]


@dataclass
class ProgramWorkload:
    name: str
    program: Any
    items: list[dict[str, str]]


PROGRAM_WORKLOADS: dict[str, Callable[[], ProgramWorkload]] = {
    "W5-select": lambda: ProgramWorkload("W5 select program", classify, select_items()),
    "W5-fork": lambda: ProgramWorkload("W5 fork/join program", brainstorm, fork_items()),
}


class ProgramRunner:
    """Runs a ProgramWorkload on the engine, batched (`run_batch`) or one program at a time.
    Programs/s lands in requests_per_s; prompt tokens computed/sent (the cache hit rate) come from
    the engine's counters, the sums of every request's meta_info prompt/cached tokens."""

    def __init__(self, engine: Any, system: str = "forklm"):
        self.engine, self.system = engine, system
        self.backend = sgl.EngineBackend(engine)

    def run(self, pw: ProgramWorkload, batched: bool) -> Metrics:
        self.engine.flush_cache()
        before = self.engine.stats()
        latencies: list[float] = []
        t0 = time.perf_counter()
        if batched:
            states = pw.program.run_batch(pw.items, backend=self.backend, temperature=0.0,
                                          generator_style=True)
            for state in states:  # in input order: latency = when each is seen finished
                state.text()
                latencies.append(time.perf_counter() - t0)
        else:
            for item in pw.items:
                start = time.perf_counter()
                pw.program.run(**item, backend=self.backend, temperature=0.0).text()
                latencies.append(time.perf_counter() - start)
        wall = time.perf_counter() - t0
        after = self.engine.stats()
        sent = after["prompt_tokens"] - before["prompt_tokens"]
        cached = after["cache_hit_tokens"] - before["cache_hit_tokens"]
        out_tokens = after["generated_tokens"] - before["generated_tokens"]
        wl = Workload(pw.name + (" (run_batch)" if batched else " (one at a time)"), [])
        return _metrics(self.system, wl, wall, out_tokens, latencies, [], sent, sent - cached)


def hit_rate(ms: list[Metrics]) -> float:
    """Median share of prompt tokens served from the cache over repeated runs."""
    return statistics.median(1 - m.prompt_tokens_computed / max(m.prompt_tokens_sent, 1)
                             for m in ms)
