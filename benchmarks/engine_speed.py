"""Engine speed on the default model: prefill tokens/s, decode tokens/s at batch 1 and 16, and the
per-step time spent outside the model forward (scheduler + sampling + bookkeeping).

Run: `python -m benchmarks.engine_speed [--dtype auto] [--repeats 3]`; prints medians.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from forklm import Engine

WORDS = ["river", "stone", "light", "garden", "music", "window", "paper", "silver", "forest", "market", "engine", "cloud", "bridge", "winter", "harbor", "letter", "orange", "lantern", "valley", "signal"]


def _prompt(rng: random.Random, num_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(num_words))


def _measure(engine: Engine, prompts: list[str], new_tokens: int) -> dict[str, float]:
    before = engine.stats()
    t0 = time.perf_counter()
    engine.generate(prompts, {"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True})
    wall = time.perf_counter() - t0
    after = engine.stats()
    steps = after["steps"] - before["steps"]
    return {"wall_s": wall, "tokens_per_s": len(prompts) * new_tokens / wall, "steps": steps}


def decode_step_split(engine: Engine, batch: int = 16, new_tokens: int = 64,
                      seed: int = 0) -> tuple[float, float]:
    """(model forward ms, everything-else ms) per step of `batch` short prompts decoding together
    (their one prefill step is included in the averages: 1 of new_tokens steps)."""
    rng = random.Random(seed)
    s0 = engine.stats()
    _measure(engine, [_prompt(rng, 20) for _ in range(batch)], new_tokens)
    s1 = engine.stats()
    steps = s1["steps"] - s0["steps"]
    forward = (s1["forward_ms_per_step"] * s1["steps"] - s0["forward_ms_per_step"] * s0["steps"])
    overhead = (s1["overhead_ms_per_step"] * s1["steps"]
                - s0["overhead_ms_per_step"] * s0["steps"])
    return forward / steps, overhead / steps


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    rng = random.Random(0)
    with Engine(dtype=args.dtype, max_total_tokens=32768, disable_radix_cache=True) as engine:
        engine.generate("warm up", {"max_new_tokens": 4})
        rows = {"prefill 16x400 tokens": [], "decode batch 1": [], "decode batch 16": []}
        overhead, forward = [], []
        for _ in range(args.repeats):
            prompts = [_prompt(rng, 400) for _ in range(16)]
            num_prompt = sum(len(engine.tokenizer.encode(p)) for p in prompts)
            t0 = time.perf_counter()
            engine.generate(prompts, {"max_new_tokens": 0})
            rows["prefill 16x400 tokens"].append(num_prompt / (time.perf_counter() - t0))
            rows["decode batch 1"].append(_measure(engine, [_prompt(rng, 20)], 64)["tokens_per_s"])
            t0 = time.perf_counter()
            fwd, over = decode_step_split(engine, 16, 64, seed=rng.randrange(1 << 30))
            rows["decode batch 16"].append(16 * 64 / (time.perf_counter() - t0))
            forward.append(fwd)
            overhead.append(over)
        print(f"dtype={engine.config.torch_dtype_name}, medians of {args.repeats} runs")
        print("| measure | tokens/s |\n|---|---|")
        for name, values in rows.items():
            print(f"| {name} | {statistics.median(values):.1f} |")
        print(f"\nbatch-16 decode step: model forward {statistics.median(forward):.1f} ms, "
              f"outside the forward {statistics.median(overhead):.2f} ms")


if __name__ == "__main__":
    main()
