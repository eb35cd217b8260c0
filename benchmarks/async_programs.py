"""1,000 programs at once: async programs on one event loop vs the thread-based run_batch.

  python -m benchmarks.async_programs [--programs 1000] [--modes async,threads,threads-all]
      [--dtype auto]

The same two-gen program (a shared system prompt, a question, an answer, then a follow-up that
depends on the answer's length) written twice: `async def` with awaited reads, run by
`run_batch_async` (every item a task on one loop), and the plain twin run by `run_batch` with its
default pool (`threads`: max(96, 16 x cores) workers) and with one thread per program
(`threads-all`). Each mode runs in a fresh process on an in-process engine on the default model,
after a warm-up batch, and reports wall time, programs/s, the peak number of threads and the
growth of the process's resident memory during the run (peak minus before); the texts of every mode must agree (greedy).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from typing import Any

import forklm as sgl
from benchmarks.quant_speed import cpu_flags

SYSTEM = "You are a terse assistant. Answer in a few words."
TOPICS = ["rivers", "planets", "metals", "birds", "languages", "mountains", "colours", "tools"]


@sgl.function
async def ask_async(s, i):
    s += sgl.system(SYSTEM)
    s += sgl.user(f"Name one of the {TOPICS[i % len(TOPICS)]} (question {i}).")
    s += sgl.assistant(sgl.gen("answer", max_tokens=8))
    answer = await s["answer"]
    s += sgl.user("One more." if len(answer) < 20 else "A shorter one.")
    s += sgl.assistant(sgl.gen("more", max_tokens=4))


@sgl.function
def ask_threads(s, i):
    s += sgl.system(SYSTEM)
    s += sgl.user(f"Name one of the {TOPICS[i % len(TOPICS)]} (question {i}).")
    s += sgl.assistant(sgl.gen("answer", max_tokens=8))
    answer = s["answer"]
    s += sgl.user("One more." if len(answer) < 20 else "A shorter one.")
    s += sgl.assistant(sgl.gen("more", max_tokens=4))


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


class Watch:
    """The most threads alive at once and the highest resident memory, sampled every 5 ms on a
    thread of its own (not counted)."""

    def __init__(self) -> None:
        self.peak_threads, self.peak_rss, self._stop = 0, rss_mb(), threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak_threads = max(self.peak_threads, threading.active_count() - 1)
            self.peak_rss = max(self.peak_rss, rss_mb())
            time.sleep(0.005)

    def __enter__(self) -> Watch:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()


def run_mode(mode: str, programs: int, dtype: str) -> dict[str, Any]:
    """One mode in this process: warm up on 16 programs, then time `programs` of them."""
    backend = sgl.EngineBackend(dtype=dtype)
    greedy = {"temperature": 0.0}

    def batch(n: int) -> list[Any]:
        items = [{"i": i} for i in range(n)]
        if mode == "async":
            return asyncio.run(ask_async.run_batch_async(items, backend=backend, **greedy))
        threads = len(items) if mode == "threads-all" else "auto"
        return ask_threads.run_batch(items, backend=backend, num_threads=threads, **greedy)

    batch(16)
    base_threads, rss_before = threading.active_count(), rss_mb()
    with Watch() as watch:
        t0 = time.perf_counter()
        states = batch(programs)
        wall = time.perf_counter() - t0
    texts = [s.text() for s in states]
    backend.engine.shutdown()  # type: ignore[attr-defined]
    return {"mode": mode, "programs": programs, "wall_s": wall, "programs_per_s": programs / wall,
            "threads_before": base_threads, "peak_threads": watch.peak_threads,
            "peak_rss_growth_mb": watch.peak_rss - rss_before, "texts": texts}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--programs", type=int, default=1000)
    parser.add_argument("--modes", default="async,threads,threads-all")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(run_mode(args.child, args.programs, args.dtype)))
        return
    results = []
    for mode in args.modes.split(","):
        out = subprocess.run(
            [sys.executable, "-m", "benchmarks.async_programs", "--child", mode,
             "--programs", str(args.programs), "--dtype", args.dtype],
            check=True, capture_output=True, text=True, env=os.environ)
        results.append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"{args.programs} programs, default model, dtype {args.dtype}, CPU: {cpu_flags()}, "
          f"{os.cpu_count()} cores")
    print(f"{'mode':12s} {'wall s':>8s} {'prog/s':>8s} {'threads':>8s} {'+peak RSS MB':>13s}")
    for r in results:
        print(f"{r['mode']:12s} {r['wall_s']:8.1f} {r['programs_per_s']:8.1f} "
              f"{r['peak_threads']:8d} {r['peak_rss_growth_mb']:13.0f}")
    for r in results[1:]:  # batch composition differs by mode; reduced precision may show it
        same = sum(a == b for a, b in zip(r["texts"], results[0]["texts"]))
        print(f"{r['mode']}: {same}/{args.programs} texts identical to {results[0]['mode']}'s")


if __name__ == "__main__":
    main()
