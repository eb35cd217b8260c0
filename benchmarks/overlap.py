"""The overlap scheduler on and off, side by side in one process: decode ms/token at batch 1 and
tokens/s at batch 16 (and 64), interleaved repeats, medians; and whether the tokens are the same.

Run: `python -m benchmarks.overlap [--dtype auto] [--repeats 3] [--new-tokens 64]`.
"""

from __future__ import annotations

import argparse
import random
import time

from benchmarks import report
from benchmarks.engine_speed import WORDS
from forklm import Engine


def prompts(batch: int, seed: int, words: int = 40) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(words)) for _ in range(batch)]


def _run(engine: Engine, prompts: list[str], new_tokens: int) -> tuple[float, list[list[int]]]:
    t0 = time.perf_counter()
    outs = engine.generate(prompts, {"temperature": 0, "max_new_tokens": new_tokens,
                                     "ignore_eos": True})
    return time.perf_counter() - t0, [o["output_ids"] for o in outs]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--batches", default="1,16,64")
    args = parser.parse_args()
    engines = {name: Engine(dtype=args.dtype, disable_overlap_schedule=(name == "plain"))
               for name in ("plain", "overlap")}
    batches = [int(b) for b in args.batches.split(",")]
    walls: dict[tuple[str, int], list[float]] = {}
    same = True
    for engine in engines.values():  # warm-up: first-step costs and the radix cache
        _run(engine, prompts(1, 99), 4)
    for rep in range(args.repeats):
        for batch in batches:
            outputs = {}
            order = list(engines) if rep % 2 == 0 else list(reversed(engines))
            for name in order:
                engines[name].flush_cache()
                wall, outputs[name] = _run(engines[name], prompts(batch, rep), args.new_tokens)
                walls.setdefault((name, batch), []).append(wall)
            same = same and outputs["plain"] == outputs["overlap"]
    print(f"dtype {args.dtype}, {args.new_tokens} new tokens per request, "
          f"{args.repeats} interleaved repeats (medians)")
    per_step = {key: [wall / args.new_tokens for wall in walls[key]] for key in walls}
    print(report.ab_table(("plain", "overlap"), ("plain", "overlap"), batches, per_step))
    print(f"tokens identical: {same}")
    for engine in engines.values():
        engine.shutdown()


if __name__ == "__main__":
    main()
