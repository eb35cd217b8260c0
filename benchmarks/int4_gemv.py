"""torch's int4 CPU kernel vs kernels/cpu/int4_gemv.c on the default model's decode matmuls
(SmolLM2-135M: qkv, o_proj, gate_up, down), interleaved in one process; medians.
--forward: the whole decode forward (the GGUF kept quantized, fused decode layers) with the
native kernel and with torch's kernel + the dense copy (as where the native one did not build),
alternating rounds. --engine: the same switch in one engine, decode tokens/s per batch size.

    PYTHONPATH=. .venv/bin/python -m benchmarks.int4_gemv [--rows 1 4 7 16] [--threads 2]
    PYTHONPATH=. .venv/bin/python -m benchmarks.int4_gemv --forward [--batch 1] [--ctx 450]
    PYTHONPATH=. .venv/bin/python -m benchmarks.int4_gemv --engine 1,8,16 [--rounds 6] \
        [--pair torch,bf16 | bf16,int8]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from forklm.kernels.cpu import bindings as native_kernels
from forklm.runtime.quant.linear import KERNEL_GROUP, Int4Matrix, pack_block_n

SHAPES = {"qkv": (960, 576), "o_proj": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}


def random_matrix(out_features: int, in_features: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed codes, bf16 scale_zeros [K / 32, N, 2]) as Int4Matrix holds them."""
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (out_features, in_features), generator=gen, dtype=torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    scale_zeros = torch.randn(in_features // KERNEL_GROUP, out_features, 2, generator=gen) * 0.01
    return packed, scale_zeros.bfloat16().contiguous()


def medians(fns: dict[str, Callable[[], object]], calls: int, rounds: int) -> dict[str, float]:
    """Median microseconds a call of each function, the functions taking turns each round."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            times[name].append((time.perf_counter() - start) / calls * 1e6)
    return {name: statistics.median(t) for name, t in times.items()}


def time_rows(packed: torch.Tensor, scale_zeros: torch.Tensor, rows: int, calls: int,
              rounds: int) -> dict[str, float]:
    """Median us of torch's kernel and the native one on `rows` random bf16 rows."""
    n, k = packed.shape[0], scale_zeros.shape[0] * KERNEL_GROUP
    native = native_kernels.int4_gemv(packed, scale_zeros, n, pack_block_n())
    assert native is not None, "native int4 kernel off (FORKLM_NATIVE_INT4=0, or no build)"
    int4_mm = torch.ops.aten._weight_int4pack_mm_for_cpu
    x = torch.randn(rows, k).bfloat16()
    return medians({"torch": lambda: int4_mm(x, packed, KERNEL_GROUP, scale_zeros),
                    "native": lambda: native(x)}, calls, rounds)


def use_native(model: torch.nn.Module, attn: object, on: bool, int8: bool = False) -> None:
    """Switch the model's int4 matrices to the native kernel (on; with int8 dot products when
    `int8`) or torch's (off, with the dense copy from DENSE_COPY_MIN_ROWS, as without the native
    library), rebuilding the fused decode layers' direct matmul calls when it has them."""
    from forklm.runtime.models.fused_layers import FusedDecodeLayers

    for module in model.modules():
        if isinstance(module, Int4Matrix):
            module.int8_activations = int8
            module._native = None if on else (module.packed.data_ptr(), None, None)
            if on:
                module._native_functions()
    if getattr(model, "fused_layers", None) is not None:
        model.fused_layers = FusedDecodeLayers(model, attn)  # type: ignore[arg-type]


def compare_forwards(batch: int, ctx: int, repeats: int, rounds: int) -> None:
    """Median ms of the decode forward with fused layers over the native and torch's kernel."""
    from benchmarks.profile_step import build, decode_batch, time_forwards
    from forklm.runtime.models.fused_layers import FusedDecodeLayers, unsupported_reason

    model, _, attn = build(torch.bfloat16, batch * ctx + 64, quantized=True,
                           attention="native")
    assert not unsupported_reason(model, attn), unsupported_reason(model, attn)
    model.fused_layers = FusedDecodeLayers(model, attn)  # type: ignore[arg-type]
    fb = decode_batch(batch, ctx)
    times: dict[str, list[float]] = {"native": [], "torch": []}
    for _ in range(rounds):
        for name in times:
            use_native(model, attn, name == "native")
            times[name] += time_forwards(model, attn, fb, repeats, warm_up=1)
    native, torch_ms = (statistics.median(times[name]) for name in ("native", "torch"))
    print(f"decode batch {batch} ctx {ctx}, fused layers: native {native:.2f} ms, torch "
          f"{torch_ms:.2f} ms (x{torch_ms / native:.2f}), medians of {len(times['native'])}")


KERNELS = {"torch": "torch int4 + dense copy", "bf16": "native, bf16 dots",
           "int8": "native, int8 dots"}


def set_kernel(model: torch.nn.Module, attn: object, name: str) -> None:
    use_native(model, attn, name != "torch", int8=name == "int8")


def compare_engine(pair: tuple[str, str], batches: list[int], repeats: int, new_tokens: int,
                   words: int) -> None:
    """One engine (dtype auto, the GGUF kept quantized), switched between two of KERNELS
    between interleaved runs: ms/token at batch 1, tokens/s above, and how many requests got
    the same tokens."""
    from benchmarks import report
    from benchmarks.fused_layers import _run
    from benchmarks.overlap import prompts
    from forklm import Engine

    engine = Engine(dtype="auto")
    model, attn = engine.parts.runner.model, engine.parts.runner.attn
    steps: dict[tuple[str, int], list[float]] = {}
    same = total = 0
    _run(engine, prompts(1, 99, words=20), 4)  # warm-up
    for rep in range(repeats):
        for batch in batches:
            outputs = {}
            for name in (pair if rep % 2 == 0 else pair[::-1]):
                set_kernel(model, attn, name)
                engine.flush_cache()
                step, outputs[name] = _run(engine, prompts(batch, rep, words=words), new_tokens)
                steps.setdefault((name, batch), []).append(step)
            same += sum(a == b for a, b in zip(outputs[pair[0]], outputs[pair[1]]))
            total += batch
    governor = engine._loop._governor
    print(f"~{words}-word prompts, {new_tokens} new tokens, {repeats} interleaved repeats; "
          f"thread-count changes: {governor.switches if governor else 'no governor'}")
    print(report.ab_table(pair, (KERNELS[pair[0]], KERNELS[pair[1]]), batches, steps))
    print(f"requests with identical tokens: {same}/{total}")
    engine.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 7])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--forward", action="store_true", help="whole decode forward A/B")
    parser.add_argument("--engine", default="", help="engine A/B at these batches, e.g. 1,8,16")
    parser.add_argument("--pair", default="torch,bf16",
                        help=f"the two kernels the engine A/B compares, of {','.join(KERNELS)}")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-words", type=int, default=300)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--ctx", type=int, default=450)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.engine:
        first, second = args.pair.split(",")
        compare_engine((first, second), [int(b) for b in args.engine.split(",")], args.rounds,
                       args.new_tokens, args.prompt_words)
        return
    if args.forward:
        compare_forwards(args.batch, args.ctx, repeats=10, rounds=args.rounds)
        return
    print(f"threads {args.threads}, pack_block_n {pack_block_n()}, parallel above "
          f"{native_kernels.PARALLEL_WORK} weights x rows")
    for name, (n, k) in SHAPES.items():
        packed, scale_zeros = random_matrix(n, k)
        megabytes = (packed.numel() + scale_zeros.numel() * 2) / 1e6
        for rows in args.rows:
            us = time_rows(packed, scale_zeros, rows, args.calls, args.rounds)
            print(f"{name:8s} {n:5d}x{k:<5d} M={rows}  torch {us['torch']:6.1f} us "
                  f"{megabytes / us['torch'] * 1e3:5.1f} GB/s   native {us['native']:6.1f} us "
                  f"{megabytes / us['native'] * 1e3:5.1f} GB/s   x{us['torch'] / us['native']:.2f}",
                  flush=True)


if __name__ == "__main__":
    main()
