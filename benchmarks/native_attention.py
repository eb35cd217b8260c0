"""Decode attention on the CPU: TorchAttention (gather + SDPA) vs NativeAttention (the C kernel
reading the pool in place), per layer and for a whole model forward, on the default model's
shapes (9 heads, 3 KV heads, head_dim 64).

  python -m benchmarks.native_attention [--quick]

Each OpenMP wait policy runs in its own child process (libgomp reads it once, when torch loads):
the default (spinning, GOMP_SPINCOUNT=30000) and OMP_WAIT_POLICY=PASSIVE. Prints markdown.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

POLICIES = {"spin 30000": {"GOMP_SPINCOUNT": "30000"}, "passive": {"OMP_WAIT_POLICY": "PASSIVE"}}
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 9, 3, 64
LAYER_CASES = [(b, ctx, 0) for b in (1, 16, 64) for ctx in (100, 450, 2000)] + [(16, 500, 420)]
EXTEND_CASES = [(b, 450, q) for b in (1, 8) for q in (2, 4, 8, 16, 32)]
FORWARD_CASES = [(1, 450), (16, 450), (64, 450)]


def median_us(fn, repeats: int, warm_up: int = 5) -> float:
    for _ in range(warm_up):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(1e6 * (time.perf_counter() - t0))
    return statistics.median(times)


def time_layer(attn, fb, qkv, repeats: int) -> tuple[float, float]:
    """us of one layer's forward and of the per-batch prepare."""
    prepared = attn.prepare(fb)
    return (median_us(lambda: attn.forward(0, *qkv, prepared), repeats),
            median_us(lambda: attn.prepare(fb), 20))


def layer_rows(dtypes, quick: bool) -> list[dict]:
    """One layer's forward (store + attention) of both backends on one batch."""
    import torch

    import forklm.runtime.attention.native as attention_native
    from benchmarks.profile_step import decode_batch
    from forklm.runtime.attention.backends import TorchAttention
    from forklm.runtime.attention.native import NativeAttention
    from forklm.runtime.kvcache.pool import KVPool
    from tests.test_triton_backend import make_forward_batch

    attention_native.NATIVE_MAX_Q_LEN = 1 << 30  # the kernel at every q_len, to find the limit
    rows = []
    gen = torch.Generator().manual_seed(0)
    cases = [("decode", *c) for c in LAYER_CASES] + [("extend", *c) for c in EXTEND_CASES]
    for dtype in dtypes:
        for kind, bsz, ctx, extra in cases:
            if quick and bsz * ctx > 16 * 500:
                continue
            capacity = bsz * ctx + 64
            if kind == "decode":
                fb = decode_batch(bsz, ctx, extra)
            else:  # a verify-like extend: `extra` new tokens per request
                fb = make_forward_batch(gen, [ctx] * bsz, [extra] * bsz, capacity)
            pool = KVPool(1, capacity, NUM_KV_HEADS, HEAD_DIM, dtype)
            pool.k_buffer.normal_(generator=gen)
            pool.v_buffer.normal_(generator=gen)
            n = fb.num_tokens
            q = torch.randn(n, NUM_HEADS, HEAD_DIM, generator=gen).to(dtype)
            k, v = (torch.randn(n, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(dtype) for _ in "kv")
            row = {"dtype": str(dtype).removeprefix("torch."), "kind": kind, "batch": bsz,
                   "ctx": ctx, "extra": extra}
            repeats = 20 if bsz * ctx * max(extra, 1) > 50_000 else 100
            for name, cls in (("torch", TorchAttention), ("native", NativeAttention)):
                attn = cls(pool, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM)
                row[name], row[f"{name}_prepare"] = time_layer(attn, fb, (q, k, v), repeats)
            rows.append(row)
            print(json.dumps(row), file=sys.stderr)
    return rows


def forward_rows(dtypes, quick: bool) -> list[dict]:
    """Whole decode forwards of the default model, each backend on the same model and pool."""
    import torch

    from benchmarks.profile_step import build, decode_batch, time_forwards
    from forklm.runtime.attention.registry import create_attention_backend

    rows = []
    cases = FORWARD_CASES[:2] if quick else FORWARD_CASES
    for dtype in dtypes:
        model, pool, torch_attn = build(dtype, max(b * ctx for b, ctx in cases) + 64)
        native = create_attention_backend("native", pool, torch_attn.num_heads,  # type: ignore[attr-defined]
                                          torch_attn.num_kv_heads, torch_attn.head_dim,  # type: ignore[attr-defined]
                                          model.attention_layers)
        with torch.inference_mode():
            for bsz, ctx in cases:
                fb = decode_batch(bsz, ctx)
                row = {"dtype": str(dtype).removeprefix("torch."), "batch": bsz, "ctx": ctx}
                for _ in range(2):  # alternate rounds: drift hits both alike
                    for name, attn in (("torch", torch_attn), ("native", native)):
                        ms = statistics.median(time_forwards(model, attn, fb, 10, warm_up=2))
                        row[name] = min(row.get(name, ms), ms)
                rows.append(row)
                print(json.dumps(row), file=sys.stderr)
    return rows


def child(quick: bool) -> None:
    import torch

    from forklm.kernels.cpu import bindings as native_kernels

    assert native_kernels.available(), native_kernels.unavailable_reason()
    dtypes = [torch.bfloat16, torch.float32]
    print(json.dumps({"threads": torch.get_num_threads(), "layer": layer_rows(dtypes, quick),
                      "forward": forward_rows(dtypes, quick)}))


def markdown(results: dict[str, dict]) -> str:
    lines = ["Per layer (store + attention), median us; prepare once per forward.", "",
             "| policy | dtype | batch x ctx (q/req) | torch | native | x | prepare torch / native |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: |"]
    for policy, res in results.items():
        for r in res["layer"]:
            case = f"{r['batch']} x {r['ctx']}"
            case += f" ({r['extra']} shared)" if r["kind"] == "decode" and r["extra"] else ""
            case += f" (q {r['extra']})" if r["kind"] == "extend" else ""
            lines.append(f"| {policy} | {r['dtype']} | {case} | {r['torch']:.1f} | "
                         f"{r['native']:.1f} | {r['torch'] / r['native']:.2f} | "
                         f"{r['torch_prepare']:.1f} / {r['native_prepare']:.1f} |")
    lines += ["", "Whole decode forward of the default model, ms (best of 2 medians of 10).", "",
              "| policy | dtype | batch x ctx | torch | native | x |",
              "| --- | --- | --- | ---: | ---: | ---: |"]
    for policy, res in results.items():
        for r in res["forward"]:
            lines.append(f"| {policy} | {r['dtype']} | {r['batch']} x {r['ctx']} | "
                         f"{r['torch']:.2f} | {r['native']:.2f} | {r['torch'] / r['native']:.2f} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true", help="small cases only")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args.quick)
        return
    results = {}
    for policy, env in POLICIES.items():
        base = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
        cmd = [sys.executable, "-m", "benchmarks.native_attention", "--child"]
        cmd += ["--quick"] if args.quick else []
        done = subprocess.run(cmd, env={**base, **env}, stdout=subprocess.PIPE, text=True,
                              check=True)
        results[policy] = json.loads(done.stdout.strip().splitlines()[-1])
    flags = pathlib.Path("/proc/cpuinfo").read_text()
    cpu = "avx512_bf16" if "avx512_bf16" in flags else "no avx512_bf16"
    print(f"CPU: {cpu}, {results['passive']['threads']} torch threads\n")
    print(markdown(results))


if __name__ == "__main__":
    main()
