"""Demo: a batch of chat requests that share one long system prompt, served together by forklm on
the default model (SmolLM2-135M-Instruct). Prints each answer, then cache-hit and throughput stats.

Run: `make demo` (or `python examples/shared_system_prompt.py`).
"""

from __future__ import annotations

import time

from forklm import Engine

SYSTEM = (
    "You are a concise geography tutor. Answer in one or two sentences. Facts you may rely on: "
    "Paris is the capital of France; Berlin is the capital of Germany; Madrid is the capital of "
    "Spain; Rome is the capital of Italy; Tokyo is the capital of Japan; Canberra is the capital "
    "of Australia; Ottawa is the capital of Canada; Brasilia is the capital of Brazil. The Nile "
    "and the Amazon are the two longest rivers; Mount Everest is the highest mountain."
)
QUESTIONS = [
    "What is the capital of France?",
    "What is the capital of Japan?",
    "Which city is the capital of Australia?",
    "Name the highest mountain on Earth.",
    "What is the capital of Canada?",
    "Which two rivers are the longest?",
    "What is the capital of Italy?",
    "What is the capital of Brazil?",
]


def main() -> None:
    t0 = time.perf_counter()
    with Engine() as engine:  # the default model, bf16 on the CPU
        load_s = time.perf_counter() - t0
        prompts = [
            engine.tokenizer.apply_chat_template(
                [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}],
                tokenize=False, add_generation_prompt=True)
            for q in QUESTIONS
        ]
        t1 = time.perf_counter()
        results = engine.generate(prompts, {"temperature": 0, "max_new_tokens": 48})
        wall = time.perf_counter() - t1
        for q, r in zip(QUESTIONS, results):
            meta = r["meta_info"]
            print(f"Q: {q}\nA: {r['text'].strip()}\n   ({meta['completion_tokens']} tokens, "
                  f"{meta['cached_tokens']}/{meta['prompt_tokens']} prompt tokens from cache)\n")
        stats = engine.stats()
        out_tokens = sum(r["meta_info"]["completion_tokens"] for r in results)
        print(f"model load {load_s:.1f} s; {len(prompts)} requests in {wall:.2f} s; "
              f"{out_tokens / wall:.1f} output tokens/s overall")
        print(f"cache hit rate {stats['cache_hit_rate']:.0%} of prompt tokens; "
              f"decode {stats['decode_tokens_per_s']:.1f} tokens/s, "
              f"prefill {stats['prefill_tokens_per_s']:.0f} tokens/s; "
              f"engine overhead {stats['overhead_ms_per_step']:.1f} ms/step vs model "
              f"{stats['forward_ms_per_step']:.1f} ms/step")


if __name__ == "__main__":
    main()
