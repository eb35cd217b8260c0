"""GPU check of the Triton attention kernels: correctness at realistic sizes (bf16, batch 64,
context 4k, 32 heads, GQA 4), the engine's greedy tokens vs transformers on CUDA, decode from
CUDA graphs and the overlap scheduler on/off (same tokens, tokens/s at batch 1/16/64, the KV
pool's size), W1-W3 on the default model (overlap on/off), and one timing table against torch's
scaled_dot_product_attention on gathered K/V. A few minutes on an H100.

Run on a CUDA machine, from the repository root (forklm.kernels.triton maps to kernels/triton/ only once
the project is installed; the engine section also needs the engine's imports, e.g. xgrammar):
    python3 -m pip install --no-deps --no-build-isolation -e . && python3 -m benchmarks.gpu_check
`--compile-only` compiles every kernel for sm_90 with Triton's bundled ptxas and needs no GPU.
Exits 1 if any check failed.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import traceback
from collections.abc import Callable

import torch
import torch.nn.functional as F

from forklm.kernels.triton.decode_attention import decode_attention, decode_attention_ref
from forklm.kernels.triton.extend_attention import extend_attention, extend_attention_ref
from forklm.kernels.triton.store_kv import store_kv, store_kv_ref

BATCH, CONTEXT, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 64, 4096, 32, 8, 128
GROUP = NUM_HEADS // NUM_KV_HEADS
DTYPE = torch.bfloat16
BF16_ATOL = 2e-2  # bf16 output rounding plus bf16 softmax weights in the P @ V product
failures: list[str] = []


def report(name: str, err: float, atol: float) -> None:
    ok = err <= atol
    print(f"{'PASS' if ok else 'FAIL'}  {name:58s} max abs err {err:.2e} (atol {atol:.0e})")
    if not ok:
        failures.append(name)


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


class Paged:
    """K/V for `lens` contexts in one pool layer, each request's slots scattered over the pool and
    listed in a padded table [batch, width], as the engine's slot table is."""

    def __init__(self, lens: list[int], gen: torch.Generator):
        total, width = sum(lens), max(lens)
        shape = (total + 1000, NUM_KV_HEADS, HEAD_DIM)
        self.k_buffer = torch.randn(shape, device="cuda", generator=gen).to(DTYPE)
        self.v_buffer = torch.randn(shape, device="cuda", generator=gen).to(DTYPE)
        perm = torch.randperm(shape[0], device="cuda", generator=gen)[:total]
        self.table = torch.zeros(len(lens), width, dtype=torch.int64, device="cuda")
        for b, slots in enumerate(perm.split(lens)):
            self.table[b, : lens[b]] = slots
        self.kv_lens = torch.tensor(lens, device="cuda")
        self.kv_indices = self.table.reshape(-1)
        self.kv_start = torch.arange(len(lens), device="cuda") * width

    def index(self) -> tuple[torch.Tensor, ...]:
        return self.k_buffer, self.v_buffer, self.kv_indices, self.kv_start, self.kv_lens

    def gather(self) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V as dense [batch, num_heads, width, head_dim], GQA heads expanded (padding rows hold
        slot 0's K/V and must be masked)."""
        k = self.k_buffer[self.table].transpose(1, 2).repeat_interleave(GROUP, dim=1)
        v = self.v_buffer[self.table].transpose(1, 2).repeat_interleave(GROUP, dim=1)
        return k, v

    def mask(self, q_lens: torch.Tensor, max_q: int) -> torch.Tensor:
        """[batch, 1, max_q, width]: query i of request b sees keys j <= prefix_b + i."""
        width = self.table.shape[1]
        q_pos = (self.kv_lens - q_lens)[:, None] + torch.arange(max_q, device="cuda")[None, :]
        k_pos = torch.arange(width, device="cuda")
        visible = k_pos[None, None, :] <= q_pos[:, :, None]
        return (visible & (k_pos < self.kv_lens[:, None, None]))[:, None]


def dense(q4: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """fp32 SDPA on gathered K/V: q4 [batch, heads, m, d] -> [batch, heads, m, d]."""
    return F.scaled_dot_product_attention(q4.float(), k.float(), v.float(), attn_mask=mask)


def check_store_kv(gen: torch.Generator) -> None:
    paged = Paged([CONTEXT] * 4, gen)
    n = BATCH * 64
    kv = torch.randn(n, 2 * NUM_KV_HEADS * HEAD_DIM, device="cuda", generator=gen).to(DTYPE)
    k, v = (t.view(n, NUM_KV_HEADS, HEAD_DIM) for t in kv.chunk(2, dim=1))  # strided rows
    slots = torch.randperm(paged.k_buffer.shape[0], device="cuda", generator=gen)[:n]
    k_ref, v_ref = paged.k_buffer.clone(), paged.v_buffer.clone()
    store_kv(paged.k_buffer, paged.v_buffer, slots, k, v)
    store_kv_ref(k_ref, v_ref, slots, k, v)
    err = max(max_err(paged.k_buffer, k_ref), max_err(paged.v_buffer, v_ref))
    report(f"store_kv {n} tokens", err, 0.0)


def check_decode(gen: torch.Generator) -> None:
    lens = [CONTEXT, 1] + torch.randint(1, CONTEXT + 1, (BATCH - 2,), device="cuda",
                                        generator=gen).tolist()
    paged = Paged(lens, gen)
    q = torch.randn(BATCH, NUM_HEADS, HEAD_DIM, device="cuda", generator=gen).to(DTYPE)
    out = decode_attention(q, *paged.index())
    report("decode vs decode_attention_ref", max_err(out, decode_attention_ref(q, *paged.index())),
           BF16_ATOL)
    k, v = paged.gather()
    want = dense(q[:, :, None], k, v, paged.mask(torch.ones_like(paged.kv_lens), 1))[:, :, 0]
    report("decode vs fp32 SDPA on gathered K/V", max_err(out, want), BF16_ATOL)


def check_extend(name: str, q_lens: list[int], lens: list[int], gen: torch.Generator) -> None:
    paged = Paged(lens, gen)
    q_lens_t = torch.tensor(q_lens, device="cuda")
    q_start = torch.cumsum(q_lens_t, 0) - q_lens_t
    q = torch.randn(sum(q_lens), NUM_HEADS, HEAD_DIM, device="cuda", generator=gen).to(DTYPE)
    k_buffer, v_buffer, kv_indices, kv_start, kv_lens = paged.index()
    args = (q, k_buffer, v_buffer, q_start, q_lens_t, kv_indices, kv_start, kv_lens, max(q_lens))
    out = extend_attention(*args)
    report(f"{name} vs extend_attention_ref", max_err(out, extend_attention_ref(*args)), BF16_ATOL)
    k, v = paged.gather()
    rows = q_start[:, None] + torch.arange(max(q_lens), device="cuda")[None, :]
    valid = torch.arange(max(q_lens), device="cuda")[None, :] < q_lens_t[:, None]
    q4 = q[torch.where(valid, rows, 0)].transpose(1, 2)  # [batch, heads, max_q, d]
    want = dense(q4, k, v, paged.mask(q_lens_t, max(q_lens))).transpose(1, 2)[valid]
    report(f"{name} vs fp32 SDPA on gathered K/V", max_err(out[rows[valid]], want), BF16_ATOL)


def check_extends(gen: torch.Generator) -> None:
    # Chunked prefill: 64 new tokens (1 for one) over prefixes up to 4k; then whole long prompts
    # in a small batch (the fp32 references hold [batch, heads, q, context] scores).
    prefixes = torch.randint(0, CONTEXT - 64 + 1, (BATCH - 2,), generator=torch.Generator())
    q_lens = [64, 1] + [64] * (BATCH - 2)
    check_extend("extend 64 x 64 new, 4k ctx", q_lens,
                 [CONTEXT, CONTEXT] + (prefixes + 64).tolist(), gen)
    check_extend("prefill 4k + 2000 after 1000", [CONTEXT, 2000], [CONTEXT, 3000], gen)


def check_alibi(gen: torch.Generator) -> None:
    """ALiBi (BLOOM's slopes of NUM_HEADS heads) in both kernels against their twins."""
    from forklm.runtime.models.layers import alibi_slopes

    slopes = torch.tensor(alibi_slopes(NUM_HEADS), dtype=torch.float32, device="cuda")
    lens = [CONTEXT, 1] + [CONTEXT // 2] * 6
    paged = Paged(lens, gen)
    q = torch.randn(len(lens), NUM_HEADS, HEAD_DIM, device="cuda", generator=gen).to(DTYPE)
    out = decode_attention(q, *paged.index(), alibi_slopes=slopes)
    want = decode_attention_ref(q, *paged.index(), alibi_slopes=slopes)
    report("alibi decode vs decode_attention_ref", max_err(out, want), BF16_ATOL)
    q_lens = torch.tensor([64, 1] + [64] * 6, device="cuda")
    q = torch.randn(int(q_lens.sum()), NUM_HEADS, HEAD_DIM, device="cuda", generator=gen).to(DTYPE)
    k_buffer, v_buffer, kv_indices, kv_start, kv_lens = paged.index()
    args = (q, k_buffer, v_buffer, torch.cumsum(q_lens, 0) - q_lens, q_lens, kv_indices,
            kv_start, kv_lens, 64)
    report("alibi extend vs extend_attention_ref",
           max_err(extend_attention(*args, alibi_slopes=slopes),
                   extend_attention_ref(*args, alibi_slopes=slopes)), BF16_ATOL)


def _random_llama():
    """A random Llama shaped like SmolLM2-135M (4 layers, GQA 3, head_dim 64) on CUDA, with
    sharpened weights so greedy argmaxes are stable."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=4096, hidden_size=576, intermediate_size=1536, num_hidden_layers=4,
        num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
        rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, tie_word_embeddings=True)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():  # random init gives near-uniform logits; sharpen so argmax is stable
        for p in model.parameters():
            p.mul_(4.0)
    return model.eval().cuda()


def check_engine() -> None:
    """The random Llama in fp32 on CUDA: greedy tokens from the engine (Triton backend, chunked
    prefill, radix cache, decode from CUDA graphs) == transformers'."""
    from forklm.runtime.engine.engine import Engine

    model = _random_llama()
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 4096, (n,), generator=gen).tolist() for n in (5, 40, 130, 300, 700)]
    prompts.append(prompts[3][:200] + prompts[0])  # shares a cached prefix with prompt 3
    expected = [_hf_greedy(model, ids, 24) for ids in prompts]
    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder)
        _word_tokenizer(model.config.vocab_size).save_pretrained(folder)
        with Engine(model_path=folder, device="cuda", dtype="float32", max_total_tokens=16384,
                    attention_backend="triton", chunked_prefill_size=256) as engine:
            params = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}
            results = engine.generate(input_ids=prompts, sampling_params=params)
            graphs = engine.parts.runner.graphs
    got = [r["output_ids"] for r in results]
    same = sum(g == e for g, e in zip(got, expected))
    print(f"{'PASS' if same == len(prompts) else 'FAIL'}  engine greedy == transformers (fp32, "
          f"cuda, decode graphs {'replayed ' + str(graphs.replays) + 'x' if graphs else 'off'}): "
          f"{same}/{len(prompts)} prompts")
    if same != len(prompts):
        failures.append("engine greedy")
        for g, e in zip(got, expected):
            print(f"      engine {g}\n      hf     {e}")


def check_cuda_graphs() -> None:
    """Decode with CUDA graphs on/off and the overlap scheduler on/off, on the random Llama (fp32,
    Triton): the same greedy tokens in all four, decode tokens/s at batch 1, 16 and 64 each way,
    and the KV pool that --mem-fraction-static (default) sized."""
    import time

    from forklm.runtime.engine.engine import Engine

    model = _random_llama()
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 4096, (64,), generator=gen).tolist() for _ in range(64)]
    params = {"temperature": 0, "max_new_tokens": 64, "ignore_eos": True}
    tokens, rows = {}, []
    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder)
        _word_tokenizer(model.config.vocab_size).save_pretrained(folder)
        for graphs in (False, True):
            for overlap in (False, True):
                with Engine(model_path=folder, device="cuda", dtype="float32",
                            attention_backend="triton", disable_cuda_graph=not graphs,
                            cuda_graph_max_bs=64, disable_overlap_schedule=not overlap) as engine:
                    captured = engine.parts.runner.graphs is not None
                    if graphs and not captured:
                        failures.append("cuda graph capture")
                        print("FAIL  decode graphs were not captured (see the warning above)")
                    tokens[graphs, overlap] = [r["output_ids"] for r in engine.generate(
                        input_ids=prompts[:16], sampling_params=params)]
                    speeds = []
                    for batch in (1, 16, 64):
                        start = time.perf_counter()
                        engine.generate(input_ids=prompts[:batch], sampling_params=params)
                        speeds.append(batch * 64 / (time.perf_counter() - start))
                    rows.append((f"graphs {'on ' if captured else 'off'} overlap "
                                 f"{'on ' if overlap else 'off'}", speeds,
                                 engine.stats()["kv_capacity"]))
    same = all(t == tokens[False, False] for t in tokens.values())
    print(f"{'PASS' if same else 'FAIL'}  graphs and overlap on/off give the same greedy tokens "
          "(16 prompts)")
    if not same:
        failures.append("graphs/overlap tokens")
    print("decode tok/s (64 new tokens after 64-token prompts, end to end)")
    print(f"  {'':22s} {'batch 1':>9s} {'batch 16':>9s} {'batch 64':>9s} {'KV tokens':>11s}")
    for name, speeds, kv in rows:
        print(f"  {name:22s} " + " ".join(f"{v:9.1f}" for v in speeds) + f" {kv:11d}")


def check_workloads() -> None:
    """W1-W3 (shared/workloads.md) on the default model on CUDA, dtype auto (bf16), in process,
    overlap on and off: output tokens/s, median TTFT and the prompt tokens computed."""
    from benchmarks import workloads
    from benchmarks.runners import EngineRunner
    from forklm.runtime.engine.engine import Engine

    print("W1-W3, default model, cuda, bf16 (in process)")
    print(f"  {'':12s} {'workload':18s} {'tok/s':>8s} {'TTFT s':>7s} {'computed/sent':>15s}")
    for overlap in (True, False):
        with Engine(device="cuda", disable_overlap_schedule=not overlap) as engine:
            runner = EngineRunner(engine)
            for wl in (workloads.shared_prefix(), workloads.no_sharing(),
                       workloads.multi_turn()):
                engine.flush_cache()
                m = runner.run(wl)
                print(f"  overlap {'on ' if overlap else 'off'}  {wl.name:18s} "
                      f"{m.output_tokens_per_s:8.1f} {m.median_ttft_s:7.2f} "
                      f"{m.prompt_tokens_computed:>7d}/{m.prompt_tokens_sent:<7d}")


@torch.inference_mode()
def _hf_greedy(model, ids: list[int], num_new: int) -> list[int]:
    """Greedy decoding by full recompute each step (no cache API differences across versions)."""
    out: list[int] = []
    for _ in range(num_new):
        logits = model(torch.tensor([ids + out], device="cuda")).logits[0, -1]
        out.append(int(logits.argmax()))
    return out


def _word_tokenizer(vocab_size: int):
    """A tokenizer for the random model with no download: word i <-> token i."""
    import tokenizers
    import transformers

    vocab = {f"w{i}": i for i in range(vocab_size)}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0",
                                                bos_token="w1", eos_token="w2")


def time_table() -> None:
    """Triton kernels vs SDPA on K/V already gathered into dense [batch, heads, len, d] tensors
    (SDPA alone, and with the gather that a paged pool needs)."""
    gen = torch.Generator(device="cuda").manual_seed(2)
    rows = []
    # decode: batch 64 x 4k context, one query each
    paged = Paged([CONTEXT] * BATCH, gen)
    q = torch.randn(BATCH, NUM_HEADS, HEAD_DIM, device="cuda", generator=gen).to(DTYPE)
    k, v = paged.gather()
    q4 = q[:, :, None]
    kv_bytes = 2 * BATCH * CONTEXT * NUM_KV_HEADS * HEAD_DIM * DTYPE.itemsize
    rows.append(_row("decode 64 x 4k ctx", bench(lambda: decode_attention(q, *paged.index())),
                     bench(lambda: F.scaled_dot_product_attention(q4, k, v)),
                     bench(lambda: F.scaled_dot_product_attention(q4, *paged.gather())),
                     kv_bytes / 1e6))
    # extend: 64 new tokens per request over a 4k context (chunked prefill)
    q_lens = torch.full((BATCH,), 64, device="cuda")
    rows.append(_time_extend("extend 64 x (4032 + 64)", paged, q_lens, gen))
    # prefill: 4 prompts of 2048, no prefix
    paged = Paged([2048] * 4, gen)
    rows.append(_time_extend("prefill 4 x 2048", paged, torch.full((4,), 2048, device="cuda"),
                             gen))
    print(f"\n{'case (bf16, 32 heads, GQA 4)':30s} {'triton ms':>10s} {'sdpa ms':>10s} "
          f"{'gather+sdpa':>12s} {'sdpa/triton':>12s} {'KV GB/s':>8s}")
    for name, t, s, gs, gbs in rows:
        print(f"{name:30s} {t:10.3f} {s:10.3f} {gs:12.3f} {s / t:11.2f}x {gbs:>8s}")


def _time_extend(name: str, paged: Paged, q_lens: torch.Tensor, gen: torch.Generator) -> tuple:
    batch, max_q = q_lens.shape[0], int(q_lens.max())
    q = torch.randn(batch * max_q, NUM_HEADS, HEAD_DIM, device="cuda", generator=gen).to(DTYPE)
    q_start = torch.arange(batch, device="cuda") * max_q
    k_buffer, v_buffer, kv_indices, kv_start, kv_lens = paged.index()
    q4 = q.view(batch, max_q, NUM_HEADS, HEAD_DIM).transpose(1, 2)
    k, v = paged.gather()
    mask = paged.mask(q_lens, max_q)

    def sdpa(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if k.shape[2] == max_q:  # no prefix: plain causal, the flash path
            return F.scaled_dot_product_attention(q4, k, v, is_causal=True)
        return F.scaled_dot_product_attention(q4, k, v, attn_mask=mask)

    return _row(name, bench(lambda: extend_attention(q, k_buffer, v_buffer, q_start, q_lens,
                                                        kv_indices, kv_start, kv_lens, max_q)),
                bench(lambda: sdpa(k, v)), bench(lambda: sdpa(*paged.gather())), None)


def bench(fn: Callable[[], object]) -> float:
    """Median milliseconds per call (Triton's do_bench: warm-up, L2 flush between calls)."""
    from triton.testing import do_bench

    return do_bench(fn, return_mode="median")


def _row(name: str, triton_ms: float, sdpa_ms: float, gather_ms: float,
         kv_mb: float | None) -> tuple:
    """kv_mb: K/V megabytes a decode step must read, for a bandwidth column (None: not bound)."""
    return name, triton_ms, sdpa_ms, gather_ms, "-" if kv_mb is None else f"{kv_mb / triton_ms:.0f}"


def compile_only() -> None:
    """Compile each kernel for sm_90 (bf16, fp16, fp32; head_dim 64 and 128) without a GPU."""
    from forklm.kernels.triton import decode_attention as da
    from forklm.kernels.triton import extend_attention as ea
    from forklm.kernels.triton import store_kv as sk

    for dt, precision in (("bf16", "tf32"), ("fp16", "tf32"), ("fp32", "ieee")):
        # the last: gpt-oss's attention sinks and sliding window
        for d, extra in ((64, False), (128, False), (64, True)):
            common = dict(HEAD_DIM=d, BLOCK_D=d)
            block = 32 if dt == "fp32" else 64
            for alibi in (False, True):
                _compile(da._stage1_kernel, dt, dict(common, GROUP=GROUP, NUM_SPLITS=8,
                                                     BLOCK_H=16, BLOCK_N=64, PRECISION=precision,
                                                     HAS_ALIBI=alibi, HAS_WINDOW=extra))
                _compile(ea._extend_kernel, dt, dict(common, GROUP=GROUP, BLOCK_M=block,
                                                     BLOCK_N=block, PRECISION=precision,
                                                     HAS_ALIBI=alibi, HAS_SINKS=extra,
                                                     HAS_WINDOW=extra),
                         num_warps=4 if d <= 64 else 8)
            _compile(da._stage2_kernel, dt, dict(common, NUM_SPLITS=8, BLOCK_S=8,
                                                 HAS_SINKS=extra))
            if not extra:
                _compile(sk._store_kv_kernel, dt, dict(common, NUM_KV_HEADS=8, BLOCK_H=8))


def _compile(kernel, dtype: str, constexprs: dict, num_warps: int = 4) -> None:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    def arg_type(name: str) -> str:
        if name in constexprs:
            return "constexpr"
        if name.startswith("stride"):
            return "i32"
        if name == "qk_scale":
            return "fp32"
        if name == "window":
            return "i32"
        if name.startswith(("Mid_", "Sinks")) or name == "Alibi":  # ALiBi's slopes are float32
            return "*fp32"
        if name.startswith(("KV_", "Q_", "Slots")):
            return "*i64"
        return f"*{dtype}"

    signature = {name: arg_type(name) for name in kernel.arg_names}
    compiled = triton.compile(ASTSource(kernel, signature, constexprs),
                              target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": num_warps, "num_stages": 2})
    extras = [label for label, flag in (("alibi", "HAS_ALIBI"), ("sinks", "HAS_SINKS"),
                                        ("window", "HAS_WINDOW")) if constexprs.get(flag)]
    print(f"compiled {kernel.__name__:18s} {dtype} d={constexprs['HEAD_DIM']:<4d} "
          f"shared memory {compiled.metadata.shared} B {'/'.join(extras)}")


def run(name: str, fn: Callable[[], None]) -> None:
    try:
        fn()
    except Exception:
        traceback.print_exc()
        print(f"FAIL  {name}: raised (traceback above)")
        failures.append(name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compile-only", action="store_true")
    args = parser.parse_args()
    if args.compile_only:
        compile_only()
        return
    if not torch.cuda.is_available():
        sys.exit("gpu_check: no CUDA device (use --compile-only to only compile the kernels)")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    gen = torch.Generator(device="cuda").manual_seed(0)
    run("store_kv", lambda: check_store_kv(gen))
    run("decode", lambda: check_decode(gen))
    run("extend", lambda: check_extends(gen))
    run("alibi", lambda: check_alibi(gen))
    run("engine greedy", check_engine)
    run("cuda graphs and overlap", check_cuda_graphs)
    run("workloads", check_workloads)
    run("timings", time_table)
    print(f"\n{len(failures)} failed: {', '.join(failures)}" if failures else "\nall checks passed")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
