"""Programs under KV pressure, with and without their context pinned while they run (issue 17 §3).

  python -m benchmarks.program_pinning [--agents 8] [--turns 5] [--tool-wait 0.3]
      [--forks 16] [--pool-fraction 0.5] [--pinned-fraction 0.5] [--repeats 2] [--dtype float32]

Two program workloads, each run with `run_batch` on one in-process engine whose KV pool holds
`--pool-fraction` of the workload's working set (its programs' final contexts together), so the
radix cache must evict while programs are between gens:
  - agent: the conversations of benchmarks/session_pinning.py written as a program (a gen per
    turn, then a tool that takes `--tool-wait` seconds and whose result is appended);
  - w5-fork: W5's fork program (a prompt, fork(4) 48-token ideas, join, a 32-token summary).
With `--traffic N`, N streams of other clients' one-off requests (unique ~`--traffic-tokens`
prompts) run beside the programs and compete for the pool. Each workload runs plain
(global_config.pin_program_context = False) and pinned (every program run holds an engine
session), interleaved per repeat. Reports the programs' own prompt tokens computed / sent (from
their gens' meta_info), wall time and programs/s (medians), and checks both give the same texts.
"""

from __future__ import annotations

import argparse
import functools
import random
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

import forklm as sgl
from benchmarks.programs import brainstorm, fork_items
from benchmarks.quant_speed import cpu_flags
from benchmarks.session_pinning import SYSTEM, TOOL, final_context_tokens
from benchmarks.workloads import WORDS
from forklm import Engine
from forklm.frontend_dsl.global_config import global_config
from forklm.runtime.config import DEFAULT_MODEL
from forklm.runtime.models.loader import load_model

GREEDY = {"temperature": 0.0}


@sgl.function
def agent(s, task, turns, tool_wait):
    s += SYSTEM + f"Task {task}: check the health of service {task} and report.\n"
    for turn in range(turns):
        s += "Agent:" + sgl.gen(f"turn{turn}", max_tokens=24, ignore_eos=True)
        s[f"turn{turn}"]  # the agent reads its answer, then calls the tool
        time.sleep(tool_wait)
        items = ", ".join(str(task * 100 + turn * 7 + k) for k in range(12))
        s += "\n" + TOOL.format(turn=turn, task=task, items=items, lat=40 + 3 * turn)


def fork_working_set(tok: Any, items: list[dict[str, str]]) -> int:
    """Tokens of every fork program's branches and summary context (ideas taken as 48 tokens)."""
    total = 0
    for item in items:
        prompt = len(tok.encode(f"Here are four short ideas about {item['topic']}.\n"))
        ideas = 4 * (len(tok.encode("Idea 1:")) + 49)
        total += prompt + ideas + (prompt + ideas + len(tok.encode("Summary:")) + 32)
    return total


class OneOffTraffic:
    """Other clients' requests while the programs run: unique prompts (never reused) of about
    `tokens` tokens with 8 new tokens each, `streams` at a time, until stopped."""

    def __init__(self, engine: Engine, streams: int, tokens: int):
        self.engine, self.tokens, self._stop = engine, tokens, threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True)
                         for i in range(streams)]

    def _run(self, stream: int) -> None:
        rng = random.Random(stream)
        while not self._stop.is_set():
            words = " ".join(rng.choice(WORDS) for _ in range(self.tokens // 2))
            self.engine.generate(f"Summarise: {words}\nSummary:",
                                 {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True})

    def __enter__(self) -> OneOffTraffic:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join()


def gen_tokens(meta: Any, totals: list[int]) -> None:
    """Add up prompt and cached tokens of every gen meta (a join holds lists of them)."""
    if isinstance(meta, list):
        for m in meta:
            gen_tokens(m, totals)
    elif isinstance(meta, dict) and "cached_tokens" in meta:
        totals[0] += meta["prompt_tokens"]
        totals[1] += meta["cached_tokens"]


def measure(engine: Engine, run: Callable[[], list[Any]], pinned: bool,
            traffic: tuple[int, int]) -> dict[str, Any]:
    """One run of the programs (with one-off traffic beside them when traffic[0] > 0); prompt
    tokens are the programs' own, from their gens' meta_info."""
    engine.flush_cache()
    global_config.pin_program_context = pinned
    t0 = time.perf_counter()
    try:
        if traffic[0]:
            with OneOffTraffic(engine, *traffic):
                states = run()
        else:
            states = run()
    finally:
        global_config.pin_program_context = True
    wall = time.perf_counter() - t0
    totals = [0, 0]
    for state in states:
        for name in state.variables():
            gen_tokens(state.get_meta_info(name), totals)
    sent, cached = totals
    return {"wall_s": wall, "sent": sent, "computed": sent - cached,
            "programs_per_s": len(states) / wall, "texts": [s.text() for s in states]}


def compare(name: str, engine: Engine, run: Callable[[], list[Any]], repeats: int,
            traffic: tuple[int, int]) -> None:
    measure(engine, run, True, (0, 0))  # warm-up
    runs: dict[str, list[dict[str, Any]]] = {"plain": [], "pinned": []}
    for _ in range(repeats):
        for mode in runs:
            runs[mode].append(measure(engine, run, mode == "pinned", traffic))
    for mode, results in runs.items():
        computed = statistics.median(r["computed"] for r in results)
        sent = results[0]["sent"]
        print(f"  {name:8s} {mode:7s} prompt tokens computed / sent {computed:.0f} / {sent} "
              f"({computed / sent:.0%}), wall {statistics.median(r['wall_s'] for r in results):.1f}"
              f" s, {statistics.median(r['programs_per_s'] for r in results):.2f} programs/s")
    same = all(a["texts"] == b["texts"] for a, b in zip(runs["plain"], runs["pinned"]))
    print(f"  {name:8s} texts identical plain vs pinned: {same}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--agents", type=int, default=8)
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--tool-wait", type=float, default=0.3)
    p.add_argument("--forks", type=int, default=16)
    p.add_argument("--pool-fraction", type=float, default=0.5)
    p.add_argument("--pinned-fraction", type=float, default=0.5)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--traffic", type=int, default=0,
                   help="streams of other clients' one-off requests beside the programs")
    p.add_argument("--traffic-tokens", type=int, default=300)
    p.add_argument("--dtype", default="float32",
                   help="float32 (default) keeps greedy texts comparable between the runs")
    args = p.parse_args()
    print(f"CPU: {cpu_flags()}; pool = {args.pool_fraction:.0%} of each workload's working set, "
          f"pins up to {args.pinned_fraction:.0%} of the pool")

    tok = load_model(DEFAULT_MODEL).tokenizer
    items = fork_items(args.forks)
    for name in ("agent", "w5-fork"):
        if name == "agent":
            sizing = argparse.Namespace(conversations=args.agents, turns=args.turns)
            working_set = final_context_tokens(tok, sizing)
            batch = [{"task": i, "turns": args.turns, "tool_wait": args.tool_wait}
                     for i in range(args.agents)]
            program = agent
        else:
            working_set, batch, program = fork_working_set(tok, items), items, brainstorm
        pool = max(256, int(working_set * args.pool_fraction))
        engine = Engine(max_total_tokens=pool, session_pinned_fraction=args.pinned_fraction,
                        dtype=args.dtype)
        backend = sgl.EngineBackend(engine)
        print(f"{name}: {len(batch)} programs, working set ~{working_set} tokens, KV pool {pool}")
        with engine:
            compare(name, engine, functools.partial(
                program.run_batch, batch, backend=backend, **GREEDY), args.repeats,
                (args.traffic, args.traffic_tokens))


if __name__ == "__main__":
    main()
