"""SlotAllocator and KVPool: unit tests plus a random allocate/free walk against a set model."""

from __future__ import annotations

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from forklm.runtime.errors import KVCacheFullError
from forklm.runtime.kvcache.pool import KVPool, SlotAllocator, int8_rows


def test_allocate_gives_distinct_free_slots():
    alloc = SlotAllocator(8)
    a, b = alloc.allocate(3), alloc.allocate(5)
    assert a.dtype == torch.int64 and a.shape == (3,)
    assert sorted(torch.cat([a, b]).tolist()) == list(range(8))
    assert alloc.num_free == 0
    alloc.check_invariants()


def test_allocate_zero_is_empty():
    alloc = SlotAllocator(4)
    slots = alloc.allocate(0)
    assert slots.numel() == 0 and slots.dtype == torch.int64
    assert alloc.num_free == 4


def test_allocate_more_than_free_raises_and_changes_nothing():
    alloc = SlotAllocator(4)
    alloc.allocate(3)
    with pytest.raises(KVCacheFullError, match="need 2"):
        alloc.allocate(2)
    assert alloc.num_free == 1
    alloc.check_invariants()


def test_free_returns_slots():
    alloc = SlotAllocator(4)
    slots = alloc.allocate(4)
    alloc.free(slots[:2])
    assert alloc.num_free == 2
    assert sorted(alloc.free_slots().tolist()) == sorted(slots[:2].tolist())
    again = alloc.allocate(2)
    assert sorted(again.tolist()) == sorted(slots[:2].tolist())


def test_slots_freed_in_any_order_come_back_as_an_ascending_run():
    """After a busy period the free slots are scattered; once the run of never-used slots is
    spent, an allocation merges what was freed and takes its lowest slots, in order."""
    alloc = SlotAllocator(64)
    slots = alloc.allocate(64)
    shuffled = slots[torch.randperm(64, generator=torch.Generator().manual_seed(0))]
    for part in shuffled.split(5):
        alloc.free(part)
    assert alloc.allocate(10).tolist() == list(range(10))
    alloc.free(torch.tensor([3, 1]))
    assert alloc.allocate(54).tolist() == list(range(10, 64))  # the run lasts; 1 and 3 wait
    assert alloc.allocate(2).tolist() == [1, 3]
    alloc.check_invariants()


def test_double_free_asserts():
    alloc = SlotAllocator(4)
    slots = alloc.allocate(2)
    alloc.free(slots)
    with pytest.raises(AssertionError, match="double free"):
        alloc.free(slots[:1])
    assert alloc.num_free == 4


def test_duplicate_in_one_free_asserts():
    alloc = SlotAllocator(4)
    slots = alloc.allocate(2)
    with pytest.raises(AssertionError, match="twice"):
        alloc.free(torch.cat([slots[:1], slots[:1]]))


def test_free_out_of_range_asserts():
    alloc = SlotAllocator(4)
    with pytest.raises(AssertionError, match="outside"):
        alloc.free(torch.tensor([4]))


def test_reset_frees_everything():
    alloc = SlotAllocator(5)
    alloc.allocate(4)
    alloc.reset()
    assert alloc.num_free == 5
    alloc.check_invariants()


def test_store_writes_the_right_rows():
    pool = KVPool(num_layers=2, capacity=6, num_kv_heads=2, head_dim=3, dtype=torch.float32)
    # one scratch row past the allocatable slots (padding rows of captured decode batches)
    assert pool.k_buffer.shape == (2, 7, 2, 3) and pool.v_buffer.shape == (2, 7, 2, 3)
    assert pool.scratch_slot == 6 and pool.allocator.capacity == 6
    slots = torch.tensor([4, 1])
    k, v = torch.randn(2, 2, 3), torch.randn(2, 2, 3)
    pool.store(1, slots, k, v)
    torch.testing.assert_close(pool.k_buffer[1, 4], k[0])
    torch.testing.assert_close(pool.k_buffer[1, 1], k[1])
    torch.testing.assert_close(pool.v_buffer[1, slots], v)
    untouched = [0, 2, 3, 5, 6]
    assert not pool.k_buffer[1, untouched].any() and not pool.k_buffer[0].any()
    assert not pool.v_buffer[0].any()


def test_store_casts_to_pool_dtype():
    pool = KVPool(1, 4, 1, 2, dtype=torch.bfloat16)
    k = torch.ones(1, 1, 2)
    pool.store(0, torch.tensor([2]), k, 2 * k)
    assert pool.k_buffer.dtype == torch.bfloat16
    assert pool.v_buffer[0, 2].tolist() == [[2.0, 2.0]]


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith("VmRSS:")).split()[1]) / 1024


def test_a_cpu_pool_is_reserved_not_touched():
    """A pool sized for the worst case (here 1 GiB) costs resident memory only as tokens fill
    it, and reads as zeros where nothing was written."""
    before = _rss_mb()
    pool = KVPool(num_layers=8, capacity=262143, num_kv_heads=2, head_dim=64,
                  dtype=torch.bfloat16)
    assert pool.k_buffer.numel() * 2 * 2 == 1 << 30
    assert _rss_mb() - before < 64
    k = torch.randn(3, 2, 64)
    pool.store(5, torch.tensor([7, 200_000, 262143]), k, -k)
    assert torch.equal(pool.k_buffer[5, 200_000], k[1].to(torch.bfloat16))
    assert torch.equal(pool.v_buffer[5, 7], (-k[0]).to(torch.bfloat16))
    assert not pool.k_buffer[5, 8].any() and not pool.v_buffer[0, 200_000].any()
    assert _rss_mb() - before < 64  # three rows written: a few pages


def test_bytes_per_token():
    assert KVPool.bytes_per_token(30, 3, 64, torch.bfloat16) == 2 * 30 * 3 * 64 * 2
    assert KVPool.bytes_per_token(2, 1, 8, torch.float32) == 2 * 2 * 1 * 8 * 4
    assert KVPool.bytes_per_token(2, 1, 8, torch.float8_e4m3fn) == 2 * 2 * 1 * 8
    assert KVPool.bytes_per_token(2, 1, 8, torch.int8) == 2 * 2 * 1 * (8 + 4)  # + the scales


FP8 = pytest.mark.parametrize("kv_dtype", [torch.float8_e5m2, torch.float8_e4m3fn],
                              ids=["e5m2", "e4m3"])


@FP8
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_fp8_pool_stores_rounded_and_reads_widened(dtype, kv_dtype):
    """An 8-bit pool (--kv-cache-dtype) holds kv_dtype; read_k / read_v give the model's dtype,
    exactly x.clamp(-max, max).to(kv_dtype).to(dtype) of what was stored, from values below the
    format's subnormals to past its largest; the rows not stored read as zeros."""
    pool = KVPool(num_layers=2, capacity=9, num_kv_heads=2, head_dim=16, dtype=dtype,
                  kv_dtype=kv_dtype)
    assert (pool.dtype, pool.kv_dtype, pool.narrow) == (dtype, kv_dtype, True)
    assert pool.k_buffer.dtype == pool.v_buffer.dtype == kv_dtype
    assert pool.k_buffer.shape == (2, 10, 2, 16)
    gen = torch.Generator().manual_seed(0)
    k, v = (torch.randn(4, 2, 16, generator=gen) * 2.0 ** torch.randint(-20, 18, (4, 2, 16),
                                                                        generator=gen)
            for _ in "kv")
    k, v = k.to(dtype), v.to(dtype)
    slots = torch.tensor([7, 0, 3, 9])  # 9: the scratch row past the allocatable slots
    pool.store(1, slots, k, v)
    limit = torch.finfo(kv_dtype).max
    for read, x in ((pool.read_k, k), (pool.read_v, v)):
        got = read(1, slots)
        assert got.dtype == dtype
        assert torch.equal(got, x.clamp(-limit, limit).to(kv_dtype).to(dtype))
    assert (k.float().abs() > limit).any() and (k.float().abs() < 2.0**-16).any()
    others = torch.tensor([1, 2, 4, 5, 6, 8])
    for layer, rows in ((1, others), (0, torch.arange(10))):
        assert not pool.read_k(layer, rows).any() and not pool.read_v(layer, rows).any()
        assert not pool.k_buffer[layer].view(torch.uint8)[rows].any()


@FP8
def test_an_fp8_pool_saturates_instead_of_overflowing(kv_dtype):
    """Values past the format's largest become +-max (448 for e4m3, 57344 for e5m2), never inf
    or NaN (e4m3fn has no inf; e5m2's would turn a softmax into NaN)."""
    limit = {torch.float8_e5m2: 57344.0, torch.float8_e4m3fn: 448.0}[kv_dtype]
    pool = KVPool(1, 4, 1, 4, torch.float32, kv_dtype=kv_dtype)
    big = torch.tensor([[[1e6, -1e6, 3e38, -limit * 1.05]]])
    pool.store(0, torch.tensor([2]), big, -big)
    assert pool.read_k(0, torch.tensor([2])).tolist() == [[[limit, -limit, limit, -limit]]]
    assert pool.read_v(0, torch.tensor([2])).tolist() == [[[-limit, limit, -limit, limit]]]
    assert pool.k_buffer.float().isfinite().all() and pool.v_buffer.float().isfinite().all()


def test_an_fp8_pool_takes_half_the_bytes_per_token():
    """bytes_per_token of the buffers' dtype: an 8-bit pool's is half a bf16 pool's (twice the
    tokens in the same memory), and what its buffers allocate."""
    bf16 = KVPool.bytes_per_token(30, 3, 64, torch.bfloat16)
    for kv_dtype in (torch.float8_e5m2, torch.float8_e4m3fn):
        assert KVPool.bytes_per_token(30, 3, 64, kv_dtype) * 2 == bf16
        pool = KVPool(30, 100, 3, 64, torch.bfloat16, kv_dtype=kv_dtype)
        allocated = pool.k_buffer.untyped_storage().nbytes() * 2
        assert allocated == (100 + 1) * KVPool.bytes_per_token(30, 3, 64, kv_dtype)


@pytest.mark.parametrize(("dtype", "kv_dtype"), [(torch.bfloat16, torch.int16),
                                                 (torch.float32, torch.uint8),
                                                 (torch.float32, torch.int32),
                                                 (torch.bfloat16, torch.float16),
                                                 (torch.float32, torch.bfloat16)])
def test_a_pool_holds_the_model_dtype_an_fp8_one_or_int8(dtype, kv_dtype):
    with pytest.raises(AssertionError, match="8-bit float or int8"):
        KVPool(1, 4, 1, 8, dtype, kv_dtype=kv_dtype)
    same = KVPool(1, 4, 1, 8, dtype, kv_dtype=dtype)  # the model's own: a plain pool
    assert same.k_buffer.dtype == dtype and not same.narrow
    assert same.k_scale is None and same.v_scale is None  # scales are int8's only
    for narrow in (torch.float8_e5m2, torch.float8_e4m3fn, torch.int8):
        pool = KVPool(1, 4, 1, 8, dtype, kv_dtype=narrow)
        assert pool.narrow and pool.k_buffer.dtype == narrow
        assert (pool.k_scale is not None) == (narrow == torch.int8)


# -- int8 codes with a float32 scale per (token, KV head) row ----------------------------------


def int8_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8_rows spelled out per row in Python floats: scale = fp32(max |x| / 127) (1 for an
    all-zero row), codes = x / scale in fp32, rounded half to even."""
    rows = x.float().reshape(-1, x.shape[-1])
    codes = torch.empty(rows.shape, dtype=torch.int8)
    scales = torch.empty(rows.shape[0], dtype=torch.float32)
    for i, row in enumerate(rows):
        amax = float(row.abs().max())
        scale = torch.tensor(amax, dtype=torch.float32) / 127 if amax else torch.tensor(1.0)
        scales[i] = scale
        codes[i] = torch.round(row / scale).to(torch.int8)  # torch.round: half to even
    return codes.view(x.shape), scales.view(x.shape[:-1])


def int8_cases(gen: torch.Generator, n: int, kv_heads: int, d: int,
               dtype: torch.dtype) -> torch.Tensor:
    """[n, kv_heads, d] rows of dtype over 2^-20..2^17 (a scale per row, and within rows),
    with the edge rows: all zeros, one huge value among small ones, one whose largest
    magnitude is negative, one of a single value repeated, exact half-step ties (max 127:
    scale 1) and ones with every value negative."""
    x = torch.randn(n, kv_heads, d, generator=gen)
    x = x * 2.0 ** torch.randint(-20, 18, (n, kv_heads, 1), generator=gen)
    x = x * 2.0 ** torch.randint(-3, 4, (n, kv_heads, d), generator=gen)
    x[0, 0] = 0.0
    x[1, 0] = torch.randn(d, generator=gen) * 1e-3
    x[1, 0, 5] = 3e4
    x[1, 1] = torch.randn(d, generator=gen).abs()
    x[1, 1, 7] = -9.0  # max |x| is a negative value: its code is -127
    x[2, 0] = 0.75
    x[2, 1] = torch.arange(d) - d / 2 + 0.5  # ..., -0.5, 0.5, 1.5, ...: ties
    x[2, 1, 0] = 127.0
    x[3, 0] = -torch.rand(d, generator=gen) - 0.01
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_rows_is_max_over_127_rounded_half_to_even(dtype):
    """int8_rows' codes and scales against a per-row spelling of its rule, on the edge rows:
    an all-zero row gets scale 1 and codes 0; a row's largest magnitude gets code +-127 (-127
    for a negative one) and no code passes +-127; ties go to even codes; every value is within
    half a step (its scale / 2) of codes * scale."""
    gen = torch.Generator().manual_seed(11)
    x = int8_cases(gen, 6, 2, 32, dtype)
    codes, scales = int8_rows(x)
    assert codes.dtype == torch.int8 and codes.shape == x.shape
    assert scales.dtype == torch.float32 and scales.shape == x.shape[:-1]
    want_codes, want_scales = int8_reference(x)
    assert torch.equal(codes, want_codes) and torch.equal(scales, want_scales)
    assert int(codes.abs().max()) == 127 and int(codes.min()) >= -127
    nonzero = x.float().abs().amax(-1) > 0
    assert (codes.abs().amax(-1)[nonzero] == 127).all()  # each row's largest value: 127 steps
    assert scales[0, 0] == 1.0 and not codes[0, 0].any()  # the all-zero row
    assert codes[1, 1, 7] == -127 and scales[1, 1] == torch.tensor(9.0) / 127
    assert codes[1, 0, 5] == 127 and codes[1, 0].abs().sum() == 127  # the rest rounds to 0
    assert (codes[2, 0] == 127).all() and (codes[3, 0] <= 0).all()
    ties = torch.arange(32) - 16 + 0.5
    assert scales[2, 1] == 1.0
    assert torch.equal(codes[2, 1, 1:], torch.round(ties[1:]).to(torch.int8))
    assert codes[2, 1, 1:].remainder(2).eq(0).all()  # every tie went to the even neighbour
    err = (codes.double() * scales.double()[..., None] - x.double()).abs()
    assert (err <= scales.double()[..., None] * (0.5 + 1e-6)).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_int8_pool_stores_codes_and_scales_and_reads_them_scaled(dtype):
    """An int8 pool (--kv-cache-dtype int8) holds int8 codes in k_buffer / v_buffer and one
    float32 scale per (slot, KV head) in k_scale / v_scale [num_layers, capacity + 1,
    num_kv_heads]; store writes exactly int8_rows of k and v (the scratch row too); read_k /
    read_v give (codes * scale) in the model's dtype; the rows not stored keep zero codes and
    zero scales, and read as zeros."""
    pool = KVPool(num_layers=2, capacity=9, num_kv_heads=2, head_dim=32, dtype=dtype,
                  kv_dtype=torch.int8)
    assert (pool.dtype, pool.kv_dtype, pool.narrow) == (dtype, torch.int8, True)
    assert pool.k_buffer.dtype == pool.v_buffer.dtype == torch.int8
    assert pool.k_buffer.shape == (2, 10, 2, 32)
    for scale in (pool.k_scale, pool.v_scale):
        assert scale is not None and scale.dtype == torch.float32
        assert scale.shape == (2, 10, 2) and scale.is_contiguous()
        assert not scale.any()
    gen = torch.Generator().manual_seed(12)
    k = int8_cases(gen, 4, 2, 32, dtype)
    v = -int8_cases(gen, 4, 2, 32, dtype).flip(0)
    slots = torch.tensor([7, 0, 3, 9])  # 9: the scratch row past the allocatable slots
    pool.store(1, slots, k, v)
    assert pool.k_scale is not None and pool.v_scale is not None
    for read, buffer, scales, x in ((pool.read_k, pool.k_buffer, pool.k_scale, k),
                                    (pool.read_v, pool.v_buffer, pool.v_scale, v)):
        codes, row_scales = int8_rows(x)
        assert torch.equal(buffer[1, slots], codes)
        assert torch.equal(scales[1, slots], row_scales)
        assert int(buffer.abs().max()) <= 127
        got = read(1, slots)
        assert got.dtype == dtype
        assert torch.equal(got, (codes.float() * row_scales[..., None]).to(dtype))
        # within half a step of what was stored (plus the model dtype's own rounding)
        half_step = row_scales[..., None].double() * 0.5
        ulp = 2.0**-8 if dtype == torch.bfloat16 else 2.0**-23
        assert ((got.double() - x.double()).abs()
                <= half_step * 1.001 + x.double().abs() * ulp).all()
    assert pool.k_scale[1, 7, 0] == 1.0 and not pool.k_buffer[1, 7, 0].any()  # all-zero row
    assert not pool.read_k(1, torch.tensor([7]))[0, 0].any()
    others = torch.tensor([1, 2, 4, 5, 6, 8])
    for layer, rows in ((1, others), (0, torch.arange(10))):
        assert not pool.read_k(layer, rows).any() and not pool.read_v(layer, rows).any()
        assert not pool.k_buffer[layer, rows].any() and not pool.v_buffer[layer, rows].any()
        assert not pool.k_scale[layer, rows].any() and not pool.v_scale[layer, rows].any()


def test_an_int8_pool_overwrites_a_row_with_its_new_scale():
    """A slot stored again (freed and reused) takes the new row's codes and scale wholly."""
    pool = KVPool(1, 4, 1, 16, torch.float32, kv_dtype=torch.int8)
    big, small = torch.full((1, 1, 16), 1000.0), torch.linspace(-1, 1, 16).view(1, 1, 16)
    slot = torch.tensor([2])
    pool.store(0, slot, big, big)
    pool.store(0, slot, small, torch.zeros(1, 1, 16))
    assert pool.k_scale is not None and pool.v_scale is not None
    assert pool.k_scale[0, 2, 0] == torch.tensor(1.0) / 127 and pool.v_scale[0, 2, 0] == 1.0
    torch.testing.assert_close(pool.read_k(0, slot), small, atol=0.5 / 127, rtol=0)
    assert not pool.read_v(0, slot).any()


def test_an_int8_pool_counts_its_scales_in_the_bytes_per_token():
    """bytes_per_token of int8: head_dim code bytes plus a 4-byte scale per (layer, KV head),
    K and V: a bit over half a bf16 pool's; what its buffers and scales allocate."""
    assert KVPool.bytes_per_token(30, 3, 64, torch.int8) == 2 * 30 * 3 * (64 + 4)
    assert KVPool.bytes_per_token(2, 1, 128, torch.int8) == 2 * 2 * 1 * (128 + 4)
    bf16 = KVPool.bytes_per_token(30, 3, 64, torch.bfloat16)
    assert KVPool.bytes_per_token(30, 3, 64, torch.int8) * 2 == bf16 + 2 * 2 * 30 * 3 * 4
    pool = KVPool(30, 100, 3, 64, torch.bfloat16, kv_dtype=torch.int8)
    assert pool.k_scale is not None and pool.v_scale is not None
    allocated = sum(x.untyped_storage().nbytes()
                    for x in (pool.k_buffer, pool.v_buffer, pool.k_scale, pool.v_scale))
    assert allocated == (100 + 1) * KVPool.bytes_per_token(30, 3, 64, torch.int8)


CAPACITY = 16


class AllocatorMachine(RuleBasedStateMachine):
    """Random allocate/free against a brute-force model of the policy: slots come from a sorted
    run of free slots; freed ones join it, sorted, when it is too short for an allocation."""

    def __init__(self):
        super().__init__()
        self.alloc = SlotAllocator(CAPACITY)
        self.held: list[int] = []
        self.run = list(range(CAPACITY))
        self.released: list[int] = []

    @rule(n=st.integers(0, CAPACITY + 2))
    def allocate(self, n):
        if n > CAPACITY - len(self.held):
            with pytest.raises(KVCacheFullError):
                self.alloc.allocate(n)
            return
        if n > len(self.run):
            self.run, self.released = sorted(self.run + self.released), []
        expected, self.run = self.run[:n], self.run[n:]
        slots = self.alloc.allocate(n).tolist()
        assert slots == expected
        self.held += slots

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def free(self, data):
        picked = data.draw(st.lists(st.sampled_from(self.held), min_size=1, unique=True))
        self.alloc.free(torch.tensor(picked))
        self.held = [s for s in self.held if s not in picked]
        self.released += picked

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def double_free_asserts(self, data):
        slot = data.draw(st.sampled_from(sorted(set(range(CAPACITY)) - set(self.held)) or [-1]))
        with pytest.raises(AssertionError):
            self.alloc.free(torch.tensor([slot]))

    @rule()
    def reset(self):
        self.alloc.reset()
        self.held, self.run, self.released = [], list(range(CAPACITY)), []

    @invariant()
    def matches_model(self):
        self.alloc.check_invariants()
        free = self.alloc.free_slots().tolist()
        assert self.alloc.num_free == len(free) == CAPACITY - len(self.held)
        assert set(free) == set(range(CAPACITY)) - set(self.held)


AllocatorMachine.TestCase.settings = settings(
    max_examples=100, stateful_step_count=30, deadline=None
)
test_allocator_machine = AllocatorMachine.TestCase
