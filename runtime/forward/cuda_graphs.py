"""Decode steps replayed from captured CUDA graphs (SGLang's cuda graph runner, issue 20).

A decode step launches hundreds of small kernels from Python; on a GPU that launch overhead, not
the math, bounds small batches. The decode forward is captured once per batch-size bucket on
static input buffers; a step copies its batch into the buffers of the smallest bucket that holds
it, pads the rest, replays the graph and keeps its own rows of the output.

Padding rows must not disturb real ones: each is a one-token context whose key and value are
written to and read from the pool's scratch slot (one row past every allocatable slot), and its
logits are dropped. Slot tables are as wide as the longest context the runner serves, so one
graph serves every context length.

`Graph` is the capture interface: `CudaGraph` on a GPU; `EagerGraph` re-runs the captured
function on the same buffers, which lets the CPU test the bucketing, padding and buffer handling
(the step's tokens must equal the plain forward's).
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable
from typing import Any, Protocol

import torch

from forklm.runtime.forward.batch import ForwardBatch

logger = logging.getLogger(__name__)

Forward = Callable[[ForwardBatch], torch.Tensor]  # a decode batch -> logits [batch, vocab]


def graph_batch_sizes(max_bs: int) -> list[int]:
    """The buckets captured for batches up to max_bs: 1, 2, 4, 8, then every 8 (SGLang's
    spacing), and max_bs itself."""
    if max_bs < 1:
        raise ValueError(f"cuda_graph_max_bs must be >= 1, got {max_bs}")
    sizes = [s for s in (1, 2, 4) if s < max_bs] + list(range(8, max_bs, 8))
    return sorted({*sizes, max_bs})


class Graph(Protocol):
    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        """Record fn; returns its output tensor, which every replay overwrites in place."""
        ...

    def replay(self) -> None: ...


class CudaGraph:
    """torch.cuda.CUDAGraph around one function: warmed up on a side stream, then captured."""

    def __init__(self, pool: Any = None):
        self.graph = torch.cuda.CUDAGraph()
        self.pool = pool  # graphs share one memory pool (buckets never run at once)

    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # allocator and autotuning settle before capture
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        with torch.cuda.graph(self.graph, pool=self.pool):
            out = fn()
        return out

    def replay(self) -> None:
        self.graph.replay()


class EagerGraph:
    """A stand-in for CudaGraph on the CPU: replay runs the function again on the same static
    buffers and writes into the output captured first, as a graph replay would."""

    def __init__(self) -> None:
        self.fn: Callable[[], torch.Tensor] | None = None
        self.out: torch.Tensor | None = None

    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        self.fn, self.out = fn, fn()
        return self.out

    def replay(self) -> None:
        assert self.fn is not None and self.out is not None, "replay before capture"
        with torch.inference_mode():  # `out` was made in inference mode, at capture
            self.out.copy_(self.fn())


class StaticDecodeBuffers:
    """The inputs of the largest bucket; a bucket of size n uses the first n rows."""

    def __init__(self, max_bs: int, max_context: int, scratch_slot: int, device: torch.device):
        def zeros(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.int64, device=device)

        self.max_bs, self.max_context, self.scratch_slot = max_bs, max_context, scratch_slot
        self.input_ids, self.positions, self.out_slots = zeros(max_bs), zeros(max_bs), zeros(max_bs)
        self.kv_lens = zeros(max_bs)
        self.slot_table = zeros(max_bs, max_context)
        self.q_lens = torch.ones(max_bs, dtype=torch.int64, device=device)
        self.rows = torch.arange(max_bs, dtype=torch.int64, device=device)
        self.pad()

    def pad(self, start: int = 0) -> None:
        """Rows from `start` on become padding: a one-token context in the scratch slot."""
        self.input_ids[start:] = 0
        self.positions[start:] = 0
        self.out_slots[start:] = self.scratch_slot
        self.kv_lens[start:] = 1
        self.slot_table[start:] = self.scratch_slot

    def fill(self, batch: ForwardBatch) -> None:
        """Copy a decode batch into the first rows (its slot table left-aligned; columns past a
        context are never read: attention masks by kv_lens) and pad the rest."""
        n, width = batch.batch_size, batch.slot_table.shape[1]
        self.input_ids[:n].copy_(batch.input_ids)
        self.positions[:n].copy_(batch.positions)
        self.out_slots[:n].copy_(batch.out_slots)
        self.kv_lens[:n].copy_(batch.kv_lens)
        self.slot_table[:n, :width].copy_(batch.slot_table)
        self.pad(n)

    def batch(self, size: int) -> ForwardBatch:
        """The static ForwardBatch of bucket `size` (views of the buffers: what a graph reads)."""
        return ForwardBatch(
            input_ids=self.input_ids[:size], positions=self.positions[:size],
            out_slots=self.out_slots[:size], q_lens=self.q_lens[:size],
            kv_lens=self.kv_lens[:size], slot_table=self.slot_table[:size],
            q_index=self.rows[:size, None], logits_indices=self.rows[:size], max_q_len=1,
            is_decode=True)


class DecodeGraphRunner:
    """Captures `forward` for each bucket up to max_bs and replays it for decode batches."""

    def __init__(self, forward: Forward, max_bs: int, max_context: int, scratch_slot: int,
                 device: torch.device, new_graph: Callable[[], Graph]):
        self.forward, self.sizes = forward, graph_batch_sizes(max_bs)
        self.buffers = StaticDecodeBuffers(max_bs, max_context, scratch_slot, device)
        self.new_graph = new_graph
        self.graphs: dict[int, tuple[Graph, torch.Tensor]] = {}
        self.replays = 0  # steps served from a graph (for stats and tests)

    def capture(self) -> None:
        """Capture every bucket, largest first (later, smaller graphs reuse its memory)."""
        for size in reversed(self.sizes):
            self.buffers.pad()
            graph = self.new_graph()
            # Fresh views of the same buffers at every call: a graph replays the ops, but an
            # eager re-run must not hit per-batch caches keyed on the tensors (the rotary rows).
            out = graph.capture(lambda size=size: self.forward(  # type: ignore[misc]
                self.buffers.batch(size)))
            self.graphs[size] = (graph, out)

    def bucket(self, batch_size: int) -> int | None:
        """The smallest captured size that holds the batch; None when none does."""
        i = bisect.bisect_left(self.sizes, batch_size)
        return self.sizes[i] if i < len(self.sizes) else None

    def can_run(self, batch: ForwardBatch) -> bool:
        return (batch.is_decode and self.bucket(batch.batch_size) is not None
                and batch.rope_positions is None  # the graphs read the plain positions
                and batch.slot_table.shape[1] <= self.buffers.max_context
                and int(batch.logits_indices.numel()) == batch.batch_size)

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits of a decode batch (one row per request), replayed from its bucket's graph."""
        size = self.bucket(batch.batch_size)
        assert size is not None, "run() needs a batch can_run() accepts"
        graph, out = self.graphs[size]
        self.buffers.fill(batch)
        graph.replay()
        self.replays += 1
        return out[: batch.batch_size].clone()  # the next replay overwrites `out`
