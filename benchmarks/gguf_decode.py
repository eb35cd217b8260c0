"""A GGUF kept quantized against the same file dequantized (float32 and bfloat16), and optionally
llama.cpp's server on the same file: decode tokens/s at batch 1 and 16, prefill tokens/s, resident
weight memory. Engines run side by side in one process, their repeats interleaved.

Run: `python -m benchmarks.gguf_decode [--repeats 3] [--llama-server http://127.0.0.1:8080]`
(llama-server started by hand on the same GGUF, e.g. `llama-server -m FILE -t 2 -np 16 -c 8192`).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import torch

from benchmarks.engine_speed import WORDS
from forklm import Engine
from forklm.runtime.quant.linear import QuantizedLinear

SYSTEMS = {
    "quantized (int4 kernel)": dict(quantization="gguf", dtype="float32"),
    "dequantized float32": dict(quantization="none", dtype="float32"),
    "dequantized bfloat16": dict(quantization="none", dtype="bfloat16"),
}
NEW_TOKENS = 64


def _prompts(rng: random.Random, n: int, words: int) -> list[str]:
    return [" ".join(rng.choice(WORDS) for _ in range(words)) for _ in range(n)]


def _engine_decode(engine: Engine, prompts: list[str]) -> float:
    t0 = time.perf_counter()
    engine.generate(prompts, {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True})
    return len(prompts) * NEW_TOKENS / (time.perf_counter() - t0)


def _engine_prefill(engine: Engine, prompts: list[str]) -> float:
    num = sum(len(engine.tokenizer.encode(p)) for p in prompts)
    t0 = time.perf_counter()
    engine.generate(prompts, {"max_new_tokens": 0})
    return num / (time.perf_counter() - t0)


def _server_decode(url: str, prompts: list[str]) -> float:
    def one(prompt: str) -> None:
        body = {"prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True,
                "cache_prompt": False}
        httpx.post(f"{url}/v1/completions", json=body, timeout=600).raise_for_status()

    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(prompts)) as pool:
        list(pool.map(one, prompts))
    return len(prompts) * NEW_TOKENS / (time.perf_counter() - t0)


def weight_mb(engine: Engine) -> float:
    model = engine.parts.runner.model
    packed = sum(m.nbytes for m in model.modules() if isinstance(m, QuantizedLinear))
    dense = sum(p.numel() * p.element_size() for p in model.parameters())
    return (packed + dense) / 2**20


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--llama-server", default=None, help="URL of llama-server on the same GGUF")
    args = parser.parse_args()
    rng = random.Random(0)
    engines = {name: Engine(max_total_tokens=16384, disable_radix_cache=True, **kw)
               for name, kw in SYSTEMS.items()}
    rows: dict[str, dict[str, list[float]]] = {name: {} for name in [*engines, "llama-server"]}
    for _ in range(args.repeats):
        batches = {"decode batch 1": _prompts(rng, 1, 20), "decode batch 16": _prompts(rng, 16, 20),
                   "prefill 4x400": _prompts(rng, 4, 400)}
        for name, engine in engines.items():
            for measure, prompts in batches.items():
                run = _engine_prefill if measure.startswith("prefill") else _engine_decode
                rows[name].setdefault(measure, []).append(run(engine, prompts))
        if args.llama_server:
            for measure in ("decode batch 1", "decode batch 16"):
                rows["llama-server"].setdefault(measure, []).append(
                    _server_decode(args.llama_server, batches[measure]))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; medians of "
          f"{args.repeats} interleaved runs, tokens/s")
    print("| system | decode batch 1 | decode batch 16 | prefill 4x400 | weights MB |")
    print("|---|---|---|---|---|")
    for name, measures in rows.items():
        if not measures:
            continue
        cells = [f"{statistics.median(measures[m]):.1f}" if m in measures else "-"
                 for m in ("decode batch 1", "decode batch 16", "prefill 4x400")]
        memory = f"{weight_mb(engines[name]):.0f}" if name in engines else "-"
        print(f"| {name} | {' | '.join(cells)} | {memory} |")
    for engine in engines.values():
        engine.shutdown()


if __name__ == "__main__":
    main()
