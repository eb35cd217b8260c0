"""Triton kernels under TRITON_INTERPRET=1 on the CPU against their torch twins (`_ref`) and a dense
float64 attention over the gathered K/V, on random ragged batches with scattered slots."""

from __future__ import annotations

import os

# Before anything imports Triton: @triton.jit reads it when the kernel modules are imported.
os.environ["TRITON_INTERPRET"] = "1"

import subprocess  # noqa: E402
import sys  # noqa: E402
from dataclasses import dataclass  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from forklm.kernels.triton.decode_attention import decode_attention, decode_attention_ref  # noqa: E402
from forklm.kernels.triton.extend_attention import extend_attention, extend_attention_ref  # noqa: E402
from forklm.kernels.triton.store_kv import store_kv, store_kv_ref  # noqa: E402
from forklm.runtime.models.layers import alibi_slopes  # noqa: E402

NUM_KV_HEADS = 2
# Atol vs the fp32 twin / vs float64 dense; fp16 rounds q, k, v and the softmax weights.
TOL = {torch.float32: (2e-5, 5e-5), torch.float16: (4e-3, 4e-3)}
CASES = [pytest.param(dtype, group, head_dim, id=f"{str(dtype)[6:]}-group{group}-d{head_dim}")
         for dtype in (torch.float32, torch.float16) for group in (1, 3, 4) for head_dim in (64, 128)]
# Decode splits per GQA group: 3 is padded to a power of two in the merge, None is the default.
SPLITS = {1: 3, 3: 1, 4: None}


@dataclass
class PagedBatch:
    """A ragged batch in a paged pool: request b's context slots are
    kv_indices[kv_start[b] : kv_start[b] + kv_lens[b]], scattered over the pool; the flattened
    table has garbage gaps between requests and does not follow request order."""

    k_buffer: torch.Tensor  # [num_slots, num_kv_heads, head_dim]
    v_buffer: torch.Tensor
    kv_indices: torch.Tensor  # [table_len]
    kv_start: torch.Tensor  # [batch]
    kv_lens: torch.Tensor  # [batch]

    def slots(self, b: int) -> torch.Tensor:
        start = int(self.kv_start[b])
        return self.kv_indices[start : start + int(self.kv_lens[b])]


def make_paged_batch(gen: torch.Generator, kv_lens: list[int], head_dim: int,
                     dtype: torch.dtype) -> PagedBatch:
    num_slots = sum(kv_lens) + 37
    shape = (num_slots, NUM_KV_HEADS, head_dim)
    k_buffer = torch.randn(shape, generator=gen).to(dtype)
    v_buffer = torch.randn(shape, generator=gen).to(dtype)
    perm = torch.randperm(num_slots, generator=gen)  # each request's slots scattered
    owned = list(torch.split(perm[: sum(kv_lens)], kv_lens))
    order = torch.randperm(len(kv_lens), generator=gen).tolist()  # table order != request order
    pieces: list[torch.Tensor] = []
    kv_start = [0] * len(kv_lens)
    used = 0
    for b in order:
        gap = torch.randint(0, num_slots, (int(torch.randint(0, 5, (1,), generator=gen)),),
                            generator=gen)  # real slot ids of other requests: must not be read
        kv_start[b] = used + gap.numel()
        pieces += [gap, owned[b]]
        used += gap.numel() + kv_lens[b]
    index_dtype = torch.int32 if dtype == torch.float16 else torch.int64  # both are accepted
    return PagedBatch(k_buffer, v_buffer, torch.cat(pieces).to(index_dtype),
                      torch.tensor(kv_start, dtype=index_dtype),
                      torch.tensor(kv_lens, dtype=index_dtype))


def random_lens(gen: torch.Generator, n: int, low: int, high: int, fixed: list[int]) -> list[int]:
    """`fixed` (the extremes) followed by random lengths in [low, high]."""
    return fixed + torch.randint(low, high + 1, (n - len(fixed),), generator=gen).tolist()


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix: int,
                    alibi: torch.Tensor | None = None, sinks: torch.Tensor | None = None,
                    window: int | None = None) -> torch.Tensor:
    """float64 causal attention: q [m, heads, d] at positions prefix..prefix+m-1 over k/v
    [n, kv_heads, d] gathered from the pool -> [m, heads, d]; `alibi` [heads]: ALiBi's slopes,
    slope * (key - query position) (BLOOM's slope * key position is the same softmax, but not
    beside a sink); sinks [heads]: one more softmax column per head, with no value; window:
    position p sees keys (p - window, p]."""
    group = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    s = torch.einsum("mhd,nhd->hmn", q.double(), k) / q.shape[-1] ** 0.5
    key_pos, q_pos = torch.arange(k.shape[0])[None, :], prefix + torch.arange(q.shape[0])[:, None]
    if alibi is not None:
        s = s + alibi.double()[:, None, None] * (key_pos - q_pos)
    visible = key_pos <= q_pos
    if window:
        visible &= key_pos > q_pos - window
    s = s.masked_fill(~visible, float("-inf"))
    if sinks is not None:
        s = torch.cat((s, sinks.double()[:, None, None].expand(-1, s.shape[1], 1)), dim=-1)
    p = torch.softmax(s, dim=-1)[..., : k.shape[0]]
    return torch.einsum("hmn,nhd->mhd", p, v)


def assert_close(got: torch.Tensor, want: torch.Tensor, atol: float) -> None:
    err = (got.double() - want.double()).abs().max().item()
    assert err <= atol, f"max abs error {err:.2e} > {atol:.0e}"


@pytest.mark.parametrize(("dtype", "group", "head_dim"), CASES)
def test_decode_attention(dtype, group, head_dim):
    gen = torch.Generator().manual_seed(group * 1000 + head_dim)
    kv_lens = random_lens(gen, 5, 1, 300, fixed=[1, 300])
    batch = make_paged_batch(gen, kv_lens, head_dim, dtype)
    q = torch.randn(len(kv_lens), NUM_KV_HEADS * group, head_dim, generator=gen).to(dtype)
    args = (q, batch.k_buffer, batch.v_buffer, batch.kv_indices, batch.kv_start, batch.kv_lens)
    splits = SPLITS[group]
    out = decode_attention(*args, num_kv_splits=splits)
    assert out.shape == q.shape and out.dtype == dtype
    tol_ref, tol_dense = TOL[dtype]
    assert_close(out, decode_attention_ref(*args, num_kv_splits=splits), tol_ref)
    for b in range(len(kv_lens)):
        slots = batch.slots(b)
        want = dense_attention(q[b : b + 1], batch.k_buffer[slots], batch.v_buffer[slots],
                               kv_lens[b] - 1)
        assert_close(out[b : b + 1], want, tol_dense)


@pytest.mark.parametrize(("dtype", "group", "head_dim"), CASES)
def test_extend_attention(dtype, group, head_dim):
    gen = torch.Generator().manual_seed(group * 1000 + head_dim + 1)
    # (context, chunk): chunk 1, a whole prompt, the longest of each, then random.
    fixed = [(1, 1), (64, 64), (300, 64), (300, 1)]
    kv_lens = random_lens(gen, 6, 1, 300, fixed=[c for c, _ in fixed])
    q_lens = [n for _, n in fixed] + [
        int(torch.randint(1, min(64, c) + 1, (1,), generator=gen)) for c in kv_lens[len(fixed):]]
    batch = make_paged_batch(gen, kv_lens, head_dim, dtype)
    num_tokens = sum(q_lens)
    q = torch.randn(num_tokens, NUM_KV_HEADS * group, head_dim, generator=gen).to(dtype)
    # Requests' rows in the packed q in a shuffled order, as starts + lengths allow.
    order = torch.randperm(len(q_lens), generator=gen).tolist()
    q_start = [0] * len(q_lens)
    for i, b in enumerate(order):
        q_start[b] = sum(q_lens[o] for o in order[:i])
    q_start_t, q_lens_t = torch.tensor(q_start), torch.tensor(q_lens)
    args = (q, batch.k_buffer, batch.v_buffer, q_start_t, q_lens_t, batch.kv_indices,
            batch.kv_start, batch.kv_lens, max(q_lens))
    out = extend_attention(*args)
    assert out.shape == q.shape and out.dtype == dtype
    tol_ref, tol_dense = TOL[dtype]
    assert_close(out, extend_attention_ref(*args), tol_ref)
    for b in range(len(q_lens)):
        rows = slice(q_start[b], q_start[b] + q_lens[b])
        slots = batch.slots(b)
        want = dense_attention(q[rows], batch.k_buffer[slots], batch.v_buffer[slots],
                               kv_lens[b] - q_lens[b])
        assert_close(out[rows], want, tol_dense)


@pytest.mark.parametrize("group", [1, 2])
def test_attention_kernels_with_alibi(group):
    """ALiBi's bias (slopes of 4 or 8 heads) in both kernels: decode over several splits and
    extend chunks deep into their contexts, against the twins and a dense float64 reference."""
    gen = torch.Generator().manual_seed(group)
    heads = NUM_KV_HEADS * 2 * group
    slopes = torch.tensor(alibi_slopes(heads), dtype=torch.float32)
    kv_lens, q_lens = [1, 150, 70], [1, 40, 70]
    batch = make_paged_batch(gen, kv_lens, 64, torch.float32)
    q = torch.randn(len(kv_lens), heads, 64, generator=gen)
    args = (q, batch.k_buffer, batch.v_buffer, batch.kv_indices, batch.kv_start, batch.kv_lens)
    out = decode_attention(*args, num_kv_splits=3, alibi_slopes=slopes)
    tol_ref, tol_dense = TOL[torch.float32]
    assert_close(out, decode_attention_ref(*args, num_kv_splits=3, alibi_slopes=slopes), tol_ref)
    for b, n in enumerate(kv_lens):
        slots = batch.slots(b)
        assert_close(out[b : b + 1], dense_attention(q[b : b + 1], batch.k_buffer[slots],
                                                     batch.v_buffer[slots], n - 1, slopes),
                     tol_dense)
    q = torch.randn(sum(q_lens), heads, 64, generator=gen)
    q_start = torch.tensor([0, 1, 41])
    args = (q, batch.k_buffer, batch.v_buffer, q_start, torch.tensor(q_lens), batch.kv_indices,
            batch.kv_start, batch.kv_lens, max(q_lens))
    out = extend_attention(*args, alibi_slopes=slopes)
    assert_close(out, extend_attention_ref(*args, alibi_slopes=slopes), tol_ref)
    for b, (n, m) in enumerate(zip(kv_lens, q_lens)):
        slots, rows = batch.slots(b), slice(int(q_start[b]), int(q_start[b]) + m)
        want = dense_attention(q[rows], batch.k_buffer[slots], batch.v_buffer[slots], n - m,
                               slopes)
        assert_close(out[rows], want, tol_dense)
        plain = dense_attention(q[rows], batch.k_buffer[slots], batch.v_buffer[slots], n - m)
        assert n < 2 or not torch.allclose(want, plain, atol=1e-2)  # the bias matters


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("with_sinks", "window", "with_alibi"),
                         [(True, None, False), (False, 24, False), (True, 24, False),
                          (True, 24, True)],
                         ids=["sinks", "window", "sinks+window", "sinks+window+alibi"])
def test_sinks_and_sliding_window(dtype, with_sinks, window, with_alibi):
    """gpt-oss's per-head sink logits (from well below the scores to well above) and its sliding
    window (shorter than some contexts and chunks, longer than others) in both kernels, also
    under ALiBi's bias (both features in one model): their twins' and the dense float64
    attention's output."""
    gen = torch.Generator().manual_seed(7)
    group, head_dim = 4, 64
    sinks = torch.linspace(-4.0, 4.0, NUM_KV_HEADS * group) if with_sinks else None
    slopes = (torch.tensor(alibi_slopes(NUM_KV_HEADS * group), dtype=torch.float32)
              if with_alibi else None)
    extra = {"alibi_slopes": slopes, "sinks": sinks, "window": window}
    kv_lens, q_lens = [1, 70, 128, 9], [1, 16, 64, 9]
    batch = make_paged_batch(gen, kv_lens, head_dim, dtype)
    tol_ref, tol_dense = TOL[dtype]
    q = torch.randn(len(kv_lens), NUM_KV_HEADS * group, head_dim, generator=gen).to(dtype)
    args = (q, batch.k_buffer, batch.v_buffer, batch.kv_indices, batch.kv_start, batch.kv_lens)
    out = decode_attention(*args, num_kv_splits=2, **extra)
    assert_close(out, decode_attention_ref(*args, num_kv_splits=2, **extra), tol_ref)
    for b in range(len(kv_lens)):
        slots = batch.slots(b)
        want = dense_attention(q[b : b + 1], batch.k_buffer[slots], batch.v_buffer[slots],
                               kv_lens[b] - 1, slopes, sinks, window)
        assert_close(out[b : b + 1], want, tol_dense)
    q = torch.randn(sum(q_lens), NUM_KV_HEADS * group, head_dim, generator=gen).to(dtype)
    q_start = torch.tensor([sum(q_lens[:b]) for b in range(len(q_lens))])
    args = (q, batch.k_buffer, batch.v_buffer, q_start, torch.tensor(q_lens), batch.kv_indices,
            batch.kv_start, batch.kv_lens, max(q_lens))
    out = extend_attention(*args, **extra)
    assert_close(out, extend_attention_ref(*args, **extra), tol_ref)
    for b in range(len(q_lens)):
        rows = slice(int(q_start[b]), int(q_start[b]) + q_lens[b])
        slots = batch.slots(b)
        want = dense_attention(q[rows], batch.k_buffer[slots], batch.v_buffer[slots],
                               kv_lens[b] - q_lens[b], slopes, sinks, window)
        assert_close(out[rows], want, tol_dense)
        plain = dense_attention(q[rows], batch.k_buffer[slots], batch.v_buffer[slots],
                                kv_lens[b] - q_lens[b], slopes)
        if with_sinks or kv_lens[b] > window:  # else every row sees all its keys
            assert (want - plain).abs().max() > 1e-2, "sinks / window should change the output"


@pytest.mark.parametrize(("src_dtype", "dst_dtype"),
                         [(torch.float32, torch.float32), (torch.float32, torch.float16),
                          (torch.float16, torch.float16)])
def test_store_kv(src_dtype, dst_dtype):
    gen = torch.Generator().manual_seed(7)
    num_slots, n, kv_heads, head_dim = 64, 9, 3, 64
    k_buffer = torch.randn(num_slots, kv_heads, head_dim, generator=gen).to(dst_dtype)
    v_buffer = torch.randn(num_slots, kv_heads, head_dim, generator=gen).to(dst_dtype)
    # k and v as strided views of one fused projection, as the model produces them.
    kv = torch.randn(n, 2 * kv_heads * head_dim + 5, generator=gen).to(src_dtype)
    k = kv[:, : kv_heads * head_dim].view(n, kv_heads, head_dim)
    v = kv[:, kv_heads * head_dim : 2 * kv_heads * head_dim].view(n, kv_heads, head_dim)
    slots = torch.randperm(num_slots, generator=gen)[:n]
    k_ref, v_ref = k_buffer.clone(), v_buffer.clone()
    store_kv(k_buffer, v_buffer, slots, k, v)
    store_kv_ref(k_ref, v_ref, slots, k, v)
    assert torch.equal(k_buffer, k_ref) and torch.equal(v_buffer, v_ref)
    untouched = torch.ones(num_slots, dtype=torch.bool)
    untouched[slots] = False
    for i, slot in enumerate(slots.tolist()):
        assert torch.equal(k_buffer[slot], k[i].to(dst_dtype))
        assert torch.equal(v_buffer[slot], v[i].to(dst_dtype))
    assert torch.equal(k_buffer[untouched], k_ref[untouched])


def test_launchers_reject_bad_arguments():
    q = torch.randn(2, 4, 64)
    k_buffer = torch.randn(16, 2, 64)
    idx, start, lens = torch.arange(8), torch.tensor([0, 4]), torch.tensor([4, 4])
    with pytest.raises(ValueError, match="k_buffer: dtype"):
        decode_attention(q, k_buffer.half(), k_buffer.half(), idx, start, lens)
    with pytest.raises(ValueError, match="not a multiple"):
        decode_attention(torch.randn(2, 3, 64), k_buffer, k_buffer, idx, start, lens)
    with pytest.raises(ValueError, match="kv_lens: dim 0"):
        decode_attention(q, k_buffer, k_buffer, idx, start, lens[:1])
    with pytest.raises(ValueError, match="q: last dim must be contiguous"):
        decode_attention(torch.randn(2, 64, 4).transpose(1, 2), k_buffer, k_buffer, idx, start,
                         lens)
    with pytest.raises(ValueError, match="kv_indices: dtype"):
        extend_attention(q, k_buffer, k_buffer, start, lens, idx.float(), start, lens, 4)
    with pytest.raises(ValueError, match="k: dim 1"):
        store_kv(k_buffer, k_buffer, torch.arange(2), torch.randn(2, 3, 64), torch.randn(2, 3, 64))


def test_import_forklm_does_not_import_triton():
    code = "import sys, forklm, forklm.kernels.triton; assert 'triton' not in sys.modules, 'imported'"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)


def test_kernels_compile_for_hopper():
    """The interpreter accepts code that the compiler rejects (shapes, dtypes, tl.dot sizes):
    compile every kernel for sm_90 with the ptxas that Triton bundles; no GPU needed."""
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", "--compile-only"], check=True,
                   env=env, cwd=root, timeout=300, capture_output=True)
