"""Decode speed with tensor parallelism: TP=1 vs TP=2 on the default model, in-process engines.

  python -m benchmarks.tensor_parallel [--tp 1,2] [--batches 1,16] [--new-tokens 64]
      [--dtype float32] [--repeats 2]

For each tp_size one engine (rank 0 here, the other ranks spawned workers) decodes greedy
`--new-tokens` tokens (ignore_eos) for batches of 1 and 16 short distinct prompts. Reports decode
tokens/s (the engine's own decode steps only, prefill excluded), the all-reduce share of a decode
step (rank 0's seconds inside the forward's collectives over its forward seconds: on 2 CPU cores
this includes waiting for the slower rank, and tells how much a faster link could win), and the
bytes of weights each rank holds. Checks that every tp_size gives the same tokens.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import statistics
from typing import Any

import torch

from forklm import Engine
from forklm.runtime.config import cpu_flags
from forklm.runtime.models.loader import load_model

PROMPTS = [f"Write a story about a {x} in a harbour town." for x in (
    "fox", "lighthouse", "baker", "storm", "clock", "sailor", "cat", "bridge", "whale", "kite",
    "robot", "garden", "train", "violin", "map", "lantern")]


def cpu_name() -> str:
    for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def weight_bytes(engine: Engine) -> list[int]:
    """Bytes of weights per rank, as dense tensors in the engine's dtype."""
    shard = getattr(engine.parts.runner, "shard", None)
    if shard is not None:
        return list(shard.weight_bytes)
    numel = sum(t.numel() for _, t in load_model(engine.config.model_path).weights())
    return [numel * getattr(torch, engine.config.torch_dtype_name).itemsize]


def decode_run(engine: Engine, batch: int, new_tokens: int) -> dict[str, Any]:
    """One greedy batch: decode tokens/s, and the collectives' share of its forward time."""
    group = getattr(engine.parts.runner, "group", None)
    comm0 = group.comm_s if group else 0.0
    before = dataclasses.replace(engine._loop.stats)  # the loop's counters (a snapshot copy)
    params = {"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True}
    out = engine.generate(PROMPTS[:batch], params)
    after = engine._loop.stats
    decode_tok_s = (after.decode_tokens - before.decode_tokens) / (after.decode_s - before.decode_s)
    comm = (group.comm_s - comm0) if group else 0.0
    steps = after.steps - before.steps
    return {"tok_s": decode_tok_s, "comm_share": comm / (after.forward_s - before.forward_s),
            "ms_per_step": 1000 * (after.step_s - before.step_s) / steps,
            "comm_ms_per_step": 1000 * comm / steps, "ids": [r["output_ids"] for r in out]}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tp", default="1,2", help="tp sizes, comma-separated")
    p.add_argument("--batches", default="1,16")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--dtype", default="float32",
                   help="float32 (default: the token-exact path), bfloat16, or auto")
    args = p.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    isa = "AVX-512-bf16" if "avx512_bf16" in cpu_flags() else "AVX2"
    print(f"{cpu_name()} ({isa}), {torch.get_num_threads()} threads, dtype {args.dtype}, "
          f"{args.new_tokens} new tokens, median of {args.repeats}")
    ids: dict[int, list] = {}
    for tp in (int(t) for t in args.tp.split(",")):
        with Engine(tp_size=tp, dtype=args.dtype, max_total_tokens=8192) as engine:
            decode_run(engine, 2, 8)  # warm-up
            mib = ", ".join(f"{b / 2**20:.0f}" for b in weight_bytes(engine))
            for batch in batches:
                runs = [decode_run(engine, batch, args.new_tokens) for _ in range(args.repeats)]
                ids[batch] = ids.get(batch) or runs[0]["ids"]
                same = all(r["ids"] == ids[batch] for r in runs)
                med = {k: statistics.median(r[k] for r in runs) for k in runs[0] if k != "ids"}
                print(f"tp={tp} batch {batch:2d}: {med['tok_s']:6.1f} decode tok/s, "
                      f"{med['ms_per_step']:5.1f} ms/step of which collectives "
                      f"{med['comm_ms_per_step']:5.1f} ms ({med['comm_share']:.0%} of the "
                      f"forward), weights per rank {mib} MiB, tokens as tp=1: {same}")


if __name__ == "__main__":
    main()
