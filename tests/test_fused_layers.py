"""The fused C steps between a layer's matmuls (kernels/cpu/fused_layer_ops.c) against the eager torch
ops they replace, and FusedDecodeLayers against the eager layers on the default model. Greedy
tokens of the default (fused) engine against the torch-backend engine and transformers are
checked by test_native_attention.py, test_greedy_equivalence.py and test_architectures.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from forklm.kernels.cpu import bindings as native_kernels
from forklm.runtime.attention.backends import TorchAttention
from forklm.runtime.attention.native import NativeAttention, NativeAttentionMeta
from forklm.runtime.forward.batch import ForwardBatch
from forklm.runtime.kvcache.pool import KVPool, int8_rows
from forklm.runtime.models.fused_layers import FusedDecodeLayers, unsupported_reason
from forklm.runtime.models.layers import RMSNorm, RotaryEmbedding

pytestmark = pytest.mark.skipif(native_kernels.fused_ops() is None,
                                reason=f"no native build: {native_kernels.fused_unavailable_reason()}")

# bindings.DTYPES' codes; the 8-bit ones are KV-pool formats only (--kv-cache-dtype)
CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float8_e5m2: 3, torch.float8_e4m3fn: 4,
         torch.int8: 5}
DTYPES = [torch.float32, torch.bfloat16]
FP8 = [torch.float8_e5m2, torch.float8_e4m3fn]


def lib():
    ops = native_kernels.fused_ops()
    assert ops is not None
    return ops


def ulps_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many representable values of the dtype lie between a and b (same-sign values)."""
    bits = {torch.float32: torch.int32, torch.bfloat16: torch.int16}[a.dtype]
    return (a.view(bits).long() - b.view(bits).long()).abs()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("dim", "offset", "add"), [(576, 0.0, True), (100, 0.0, False),
                                                     (64, 1.0, True)])
def test_add_rms_norm_matches_eager(dtype, dim, offset, add):
    """residual + h rounds exactly as torch's add; the norm is within a few units in the last
    place of RMSNorm (the sum of squares is added in another order: in fp32 a 1-ulp different
    scale, then two products; in bf16 that rarely moves a rounding)."""
    gen = torch.Generator().manual_seed(dim)
    rows = 7
    residual = (torch.randn(rows, dim, generator=gen) * 3).to(dtype)
    h = torch.randn(rows, dim, generator=gen).to(dtype)
    norm = RMSNorm(dim, 1e-5, offset).to(dtype)
    norm.weight.data = torch.randn(dim, generator=gen).to(dtype)
    expected_residual = residual + h if add else residual.clone()
    expected = norm(expected_residual)
    out = torch.empty_like(residual)
    lib().fused_add_rms_norm(rows, dim, residual.data_ptr(), h.data_ptr() if add else None,
                             norm.weight.data_ptr(), out.data_ptr(), 1e-5, offset, CODES[dtype])
    assert torch.equal(residual, expected_residual)
    assert int(ulps_apart(out, expected).max()) <= (4 if dtype == torch.float32 else 1)
    if dtype == torch.bfloat16:
        assert (out != expected).float().mean() < 0.01


def rope_store(qkv, heads, kv_heads, d, cos, sin, out_slots, pool, norm_ptrs=(None, None)):
    """fused_rope_store of qkv [tokens, (heads + 2 kv_heads) d] into layer 0 of `pool` (its
    dtype and kv_dtype as the kernel's last two codes; an int8 pool's layer-0 scales as k_scale
    / v_scale, else None); returns the rotated q."""
    tokens = qkv.shape[0]
    q_out = torch.empty(tokens, heads * d, dtype=qkv.dtype)
    scales = [None if x is None else x[0].data_ptr() for x in (pool.k_scale, pool.v_scale)]
    lib().fused_rope_store(tokens, qkv.data_ptr(), qkv.shape[1], heads, kv_heads, d,
                           cos.data_ptr(), sin.data_ptr(), out_slots.data_ptr(),
                           pool.k_buffer[0].data_ptr(), pool.v_buffer[0].data_ptr(), *scales,
                           q_out.data_ptr(), *norm_ptrs, 1e-6, 0.0, CODES[pool.dtype],
                           CODES[pool.kv_dtype])
    return q_out


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def filled_pools(gen, n, slots, kv_heads, d, dtype, kv_dtype=None):
    """n one-layer pools holding the same random K/V rows (an int8 pool's: random codes and
    random scales)."""
    pools = [KVPool(1, slots, kv_heads, d, dtype, kv_dtype=kv_dtype) for _ in range(n)]
    for buf in ("k_buffer", "v_buffer"):
        fill = torch.randn(getattr(pools[0], buf).shape, generator=gen)
        if pools[0].kv_dtype == torch.int8:
            fill = fill * 50
        fill = fill.to(pools[0].kv_dtype)
        for pool in pools:
            getattr(pool, buf).copy_(fill)
    for name in ("k_scale", "v_scale"):
        if getattr(pools[0], name) is not None:
            fill = torch.rand(getattr(pools[0], name).shape, generator=gen) + 0.5
            for pool in pools:
                getattr(pool, name).copy_(fill)
    return pools


def same_scales(a: KVPool, b: KVPool) -> bool:
    """Equal per-row scales (an int8 pool's), or both pools without them."""
    return all((x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
               for x, y in ((a.k_scale, b.k_scale), (a.v_scale, b.v_scale)))


@pytest.mark.parametrize("kv_dtype", [None, *FP8, torch.int8],
                         ids=["model-dtype", "e5m2", "e4m3", "int8"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qk_norm", [False, True])
def test_rope_store_is_bit_exact(dtype, qk_norm, kv_dtype):
    """Rotated q into its buffer, rotated k and v into the pool rows out_slots, bit-equal to
    RotaryEmbedding.rotate and KVPool.store; every other pool row untouched. With Qwen3's
    per-head q/k norms first: the heads within the norm's few ulps (see above). Into an 8-bit
    pool (kv_dtype), over values from its subnormals to past its largest: k rotated and rounded
    to the model's dtype, then k and v rounded to 8 bits as KVPool(kv_dtype=...).store rounds
    them, bit for bit (with the norms: as the pool rounds the kernel's own model-dtype k). Into
    an int8 pool: each head's codes and float32 scale as KVPool.store's int8_rows computes them,
    bit for bit, over rows of scales 2^-18..2^17, all-zero heads (scale 1, codes 0) and heads of
    one huge value among small ones; the other rows' codes and scales untouched."""
    gen = torch.Generator().manual_seed(1)
    tokens, heads, kv_heads, d, slots = 5, 9, 3, 64, 300
    rotary = RotaryEmbedding(None, {"rope_type": "default", "rope_theta": 10000.0}, d, 512)
    positions = torch.tensor([0, 7, 50, 3, 511])
    cos, sin = rotary.tables_for(positions, dtype)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d, generator=gen)
    if kv_dtype is not None:  # 2^-18 (below e5m2's subnormals) to 2^17 (past its max)
        qkv = qkv * 2.0 ** torch.randint(-18, 18, qkv.shape, generator=gen)
    if kv_dtype == torch.int8:  # each head at its own scale too, and the edge heads
        qkv = qkv.view(tokens, -1, d) * 2.0 ** torch.randint(-8, 9, (tokens, heads + 2 * kv_heads,
                                                                    1), generator=gen)
        k_at, v_at = heads, heads + kv_heads  # token t's k head h: qkv[t, k_at + h]
        qkv[1, k_at + 0] = 0.0
        qkv[1, v_at + 2] = 0.0
        qkv[4, k_at:] = 0.0  # every k and v head of a token
        qkv[3, k_at + 1] = torch.randn(d, generator=gen) * 1e-3
        qkv[3, k_at + 1, 9] = 1e6
        qkv[3, v_at] = torch.randn(d, generator=gen) * 1e-3
        qkv[3, v_at, 40] = -1e6
        qkv = qkv.reshape(tokens, -1)
    qkv = qkv.to(dtype)
    q, k, v = qkv.split((heads * d, kv_heads * d, kv_heads * d), dim=-1)
    q, k = q.reshape(tokens, heads, d), k.reshape(tokens, kv_heads, d)
    v = v.reshape(tokens, kv_heads, d)
    norms = [RMSNorm(d, 1e-6).to(dtype) for _ in "qk"]
    for norm in norms:
        norm.weight.data = torch.randn(d, generator=gen).to(dtype)
    with torch.no_grad():
        if qk_norm:
            q, k = norms[0](q), norms[1](k)
        q_ref, k_ref = rotary.rotate(q, k, cos, sin)
    norm_ptrs = [n.weight.data_ptr() if qk_norm else None for n in norms]
    pool, reference = filled_pools(gen, 2, slots, kv_heads, d, dtype, kv_dtype)
    out_slots = torch.tensor([10, 299, 0, 42, 11])
    reference.store(0, out_slots, k_ref, v)
    cos, sin = cos.contiguous(), sin.contiguous()
    q_out = rope_store(qkv, heads, kv_heads, d, cos, sin, out_slots, pool, norm_ptrs)
    assert pool.k_buffer.dtype == (kv_dtype or dtype)
    assert same_bits(pool.v_buffer, reference.v_buffer)
    assert pool.v_scale is None or torch.equal(pool.v_scale, reference.v_scale)
    if kv_dtype == torch.int8:
        assert pool.k_scale is not None and pool.v_scale is not None
        zero_scale = (pool.k_scale[0, 11], pool.v_scale[0, 11], pool.k_scale[0, 299, 0],
                      pool.v_scale[0, 299, 2])  # slot 11 holds token 4, slot 299 token 1
        assert all((x == 1.0).all() for x in zero_scale)
        assert not pool.k_buffer[0, 11].any() and not pool.v_buffer[0, 11].any()
        assert not pool.k_buffer[0, 299, 0].any() and not pool.v_buffer[0, 299, 2].any()
        assert int(pool.v_buffer[0, 42, 0].abs().sum()) == 127  # the huge value's alone
        assert pool.v_buffer[0, 42, 0, 40] == -127
        assert int(pool.k_buffer[0, 42, 1].abs().max()) == 127
        assert int(pool.k_buffer[0, out_slots].abs().max()) <= 127
    if not qk_norm:
        assert torch.equal(q_out.view(tokens, heads, d), q_ref)
        assert same_bits(pool.k_buffer, reference.k_buffer)
        assert same_scales(pool, reference)
        return
    # a norm 1 ulp off, then the rotation's roundings: a few ulps of the largest value
    tol = (2e-6 if dtype == torch.float32 else 1.6e-2) * float(q_ref.abs().max())
    torch.testing.assert_close(q_out.view(tokens, heads, d), q_ref, atol=tol, rtol=0)
    if kv_dtype is None:
        tol = (2e-6 if dtype == torch.float32 else 1.6e-2) * float(reference.k_buffer.abs().max())
        torch.testing.assert_close(pool.k_buffer, reference.k_buffer, atol=tol, rtol=0)
        return
    wide = filled_pools(gen, 1, slots, kv_heads, d, dtype)[0]  # the same kernel, no 8 bits
    assert torch.equal(rope_store(qkv, heads, kv_heads, d, cos, sin, out_slots, wide, norm_ptrs),
                       q_out)
    reference.store(0, out_slots, wide.k_buffer[0, out_slots], v)
    assert same_bits(pool.k_buffer, reference.k_buffer)
    assert same_scales(pool, reference)


FP8_MAX = {torch.float8_e5m2: 57344.0, torch.float8_e4m3fn: 448.0}


def finite_fp8_values(kv_dtype) -> torch.Tensor:
    """Every finite value of the 8-bit format, ascending (-0 and 0 both), as float32."""
    values = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(kv_dtype).float()
    return values[values.isfinite()].sort().values


def store_as_v(values: torch.Tensor, kv_dtype) -> torch.Tensor:
    """`values` (bf16 or fp32) as the V part of a qkv through fused_rope_store into a pool of
    kv_dtype, at shuffled slots: the stored bytes, in the order of `values`."""
    kv_heads, d, heads = 4, 64, 1
    row = kv_heads * d
    tokens = -(-values.numel() // row)
    v = torch.zeros(tokens * row, dtype=values.dtype)
    v[: values.numel()] = values
    qkv = torch.cat((torch.zeros(tokens, (heads + kv_heads) * d, dtype=values.dtype),
                     v.view(tokens, row)), dim=1)
    rotary = RotaryEmbedding(None, {"rope_type": "default", "rope_theta": 10000.0}, d, 512)
    cos, sin = rotary.tables_for(torch.arange(tokens) % 512, values.dtype)
    pool = KVPool(1, tokens + 7, kv_heads, d, values.dtype, kv_dtype=kv_dtype)
    out_slots = torch.randperm(tokens + 7, generator=torch.Generator().manual_seed(6))[:tokens]
    rope_store(qkv, heads, kv_heads, d, cos.contiguous(), sin.contiguous(), out_slots, pool)
    return pool.v_buffer[0].view(torch.uint8)[out_slots].reshape(-1)[: values.numel()]


@pytest.mark.parametrize("kv_dtype", FP8, ids=["e5m2", "e4m3"])
def test_rope_store_rounds_every_bf16_value_like_torch(kv_dtype):
    """Every finite bf16 value (65280: V of 255 tokens x 4 heads x 64) stored into an 8-bit pool
    is bit-equal to torch's x.clamp(-max, max).to(kv_dtype): ties to even, the format's
    subnormals, signed zeros and tiny values, and everything past its largest value saturated
    to it (never inf or NaN). Every finite 8-bit value occurs (each is a bf16 value)."""
    values = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    values = values[values.isfinite()]
    assert values.numel() == 65280
    got = store_as_v(values, kv_dtype)
    limit = FP8_MAX[kv_dtype]
    assert torch.finfo(kv_dtype).max == limit
    want = values.clamp(-limit, limit).to(kv_dtype).view(torch.uint8)
    assert torch.equal(got, want)
    widened = got.view(kv_dtype).float()
    assert widened.isfinite().all()
    past_max = values.float().abs() > limit
    assert past_max.sum() > 10000 and (widened[past_max].abs() == limit).all()
    assert torch.unique(got).numel() == finite_fp8_values(kv_dtype).numel()
    tiny = torch.finfo(kv_dtype).smallest_normal
    assert ((widened != 0) & (widened.abs() < tiny)).sum() > 0  # subnormals were produced


@pytest.mark.parametrize("kv_dtype", FP8, ids=["e5m2", "e4m3"])
def test_rope_store_rounds_fp32_ties_to_even(kv_dtype):
    """An fp32 model's V: every 8-bit value, every midpoint between two neighbours (exact ties,
    subnormal ones and the one past the largest value too), the fp32 values just either side of
    each midpoint, all negated too, and random values over 2^-24..2^21: bit-equal to torch's
    clamp-and-cast, and each tie rounded to the neighbour with the even bit pattern."""
    values = finite_fp8_values(kv_dtype)
    values = values[values >= 0].unique()  # 0, the subnormals, ..., max
    limit = FP8_MAX[kv_dtype]
    beyond = torch.tensor([2 * limit - float(values[-2])])  # the next step past max
    upper = torch.cat((values[1:], beyond))
    ties = (values + upper) / 2
    assert torch.equal(ties * 2, values + upper)  # exact in fp32
    inf = torch.full_like(ties, float("inf"))
    near = torch.cat((torch.nextafter(ties, inf), torch.nextafter(ties, -inf)))
    gen = torch.Generator().manual_seed(7)
    randoms = torch.randn(20000, generator=gen) * 2.0 ** torch.randint(-24, 21, (20000,),
                                                                      generator=gen)
    positive = torch.cat((values, ties, near))
    data = torch.cat((positive, -positive, randoms))
    got = store_as_v(data, kv_dtype)
    want = data.clamp(-limit, limit).to(kv_dtype).view(torch.uint8)
    assert torch.equal(got, want)
    tie_bits = got[values.numel() : values.numel() + ties.numel()]
    below = values.to(kv_dtype).view(torch.uint8)
    # a tie goes to whichever neighbour's pattern is even (the one past max: saturated to max)
    expected = torch.where(below % 2 == 0, below, below + 1)
    expected[-1] = below[-1]
    assert torch.equal(tie_bits, expected)


def int8_v_rows(gen, tokens, dtype) -> torch.Tensor:
    """[tokens, 4, 64] V heads of dtype for an int8 pool: each at its own scale over 2^-30..2^30
    and values within a head over 2^-12..1 of its largest; then the edge heads: all zeros, one
    huge value among tiny ones, a largest magnitude that is negative, constant heads, heads of
    max 127 (scale exactly 1) holding the half-step ties -125.5..125.5, and heads whose max
    is 127 * 2^e (scale 2^e) with ties at that scale."""
    x = torch.randn(tokens, 4, 64, generator=gen)
    x = x * 2.0 ** torch.randint(-12, 1, x.shape, generator=gen)
    x = x * 2.0 ** torch.randint(-30, 31, (tokens, 4, 1), generator=gen)
    x[0, 0] = 0.0
    x[0, 1] = torch.randn(64, generator=gen) * 1e-4
    x[0, 1, 17] = 6e4
    x[0, 2] = torch.rand(64, generator=gen)
    x[0, 2, 3] = -2.5
    x[0, 3] = -0.375
    ties = torch.arange(-126, 126) + 0.5  # 252 ties: four heads of 127 and 63 of them
    for i in range(4):
        head = torch.full((64,), 127.0)
        head[1:] = ties[63 * i : 63 * (i + 1)]
        x[1, i] = head
        x[2, i] = head * 2.0 ** (i - 5)  # scale 2^(i-5): the same ties, scaled exactly
    # a subnormal max |x| whose rounded scale makes x / scale 127.5: clamped to 127, not -128
    x[3, 0] = 0.0
    x[3, 0, 0] = torch.tensor([16065], dtype=torch.int32).view(torch.float32)
    return x.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_store_quantizes_int8_like_the_pool(dtype):
    """V heads (straight from qkv, no rotation) into an int8 pool at shuffled slots: codes and
    scales bit-equal to KVPool.store's int8_rows, and so to torch's fp32 division and
    round-half-to-even: every tie at scale 1 and at powers of two goes to the even code; no
    code passes +-127; an all-zero head gets scale 1."""
    gen = torch.Generator().manual_seed(13)
    tokens, heads, kv_heads, d = 40, 1, 4, 64
    v = int8_v_rows(gen, tokens, dtype)
    qk = (torch.randn(tokens, (heads + kv_heads) * d, generator=gen)).to(dtype)
    qkv = torch.cat((qk, v.view(tokens, kv_heads * d)), dim=1)
    rotary = RotaryEmbedding(None, {"rope_type": "default", "rope_theta": 10000.0}, d, 512)
    cos, sin = rotary.tables_for(torch.arange(tokens), dtype)
    pool = KVPool(1, tokens + 7, kv_heads, d, dtype, kv_dtype=torch.int8)
    out_slots = torch.randperm(tokens + 7, generator=gen)[:tokens]
    rope_store(qkv, heads, kv_heads, d, cos.contiguous(), sin.contiguous(), out_slots, pool)
    assert pool.v_scale is not None
    codes, scales = pool.v_buffer[0, out_slots], pool.v_scale[0, out_slots]
    want_codes, want_scales = int8_rows(v)
    assert torch.equal(scales, want_scales)
    assert torch.equal(codes, want_codes)
    assert int(codes.abs().max()) == 127 and int(codes.min()) >= -127
    assert scales[0, 0] == 1.0 and not codes[0, 0].any()
    assert codes[0, 1, 17] == 127 and int(codes[0, 1].abs().sum()) == 127
    assert codes[0, 2, 3] == -127 and (codes[0, 3] == -127).all()
    if dtype == torch.float32:  # (bf16 has no such subnormal: the head is all zeros there)
        assert codes[3, 0, 0] == 127
    for t, scale in ((1, [1.0] * 4), (2, [2.0 ** (i - 5) for i in range(4)])):
        assert scales[t].tolist() == scale
        tie_codes = codes[t, :, 1:].reshape(-1)
        assert torch.equal(tie_codes, torch.round(torch.arange(-126, 126) + 0.5).to(torch.int8))
        assert (tie_codes % 2 == 0).all()
    # the K heads were rotated and stored too, as the pool stores torch's rotation
    k = qkv[:, heads * d : (heads + kv_heads) * d].reshape(tokens, kv_heads, d)
    _, k_rot = rotary.rotate(torch.zeros(tokens, heads, d, dtype=dtype), k, cos, sin)
    reference = KVPool(1, tokens + 7, kv_heads, d, dtype, kv_dtype=torch.int8)
    reference.store(0, out_slots, k_rot, v)
    assert torch.equal(pool.k_buffer, reference.k_buffer)
    assert same_scales(pool, reference)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_matches_eager(dtype):
    """silu(gate) * up over a wide range (|gate| up to 200: exp clamps, no inf or NaN)."""
    gen = torch.Generator().manual_seed(2)
    rows, inter = 3, 1000
    gate_up = (torch.randn(rows, 2 * inter, generator=gen) * 6).to(dtype)
    gate_up[0, :4] = torch.tensor([200.0, -200.0, 0.0, -90.0]).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    expected = F.silu(gate) * up
    out = torch.empty(rows, inter, dtype=dtype)
    lib().fused_silu_mul(rows, inter, gate_up.data_ptr(), out.data_ptr(), CODES[dtype])
    assert torch.isfinite(out).all()
    same_sign = (out.sign() == expected.sign()) | (expected == 0)
    assert same_sign.all()
    assert int(ulps_apart(out, expected)[expected != 0].max()) <= 2
    assert (out != expected).float().mean() < (0.05 if dtype == torch.float32 else 0.01)


def decode_like_batch(kv_lens: list[int], q_lens: list[int]) -> ForwardBatch:
    """Request b's context in slots [1000 b, 1000 b + kv_len): its last q_len tokens are new."""
    tables = [torch.arange(1000 * b, 1000 * b + n) for b, n in enumerate(kv_lens)]
    width = max(kv_lens)
    table = torch.stack([F.pad(t, (0, width - len(t)), value=int(t[0])) for t in tables])
    positions = torch.cat([torch.arange(n - q, n) for n, q in zip(kv_lens, q_lens)])
    out_slots = torch.cat([t[n - q:] for t, n, q in zip(tables, kv_lens, q_lens)])
    starts = torch.cumsum(torch.tensor([0] + q_lens[:-1]), 0)
    max_q = max(q_lens)
    q_index = torch.minimum(starts[:, None] + torch.arange(max_q)[None, :],
                            (starts + torch.tensor(q_lens) - 1)[:, None])
    num_tokens = sum(q_lens)
    return ForwardBatch(
        input_ids=torch.randint(0, 49152, (num_tokens,), generator=torch.Generator().manual_seed(3)),
        positions=positions, out_slots=out_slots, q_lens=torch.tensor(q_lens),
        kv_lens=torch.tensor(kv_lens), slot_table=table, q_index=q_index,
        logits_indices=torch.arange(num_tokens), max_q_len=max_q,
        is_decode=all(q == 1 for q in q_lens))


def eager_and_fused(model, pools: list[KVPool], batch) -> tuple:
    """`batch` through the model's eager layers over pools[0] and its fused layers over
    pools[1] (both with NativeAttention): (eager output, fused output, [their logits])."""
    spec = model.spec
    backends = [NativeAttention(pool, spec.num_heads, spec.num_kv_heads, spec.head_dim,
                                model.attention_layers) for pool in pools]
    assert all(backend.enabled for backend in backends)
    fused = FusedDecodeLayers(model, backends[1])
    with torch.inference_mode():
        prepared = [backend.prepare(batch) for backend in backends]
        assert isinstance(prepared[1].attn_meta, NativeAttentionMeta)
        x = model._embed(batch.input_ids)
        eager = x.clone()
        for layer in model.model.layers:
            eager = layer(eager, prepared[0], backends[0])
        assert fused.takes(prepared[1], x)
        out = fused.run(x.clone(), prepared[1])
    return eager, out, [model._head(model.model.norm(h)) for h in (eager, out)]


def test_fused_forward_matches_eager_layers(make_engine):
    """The default model (fp32): a decode batch and a speculative-verify-like batch through the
    fused layers and through the eager layers over copies of one random KV pool: the same
    greedy tokens, logits within float32 summation-order noise, and the same K/V written."""
    engine = make_engine()
    model = engine.parts.runner.model
    assert isinstance(model.fused_layers, FusedDecodeLayers)  # the default CPU engine fuses
    spec = model.spec
    for kv_lens, q_lens in [([40, 9, 130], [1, 1, 1]), ([30, 12], [5, 3])]:
        batch = decode_like_batch(kv_lens, q_lens)
        pools = [KVPool(spec.num_layers, 1000 * len(kv_lens), spec.num_kv_heads, spec.head_dim,
                        torch.float32) for _ in range(2)]
        gen = torch.Generator().manual_seed(4)
        pools[0].k_buffer.normal_(generator=gen)
        pools[0].v_buffer.normal_(generator=gen)
        pools[1].k_buffer.copy_(pools[0].k_buffer)
        pools[1].v_buffer.copy_(pools[0].v_buffer)
        eager, out, logits = eager_and_fused(model, pools, batch)
        # The last layers' stream reaches thousands: noise is relative to its largest value.
        torch.testing.assert_close(out, eager, atol=1e-4 * float(eager.abs().max()), rtol=0)
        torch.testing.assert_close(logits[1], logits[0],
                                   atol=1e-4 * float(logits[0].abs().max()), rtol=0)
        assert torch.equal(logits[1].argmax(-1), logits[0].argmax(-1))
        for buf in ("k_buffer", "v_buffer"):
            written = getattr(pools[0], buf)
            torch.testing.assert_close(getattr(pools[1], buf), written,
                                       atol=1e-4 * float(written.abs().max()), rtol=0)


def test_fused_forward_over_an_int8_pool_matches_eager_layers(make_engine):
    """The same two batches over copies of one random int8 pool (codes and row scales): the
    fused layers (fused_rope_store quantizing in C, the kernel reading the layer's scales)
    against the eager layers (KVPool.store's int8_rows, the same kernel). Their K/V differ by
    float32 noise (the norms' summation order), which moves a code by one step where a value
    sits at a rounding boundary, and the random caches amplify that through the layers.
    Measured over seeds 4-9: the first layers' rows equal, the deepest up to 2.8 steps of
    their scale and their scales 1.2e-2 apart; outputs up to 4e-3 and logits up to 1.3e-2 of
    their largest apart, the same greedy tokens (fused layers reading each layer's neighbour's
    scales: 1.5 and 1.1). Asserted: outputs and logits within 5e-2 of their largest, the first
    two layers' rows within a step, every row within 4.5 steps, the rows not written
    untouched."""
    model = make_engine().parts.runner.model
    spec = model.spec
    for kv_lens, q_lens in [([40, 9, 130], [1, 1, 1]), ([30, 12], [5, 3])]:
        batch = decode_like_batch(kv_lens, q_lens)
        pools = [KVPool(spec.num_layers, 1000 * len(kv_lens), spec.num_kv_heads, spec.head_dim,
                        torch.float32, kv_dtype=torch.int8) for _ in range(2)]
        gen = torch.Generator().manual_seed(4)
        for name in ("k_buffer", "v_buffer", "k_scale", "v_scale"):
            shape = getattr(pools[0], name).shape
            fill = ((torch.randn(shape, generator=gen) * 40).clamp(-127, 127).to(torch.int8)
                    if name.endswith("buffer") else torch.rand(shape, generator=gen) / 20 + 0.005)
            for pool in pools:
                getattr(pool, name).copy_(fill)
        assert all(pool.k_scale is not None for pool in pools)
        eager, out, logits = eager_and_fused(model, pools, batch)
        torch.testing.assert_close(out, eager, atol=5e-2 * float(eager.abs().max()), rtol=0)
        torch.testing.assert_close(logits[1], logits[0],
                                   atol=5e-2 * float(logits[0].abs().max()), rtol=0)
        for buf, scale in (("k_buffer", "k_scale"), ("v_buffer", "v_scale")):
            codes = [getattr(pool, buf) for pool in pools]
            scales = [getattr(pool, scale) for pool in pools]
            torch.testing.assert_close(scales[1], scales[0], atol=0, rtol=5e-2)
            widened = [c.float() * s[..., None] for c, s in zip(codes, scales)]
            steps = (widened[1] - widened[0]).abs() / scales[0][..., None]
            assert float(steps[:2].max()) <= 1.01 and float(steps.max()) <= 4.5
            others = torch.ones(codes[0].shape[1], dtype=torch.bool)
            others[batch.out_slots] = False  # the rows not written: the same random fill
            assert torch.equal(codes[1][:, others], codes[0][:, others])
            assert torch.equal(scales[1][:, others], scales[0][:, others])
            # the batch's rows were written, with 127 for each row's largest value
            assert (codes[0][:, batch.out_slots].abs().amax(-1) == 127).all()


def test_fused_layers_take_only_native_decode_batches(make_engine):
    """A prefill batch (SDPA, not the kernel) or a dtype other than the pool's runs eagerly."""
    model = make_engine().parts.runner.model
    fused = model.fused_layers
    assert fused is not None
    spec = model.spec
    pool = KVPool(spec.num_layers, 4000, spec.num_kv_heads, spec.head_dim, torch.float32)
    backend = NativeAttention(pool, spec.num_heads, spec.num_kv_heads, spec.head_dim)
    x = torch.zeros(2, spec.hidden_size)
    prefill = backend.prepare(decode_like_batch([40, 40], [40, 30]))
    assert not fused.takes(prefill, torch.zeros(70, spec.hidden_size))
    decode = backend.prepare(decode_like_batch([40, 9], [1, 1]))
    assert fused.takes(decode, x)
    assert not fused.takes(decode, x.to(torch.bfloat16))


def test_unsupported_reasons(make_engine):
    model = make_engine().parts.runner.model
    spec = model.spec
    pool = KVPool(spec.num_layers, 64, spec.num_kv_heads, spec.head_dim, torch.float32)
    native = NativeAttention(pool, spec.num_heads, spec.num_kv_heads, spec.head_dim)
    assert unsupported_reason(model, native) == ""
    torch_attn = TorchAttention(pool, spec.num_heads, spec.num_kv_heads, spec.head_dim)
    assert "not the native kernel" in unsupported_reason(model, torch_attn)

    class Variant:  # the same layers under another spec
        def __init__(self, **changes):
            self.spec, self.model = dataclasses.replace(spec, **changes), model.model

    assert unsupported_reason(Variant(qk_norm="head"), native) == ""  # Qwen3's q/k norms are fused
    reason = unsupported_reason(Variant(norm_placement="sandwich", activation="gelu_tanh"), native)
    assert "sandwich norms" in reason and "gelu_tanh" in reason


def test_direct_calls_equal_the_modules():
    """direct_call gives each linear kind's own forward result (the fused layers' matmuls)."""
    from torch import nn

    from forklm.runtime.models.fp16_linear import Fp16WeightLinear, fp16_weights_available
    from forklm.runtime.models.fused_layers import direct_call
    from forklm.runtime.models.onednn_linear import OneDNNLinear, can_pack
    from forklm.runtime.models.weights import FusedLinear

    gen = torch.Generator().manual_seed(5)
    weight, bias = torch.randn(48, 32, generator=gen), torch.randn(48, generator=gen)
    fused = FusedLinear(32, (16, 32), bias=True)
    fused.weight.data, fused.bias.data = weight.clone(), bias.clone()
    modules: list[tuple[nn.Module, torch.dtype]] = [(fused, torch.float32)]
    plain = nn.Linear(32, 48, bias=False, dtype=torch.bfloat16)
    modules.append((plain, torch.bfloat16))
    if can_pack(torch.bfloat16, "cpu"):
        modules.append((OneDNNLinear(weight.bfloat16(), bias.bfloat16()), torch.bfloat16))
    if fp16_weights_available():
        modules.append((Fp16WeightLinear(weight, bias), torch.float32))
    for module, dtype in modules:
        call = direct_call(module)
        assert call is not module  # every kind here has a path without module lookups
        for rows in (1, 5, 17):
            x = torch.randn(rows, 32, generator=gen).to(dtype)
            with torch.inference_mode():
                assert torch.equal(call(x), module(x)), (type(module).__name__, rows)


def test_a_forward_whose_every_row_has_logits_takes_the_final_norm_from_the_fused_layers(
        make_engine, monkeypatch):
    """CausalLM.forward on the default model (fp32): a decode batch (every row's logits) runs
    the final norm in the fused layers' C call, a batch that wants fewer rows (a verified
    draft's prompt) in torch; both give the eager forward's logits within float32 noise and
    its greedy tokens."""
    model = make_engine().parts.runner.model
    spec = model.spec
    for kv_lens, q_lens, rows in [([40, 9, 130], [1, 1, 1], [0, 1, 2]),
                                  ([30, 12], [5, 3], [4, 7])]:
        batch = dataclasses.replace(decode_like_batch(kv_lens, q_lens),
                                    logits_indices=torch.tensor(rows))
        pools = [KVPool(spec.num_layers, 1000 * len(kv_lens), spec.num_kv_heads, spec.head_dim,
                        torch.float32) for _ in range(2)]
        pools[0].k_buffer.normal_(generator=torch.Generator().manual_seed(4))
        pools[1].k_buffer.copy_(pools[0].k_buffer)
        backends = [NativeAttention(pool, spec.num_heads, spec.num_kv_heads, spec.head_dim,
                                    model.attention_layers) for pool in pools]
        fused = FusedDecodeLayers(model, backends[1])
        norms: list = []

        def run(x, b, final_norm=None, run=fused.run, norms=norms):
            norms.append(final_norm)
            return run(x, b, final_norm)

        monkeypatch.setattr(fused, "run", run)
        monkeypatch.setattr(model, "fused_layers", None)
        eager = model(batch, backends[0])
        monkeypatch.setattr(model, "fused_layers", fused)
        logits = model(batch, backends[1])
        assert norms == [model.model.norm if len(rows) == sum(q_lens) else None]
        torch.testing.assert_close(logits, eager, atol=1e-4 * float(eager.abs().max()), rtol=0)
        assert torch.equal(logits.argmax(-1), eager.argmax(-1))
