"""Fused decode layers on and off in one engine, side by side: decode ms/token at batch 1 and
tokens/s at larger batches, interleaved repeats, medians, and whether the tokens are the same.

One engine whose model's fused layers are switched off and on between runs: two engines in one
process would give libgomp more threads than cores, which throttles its spin for both.

Run: `python -m benchmarks.fused_layers [--dtype auto] [--repeats 3] [--new-tokens 64]
[--batches 1,16] [--prompt-words 300]`.
"""

from __future__ import annotations

import argparse
import time

from benchmarks import report
from benchmarks.overlap import prompts
from forklm import Engine


def _run(engine: Engine, prompts: list[str], new_tokens: int) -> tuple[float, list[list[int]]]:
    """(seconds per decode step, outputs). The prompts are prefilled by a 1-token run first, so
    the timed run finds them cached: one 1-token extend, then new_tokens decode steps."""
    params = {"temperature": 0, "ignore_eos": True}
    engine.generate(prompts, {**params, "max_new_tokens": 1})
    t0 = time.perf_counter()
    outs = engine.generate(prompts, {**params, "max_new_tokens": new_tokens + 1})
    return (time.perf_counter() - t0) / (new_tokens + 1), [o["output_ids"] for o in outs]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--prompt-words", type=int, default=300)
    args = parser.parse_args()
    engine = Engine(dtype=args.dtype)
    model = engine.parts.runner.model
    fused = model.fused_layers
    if fused is None:
        raise SystemExit("this engine runs no fused layers (see the log for why)")
    batches = [int(b) for b in args.batches.split(",")]
    steps: dict[tuple[str, int], list[float]] = {}
    same, total = 0, 0
    _run(engine, prompts(1, 99, words=20), 4)  # warm-up
    for rep in range(args.repeats):
        for batch in batches:
            outputs = {}
            order = ["eager", "fused"] if rep % 2 == 0 else ["fused", "eager"]
            for name in order:
                model.fused_layers = fused if name == "fused" else None
                engine.flush_cache()
                step, outputs[name] = _run(engine, prompts(batch, rep, words=args.prompt_words),
                                           args.new_tokens)
                steps.setdefault((name, batch), []).append(step)
            same += sum(a == b for a, b in zip(outputs["eager"], outputs["fused"]))
            total += batch
    model.fused_layers = fused
    print(f"dtype {args.dtype}, ~{args.prompt_words}-word prompts, {args.new_tokens} new tokens "
          f"per request, {args.repeats} interleaved repeats (medians)")
    print(report.ab_table(("eager", "fused"), ("eager layers", "fused layers"), batches, steps))
    # bf16: the norms' sums of squares are added in another order, which now and then moves a
    # rounding and so a near-tie; float32 keeps greedy tokens (tests/test_fused_layers.py)
    print(f"requests with identical tokens: {same}/{total}")
    engine.shutdown()


if __name__ == "__main__":
    main()
