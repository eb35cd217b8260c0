"""What LoRA adapters cost on the default model: decode at batch 16 with no adapter, with one
adapter for every request, and with 8 adapters mixed (2 requests each); single stream with and
without an adapter; and the base model on an engine without LoRA (what wrapping costs when no
request names an adapter).

Adapters are random rank-`--rank` matrices on every projection (q, k, v, o, gate, up, down),
written in PEFT's format: speed does not depend on their values.

Run: `python -m benchmarks.lora_speed [--repeats 3] [--rank 16] [--max-new-tokens 64]`.
The engines run one after the other; within one, repeats alternate between its cases.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import tempfile
import time

import safetensors.torch
import torch

from benchmarks.quant_speed import cpu_flags
from forklm import Engine

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def write_adapter(folder: pathlib.Path, config, rank: int, seed: int) -> None:
    """A random PEFT adapter for `config` (a transformers Llama config) on every projection."""
    hidden, inter = config.hidden_size, config.intermediate_size
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    q_out, kv_out = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    shapes = {"q_proj": (hidden, q_out), "k_proj": (hidden, kv_out), "v_proj": (hidden, kv_out),
              "o_proj": (q_out, hidden), "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
              "down_proj": (inter, hidden)}
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for target, (fan_in, fan_out) in shapes.items():
            part = "self_attn" if target in TARGETS[:4] else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{target}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) * 0.01
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * 0.01
    folder.mkdir(parents=True)
    safetensors.torch.save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS)}))


def timed(engine: Engine, adapters: list[str | None], params: dict) -> tuple[float, int]:
    """One batch: every request's prompt + decode, end to end; (seconds, output tokens)."""
    prompts = [f"{PROMPT} (Version {i}.)" for i in range(len(adapters))]
    t0 = time.perf_counter()
    results = engine.generate(prompts, params, lora_path=adapters)
    wall = time.perf_counter() - t0
    return wall, sum(len(r["output_ids"]) for r in results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()
    params = {"temperature": 0, "max_new_tokens": args.max_new_tokens, "ignore_eos": True}
    with tempfile.TemporaryDirectory() as tmp:
        b = args.batch
        # One engine at a time: two engines in one process share the CPU's thread pools, and
        # the idle one's threads slow the other's many small LoRA ops several-fold.
        plain = Engine(dtype=args.dtype, max_total_tokens=16384)
        config = plain.parts.model_config
        runs = measure(plain, {f"no LoRA engine, batch {b}": [None] * b,
                               "no LoRA engine, batch 1": [None]}, params, args.repeats)
        plain.shutdown()
        names = [f"a{i}" for i in range(8)]
        for i, name in enumerate(names):
            write_adapter(pathlib.Path(tmp) / name, config, args.rank, seed=i)
        lora = Engine(dtype=args.dtype, max_total_tokens=16384,
                      lora_paths=tuple(f"{n}={tmp}/{n}" for n in names))
        runs |= measure(lora, {f"LoRA engine, base, batch {b}": [None] * b,
                               f"1 adapter, batch {b}": ["a0"] * b,
                               f"8 adapters mixed, batch {b}": [names[i % 8] for i in range(b)],
                               "1 adapter, batch 1": ["a0"]}, params, args.repeats)
        lora.shutdown()
    print(f"CPU: {cpu_flags()}; dtype {args.dtype}; rank {args.rank} on all 7 projections; "
          f"{args.max_new_tokens} new tokens; {args.repeats} repeats (medians)")
    base_tok_s: dict[str, float] = {}
    for name in sorted(runs, key=lambda n: (n.endswith("batch 1"), "no LoRA" not in n)):
        tok_s = statistics.median(n / wall for wall, n in runs[name])
        batch = name.rsplit(" ", 1)[-1]
        base_tok_s.setdefault(batch, tok_s)
        print(f"{name:32s} {tok_s:8.1f} tok/s  {1000 / tok_s * int(batch):7.2f} ms/step  "
              f"{tok_s / base_tok_s[batch]:5.2f}x the no-LoRA engine")


def measure(engine: Engine, cases: dict[str, list[str | None]], params: dict,
            repeats: int) -> dict[str, list[tuple[float, int]]]:
    """Each case `repeats` times, the cases interleaved so that noise hits all of them."""
    for adapters in cases.values():  # warm-up
        timed(engine, adapters[:2], {**params, "max_new_tokens": 4})
    runs: dict[str, list[tuple[float, int]]] = {name: [] for name in cases}
    for _ in range(repeats):
        for name, adapters in cases.items():
            runs[name].append(timed(engine, adapters, params))
    return runs

if __name__ == "__main__":
    main()
