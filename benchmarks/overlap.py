"""The overlap scheduler on and off, side by side in one process: decode ms/token at batch 1 and
tokens/s at batch 16 (and 64), interleaved repeats, medians; and whether the tokens are the same.

Run: `python -m benchmarks.overlap [--dtype auto] [--repeats 3] [--new-tokens 64]`.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from benchmarks.engine_speed import WORDS
from forklm import Engine


def _prompts(batch: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(40)) for _ in range(batch)]


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
        _run(engine, _prompts(1, 99), 4)
    for rep in range(args.repeats):
        for batch in batches:
            outputs = {}
            order = list(engines) if rep % 2 == 0 else list(reversed(engines))
            for name in order:
                engines[name].flush_cache()
                wall, outputs[name] = _run(engines[name], _prompts(batch, rep), args.new_tokens)
                walls.setdefault((name, batch), []).append(wall)
            same = same and outputs["plain"] == outputs["overlap"]
    print(f"dtype {args.dtype}, {args.new_tokens} new tokens per request, "
          f"{args.repeats} interleaved repeats (medians)")
    print("| batch | plain | overlap | overlap / plain time |")
    print("|---|---|---|---|")
    for batch in batches:
        plain = statistics.median(walls[("plain", batch)])
        overlap = statistics.median(walls[("overlap", batch)])
        if batch == 1:
            cells = (f"{plain / args.new_tokens * 1e3:.1f} ms/token",
                     f"{overlap / args.new_tokens * 1e3:.1f} ms/token")
        else:
            cells = (f"{batch * args.new_tokens / plain:.1f} tok/s",
                     f"{batch * args.new_tokens / overlap:.1f} tok/s")
        print(f"| {batch} | {cells[0]} | {cells[1]} | {overlap / plain:.3f} |")
    print(f"tokens identical: {same}")
    for engine in engines.values():
        engine.shutdown()


if __name__ == "__main__":
    main()
