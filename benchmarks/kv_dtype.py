"""What an 8-bit KV cache (`--kv-cache-dtype fp8_e5m2 | fp8_e4m3 | int8`) costs and buys against
the model's own dtype, on one model (default: the default model; `--model` a GGUF or folder):

- accuracy: greedy continuations of short chat questions and of long README-based prompts, from
  an engine per KV dtype. Reported against the 16-bit cache: outputs identical, the first token
  where they part (median), and, scoring the 16-bit cache's own continuations teacher-forced
  through each engine, how often its top-1 token agrees and the mean |logprob drift| of those
  tokens (the 16-bit cache's own row is the noise floor: its prefill rounds differently from
  its decode);
- speed: one layer's decode attention (the native kernel alone: the fused decode layers store
  K/V in C) at batch 1 and 16 over 500 and 2000 keys, and a whole engine's decode step at batch 16 over long prompts (each
  dtype's engine in its own process, alternating, medians);
- memory: bytes per cached token.

    python -m benchmarks.kv_dtype [--model FILE] [--repeats 3] [--parts accuracy,layer,step]
"""

from __future__ import annotations

import argparse
import functools
import json
import pathlib
import statistics
import subprocess
import sys
import time

KV_DTYPES = ("auto", "fp8_e5m2", "fp8_e4m3", "int8")
QUESTIONS = [
    "What is the capital of Australia, and why was it chosen?",
    "Explain how a refrigerator keeps food cold.",
    "Write a haiku about autumn rain.",
    "List three differences between Python lists and tuples.",
    "How many legs does a spider have? Answer in one sentence.",
    "Give me a recipe for a simple tomato soup.",
    "What causes the seasons on Earth?",
    "Translate 'good morning, how are you?' into French and Spanish.",
    "Write a Python function that reverses a string.",
    "Why is the sky blue?",
    "Summarise the plot of Romeo and Juliet in two sentences.",
    "What is 17 times 23? Show your working.",
    "Suggest a name for a bakery that sells only bread.",
    "What are the main causes of inflation?",
    "Describe the water cycle for a ten-year-old.",
    "Write a SQL query that counts the orders per customer.",
    "What is photosynthesis?",
    "Give three tips for a job interview.",
    "Who wrote 'Pride and Prejudice', and when?",
    "Explain recursion with an example.",
    "What should I pack for a weekend hiking trip?",
    "Write a limerick about a cat who loves cheese.",
    "How does a bicycle stay upright?",
    "What is the difference between weather and climate?",
]
LONG_QUESTIONS = ["Summarise the text above in three sentences.",
                  "What does the text above say about the KV cache?",
                  "List the command-line flags the text above mentions.",
                  "Which models does the text above say are supported?"]


def prompts(tokenizer, long_tokens: int) -> list[str]:
    """The chat-templated short questions, then the long ones: each after its own ~long_tokens
    slice of README.md (so the prompts share no prefix)."""
    readme = (pathlib.Path(__file__).resolve().parents[1] / "README.md").read_text()
    ids = tokenizer.encode(readme, add_special_tokens=False)
    long = []
    for i, question in enumerate(LONG_QUESTIONS):
        chunk = tokenizer.decode(ids[i * long_tokens:(i + 1) * long_tokens])
        long.append(f"{chunk}\n\n{question}")

    def chat(text: str) -> str:
        return tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)
    return [chat(q) for q in QUESTIONS + long]


def accuracy(model: str | None, new_tokens: int, long_tokens: int) -> list[dict]:
    """One engine per KV dtype in turn: greedy continuations, then the 16-bit cache's
    continuations teacher-forced through it."""
    from forklm import Engine

    greedy = {"temperature": 0, "max_new_tokens": new_tokens}
    runs: dict[str, dict] = {}
    reference: list[list[int]] = []
    texts: list[str] = []
    prompt_ids: list[list[int]] = []
    for kv in KV_DTYPES:
        kwargs = {"model_path": model} if model else {}
        engine = Engine(kv_cache_dtype=kv, max_total_tokens=32768, **kwargs)
        if not texts:
            texts = prompts(engine.parts.tokenizer, long_tokens)
            prompt_ids = [engine.parts.tokenizer.encode(t, add_special_tokens=False)
                          for t in texts]
        outs = engine.generate(texts, greedy)
        if kv == "auto":
            reference = [p + o["output_ids"] for p, o in zip(prompt_ids, outs)]
        engine.flush_cache()
        # the reference continuation scored in one prefill: its tokens' logprobs and top-1s
        scored = [engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 1},
                                  return_logprob=True, top_logprobs_num=1,
                                  logprob_start_len=len(p))
                  for ids, p in zip(reference, prompt_ids)]
        engine.shutdown()
        runs[kv] = {"outputs": [o["output_ids"] for o in outs], "scored": [
            (s["meta_info"]["input_token_logprobs"], s["meta_info"]["input_top_logprobs"])
            for s in scored]}
    rows = []
    base = runs["auto"]
    for kv in KV_DTYPES:  # auto's own row: its prefill's top-1s against its decode's tokens
        run = runs[kv]
        same = sum(a == b for a, b in zip(base["outputs"], run["outputs"]))
        parted = [_first_difference(a, b) for a, b in zip(base["outputs"], run["outputs"])]
        agree = total = 0
        drift = []
        for (ref_lp, _), (lp, top) in zip(base["scored"], run["scored"]):
            for (ref, tok, _), (got, _, _), best in zip(ref_lp, lp, top):
                total += 1
                agree += best[0][1] == tok
                drift.append(abs(got - ref))
        rows.append({"kv_cache_dtype": kv, "prompts": len(texts), "identical": same,
                     "first_difference_median": statistics.median(parted),
                     "teacher_forced_top1_agreement": agree / total,
                     "mean_abs_logprob_drift": statistics.fmean(drift),
                     "max_abs_logprob_drift": max(drift), "scored_tokens": total})
    return rows


def _first_difference(a: list[int], b: list[int]) -> int:
    """Index of the first token where a and b differ (their common length if none)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def layer_speed(repeats: int) -> list[dict]:
    """One layer's NativeAttention forward per KV dtype, on the default model's attention shape
    (9 heads, 3 KV heads, head_dim 64) and a 1B one (32 heads, 8 KV heads, head_dim 64)."""
    import torch

    from benchmarks.native_attention import median_us
    from forklm.runtime.attention.native import NativeAttention
    from forklm.runtime.kvcache.pool import KVPool
    from tests.test_triton_backend import make_forward_batch

    torch.manual_seed(0)
    rows = []
    dtypes = {"auto": None, "fp8_e5m2": torch.float8_e5m2, "fp8_e4m3": torch.float8_e4m3fn,
              "int8": torch.int8}
    for heads, kv_heads in ((9, 3), (32, 8)):
        for batch, keys in ((1, 500), (1, 2000), (16, 500), (16, 2000)):
            row = {"heads": f"{heads}/{kv_heads}", "batch": batch, "keys": keys}
            for name, kv_dtype in dtypes.items():
                pool = KVPool(1, batch * keys + 64, kv_heads, 64, torch.bfloat16,
                              kv_dtype=kv_dtype)
                pool.store(0, torch.arange(batch * keys),
                           *(torch.randn(batch * keys, kv_heads, 64).bfloat16() for _ in "kv"))
                attn = NativeAttention(pool, heads, kv_heads, 64)
                assert attn.enabled, "the native kernel does not handle this pool"
                fb = make_forward_batch(torch.Generator().manual_seed(1), [keys] * batch,
                                        [1] * batch, pool.capacity)
                prepared = attn.prepare(fb)
                q = torch.randn(batch, heads, 64).bfloat16()
                out = torch.empty(batch, heads * 64, dtype=torch.bfloat16)
                run = functools.partial(
                    prepared.attn_meta.plan.run, q, attn.k_layers[0], attn.v_layers[0], out,
                    0.125, 0.0, 0, attn.dtype_code, attn.kv_dtype_code, None, None,
                    *attn.scales_of(0))
                row[name] = median_us(run, repeats * 20)
            rows.append(row)
    return rows


def engine_step(model: str | None, kv: str, batch: int, prompt_tokens: int, new_tokens: int,
                ) -> float:
    """ms per decode step at `batch` requests of ~prompt_tokens each, prompts already cached."""
    from forklm import Engine

    kwargs = {"model_path": model} if model else {}
    engine = Engine(kv_cache_dtype=kv, max_total_tokens=batch * (prompt_tokens + new_tokens + 64),
                    **kwargs)
    words = (pathlib.Path(__file__).resolve().parents[1] / "README.md").read_text().split()
    texts = [f"Request {i}: " + " ".join(words[i * 50:i * 50 + prompt_tokens * 3 // 4])
             for i in range(batch)]
    ids = [engine.parts.tokenizer.encode(t)[:prompt_tokens] for t in texts]
    engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 1})  # prefill, cached
    params = {"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True}
    t0 = time.perf_counter()
    engine.generate(input_ids=ids, sampling_params=params)
    seconds = time.perf_counter() - t0
    engine.shutdown()
    return 1000 * seconds / new_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--long-tokens", type=int, default=1500)
    parser.add_argument("--step-batch", type=int, default=16)
    parser.add_argument("--step-prompt", type=int, default=2000)
    parser.add_argument("--parts", default="accuracy,layer,step",
                        help="which of accuracy, layer, step to run")
    parser.add_argument("--child-step", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child_step:  # one engine's decode step, in its own process
        print(json.dumps(engine_step(args.model, args.child_step, args.step_batch,
                                     args.step_prompt, args.new_tokens)))
        return
    from benchmarks.report import machine
    from forklm.runtime.config import KV_CACHE_DTYPES

    print(f"# {machine()}")
    import torch

    from forklm.runtime.kvcache.pool import KVPool
    print("\n| KV dtype | bytes per token, default model's shape (30 layers, 3 KV heads x 64) |")
    print("|---|---|")
    for kv in KV_DTYPES:
        dtype = getattr(torch, KV_CACHE_DTYPES.get(kv, "bfloat16"))
        print(f"| {kv} | {KVPool.bytes_per_token(30, 3, 64, dtype)} |")

    parts = set(args.parts.split(","))
    if "accuracy" in parts:
        print(f"\n## Accuracy against the 16-bit cache ({args.new_tokens} greedy tokens)\n")
        print("| KV dtype | prompts | identical outputs | first difference (median token) | "
              "teacher-forced top-1 agreement | mean / max abs logprob drift |")
        print("|---|---|---|---|---|---|")
        for r in accuracy(args.model, args.new_tokens, args.long_tokens):
            print(f"| {r['kv_cache_dtype']} | {r['prompts']} | {r['identical']} | "
                  f"{r['first_difference_median']} | "
                  f"{100 * r['teacher_forced_top1_agreement']:.1f}% of {r['scored_tokens']} | "
                  f"{r['mean_abs_logprob_drift']:.4f} / {r['max_abs_logprob_drift']:.3f} |",
                  flush=True)

    if "layer" in parts:
        print_layer_speed(args.repeats)
    if "step" in parts:
        print_engine_steps(args)


def print_layer_speed(repeats: int) -> None:
    print("\n## One layer's decode attention (the native kernel, bf16 queries; one pool re-read, "
          "so cache-resident where it fits), us, medians\n")
    print("| heads / KV heads | batch | keys | auto (bf16) | fp8_e5m2 | fp8_e4m3 | int8 | "
          "e5m2 / e4m3 / int8 over bf16 |")
    print("|---|---|---|---|---|---|---|---|")
    for r in layer_speed(repeats):
        ratios = " / ".join(f"{r[kv] / r['auto']:.2f}" for kv in KV_DTYPES[1:])
        print(f"| {r['heads']} | {r['batch']} | {r['keys']} | {r['auto']:.1f} | "
              f"{r['fp8_e5m2']:.1f} | {r['fp8_e4m3']:.1f} | {r['int8']:.1f} | {ratios} |",
              flush=True)


def print_engine_steps(args: argparse.Namespace) -> None:
    print(f"\n## Engine decode step, batch {args.step_batch} x ~{args.step_prompt} cached prompt "
          f"tokens, {args.new_tokens} new (ms/step, each engine in its own process, "
          "alternating)\n")
    steps: dict[str, list[float]] = {kv: [] for kv in KV_DTYPES}
    for _ in range(args.repeats):
        for kv in KV_DTYPES:
            cmd = [sys.executable, "-m", "benchmarks.kv_dtype", "--child-step", kv,
                   "--step-batch", str(args.step_batch), "--step-prompt", str(args.step_prompt),
                   "--new-tokens", str(args.new_tokens)] + (
                       ["--model", args.model] if args.model else [])
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            steps[kv].append(json.loads(out.strip().splitlines()[-1]))
    print("| KV dtype | ms/step (median) | runs | vs auto |")
    print("|---|---|---|---|")
    base = statistics.median(steps["auto"])
    for kv, values in steps.items():
        med = statistics.median(values)
        print(f"| {kv} | {med:.2f} | {', '.join(f'{v:.2f}' for v in values)} | "
              f"{med / base:.2f} |")


if __name__ == "__main__":
    main()
