"""Paged KV memory with page size 1: a slot allocator and per-layer K/V buffers addressed by slot.

A slot is one token's K and V in every layer; the radix cache and requests hold slot indices.
The buffers hold the model's dtype, or 8 bits a value (--kv-cache-dtype): SGLang's fp8_e5m2 /
fp8_e4m3 (each value rounded to 2-3 mantissa bits), or int8 codes with one float32 scale per
token and KV head (max |x| / 127: the head's largest value keeps 8 bits, small ones are exact
to 1/254 of it). About half the bytes per token: twice the cached tokens per GB and half the
bytes decode attention reads.
"""

from __future__ import annotations

import math
import mmap

import torch

from forklm.runtime.errors import KVCacheFullError


class SlotAllocator:
    """Free list of KV slot indices in [0, capacity), handed out in ascending runs.

    Allocation takes the lowest slots of a sorted run of free slots (`_run[_head:_tail]`); freed
    slots wait in `_released` until the run cannot satisfy an allocation, and then both are merged
    into one sorted run (SGLang's allocator does the same). Why: decode attention reads a request's
    KV in token order, and slots in ascending runs read as streams; a LIFO stack, after a busy
    period, hands out slots scattered over the pool, which attention reads 2.3-2.6x slower
    (benchmarks/NOTES.md). Each operation is a slice plus a few vectorized ops, O(n) in the slots
    moved; a merge sorts the free slots, at most once per `capacity` slots allocated plus once per
    allocation that finds the run short. `_is_free` mirrors the free slots as a mask so double
    frees are caught without a Python loop. Slots live on the CPU; callers move them to the device
    where the KV buffers are.
    """

    def __init__(self, capacity: int):
        assert capacity >= 0, f"capacity must be >= 0, got {capacity}"
        self.capacity = capacity
        self._run = torch.empty(capacity, dtype=torch.int64)
        self._released = torch.empty(capacity, dtype=torch.int64)
        self._is_free = torch.empty(capacity, dtype=torch.bool)
        self._head = self._tail = self._num_released = 0
        self.reset()

    @property
    def num_free(self) -> int:
        return self._tail - self._head + self._num_released

    def allocate(self, n: int) -> torch.Tensor:
        """Take `n` distinct free slots (int64 [n], ascending); raises KVCacheFullError if fewer
        are free.

        The caller owns the returned slots until it frees them or hands them to the radix cache.
        """
        assert n >= 0, f"cannot allocate {n} slots"
        if n > self.num_free:
            raise KVCacheFullError(
                f"need {n} KV slots but only {self.num_free} of {self.capacity} are free"
            )
        if n > self._tail - self._head:
            self._merge_released()
        slots = self._run[self._head : self._head + n].clone()
        self._head += n
        self._is_free[slots] = False
        return slots

    def free(self, slots: torch.Tensor) -> None:
        """Return owned slots to the free list; a double free or out-of-range slot asserts."""
        slots = slots.reshape(-1).to(device="cpu", dtype=torch.int64)
        n = slots.numel()
        if n == 0:
            return
        out_of_range = (slots < 0) | (slots >= self.capacity)
        assert not bool(out_of_range.any()), (
            f"freeing slots outside [0, {self.capacity}): {slots[out_of_range].tolist()}"
        )
        already_free = self._is_free[slots]
        assert not bool(already_free.any()), f"double free of slots {slots[already_free].tolist()}"
        assert n == 1 or torch.unique(slots).numel() == n, (
            f"slots freed twice in one call: {slots.tolist()}"
        )
        self._released[self._num_released : self._num_released + n] = slots
        self._num_released += n
        self._is_free[slots] = True

    def _merge_released(self) -> None:
        """One sorted run of every free slot, at the start of `_run`."""
        free = self.free_slots()
        self._tail = free.numel()
        self._run[: self._tail] = torch.sort(free).values
        self._head = self._num_released = 0

    def free_slots(self) -> torch.Tensor:
        """A copy of the free slots (int64, the run then the released ones), for merges and
        invariant checks; not for the hot path."""
        return torch.cat([self._run[self._head : self._tail],
                          self._released[: self._num_released]])

    def reset(self) -> None:
        """Mark every slot free; any slot held elsewhere becomes invalid."""
        torch.arange(self.capacity, dtype=torch.int64, out=self._run)
        self._is_free.fill_(True)
        self._head, self._tail, self._num_released = 0, self.capacity, 0

    def check_invariants(self) -> None:
        """The free slots are distinct and in range, the run is sorted, and the free mask
        agrees."""
        free = self.free_slots()
        run = self._run[self._head : self._tail]
        assert torch.unique(free).numel() == free.numel(), "free list holds a slot twice"
        assert bool(((free >= 0) & (free < self.capacity)).all()), "free slot out of range"
        assert bool((run[1:] > run[:-1]).all()), "the free run is not ascending"
        assert int(self._is_free.sum()) == free.numel(), (
            f"free mask counts {int(self._is_free.sum())} slots, free list holds {free.numel()}"
        )
        assert bool(self._is_free[free].all()), "free list slot not marked free"


# 8-bit float KV formats: torch has no index_copy_/index_select for them, so the pool moves
# their bytes as uint8. Stores saturate at the format's largest value (e4m3fn has no inf, and an
# e5m2 inf would turn a softmax into NaN); no scale is applied (SGLang's default of 1.0).
FP8_KV_DTYPES = (torch.float8_e5m2, torch.float8_e4m3fn)
# int8 codes, each K/V row (one token's head) with its own float32 scale beside the pool.
INT8_LEVELS = 127


class KVPool:
    """Preallocated K/V for all layers, addressed by slot; slot ownership lives in `allocator`.

    `dtype` is what attention computes in (the model's); `kv_dtype` what the buffers hold: the
    same, or an 8-bit format (a float, or int8 codes with row scales) that store() rounds to and
    read_k()/read_v() widen back from."""

    def __init__(
        self,
        num_layers: int,
        capacity: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: str | torch.device = "cpu",
        kv_dtype: torch.dtype | None = None,
    ):
        self.num_layers = num_layers
        self.capacity = capacity
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.kv_dtype = kv_dtype or dtype
        assert self.kv_dtype in (dtype, torch.int8, *FP8_KV_DTYPES), (
            f"a KV pool holds the model's dtype, an 8-bit float or int8, not {self.kv_dtype}")
        self.narrow = self.kv_dtype != dtype  # 8-bit buffers, widened on reading
        self.device = torch.device(device)
        # One row past the allocatable slots that no request ever owns: the padding rows of a
        # captured decode batch write their K/V there (runtime/forward/cuda_graphs.py).
        self.scratch_slot = capacity
        shape = (num_layers, capacity + 1, num_kv_heads, head_dim)
        # Plain pages: 2 MiB ones made decode 4% faster at batch 16 but stalled allocation for up
        # to 9 s in direct compaction (kernels/cpu/huge_pages.py), once per engine.
        self.k_buffer = _reserved_zeros(shape, self.kv_dtype, self.device)
        self.v_buffer = _reserved_zeros(shape, self.kv_dtype, self.device)
        # int8: each row's scale, [num_layers, capacity + 1, num_kv_heads] float32; else None
        self.k_scale = self.v_scale = None
        if self.kv_dtype == torch.int8:
            self.k_scale = _reserved_zeros(shape[:3], torch.float32, self.device)
            self.v_scale = _reserved_zeros(shape[:3], torch.float32, self.device)
        self.allocator = SlotAllocator(capacity)

    def store(self, layer_id: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write k, v ([n, num_kv_heads, head_dim]) into rows `slots` of layer `layer_id`, in place.

        The caller must own `slots` (allocated, not yet freed); k and v are cast to the pool's
        kv_dtype (an 8-bit float saturated at its largest value, int8 codes with their rows'
        scales; as the native kernels store).
        """
        n = slots.numel()
        expected = (n, self.num_kv_heads, self.head_dim)
        assert tuple(k.shape) == expected, f"k shape {tuple(k.shape)} != {expected}"
        assert tuple(v.shape) == expected, f"v shape {tuple(v.shape)} != {expected}"
        index = slots.reshape(-1).to(device=self.device, dtype=torch.int64)
        self._store(self.k_buffer[layer_id], _layer(self.k_scale, layer_id), index, k)
        self._store(self.v_buffer[layer_id], _layer(self.v_scale, layer_id), index, v)

    def _store(self, rows: torch.Tensor, scales: torch.Tensor | None, index: torch.Tensor,
               x: torch.Tensor) -> None:
        """x into one layer's `rows` (and an int8 pool's row `scales`) at `index`."""
        if not self.narrow:
            rows.index_copy_(0, index, x.to(self.kv_dtype))
        elif scales is not None:
            codes, scale = int8_rows(x)
            rows.index_copy_(0, index, codes)
            scales.index_copy_(0, index, scale)
        else:
            limit = torch.finfo(self.kv_dtype).max
            narrowed = x.clamp(-limit, limit).to(self.kv_dtype)
            rows.view(torch.uint8).index_copy_(0, index, narrowed.view(torch.uint8))

    def read_k(self, layer_id: int, index: torch.Tensor) -> torch.Tensor:
        """K rows `index` (int64 slots) of layer `layer_id` in the model's dtype."""
        return self._read(self.k_buffer[layer_id], _layer(self.k_scale, layer_id), index)

    def read_v(self, layer_id: int, index: torch.Tensor) -> torch.Tensor:
        """V rows `index` of layer `layer_id` in the model's dtype."""
        return self._read(self.v_buffer[layer_id], _layer(self.v_scale, layer_id), index)

    def _read(self, rows: torch.Tensor, scales: torch.Tensor | None,
              index: torch.Tensor) -> torch.Tensor:
        if not self.narrow:
            return rows.index_select(0, index)
        if scales is not None:  # int8: codes * their row's scale
            codes = rows.index_select(0, index).float()
            return (codes * scales.index_select(0, index)[..., None]).to(self.dtype)
        narrowed = rows.view(torch.uint8).index_select(0, index).view(self.kv_dtype)
        return narrowed.to(self.dtype)

    @staticmethod
    def bytes_per_token(
        num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        """Bytes one slot takes across all layers, K and V together (`dtype`: the buffers'; int8
        rows carry a float32 scale each)."""
        per_row = head_dim * dtype.itemsize + (4 if dtype == torch.int8 else 0)
        return 2 * num_layers * num_kv_heads * per_row


def _layer(scales: torch.Tensor | None, layer_id: int) -> torch.Tensor | None:
    """One layer of an int8 pool's row scales; None for a pool without them."""
    return None if scales is None else scales[layer_id]


def int8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., head_dim] -> (int8 codes of the same shape, float32 scales [...]): each row's
    scale is max |x| / 127 (1 for an all-zero row), its codes x / scale rounded to nearest even
    and clamped to +-127, computed in float32 as kernels/cpu/cpu_kernels.h's int8_from_values does."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / INT8_LEVELS, torch.ones_like(amax))
    # clamped: with a subnormal max |x| the rounded scale can make x / scale 127.5
    codes = torch.round(xf / scale[..., None]).clamp(-INT8_LEVELS, INT8_LEVELS)
    return codes.to(torch.int8), scale


def _reserved_zeros(shape: tuple[int, ...], dtype: torch.dtype,
                    device: torch.device) -> torch.Tensor:
    """A zero tensor. On the CPU its memory is reserved, not touched: an anonymous mapping whose
    pages the kernel supplies zeroed on first write, so a pool sized for the worst case costs
    no time at start and no resident memory until tokens fill it (torch.zeros writes every page:
    ~1 s and all of its RSS for a 2 GiB pool)."""
    nbytes = math.prod(shape) * dtype.itemsize
    if device.type != "cpu" or nbytes == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    # The tensor keeps the mapping alive (frombuffer holds the buffer) and unmaps it when freed.
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8).view(dtype).view(shape)
