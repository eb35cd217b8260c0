"""Time and profile one model forward in isolation: a decode step at batch B over contexts of L
tokens, or a prefill of B prompts of L tokens, on the default model (or --model) over the paged
KV pool.

  python -m benchmarks.profile_step --batch 16 --ctx 450 [--prefill] [--profile] [--repeats 20]
      [--quantized [--int4-only] | --fp16-weights] [--deterministic] [--torch-compile]
      [--attention auto|torch|native] [--eager-layers]

The forward is the engine's: attention backend "auto" and the fused decode layers where they
apply (--eager-layers: the torch ops). Prints the median forward time; with --profile,
torch.profiler's top operators by self CPU time.
With --torch-compile: the compile time, then eager and compiled layer steps timed in alternating
rounds in this one process (an A/B that a busy machine's drift hits equally), and how far the
compiled logits are from the eager ones.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from forklm.runtime.attention.batch_invariant import BatchInvariantAttention
from forklm.runtime.attention.native import NativeAttention
from forklm.runtime.attention.registry import create_attention_backend
from forklm.runtime.config import EngineConfig, resolved_dtype_name
from forklm.runtime.forward.batch import ForwardBatch
from forklm.runtime.forward.model_parts import build_model
from forklm.runtime.kvcache.pool import KVPool
from forklm.runtime.models import CausalLM, spec_from_config
from forklm.runtime.models.batch_invariant import make_batch_invariant
from forklm.runtime.models.fused_layers import FusedDecodeLayers, unsupported_reason
from forklm.runtime.models.loader import load_model
from forklm.sim.profile import prefill_step


def build(dtype: torch.dtype, capacity: int, quantized: bool = False, dense_copies: bool = True,
          fp16_weights: bool = False, deterministic: bool = False,
          attention: str = "torch", fused: bool = False,
          int8_activations: bool = True,
          model_path: str = "SmolLM2-135M-Instruct") -> tuple[CausalLM, KVPool, object]:
    """The model (default: the default model), a pool of `capacity` slots and its attention backend; fused: the
    fused decode layers attached as the engine attaches them (where the model and backend
    allow: runtime/models/fused_layers.py); int8_activations: as the engine's default
    (quantized decode matmuls with int8 dot products where the CPU has VNNI)."""
    loaded = load_model(model_path)
    spec = spec_from_config(loaded.config)
    model = build_model(loaded, spec, dtype, "cpu", max_positions=4096, keep_quantized=quantized,
                        dense_copies=dense_copies, fp16_weights=fp16_weights,
                        int8_activations=int8_activations)
    pool = KVPool(spec.num_layers, capacity, spec.num_kv_heads, spec.head_dim, dtype)
    attn: object
    if deterministic:  # as EngineConfig(enable_deterministic_inference=True) builds it
        make_batch_invariant(model)
        attn = BatchInvariantAttention(pool, spec.num_heads, spec.num_kv_heads, spec.head_dim,
                                       model.attention_layers)
    else:
        attn = create_attention_backend(attention, pool, spec.num_heads, spec.num_kv_heads,
                                        spec.head_dim, model.attention_layers)
        if fused and not unsupported_reason(model, attn):
            assert isinstance(attn, NativeAttention)
            model.fused_layers = FusedDecodeLayers(model, attn)
    return model, pool, attn


def attention_name(name: str) -> str:
    """The backend the engine would run for attention_backend=`name` on this machine."""
    return EngineConfig(attention_backend=name).resolved_attention_backend


def decode_batch(batch: int, ctx: int, shared: int = 0) -> ForwardBatch:
    """Each request's prompt sits in a contiguous run of slots; its generated tokens interleave
    with the other requests' (one slot per request per decode step), as the allocator hands out.
    The first `shared` slots are the same for every request (a radix-cached common prefix)."""
    prompt = ctx - 32
    table = torch.empty(batch, ctx, dtype=torch.int64)
    for b in range(batch):
        table[b, :prompt] = torch.arange(b * prompt, (b + 1) * prompt)
        table[b, prompt:] = batch * prompt + torch.arange(32) * batch + b
    table[:, :shared] = torch.arange(shared)
    return ForwardBatch(
        input_ids=torch.randint(0, 49152, (batch,)), positions=torch.full((batch,), ctx - 1),
        out_slots=table[:, -1].clone(), q_lens=torch.ones(batch, dtype=torch.int64),
        kv_lens=torch.full((batch,), ctx), slot_table=table,
        q_index=torch.arange(batch)[:, None], logits_indices=torch.arange(batch), max_q_len=1,
        is_decode=True)


def prefill_batch(batch: int, length: int) -> ForwardBatch:
    """`batch` prompts of `length` tokens each, nothing cached, each in a contiguous run of slots."""
    return prefill_step(batch, length, 0)[1]


def time_forwards(model: CausalLM, attn: object, fb: ForwardBatch, repeats: int,
                  warm_up: int = 3) -> list[float]:
    """ms of each of `repeats` forwards, after `warm_up` untimed ones."""
    for _ in range(warm_up):
        model(fb, attn)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        model(fb, attn)
        times.append(1000 * (time.perf_counter() - t0))
    return times


def compare_compiled(model: CausalLM, attn: object, fb: ForwardBatch, kind: str, repeats: int,
                     rounds: int = 10) -> None:
    """Eager vs torch.compile'd layer steps on the same batch, alternating rounds."""
    from forklm.runtime.forward.torch_compile import WARM_UP_TOKENS, enable_torch_compile

    eager_logits = model(fb, attn)
    t0 = time.perf_counter()
    compiled = enable_torch_compile(model, max_bs=max(fb.batch_size, 1))
    print(f"compile (warm-up of every layer at {WARM_UP_TOKENS} tokens): "
          f"{time.perf_counter() - t0:.1f} s{' FAILED: eager' if compiled.failed else ''}")
    diff = (model(fb, attn) - eager_logits).abs().max().item()
    times: dict[str, list[float]] = {"eager": [], "compiled": []}
    for _ in range(rounds):
        for name in times:
            model.compiled_steps = compiled if name == "compiled" else None
            times[name] += time_forwards(model, attn, fb, max(1, repeats // rounds), warm_up=1)
    eager, comp = (statistics.median(times[name]) for name in ("eager", "compiled"))
    print(f"{kind}: eager {eager:.1f} ms, compiled {comp:.1f} ms (x{comp / eager:.2f}), "
          f"medians of {len(times['eager'])} each (min {min(times['eager']):.1f} / "
          f"{min(times['compiled']):.1f}); logits max abs diff {diff:.3g}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--ctx", type=int, default=450)
    p.add_argument("--shared", type=int, default=0, help="decode: common prefix slots")
    p.add_argument("--prefill", action="store_true")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--quantized", action="store_true",
                   help="keep the GGUF's quantized blocks (plus dense copies, as the engine's auto)")
    p.add_argument("--int4-only", action="store_true", help="with --quantized: no dense copies")
    p.add_argument("--fp16-weights", action="store_true",
                   help="float32 model with FBGEMM float16 weights (dtype auto on an AVX2 CPU)")
    p.add_argument("--deterministic", action="store_true",
                   help="batch-invariant matmuls and attention (--enable-deterministic-inference)")
    p.add_argument("--torch-compile", action="store_true",
                   help="A/B: eager vs compiled layer steps (--enable-torch-compile)")
    p.add_argument("--attention", default="auto",
                   help="attention backend: auto (as the engine picks on this machine), torch, native")
    p.add_argument("--eager-layers", action="store_true",
                   help="no fused decode layers (the engine's --disable-fused-layers)")
    p.add_argument("--disable-int8-activations", action="store_true",
                   help="with --quantized: bf16 dot products (the engine's flag of that name)")
    p.add_argument("--model", default="SmolLM2-135M-Instruct",
                   help="any model forklm loads, e.g. a synthetic GGUF of benchmarks.gguf_sizes")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--profile", action="store_true")
    args = p.parse_args()
    model, pool, attn = build(getattr(torch, resolved_dtype_name(args.dtype)), args.batch * args.ctx + 64,
                               args.quantized, not args.int4_only, args.fp16_weights,
                               args.deterministic, attention_name(args.attention),
                               fused=not args.eager_layers and not args.torch_compile,
                               int8_activations=not args.disable_int8_activations,
                               model_path=args.model)
    if args.prefill:
        fb = prefill_batch(args.batch, args.ctx)
    else:
        fb = decode_batch(args.batch, args.ctx, args.shared)
    kind = f"{'prefill' if args.prefill else 'decode'} batch {args.batch} ctx {args.ctx}"
    if args.torch_compile:
        compare_compiled(model, attn, fb, kind, args.repeats)
        return
    times = time_forwards(model, attn, fb, args.repeats)
    print(f"{kind}: median {statistics.median(times):.1f} ms (min {min(times):.1f}) "
          f"over {args.repeats}")
    if args.profile:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(5):
                model(fb, attn)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18))


if __name__ == "__main__":
    main()
