"""The native paged-attention kernel (kernels/cpu/paged_attention.c) against a float64 reference on
scattered pools, NativeAttention against TorchAttention, and the engine's greedy tokens with
attention_backend="native" against "torch"."""

from __future__ import annotations

import pytest
import torch

from forklm.kernels.cpu import bindings as native_kernels
from forklm.kernels.cpu import native_build
from forklm.runtime.attention.backends import (
    AttentionLayerSpec,
    TorchAttention,
)
from forklm.runtime.attention.native import (
    NativeAttention,
    NativeAttentionMeta,
    NativePrefillMeta,
    _token_map,
)
from forklm.runtime.attention.registry import create_attention_backend
from forklm.runtime.config import EngineConfig
from forklm.runtime.kvcache.pool import KVPool, int8_rows
from forklm.runtime.models.layers import alibi_slopes
from tests.conftest import assert_idle_and_clean
from tests.test_triton_backend import make_forward_batch

if not native_kernels.available():
    pytest.skip(f"native kernels unavailable: {native_kernels.unavailable_reason()}",
                allow_module_level=True)

TOLERANCES = {torch.float32: {"rtol": 1e-5, "atol": 1e-5},
              # the output's rounding to bf16 (half an ulp: 2**-8 relative) plus fp32 math
              torch.bfloat16: {"rtol": 2**-8 + 1e-5, "atol": 1e-5},
              torch.float16: {"rtol": 2**-11 + 1e-5, "atol": 1e-5}}
FP16 = pytest.param(torch.float16, marks=pytest.mark.skipif(
    not native_kernels.available(torch.float16), reason="this compiler has no _Float16"))


def attention_ref(q, k_pool, v_pool, table, tok_req, tok_end, scale, softcap=None, window=None,
                  alibi=None, sinks=None):
    """float64, one token at a time: q [T, H, d] over keys [start, tok_end[t]) of row tok_req[t];
    `alibi` [H]: ALiBi's slopes, slope * (key - query position) (BLOOM's slope * key position is
    the same softmax, but not beside a sink); sinks [H]: one more softmax column per head, with
    no value."""
    group = q.shape[1] // k_pool.shape[1]
    out = torch.empty(q.shape, dtype=torch.float64)
    for t in range(q.shape[0]):
        end = int(tok_end[t])
        start = max(0, end - window) if window else 0
        slots = table[int(tok_req[t]), start:end]
        k = k_pool[slots].double().repeat_interleave(group, dim=1)  # [n, H, d]
        v = v_pool[slots].double().repeat_interleave(group, dim=1)
        s = torch.einsum("hd,nhd->hn", q[t].double(), k) * scale
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        if alibi is not None:
            s = s + alibi.double()[:, None] * torch.arange(start + 1 - end, 1, dtype=torch.float64)
        if sinks is not None:
            s = torch.cat((s, sinks.double()[:, None]), dim=1)
        p = s.softmax(-1)[:, : slots.numel()]
        out[t] = torch.einsum("hn,nhd->hd", p, v)
    return out


def random_case(gen, dtype, kv_lens, q_lens, num_heads, num_kv_heads, head_dim, shared=0):
    """A pool much larger than the batch's contexts, their slots scattered over it."""
    capacity = 4 * sum(kv_lens) + 64
    batch = make_forward_batch(gen, kv_lens, q_lens, capacity, shared)
    shape = (capacity + 1, num_kv_heads, head_dim)
    k_pool, v_pool = (torch.randn(shape, generator=gen).to(dtype) for _ in range(2))
    q = torch.randn(batch.num_tokens, num_heads, head_dim, generator=gen).to(dtype)
    return batch, q, k_pool, v_pool


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, FP16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"),
                         [(9, 3, 64), (4, 4, 32), (8, 4, 80), (6, 2, 128)])
@pytest.mark.parametrize(("kv_lens", "q_lens"),
                         [([450], [1]), ([3, 1, 130, 700], [1, 1, 1, 1]),
                          ([5, 9, 60], [5, 1, 3]), ([2, 40], [2, 4])],
                         ids=["decode1", "decode4", "extend", "extend-short"])
def test_kernel_matches_float64_reference(dtype, num_heads, num_kv_heads, head_dim, kv_lens,
                                          q_lens):
    gen = torch.Generator().manual_seed(sum(kv_lens) + head_dim)
    batch, q, k_pool, v_pool = random_case(gen, dtype, kv_lens, q_lens, num_heads, num_kv_heads,
                                           head_dim)
    tok_req, tok_end = _token_map(batch)
    out = torch.empty_like(q)
    scale = head_dim**-0.5
    native_kernels.paged_attention(q, k_pool, v_pool, out, batch.slot_table, tok_req, tok_end,
                                   scale, None, None)
    ref = attention_ref(q, k_pool, v_pool, batch.slot_table, tok_req, tok_end, scale)
    torch.testing.assert_close(out.double(), ref, **TOLERANCES[dtype])


def test_a_tokens_result_does_not_depend_on_its_batch_or_threads():
    """A decode token's output is the same bit for bit alone, in a batch, and on one thread
    (each (token, kv head) is one work item, its sums in one order), here over 1 to 450 keys
    with sinks; and a token with no keys gets zeros."""
    gen = torch.Generator().manual_seed(11)
    kv_lens = [450, 1, 63, 64, 65, 200]
    batch, q, k_pool, v_pool = random_case(gen, torch.float32, kv_lens, [1] * len(kv_lens), 8, 2,
                                           64)
    tok_req, tok_end = _token_map(batch)
    sinks = torch.randn(8, generator=gen)
    together = torch.empty_like(q)
    native_kernels.paged_attention(q, k_pool, v_pool, together, batch.slot_table, tok_req,
                                   tok_end, 0.125, None, None, sinks=sinks)
    ref = attention_ref(q, k_pool, v_pool, batch.slot_table, tok_req, tok_end, 0.125,
                        sinks=sinks)
    torch.testing.assert_close(together.double(), ref, **TOLERANCES[torch.float32])
    threads = torch.get_num_threads()
    for t in range(len(kv_lens)):
        alone = torch.empty_like(q[t:t + 1])
        torch.set_num_threads(1 if t % 2 else threads)
        try:
            native_kernels.paged_attention(q[t:t + 1], k_pool, v_pool, alone, batch.slot_table,
                                           tok_req[t:t + 1], tok_end[t:t + 1], 0.125, None, None,
                                           sinks=sinks)
        finally:
            torch.set_num_threads(threads)
        assert torch.equal(alone[0], together[t]), kv_lens[t]
    # no keys at all: zeros, as the torch path gives for an empty softmax row
    empty = torch.full_like(q[:1], 7.0)
    native_kernels.paged_attention(q[:1], k_pool, v_pool, empty, batch.slot_table, tok_req[:1],
                                   torch.zeros_like(tok_end[:1]), 0.125, None, None)
    assert not empty.any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("softcap", "window"), [(30.0, None), (None, 7), (5.0, 50)])
def test_kernel_softcap_and_sliding_window(dtype, softcap, window):
    gen = torch.Generator().manual_seed(3)
    batch, q, k_pool, v_pool = random_case(gen, dtype, [3, 300, 60, 9], [1, 4, 2, 5], 8, 2, 64)
    q = (q.float() * 4).to(dtype)  # large scores, so that the cap matters
    tok_req, tok_end = _token_map(batch)
    out = torch.empty_like(q)
    native_kernels.paged_attention(q, k_pool, v_pool, out, batch.slot_table, tok_req, tok_end,
                                   0.125, softcap, window)
    ref = attention_ref(q, k_pool, v_pool, batch.slot_table, tok_req, tok_end, 0.125, softcap,
                        window)
    torch.testing.assert_close(out.double(), ref, **TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "window"), [(6, 6, None), (12, 4, None),
                                                                  (6, 2, 50)])
def test_kernel_alibi(dtype, num_heads, num_kv_heads, window):
    """ALiBi's bias per query head (slopes of a head count that is no power of two, GQA groups),
    on decode and extend tokens deep into long contexts, alone and under a sliding window."""
    gen = torch.Generator().manual_seed(num_heads + (window or 0))
    batch, q, k_pool, v_pool = random_case(gen, dtype, [3, 300, 60, 9], [1, 4, 2, 5], num_heads,
                                           num_kv_heads, 64)
    slopes = torch.tensor(alibi_slopes(num_heads), dtype=torch.float32)
    tok_req, tok_end = _token_map(batch)
    out = torch.empty_like(q)
    native_kernels.paged_attention(q, k_pool, v_pool, out, batch.slot_table, tok_req, tok_end,
                                   0.125, None, window, slopes)
    ref = attention_ref(q, k_pool, v_pool, batch.slot_table, tok_req, tok_end, 0.125,
                        window=window, alibi=slopes)
    torch.testing.assert_close(out.double(), ref, **TOLERANCES[dtype])
    unbiased = attention_ref(q, k_pool, v_pool, batch.slot_table, tok_req, tok_end, 0.125,
                             window=window)
    assert not torch.allclose(ref, unbiased, atol=1e-2)  # the bias changes the result


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("window", "with_alibi"), [(None, False), (7, False), (7, True)],
                         ids=["sinks", "sinks+window", "sinks+window+alibi"])
def test_kernel_attention_sinks(dtype, window, with_alibi):
    """gpt-oss's per-head sink logits, from well below the scores to well above them (where
    they take most of the softmax): the float64 reference's output, with ALiBi's bias too (both
    features in one model)."""
    gen = torch.Generator().manual_seed(4)
    batch, q, k_pool, v_pool = random_case(gen, dtype, [3, 300, 60, 9], [1, 4, 2, 5], 8, 2, 64)
    sinks = torch.linspace(-6.0, 6.0, 8)
    alibi = torch.tensor(alibi_slopes(8), dtype=torch.float32) if with_alibi else None
    tok_req, tok_end = _token_map(batch)
    out = torch.empty_like(q)
    native_kernels.paged_attention(q, k_pool, v_pool, out, batch.slot_table, tok_req, tok_end,
                                   0.125, None, window, alibi, sinks)
    ref = attention_ref(q, k_pool, v_pool, batch.slot_table, tok_req, tok_end, 0.125, None,
                        window, alibi, sinks)
    torch.testing.assert_close(out.double(), ref, **TOLERANCES[dtype])
    plain = attention_ref(q, k_pool, v_pool, batch.slot_table, tok_req, tok_end, 0.125, None,
                          window, alibi)
    assert not torch.allclose(ref, plain, atol=1e-2), "the sinks should change the output"


FP8 = [torch.float8_e5m2, torch.float8_e4m3fn]
FP8_IDS = ["e5m2", "e4m3"]


def fp8_pools(gen, shape, kv_dtype, k_scale=1.0, v_scale=1.0):
    """Random K and V rows rounded to an 8-bit format, as KVPool.store rounds (saturated)."""
    limit = torch.finfo(kv_dtype).max
    return tuple((torch.randn(shape, generator=gen) * scale).clamp(-limit, limit).to(kv_dtype)
                 for scale in (k_scale, v_scale))


@pytest.mark.parametrize("kv_dtype", FP8, ids=FP8_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"),
                         [(9, 3, 64), (8, 4, 96), (6, 2, 128)])
@pytest.mark.parametrize(("kv_lens", "q_lens"),
                         [([3, 1, 130, 700], [1, 1, 1, 1]), ([5, 9, 60], [5, 1, 3])],
                         ids=["decode", "extend"])
def test_kernel_over_an_fp8_pool_matches_float64_reference(kv_dtype, dtype, num_heads,
                                                           num_kv_heads, head_dim, kv_lens,
                                                           q_lens):
    """q of the model's dtype over an 8-bit pool (--kv-cache-dtype), GQA groups, the specialized
    head sizes and another: the float64 reference on the pool's values widened, within the
    tolerances of a pool of q's dtype (the kernel widens each 8-bit value exactly)."""
    if not native_kernels.available(dtype, kv_dtype):
        pytest.skip(f"this build has no {dtype} over {kv_dtype} kernel")
    gen = torch.Generator().manual_seed(sum(kv_lens) + head_dim)
    capacity = 4 * sum(kv_lens) + 64
    batch = make_forward_batch(gen, kv_lens, q_lens, capacity)
    k_pool, v_pool = fp8_pools(gen, (capacity + 1, num_kv_heads, head_dim), kv_dtype)
    q = torch.randn(batch.num_tokens, num_heads, head_dim, generator=gen).to(dtype)
    tok_req, tok_end = _token_map(batch)
    out = torch.empty_like(q)
    scale = head_dim**-0.5
    native_kernels.paged_attention(q, k_pool, v_pool, out, batch.slot_table, tok_req, tok_end,
                                   scale, None, None)
    ref = attention_ref(q, k_pool.double(), v_pool.double(), batch.slot_table, tok_req, tok_end,
                        scale)
    torch.testing.assert_close(out.double(), ref, **TOLERANCES[dtype])


@pytest.mark.parametrize("kv_dtype", FP8, ids=FP8_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_over_fp8_subnormals_and_large_values(kv_dtype, dtype):
    """Keys mostly among the format's subnormals (q scaled up to make their scores O(1)) and
    values near its largest: still the float64 reference on the widened pool."""
    if not native_kernels.available(dtype, kv_dtype):
        pytest.skip(f"this build has no {dtype} over {kv_dtype} kernel")
    gen = torch.Generator().manual_seed(8)
    kv_lens, q_lens = [3, 300, 60, 9], [1, 4, 2, 5]
    capacity = 4 * sum(kv_lens) + 64
    batch = make_forward_batch(gen, kv_lens, q_lens, capacity)
    tiny = torch.finfo(kv_dtype).smallest_normal
    k_pool, v_pool = fp8_pools(gen, (capacity + 1, 2, 64), kv_dtype, k_scale=tiny / 2,
                               v_scale=torch.finfo(kv_dtype).max / 4)
    subnormal = (k_pool.float() != 0) & (k_pool.float().abs() < tiny)
    assert subnormal.float().mean() > 0.6
    assert (v_pool.float().abs() == torch.finfo(kv_dtype).max).any()  # some saturated
    q = (torch.randn(batch.num_tokens, 8, 64, generator=gen) / tiny).to(dtype)
    tok_req, tok_end = _token_map(batch)
    out = torch.empty_like(q)
    native_kernels.paged_attention(q, k_pool, v_pool, out, batch.slot_table, tok_req, tok_end,
                                   0.125, None, None)
    ref = attention_ref(q, k_pool.double(), v_pool.double(), batch.slot_table, tok_req, tok_end,
                        0.125)
    # V rows of 1e4 (e5m2) partly cancel: fp32's rounding is relative to them, not to the output
    tol = {**TOLERANCES[dtype], "atol": 1e-6 * float(v_pool.float().abs().max())}
    torch.testing.assert_close(out.double(), ref, **tol)
    flat = attention_ref(q, k_pool.double() * 0, v_pool.double(), batch.slot_table, tok_req,
                         tok_end, 0.125)
    assert not torch.allclose(ref, flat, rtol=0.05)  # the subnormal keys do shape the softmax


@pytest.mark.parametrize("kv_dtype", FP8, ids=FP8_IDS)
@pytest.mark.parametrize(("dtype", "head_dim"), [(torch.float32, 64), (torch.float32, 96),
                                                 (torch.bfloat16, 128)])
def test_kernel_widens_every_fp8_value_exactly(kv_dtype, dtype, head_dim):
    """Each query attends to one key, so its output is that key's V row: every finite 8-bit
    value (subnormals and +-max included) comes out as torch widens it, exactly (-0 as +0: the
    kernel's sums start at +0)."""
    if not native_kernels.available(dtype, kv_dtype):
        pytest.skip(f"this build has no {dtype} over {kv_dtype} kernel")
    patterns = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    patterns = patterns[patterns.view(kv_dtype).float().isfinite()]
    n = -(-patterns.numel() // head_dim)
    v_pool = torch.zeros(n * head_dim, dtype=torch.uint8)
    v_pool[: patterns.numel()] = patterns
    v_pool = v_pool.view(n, 1, head_dim).view(kv_dtype)
    k_pool = torch.randn(n, 1, head_dim, generator=torch.Generator().manual_seed(9)).to(kv_dtype)
    q = torch.randn(n, 1, head_dim, generator=torch.Generator().manual_seed(10)).to(dtype)
    out = torch.empty_like(q)
    native_kernels.paged_attention(q, k_pool, v_pool, out, torch.arange(n).view(n, 1),
                                   torch.arange(n), torch.ones(n, dtype=torch.int64), 1.0, None,
                                   None)
    want = v_pool.float().to(dtype)
    assert torch.equal(out, want)  # equal values: equal bits, but for the zeros' signs


def int8_pools(gen, shape, spread=6):
    """Random K and V rows as an int8 pool holds them: (k codes, v codes, k scales, v scales),
    each row at its own magnitude 2^-spread..2^spread (so its scale matters), quantized by
    KVPool.store's int8_rows; scales [slots, kv_heads] float32 contiguous."""
    rows = []
    for _ in "kv":
        x = torch.randn(shape, generator=gen)
        x = x * 2.0 ** torch.randint(-spread, spread + 1, (*shape[:-1], 1), generator=gen)
        rows.append(int8_rows(x))
    (k_codes, k_scale), (v_codes, v_scale) = rows
    return k_codes, v_codes, k_scale.contiguous(), v_scale.contiguous()


def widened(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """An int8 pool's rows in float64: codes * their row's scale (exact)."""
    return codes.double() * scale.double()[..., None]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"),
                         [(9, 3, 64), (8, 4, 96), (6, 2, 128)])
@pytest.mark.parametrize(("kv_lens", "q_lens"),
                         [([3, 1, 130, 700], [1, 1, 1, 1]), ([5, 9, 60], [5, 1, 3])],
                         ids=["decode", "extend"])
def test_kernel_over_an_int8_pool_matches_float64_reference(dtype, num_heads, num_kv_heads,
                                                            head_dim, kv_lens, q_lens):
    """q of the model's dtype over an int8 pool (--kv-cache-dtype int8: codes and a float32
    scale per (slot, KV head) row, rows of magnitudes 2^-6..2^6), GQA groups, the specialized
    head sizes and another: the float64 reference on the widened pool (codes * scale), within
    the tolerances of a pool of q's dtype (plus fp32 rounding relative to the largest V row)."""
    if not native_kernels.available(dtype, torch.int8):
        pytest.skip(f"this build has no {dtype} over int8 kernel")
    gen = torch.Generator().manual_seed(sum(kv_lens) + head_dim + 1)
    capacity = 4 * sum(kv_lens) + 64
    batch = make_forward_batch(gen, kv_lens, q_lens, capacity)
    k_codes, v_codes, k_scale, v_scale = int8_pools(gen, (capacity + 1, num_kv_heads, head_dim))
    assert k_scale.shape == (capacity + 1, num_kv_heads) and k_scale.dtype == torch.float32
    q = torch.randn(batch.num_tokens, num_heads, head_dim, generator=gen).to(dtype)
    tok_req, tok_end = _token_map(batch)
    out = torch.empty_like(q)
    scale = head_dim**-0.5
    native_kernels.paged_attention(q, k_codes, v_codes, out, batch.slot_table, tok_req, tok_end,
                                   scale, None, None, k_scale=k_scale, v_scale=v_scale)
    k_wide, v_wide = widened(k_codes, k_scale), widened(v_codes, v_scale)
    ref = attention_ref(q, k_wide, v_wide, batch.slot_table, tok_req, tok_end, scale)
    tol = {**TOLERANCES[dtype], "atol": max(1e-5, 1e-6 * float(v_wide.abs().max()))}
    torch.testing.assert_close(out.double(), ref, **tol)
    # the scales shape the result: codes alone (scale 1) give another softmax and other rows
    unscaled = attention_ref(q, k_codes.double() * k_scale.double().mean(),
                             v_codes.double() * v_scale.double().mean(), batch.slot_table,
                             tok_req, tok_end, scale)
    assert not torch.allclose(ref, unscaled, rtol=0.05, atol=0.05)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("softcap", "window", "with_sinks", "with_alibi"),
                         [(30.0, None, False, False), (None, 7, True, False),
                          (5.0, 50, False, True), (None, 7, True, True)],
                         ids=["softcap", "window+sinks", "softcap+window+alibi",
                              "window+sinks+alibi"])
def test_kernel_over_an_int8_pool_with_softcap_window_sinks_alibi(dtype, softcap, window,
                                                                  with_sinks, with_alibi):
    """The row scales apply before the soft-cap (score = q . (codes * scale)), and beside a
    window, gpt-oss's sinks and ALiBi's bias: the float64 reference on the widened pool."""
    if not native_kernels.available(dtype, torch.int8):
        pytest.skip(f"this build has no {dtype} over int8 kernel")
    gen = torch.Generator().manual_seed(14)
    kv_lens, q_lens = [3, 300, 60, 9], [1, 4, 2, 5]
    capacity = 4 * sum(kv_lens) + 64
    batch = make_forward_batch(gen, kv_lens, q_lens, capacity)
    k_codes, v_codes, k_scale, v_scale = int8_pools(gen, (capacity + 1, 2, 64), spread=3)
    q = (torch.randn(batch.num_tokens, 8, 64, generator=gen) * 4).to(dtype)  # the cap matters
    sinks = torch.linspace(-6.0, 6.0, 8) if with_sinks else None
    alibi = torch.tensor(alibi_slopes(8), dtype=torch.float32) if with_alibi else None
    tok_req, tok_end = _token_map(batch)
    out = torch.empty_like(q)
    native_kernels.paged_attention(q, k_codes, v_codes, out, batch.slot_table, tok_req, tok_end,
                                   0.125, softcap, window, alibi, sinks, k_scale, v_scale)
    k_wide, v_wide = widened(k_codes, k_scale), widened(v_codes, v_scale)
    ref = attention_ref(q, k_wide, v_wide, batch.slot_table, tok_req, tok_end, 0.125, softcap,
                        window, alibi, sinks)
    tol = {**TOLERANCES[dtype], "atol": max(1e-5, 1e-6 * float(v_wide.abs().max()))}
    torch.testing.assert_close(out.double(), ref, **tol)


@pytest.mark.parametrize(("dtype", "head_dim"), [(torch.float32, 64), (torch.float32, 96),
                                                 (torch.bfloat16, 128)])
def test_kernel_reads_every_int8_code_times_its_scale(dtype, head_dim):
    """Each query attends to one key, so its output is that key's V row: every code -128..127
    (-128 too, which the pool never stores) times its row's scale (powers of two from 2^-20 to
    2^20 and others), as torch computes codes.float() * scale, exactly (rounded once to bf16)."""
    if not native_kernels.available(dtype, torch.int8):
        pytest.skip(f"this build has no {dtype} over int8 kernel")
    codes = torch.arange(-128, 128, dtype=torch.int32).to(torch.int8)
    n = 4 * -(-codes.numel() // head_dim)
    v_codes = codes.repeat(-(-n * head_dim // codes.numel()))[: n * head_dim].view(n, 1, head_dim)
    gen = torch.Generator().manual_seed(15)
    v_scale = 2.0 ** torch.randint(-20, 21, (n, 1), generator=gen).float()
    v_scale[::3] = torch.rand(v_scale[::3].shape, generator=gen) * 5  # not powers of two
    k_codes = torch.randint(-127, 128, (n, 1, head_dim), generator=gen).to(torch.int8)
    k_scale = torch.rand(n, 1, generator=gen) + 0.1
    q = torch.randn(n, 1, head_dim, generator=gen).to(dtype)
    out = torch.empty_like(q)
    native_kernels.paged_attention(q, k_codes, v_codes, out, torch.arange(n).view(n, 1),
                                   torch.arange(n), torch.ones(n, dtype=torch.int64), 1.0, None,
                                   None, k_scale=k_scale, v_scale=v_scale)
    want = (v_codes.float() * v_scale[..., None]).to(dtype)
    assert torch.equal(out, want)


def test_kernel_over_an_int8_pool_refuses_to_run_without_its_scales():
    """An int8 pool's codes mean nothing without the rows' scales: the kernel returns an error
    (an AssertionError from run_addresses, nothing written), not a crash or a result; scales of
    the wrong dtype, size or layout are refused before the call."""
    gen = torch.Generator().manual_seed(16)
    batch = make_forward_batch(gen, [5, 40], [1, 1], 100)
    k_codes, v_codes, k_scale, v_scale = int8_pools(gen, (101, 2, 64))
    q = torch.randn(2, 4, 64, generator=gen)
    tok_req, tok_end = _token_map(batch)
    out = torch.full_like(q, 7.0)
    args = (q, k_codes, v_codes, out, batch.slot_table, tok_req, tok_end, 0.125, None, None)
    for scales in ({}, {"k_scale": k_scale}, {"v_scale": v_scale}):
        with pytest.raises(AssertionError, match="rejected"):
            native_kernels.paged_attention(*args, **scales)
        assert (out == 7.0).all()
    plan = native_kernels.plan(batch.slot_table, tok_req, tok_end, 4, 2, 64)
    with pytest.raises(AssertionError, match="rejected"):
        plan.run_addresses(q.data_ptr(), k_codes.data_ptr(), v_codes.data_ptr(), out.data_ptr(),
                           0.125, 0.0, 0, native_kernels.DTYPES[torch.float32],
                           native_kernels.DTYPES[torch.int8], 0, 0, k_scale.data_ptr(), 0)
    for bad in (k_scale.double(), k_scale[:50], k_scale.t()):
        with pytest.raises(AssertionError):
            plan.run(q, k_codes, v_codes, out, 0.125, 0.0, 0, 0, 5, None, None, bad, v_scale)
    assert (out == 7.0).all()
    native_kernels.paged_attention(*args, k_scale=k_scale, v_scale=v_scale)  # with them: runs
    ref = attention_ref(q, widened(k_codes, k_scale), widened(v_codes, v_scale),
                        batch.slot_table, tok_req, tok_end, 0.125)
    torch.testing.assert_close(out.double(), ref, **TOLERANCES[torch.float32])


def test_token_map_of_packed_extends():
    """Request b's i-th new token sees keys [0, kv_len_b - q_len_b + i + 1)."""
    batch = make_forward_batch(torch.Generator().manual_seed(0), [4, 6, 2], [2, 1, 2], 64)
    tok_req, tok_end = _token_map(batch)
    assert tok_req.tolist() == [0, 0, 1, 2, 2]
    assert tok_end.tolist() == [3, 4, 6, 1, 2]


def test_bf16_output_rounds_like_torch():
    """Two keys scored alike average their V rows in fp32; the result's rounding to bf16
    (nearest even, NaN kept) must be torch's, bit for bit."""
    gen = torch.Generator().manual_seed(1)
    n = 64
    v_pool = torch.randn(2 * n, 1, 32, generator=gen).to(torch.bfloat16)
    v_pool[0, 0, :4] = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0])
    k_pool = torch.zeros_like(v_pool)
    q = torch.randn(n, 1, 32, generator=gen).to(torch.bfloat16)
    table = torch.arange(2 * n).view(n, 2)  # token t averages slots 2t, 2t + 1
    out = torch.empty_like(q)
    native_kernels.paged_attention(q, k_pool, v_pool, out, table, torch.arange(n),
                                   torch.full((n,), 2), 1.0, None, None)
    want = ((v_pool[0::2].float() + v_pool[1::2].float()) / 2).to(torch.bfloat16)
    assert torch.equal(out.view(torch.int16), want.view(torch.int16))


def layer_pools(gen, dtype, num_layers, capacity, num_kv_heads, head_dim):
    """Two pools holding the same random K/V."""
    pools = [KVPool(num_layers, capacity, num_kv_heads, head_dim, dtype) for _ in range(2)]
    for buf in ("k_buffer", "v_buffer"):
        fill = torch.randn(pools[0].k_buffer.shape, generator=gen).to(dtype)
        for pool in pools:
            getattr(pool, buf).copy_(fill)
    return pools


def torch_and_native(pools: list[KVPool], num_heads: int, num_kv_heads: int, head_dim: int,
                     plain: bool) -> list:
    """TorchAttention over pools[0] and NativeAttention over pools[1], for three layers: plain,
    windowed with gpt-oss's sinks (as its sliding layers have), soft-capped; or with `plain`
    three plain layers (so TorchAttention may split off a shared prefix)."""
    layers = [AttentionLayerSpec(),
              AttentionLayerSpec(sliding_window=20, sinks=torch.linspace(-1.0, 2.0, num_heads)),
              AttentionLayerSpec(softcap=20.0, scale=0.1)]
    if plain:
        layers = [AttentionLayerSpec(), AttentionLayerSpec(scale=0.1), AttentionLayerSpec()]
    return [TorchAttention(pools[0], num_heads, num_kv_heads, head_dim, layers),
            create_attention_backend("native", pools[1], num_heads, num_kv_heads, head_dim,
                                     layers)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("kv_lens", "q_lens", "shared", "plain"),
                         [([7, 1, 130], [1, 1, 1], 0, False),
                          ([5, 1, 90, 40], [2, 1, 5, 3], 0, False),
                          ([130 + i for i in range(16)], [1] * 16, 100, True),
                          ([130 + i for i in range(16)], [1] * 16, 100, False)],
                         ids=["decode", "extend", "shared-prefix", "shared-prefix-windowed"])
def test_native_backend_matches_torch_backend(dtype, kv_lens, q_lens, shared, plain):
    """The same layers (plain, windowed, soft-capped) and batch through both backends: the same
    outputs and the same pool writes. The shared-prefix batch of plain layers takes
    TorchAttention's split; a model with a windowed or capped layer never splits (the split
    gathers no prefix for any layer)."""
    gen = torch.Generator().manual_seed(len(kv_lens))
    capacity, num_heads, num_kv_heads, head_dim = 2 * sum(kv_lens), 9, 3, 64
    batch = make_forward_batch(gen, kv_lens, q_lens, capacity, shared)
    pools = layer_pools(gen, dtype, 3, capacity, num_kv_heads, head_dim)
    backends = torch_and_native(pools, num_heads, num_kv_heads, head_dim, plain)
    prepared = [backend.prepare(batch) for backend in backends]
    assert isinstance(prepared[1].attn_meta, NativeAttentionMeta)
    if shared:
        assert (prepared[0].attn_meta.shared_slots is not None) == plain
    n = batch.num_tokens
    for layer_id in range(3):
        q = torch.randn(n, num_heads, head_dim, generator=gen).to(dtype)
        k, v = (torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype) for _ in "kv")
        outs = [b.forward(layer_id, q, k, v, p).float() for b, p in zip(backends, prepared)]
        atol = 1e-5 if dtype == torch.float32 else 2e-2  # torch's bf16 path rounds in between
        torch.testing.assert_close(outs[1], outs[0], atol=atol, rtol=0)
    assert torch.equal(pools[1].k_buffer, pools[0].k_buffer)
    assert torch.equal(pools[1].v_buffer, pools[0].v_buffer)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("kv_lens", "q_lens", "shared"),
                         [([7, 1, 130], [1, 1, 1], 0), ([5, 1, 90, 40], [2, 1, 5, 3], 0),
                          ([130 + i for i in range(16)], [1] * 16, 100)],
                         ids=["decode", "extend", "shared-prefix"])
def test_alibi_backends_agree(dtype, kv_lens, q_lens, shared):
    """An ALiBi model's layers (GQA folded: 12 heads over 4 KV heads; the windowed one with
    gpt-oss's sinks too) through TorchAttention, whose masks become biases (and which never
    splits off a shared prefix), and through the native kernel: the same outputs, and
    TorchAttention's equal the float64 reference."""
    gen = torch.Generator().manual_seed(len(kv_lens))
    capacity, num_heads, num_kv_heads, head_dim = 2 * sum(kv_lens), 12, 4, 64
    batch = make_forward_batch(gen, kv_lens, q_lens, capacity, shared)
    pools = layer_pools(gen, dtype, 2, capacity, num_kv_heads, head_dim)
    slopes = alibi_slopes(num_heads)
    sinks = torch.linspace(-2.0, 3.0, num_heads)
    layers = [AttentionLayerSpec(alibi_slopes=slopes),
              AttentionLayerSpec(alibi_slopes=slopes, sliding_window=20, sinks=sinks)]
    backends = [TorchAttention(pools[0], num_heads, num_kv_heads, head_dim, layers),
                create_attention_backend("native", pools[1], num_heads, num_kv_heads, head_dim,
                                         layers)]
    prepared = [backend.prepare(batch) for backend in backends]
    assert isinstance(prepared[1].attn_meta, NativeAttentionMeta)
    assert prepared[0].attn_meta.shared_slots is None
    tok_req, tok_end = _token_map(batch)
    n = batch.num_tokens
    for layer_id, (window, layer_sinks) in enumerate(((None, None), (20, sinks))):
        q = torch.randn(n, num_heads, head_dim, generator=gen).to(dtype)
        k, v = (torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype) for _ in "kv")
        outs = [b.forward(layer_id, q, k, v, p).float() for b, p in zip(backends, prepared)]
        atol = 1e-5 if dtype == torch.float32 else 2e-2  # torch's bf16 path rounds in between
        torch.testing.assert_close(outs[1], outs[0], atol=atol, rtol=0)
        ref = attention_ref(q, pools[0].k_buffer[layer_id], pools[0].v_buffer[layer_id],
                            batch.slot_table, tok_req, tok_end, head_dim**-0.5, window=window,
                            alibi=torch.tensor(slopes), sinks=layer_sinks)
        torch.testing.assert_close(outs[0].double(), ref.view(n, -1), atol=atol, rtol=0)


@pytest.mark.parametrize("kv_dtype", [*FP8, torch.int8], ids=[*FP8_IDS, "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("kv_lens", "q_lens", "shared"),
                         [([7, 1, 130], [1, 1, 1], 0), ([5, 1, 90, 40], [2, 1, 5, 3], 0),
                          ([130 + i for i in range(16)], [1] * 16, 100)],
                         ids=["decode", "extend", "shared-prefix"])
def test_native_backend_matches_torch_backend_over_an_8_bit_pool(kv_dtype, dtype, kv_lens, q_lens,
                                                                 shared):
    """Two 8-bit pools holding the same bytes (int8: codes and row scales), plain, windowed
    (with sinks) and soft-capped layers: NativeAttention (the kernel widening in place, an int8
    row's scale applied to its score and weight) and TorchAttention (read_k / read_v widening to
    the model's dtype; its shared-prefix split on the plain layers' batch) give the same outputs
    and write the same bytes and scales (KVPool.store, both)."""
    if not native_kernels.available(dtype, kv_dtype):
        pytest.skip(f"this build has no {dtype} over {kv_dtype} kernel")
    gen = torch.Generator().manual_seed(len(kv_lens))
    capacity, num_heads, num_kv_heads, head_dim = 2 * sum(kv_lens), 9, 3, 64
    batch = make_forward_batch(gen, kv_lens, q_lens, capacity, shared)
    pools = [KVPool(3, capacity, num_kv_heads, head_dim, dtype, kv_dtype=kv_dtype)
             for _ in range(2)]
    names = ("k_buffer", "v_buffer") + (("k_scale", "v_scale") if kv_dtype == torch.int8 else ())
    for name in names:
        shape = getattr(pools[0], name).shape
        if name.endswith("scale"):
            fill = (torch.rand(shape, generator=gen) + 0.5) / 40
        elif kv_dtype == torch.int8:
            fill = (torch.randn(shape, generator=gen) * 40).clamp(-127, 127).to(torch.int8)
        else:
            fill = torch.randn(shape, generator=gen).to(kv_dtype)
        for pool in pools:
            getattr(pool, name).copy_(fill)
    backends = torch_and_native(pools, num_heads, num_kv_heads, head_dim, bool(shared))
    native = backends[1]
    assert isinstance(native, NativeAttention) and native.enabled
    assert native.kv_dtype_code == native_kernels.DTYPES[kv_dtype]
    if kv_dtype == torch.int8:
        for layer_id in range(3):
            k_scale, v_scale = native.scales_of(layer_id)
            assert k_scale is not None and v_scale is not None
            assert k_scale.data_ptr() == pools[1].k_scale[layer_id].data_ptr()  # views
            assert v_scale.data_ptr() == pools[1].v_scale[layer_id].data_ptr()
            assert k_scale.is_contiguous() and k_scale.shape == (capacity + 1, num_kv_heads)
    prepared = [backend.prepare(batch) for backend in backends]
    assert isinstance(prepared[1].attn_meta, NativeAttentionMeta)
    if shared:
        assert prepared[0].attn_meta.shared_slots is not None
    n = batch.num_tokens
    for layer_id in range(3):
        q = torch.randn(n, num_heads, head_dim, generator=gen).to(dtype)
        k, v = (torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype) for _ in "kv")
        outs = [b.forward(layer_id, q, k, v, p) for b, p in zip(backends, prepared)]
        assert outs[1].dtype == dtype
        # torch's path rounds the widened rows (and more) to bf16 in between, the kernel not:
        # a few bf16 ulps of the outputs' magnitude
        largest = max(1.0, float(outs[0].float().abs().max()))
        atol = 1e-5 if dtype == torch.float32 else 1e-2 * largest
        torch.testing.assert_close(outs[1].float(), outs[0].float(), atol=atol, rtol=0)
    for name in names:
        assert getattr(pools[1], name).dtype == getattr(pools[0], name).dtype
        assert torch.equal(getattr(pools[1], name).view(torch.uint8),
                           getattr(pools[0], name).view(torch.uint8))


PREFILL = pytest.mark.skipif(
    not native_kernels.prefill_supported(torch.bfloat16, torch.bfloat16, 64),
    reason="the prefill kernel needs AVX512-BF16")


@PREFILL
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"),
                         [(9, 3, 64), (4, 4, 64), (32, 8, 64), (6, 2, 128)])
@pytest.mark.parametrize(("kv_lens", "q_lens"),
                         [([40], [40]), ([300, 70, 33], [200, 70, 1]), ([17, 600], [16, 45])],
                         ids=["prompt", "chunk-after-prefix", "two-chunks"])
def test_prefill_kernel_matches_float64_reference(num_heads, num_kv_heads, head_dim, kv_lens,
                                                  q_lens):
    """paged_prefill_bf16: causal attention of whole prompts and of chunks after a cached prefix
    (the rows of a GQA group of 1, 3, 4; a request's last block cut short; a one-token request
    beside them), within bf16 rounding of the value weights and the output."""
    gen = torch.Generator().manual_seed(sum(kv_lens) + num_heads)
    batch, q, k_pool, v_pool = random_case(gen, torch.bfloat16, kv_lens, q_lens, num_heads,
                                           num_kv_heads, head_dim)
    tok_req, tok_end = _token_map(batch)
    out = torch.full_like(q, float("nan"))
    scale = head_dim**-0.5
    plan = native_kernels.plan(batch.slot_table.contiguous(), tok_req, tok_end, num_heads,
                               num_kv_heads, head_dim)
    plan.run_prefill(q, k_pool, v_pool, out, scale)
    ref = attention_ref(q, k_pool, v_pool, batch.slot_table, tok_req, tok_end, scale)
    # the output's bf16 rounding (2**-8 relative) plus the weights' (2**-9 each, averaging out)
    torch.testing.assert_close(out.double(), ref, rtol=2**-8, atol=4e-3)
    # each row alone: the same bits (a row depends on its own query and keys only)
    t = batch.num_tokens - 1
    alone = torch.empty_like(q[t:t + 1])
    single = native_kernels.plan(batch.slot_table.contiguous(), tok_req[t:t + 1].contiguous(),
                                 tok_end[t:t + 1].contiguous(), num_heads, num_kv_heads,
                                 head_dim)
    single.run_prefill(q[t:t + 1].contiguous(), k_pool, v_pool, alone, scale)
    assert torch.equal(alone, out[t:t + 1])


@PREFILL
@pytest.mark.parametrize("plain", [True, False], ids=["plain", "windowed-capped"])
def test_native_backend_prefills_through_its_kernel_where_the_layers_allow(plain):
    """A bf16 prefill batch (more than NATIVE_MAX_Q_LEN new tokens) of plain layers runs the
    prefill kernel: TorchAttention's outputs within bf16 rounding, the same pool writes. A model
    with a windowed or capped layer keeps SDPA for prefill."""
    gen = torch.Generator().manual_seed(3)
    kv_lens, q_lens = [90, 200, 41], [90, 60, 41]
    capacity, num_heads, num_kv_heads, head_dim = 2 * sum(kv_lens), 9, 3, 64
    batch = make_forward_batch(gen, kv_lens, q_lens, capacity)
    pools = layer_pools(gen, torch.bfloat16, 3, capacity, num_kv_heads, head_dim)
    backends = torch_and_native(pools, num_heads, num_kv_heads, head_dim, plain)
    prepared = [backend.prepare(batch) for backend in backends]
    assert isinstance(prepared[1].attn_meta, NativePrefillMeta) == plain
    n = batch.num_tokens
    for layer_id in range(3):
        q = torch.randn(n, num_heads, head_dim, generator=gen).bfloat16()
        k, v = (torch.randn(n, num_kv_heads, head_dim, generator=gen).bfloat16() for _ in "kv")
        outs = [b.forward(layer_id, q, k, v, p).float() for b, p in zip(backends, prepared)]
        torch.testing.assert_close(outs[1], outs[0], atol=2e-2, rtol=0)
    assert torch.equal(pools[1].k_buffer, pools[0].k_buffer)
    assert torch.equal(pools[1].v_buffer, pools[0].v_buffer)


def test_native_backend_scales_of_a_pool_without_scales():
    pool = layer_pools(torch.Generator().manual_seed(0), torch.float32, 2, 20, 2, 64)[0]
    assert NativeAttention(pool, 4, 2, 64).scales_of(1) == (None, None)
    fp8 = KVPool(2, 20, 2, 64, torch.float32, kv_dtype=torch.float8_e4m3fn)
    assert NativeAttention(fp8, 4, 2, 64).scales_of(0) == (None, None)


def test_native_backend_defers_long_extends_and_odd_heads():
    gen = torch.Generator().manual_seed(0)
    pool = layer_pools(gen, torch.float32, 1, 200, 2, 64)[0]
    backend = NativeAttention(pool, 4, 2, 64)
    prefill = make_forward_batch(gen, [50, 60], [50, 20], 200)
    # (fp32: the prefill kernel is bf16's)
    assert not isinstance(backend.prepare(prefill).attn_meta, (NativeAttentionMeta,
                                                              NativePrefillMeta))
    odd = NativeAttention(layer_pools(gen, torch.float32, 1, 200, 2, 24)[0], 4, 2, 24)
    decode = make_forward_batch(gen, [5, 6], [1, 1], 200)
    assert not isinstance(odd.prepare(decode).attn_meta, NativeAttentionMeta)


def test_auto_resolves_to_native_on_the_cpu():
    assert EngineConfig(device="cpu").resolved_attention_backend == "native"
    assert EngineConfig(device="cuda").resolved_attention_backend == "triton"
    assert EngineConfig(attention_backend="torch").resolved_attention_backend == "torch"


PROMPTS = ["What is the capital of France?", "def fibonacci(n):",
           "Once upon a time, in a village by the mountains,", "2 + 2 * 3 = ? Show your steps."]


def test_engine_greedy_tokens_equal_torch_backend(make_engine):
    """fp32 on the default model: token-for-token the same greedy continuations, alone and
    batched. The native engine is the session's default one (auto resolves to native here)."""
    params = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
    engines = [make_engine(attention_backend="torch"), make_engine()]
    assert isinstance(engines[1].parts.runner.attn, NativeAttention)
    outs = [[r["output_ids"] for r in e.generate(PROMPTS, sampling_params=params)]
            for e in engines]
    assert outs[1] == outs[0]
    alone = engines[1].generate(PROMPTS[1], sampling_params=params)["output_ids"]
    assert alone == outs[0][1]
    assert_idle_and_clean(engines[1])


def test_kernel_is_batch_invariant():
    """A query's output does not depend on the rest of the batch, nor on whether the batch ran
    on one thread or several (this one is large enough to go parallel; each alone is not)."""
    gen = torch.Generator().manual_seed(5)
    batch, q, k_pool, v_pool = random_case(gen, torch.float32, [700, 690, 3, 710], [1] * 4, 8, 2,
                                           64)
    tok_req, tok_end = _token_map(batch)
    out = torch.empty_like(q)
    native_kernels.paged_attention(q, k_pool, v_pool, out, batch.slot_table, tok_req, tok_end,
                                   0.125, None, None)
    for t in range(4):
        alone = torch.empty_like(q[t : t + 1])
        native_kernels.paged_attention(q[t : t + 1], k_pool, v_pool, alone, batch.slot_table,
                                       tok_req[t : t + 1], tok_end[t : t + 1], 0.125, None, None)
        assert torch.equal(alone, out[t : t + 1])


def test_kernel_shares_torchs_openmp_runtime():
    """One libgomp in the process, so the kernel's team follows torch.set_num_threads."""
    with open("/proc/self/maps") as f:
        gomps = {line.split()[-1] for line in f if "libgomp" in line}
    assert len(gomps) <= 1, gomps
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert native_kernels.num_threads() == 1
    finally:
        torch.set_num_threads(threads)
    assert native_kernels.num_threads() == threads


def test_unavailable_reasons(monkeypatch, tmp_path):
    """Disabled, no compiler, or a failed compile: no library and a reason, never an exception.
    (The compile path: FORKLM_NATIVE_BUILD=native passes over the prebuilt libraries.)"""
    monkeypatch.setenv("FORKLM_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("FORKLM_NATIVE_BUILD", "native")
    monkeypatch.setenv("FORKLM_NATIVE_KERNELS", "0")
    assert "FORKLM_NATIVE_KERNELS=0" in native_kernels._build_and_load().reason
    monkeypatch.delenv("FORKLM_NATIVE_KERNELS")
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    assert "no C compiler" in native_kernels._build_and_load().reason
    monkeypatch.delenv("CC")
    broken = tmp_path / "broken.c"
    broken.write_text("this is not C\n")
    monkeypatch.setattr(native_kernels, "SOURCE", broken)
    monkeypatch.setitem(native_build.LIBRARIES, "broken", native_build.LIBRARIES["paged_attention"])
    state = native_kernels._build_and_load()
    assert state.lib is None and "failed" in state.reason
    assert not list(tmp_path.glob("*.so"))  # no partial file left in the cache


@pytest.mark.parametrize(("where", "value", "message"),
                         [("out_slots", -1, "slot outside the pool"),
                          ("out_slots", "past", "slot outside the pool"),
                          ("slot_table", "past", "slot outside the pool"),
                          ("kv_lens", "width", "kv_lens past the slot table")])
def test_native_backend_refuses_a_batch_outside_its_pool(where, value, message):
    """The kernels trust the slot table and out_slots: prepare refuses a batch that would read
    or write outside the pool or past a table row, naming which."""
    gen = torch.Generator().manual_seed(7)
    kv_lens, capacity = [7, 1, 30], 80
    batch = make_forward_batch(gen, kv_lens, [1, 1, 1], capacity)
    pool = KVPool(1, capacity, 3, 64, torch.float32)
    backend = create_attention_backend("native", pool, 9, 3, 64, [AttentionLayerSpec()])
    assert isinstance(backend.prepare(batch).attn_meta, NativeAttentionMeta)  # as built: fine
    past = pool.k_buffer.shape[1]  # the first slot past the pool (its scratch slot included)
    bad = {"past": past, "width": batch.slot_table.shape[1] + 1}.get(value, value)
    getattr(batch, where).view(-1)[-1] = bad
    with pytest.raises(AssertionError, match=message):
        backend.prepare(batch)
