"""Agent-like conversations under KV pressure, with and without sessions pinning their context.

  python -m benchmarks.session_pinning [--conversations 8] [--turns 5] [--pool-fraction 0.5]
      [--tool-wait 0.3] [--pinned-fraction 0.5] [--dtype float32]

Each conversation is a chain of requests: a system prompt and a task, then per turn the model's
answer (greedy, 24 tokens) and a tool result (about 60 tokens of text) appended, after a tool
wait. All conversations run at once, from threads, on one in-process engine whose KV pool holds
`--pool-fraction` of the conversations' final contexts together, so the radix cache evicts the
context of conversations waiting on their tools. The same run is made twice in one process,
interleaved per repeat: plain, and with one session per conversation (Engine.open_session,
session_params). Reports prompt tokens computed / sent, wall time, turns per second and
retractions, and checks that both runs give the same answers.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from typing import Any

from forklm import Engine
from forklm.runtime.config import DEFAULT_MODEL
from forklm.runtime.models.loader import load_model

SYSTEM = ("You are an operations agent. You call tools, read their results and answer briefly. "
          "Keep track of every number the tools report.\n")
TOOL = ("Tool result #{turn} for task {task}: status=ok, items=[{items}], latency_ms={lat}, "
        "notes='the service responded normally; nothing to escalate at this point'.\n")


def conversation(engine: Engine, task: int, turns: int, tool_wait: float, session: bool,
                 answers: list[str]) -> None:
    sid = engine.open_session() if session else None
    params = None if sid is None else {"id": sid}
    context = SYSTEM + f"Task {task}: check the health of service {task} and report.\n"
    try:
        for turn in range(turns):
            out = engine.generate(context + "Agent:", {"max_new_tokens": 24, "temperature": 0,
                                                       "ignore_eos": True},
                                  session_params=params)
            answers.append(out["text"])
            time.sleep(tool_wait)  # the tool runs; the context waits in the cache
            items = ", ".join(str(task * 100 + turn * 7 + k) for k in range(12))
            context += "Agent:" + out["text"] + "\n" + TOOL.format(
                turn=turn, task=task, items=items, lat=40 + 3 * turn)
    finally:
        if sid is not None:
            engine.close_session(sid)


def run_once(engine: Engine, args: argparse.Namespace, session: bool) -> dict[str, Any]:
    engine.flush_cache()
    before = engine.stats()
    answers: list[list[str]] = [[] for _ in range(args.conversations)]
    threads = [threading.Thread(target=conversation, args=(engine, i, args.turns, args.tool_wait,
                                                           session, answers[i]))
               for i in range(args.conversations)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    after = engine.stats()
    sent = after["prompt_tokens"] - before["prompt_tokens"]
    computed = sent - (after["cache_hit_tokens"] - before["cache_hit_tokens"])
    return {"wall_s": wall, "sent": sent, "computed": computed,
            "turns_per_s": args.conversations * args.turns / wall, "answers": answers}


def final_context_tokens(tok: Any, args: argparse.Namespace) -> int:
    """Tokens of all conversations' last prompts (answers approximated by 24 tokens each)."""
    per_turn = len(tok.encode(TOOL.format(turn=0, task=0, items=", ".join(["1234"] * 12), lat=40)))
    base = len(tok.encode(SYSTEM + "Task 0: check the health of service 0 and report.\n"))
    return args.conversations * (base + args.turns * (per_turn + 26))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--pool-fraction", type=float, default=0.5)
    p.add_argument("--pinned-fraction", type=float, default=0.5)
    p.add_argument("--tool-wait", type=float, default=0.3)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--dtype", default="float32",
                   help="float32 (default) keeps greedy answers comparable between the runs")
    args = p.parse_args()
    working_set = final_context_tokens(load_model(DEFAULT_MODEL).tokenizer, args)
    pool = max(256, int(working_set * args.pool_fraction))
    engine = Engine(max_total_tokens=pool, session_pinned_fraction=args.pinned_fraction,
                    dtype=args.dtype)
    print(f"{args.conversations} conversations x {args.turns} turns, final contexts ~{working_set} "
          f"tokens together, KV pool {pool} tokens, pins up to {args.pinned_fraction:.0%} of it")
    runs: dict[str, list[dict[str, Any]]] = {"plain": [], "sessions": []}
    with engine:
        run_once(engine, args, False)  # warm-up
        for _ in range(args.repeats):
            for name in runs:
                runs[name].append(run_once(engine, args, name == "sessions"))
    for name, results in runs.items():
        computed = statistics.median(r["computed"] for r in results)
        sent = results[0]["sent"]
        print(f"{name:9s} prompt tokens computed / sent {computed:.0f} / {sent} "
              f"({computed / sent:.0%}), wall {statistics.median(r['wall_s'] for r in results):.1f} s, "
              f"{statistics.median(r['turns_per_s'] for r in results):.2f} turns/s")
    same = all(a["answers"] == b["answers"] for a, b in zip(runs["plain"], runs["sessions"]))
    print(f"answers identical with and without sessions: {same}")


if __name__ == "__main__":
    main()
