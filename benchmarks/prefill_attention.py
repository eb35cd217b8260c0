"""Prefill attention on the CPU, one layer: TorchAttention (gather + SDPA, the GQA group folded
into a mask) against NativeAttention's prefill kernel (kernels/cpu/paged_attention.c's
paged_prefill_bf16), bf16, on three models' head shapes: a whole prompt, and a chunk after a
cached prefix (what chunked prefill of a long prompt runs). Prints markdown; GFLOP/s count the
causal half of the scores (4 d flops per visible query-key pair).

  python -m benchmarks.prefill_attention [--prompts 512 1024 2048] [--repeats 5]
"""

from __future__ import annotations

import argparse

from benchmarks.native_attention import median_us

SHAPES = {"default model (9/3 heads, d 64)": (9, 3, 64), "Llama-3.2-1B (32/8, d 64)": (32, 8, 64),
          "Qwen2.5-3B (16/2, d 128)": (16, 2, 128)}


def main() -> None:
    import torch

    from benchmarks.report import machine
    from forklm.runtime.attention.backends import TorchAttention
    from forklm.runtime.attention.native import NativeAttention, NativePrefillMeta
    from forklm.runtime.kvcache.pool import KVPool
    from tests.test_triton_backend import make_forward_batch

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--prompts", type=int, nargs="+", default=[512, 1024, 2048])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print(f"# {machine()}")
    print("| heads | new tokens after cached | SDPA ms | prefill kernel ms | kernel / SDPA | "
          "kernel GFLOP/s |")
    print("|---|---|---|---|---|---|")
    gen = torch.Generator().manual_seed(0)
    for name, (heads, kv_heads, d) in SHAPES.items():
        cases = [(n, 0) for n in args.prompts] + [(args.prompts[-1] // 2, args.prompts[-1] // 2)]
        for new, cached in cases:
            total = new + cached
            batch = make_forward_batch(gen, [total], [new], total + 64)
            pool = KVPool(1, total + 64, kv_heads, d, torch.bfloat16)
            pool.k_buffer.normal_(generator=gen)
            pool.v_buffer.normal_(generator=gen)
            q = torch.randn(new, heads, d, generator=gen).bfloat16()
            k, v = (torch.randn(new, kv_heads, d, generator=gen).bfloat16() for _ in "kv")
            times = {}
            for label, cls in (("torch", TorchAttention), ("native", NativeAttention)):
                attn = cls(pool, heads, kv_heads, d)
                prepared = attn.prepare(batch)
                if label == "native":
                    assert isinstance(prepared.attn_meta, NativePrefillMeta)
                times[label] = median_us(
                    lambda a=attn, p=prepared, qkv=(q, k, v): a.forward(0, *qkv, p), args.repeats,
                    warm_up=1) / 1e3
            pairs = new * cached + new * (new + 1) / 2
            gflops = 4 * d * heads * pairs / times["native"] / 1e6
            print(f"| {name} | {new} after {cached} | {times['torch']:.1f} | "
                  f"{times['native']:.1f} | {times['native'] / times['torch']:.2f} | "
                  f"{gflops:.0f} |", flush=True)


if __name__ == "__main__":
    main()
