"""NGRAM speculative decoding vs plain decoding on the default chat model, greedy, batch 1: (a)
agent-like answers that copy the prompt with a change, (b) JSON-ish answers written fresh.

Run: `python -m benchmarks.speculative [--repeats 3] [--max-new-tokens 128] [--dtype auto]`.
Both engines live in this process; repeats alternate between them so machine noise hits both.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass, field

from benchmarks.quant_speed import cpu_flags
from forklm import Engine

CONFIG = '{"service": "billing", "replicas": 3, "image": "billing:1.4.2", "env": {"LOG_LEVEL": "info", "DB_HOST": "db.internal", "DB_PORT": 5432}, "ports": [8080, 9090], "healthcheck": {"path": "/health", "interval_s": 10}}'
CODE = '''def moving_average(values, window):
    if window <= 0:
        raise ValueError("window must be positive")
    result = []
    total = 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        if i >= window - 1:
            result.append(total / window)
    return result'''
WORKLOADS = {
    "agent-copy": [
        f"Rewrite this JSON with replicas set to 5. Output only the JSON.\n{CONFIG}",
        f"Rename the function to rolling_mean and output the whole code.\n```python\n{CODE}\n```",
        f"Repeat this JSON exactly, but change LOG_LEVEL to debug.\n{CONFIG}",
    ],
    "json-fresh": [
        "Output a JSON object describing a fictional book: title, author, year, genres (a list)"
        " and a short summary.",
        "Give a JSON list of three cities, each an object with name, country and population.",
        "Write a JSON object for a user profile with id, name, email, and a settings object.",
    ],
}


@dataclass
class Tally:
    """One repeat of a workload on one engine: prompt + decode time end to end."""

    tokens: int = 0
    wall_s: float = 0.0
    drafted: int = 0
    accepted: int = 0
    outputs: list[list[int]] = field(default_factory=list)

    def add_run(self, engine: Engine, prompt: str, params: dict) -> None:
        before = engine.stats()
        t0 = time.perf_counter()
        result = engine.generate(prompt, params)
        self.wall_s += time.perf_counter() - t0
        after = engine.stats()
        self.tokens += len(result["output_ids"])
        self.outputs.append(result["output_ids"])
        self.drafted += after["spec_draft_tokens"] - before["spec_draft_tokens"]
        self.accepted += after["spec_accepted_tokens"] - before["spec_accepted_tokens"]


def run_workload(engines: dict[str, Engine], prompts: list[str], params: dict,
                 repeats: int) -> dict[str, list[Tally]]:
    runs: dict[str, list[Tally]] = {name: [] for name in engines}
    for _ in range(repeats):
        for name, engine in engines.items():  # interleaved: repeat r of each, then r + 1
            tally = Tally()
            for prompt in prompts:  # batch 1: one request at a time
                tally.add_run(engine, prompt, params)
            runs[name].append(tally)
    return runs


def report(workload: str, runs: dict[str, list[Tally]]) -> None:
    base = runs["plain"][0].outputs
    for name, tallies in runs.items():
        tok_s = statistics.median(t.tokens / t.wall_s for t in tallies)
        ms = statistics.median(1000 * t.wall_s / t.tokens for t in tallies)
        drafted = sum(t.drafted for t in tallies)
        accept = sum(t.accepted for t in tallies) / drafted if drafted else float("nan")
        print(f"{workload:11s} {name:6s} {tok_s:8.1f} tok/s {ms:7.2f} ms/token  "
              f"accept {accept:5.1%} ({drafted} drafted)  {_sameness(tallies, base)}")


def _sameness(tallies: list[Tally], base: list[list[int]]) -> str:
    """How many outputs equal plain decoding's first repeat, and where the others first differ."""
    pairs = [(o, b) for t in tallies for o, b in zip(t.outputs, base)]
    differ = [next((i for i, (x, y) in enumerate(zip(o, b)) if x != y), min(len(o), len(b)))
              for o, b in pairs if o != b]
    if not differ:
        return f"identical to plain: {len(pairs)}/{len(pairs)}"
    return (f"identical to plain: {len(pairs) - len(differ)}/{len(pairs)} (others first differ "
            f"at token {sorted(differ)})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--num-draft-tokens", type=int, default=4)
    parser.add_argument("--num-threads", type=int, default=None)
    args = parser.parse_args()
    common = {"dtype": args.dtype, "max_total_tokens": 8192, "num_threads": args.num_threads}
    engines = {
        "plain": Engine(**common),
        "ngram": Engine(**common, speculative_algorithm="NGRAM",
                        speculative_num_draft_tokens=args.num_draft_tokens),
    }
    print(f"CPU: {cpu_flags()}; dtype {args.dtype}; {args.repeats} repeats, greedy, batch 1, "
          f"max_new_tokens {args.max_new_tokens}, draft tokens {args.num_draft_tokens}")
    tok = engines["plain"].tokenizer
    params = {"temperature": 0, "max_new_tokens": args.max_new_tokens}
    try:
        for engine in engines.values():  # warm-up
            engine.generate("Hello", {"max_new_tokens": 8})
        for workload, questions in WORKLOADS.items():
            prompts = [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                               add_generation_prompt=True) for q in questions]
            report(workload, run_workload(engines, prompts, params, args.repeats))
    finally:
        for engine in engines.values():
            engine.shutdown()


if __name__ == "__main__":
    main()
