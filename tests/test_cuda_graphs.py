"""The decode graph runner (runtime/forward/cuda_graphs.py) on the CPU: bucketing, padding and static
buffers with a fake forward, then the whole engine with eager stand-ins for graph replays, whose
greedy tokens must equal the plain engine's through changing batch sizes."""

from __future__ import annotations

import pytest
import torch

from forklm.runtime.config import EngineConfig
from forklm.runtime.errors import InvalidArgumentError
from forklm.runtime.forward.batch import ForwardBatch
from forklm.runtime.forward.cuda_graphs import (
    DecodeGraphRunner,
    EagerGraph,
    StaticDecodeBuffers,
    graph_batch_sizes,
)
from forklm.runtime.sampling.params import SamplingParams
from tests.conftest import assert_idle_and_clean

SCRATCH = 99


def decode_batch(kv_lens: list[int], first_slot: int = 0) -> ForwardBatch:
    """A decode batch whose request b has context slots first_slot + 10 * b + [0, kv_len)."""
    n, width = len(kv_lens), max(kv_lens)
    table = torch.zeros(n, width, dtype=torch.int64)
    for b, length in enumerate(kv_lens):
        table[b, :length] = first_slot + 10 * b + torch.arange(length)
    lens = torch.tensor(kv_lens)
    return ForwardBatch(
        input_ids=torch.arange(n) + 7, positions=lens - 1,
        out_slots=table[torch.arange(n), lens - 1], q_lens=torch.ones(n, dtype=torch.int64),
        kv_lens=lens, slot_table=table, q_index=torch.arange(n)[:, None],
        logits_indices=torch.arange(n), max_q_len=1, is_decode=True)


class FakeForward:
    """Logits that depend on every input a decode forward reads (so a wrong copy shows), and a
    record of the batch sizes it ran at."""

    def __init__(self) -> None:
        self.sizes: list[int] = []

    def __call__(self, fb: ForwardBatch) -> torch.Tensor:
        self.sizes.append(fb.batch_size)
        rows = torch.arange(fb.slot_table.shape[1])[None, :] < fb.kv_lens[:, None]
        context = (fb.slot_table * rows).sum(dim=1)  # only the visible slots count
        features = torch.stack([fb.input_ids, fb.positions, fb.out_slots, fb.kv_lens, context], 1)
        return features.float()


def test_buckets_follow_sglangs_spacing_and_end_at_max_bs():
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(8) == [1, 2, 4, 8]
    assert graph_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert graph_batch_sizes(160)[-3:] == [144, 152, 160]
    with pytest.raises(ValueError):
        graph_batch_sizes(0)


def test_buffers_hold_the_batch_left_aligned_and_pad_the_rest_with_the_scratch_slot():
    buffers = StaticDecodeBuffers(max_bs=4, max_context=8, scratch_slot=SCRATCH,
                                  device=torch.device("cpu"))
    batch = decode_batch([3, 5])
    buffers.fill(batch)
    static = buffers.batch(4)
    assert static.input_ids[:2].tolist() == batch.input_ids.tolist()
    assert static.slot_table[:2, :5].tolist() == batch.slot_table.tolist()
    assert static.out_slots[2:].tolist() == [SCRATCH] * 2
    assert static.kv_lens[2:].tolist() == [1, 1] and static.positions[2:].tolist() == [0, 0]
    assert (static.slot_table[2:] == SCRATCH).all()
    assert static.logits_indices.tolist() == [0, 1, 2, 3] and static.q_index.shape == (4, 1)


def test_runner_pads_to_the_smallest_bucket_and_returns_only_the_real_rows():
    forward = FakeForward()
    runner = DecodeGraphRunner(forward, max_bs=8, max_context=16, scratch_slot=SCRATCH,
                               device=torch.device("cpu"), new_graph=EagerGraph)
    runner.capture()
    assert sorted(runner.graphs) == [1, 2, 4, 8] and forward.sizes == [8, 4, 2, 1]
    for lens in ([4], [2, 9], [3, 3, 3], [1, 2, 3, 4, 5], [16] * 8):
        batch = decode_batch(lens, first_slot=len(lens))
        assert runner.can_run(batch)
        expected = FakeForward()(batch)
        out = runner.run(batch)
        assert forward.sizes[-1] == runner.bucket(len(lens))
        assert torch.equal(out, expected)
    out.add_(1)  # the caller owns its rows: the next replay must not see them, nor they it
    assert torch.equal(runner.run(decode_batch([16] * 8, 8)), FakeForward()(decode_batch([16] * 8, 8)))
    assert runner.replays == 6


def test_runner_refuses_what_no_graph_holds():
    runner = DecodeGraphRunner(FakeForward(), max_bs=4, max_context=8, scratch_slot=SCRATCH,
                               device=torch.device("cpu"), new_graph=EagerGraph)
    runner.capture()
    assert not runner.can_run(decode_batch([2] * 5))  # more requests than the largest bucket
    assert not runner.can_run(decode_batch([9]))  # a context wider than the tables
    prefill = decode_batch([3, 3])
    prefill.is_decode = False
    assert not runner.can_run(prefill)


def test_cuda_graph_max_bs_is_checked():
    with pytest.raises(InvalidArgumentError, match="cuda_graph_max_bs"):
        EngineConfig(cuda_graph_max_bs=0)


@pytest.mark.slow
def test_engine_tokens_with_graph_replays_equal_the_plain_engine(make_engine):
    """Requests of different lengths finish at different steps, so decode batches shrink through
    the buckets (11 -> padded to 16, then 8, 4, 2, 1); four of equal length fill bucket 4
    exactly, where every context is as long as the others but not as wide as the table."""
    plain = make_engine(context_length=64, max_total_tokens=2048)
    graphs = make_engine(context_length=64, max_total_tokens=2048, debug_eager_cuda_graph=True,
                         cuda_graph_max_bs=16)
    assert graphs.parts.runner.graphs is not None
    prompts = [f"Question {i}: what is {i} plus {i}? Answer:" for i in range(11)]
    params = [SamplingParams(max_new_tokens=2 + 2 * i, temperature=0.0, ignore_eos=True)
              for i in range(11)]
    same_length = ["The sky is", "The sea is", "The sun is", "The day is"]
    for batch, sampling in ((prompts, params), (same_length, SamplingParams(
            max_new_tokens=6, temperature=0.0, ignore_eos=True))):
        want = [o["output_ids"] for o in plain.generate(batch, sampling)]
        got = [o["output_ids"] for o in graphs.generate(batch, sampling)]
        assert got == want
    assert graphs.parts.runner.graphs.replays > 20
    assert_idle_and_clean(graphs)
