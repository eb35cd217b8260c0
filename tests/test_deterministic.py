"""enable_deterministic_inference: a request's logits, bit for bit, do not depend on the batch it
runs in, on prefill chunking or on radix-cache hits (batch_invariant.py, attention_invariant.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from forklm.runtime.attention.backends import AttentionLayerSpec, TorchAttention
from forklm.runtime.attention.batch_invariant import KEY_CHUNK, BatchInvariantAttention
from forklm.runtime.config import EngineConfig
from forklm.runtime.errors import InvalidArgumentError
from forklm.runtime.forward.batch import ForwardBatch
from forklm.runtime.kvcache.pool import KVPool
from forklm.runtime.models.batch_invariant import RowTiled, make_batch_invariant, tiled_rows
from forklm.runtime.models.fp16_linear import Fp16WeightLinear, fp16_weights_available
from forklm.runtime.models.layers import alibi_slopes
from forklm.runtime.models.moe import SparseMoE
from forklm.runtime.models.spec import MoESpec
from tests.conftest import EVAL_QUESTIONS, assert_idle_and_clean

BATCH_SIZES = (1, 2, 3, 5, 7, 8, 13, 16, 31)


def _linears() -> dict[str, nn.Module]:
    torch.manual_seed(0)
    out = {"fp32": nn.Linear(576, 1536), "bf16": nn.Linear(576, 1536).bfloat16()}
    if fp16_weights_available():
        layer = nn.Linear(576, 1536)
        out["fp16 weights"] = Fp16WeightLinear(layer.weight, layer.bias)
    return out


@pytest.mark.parametrize("kind", list(_linears()))
@torch.inference_mode()
def test_row_tiled_linear_gives_each_row_the_same_bits_at_every_batch_size(kind):
    layer = _linears()[kind]
    dtype = torch.bfloat16 if kind == "bf16" else torch.float32
    x = torch.randn(40, 576).to(dtype)
    tiled = RowTiled(layer)
    alone = torch.cat([tiled(x[i:i + 1]) for i in range(len(x))])
    for m in BATCH_SIZES:
        assert torch.equal(tiled(x[:m]), alone[:m]), f"rows differ at batch {m}"
        assert torch.equal(tiled(x[m:m + 9]), alone[m:m + 9]), f"rows moved by {m} differ"
    assert torch.allclose(tiled(x).float(), layer(x).float(), atol=1e-2 if kind == "bf16" else 1e-5)


def test_tiled_rows_pads_to_whole_tiles_and_drops_the_padding():
    seen = []

    def fn(t: torch.Tensor) -> torch.Tensor:
        seen.append(t.shape[0])
        return t * 2

    x = torch.arange(10.0)[:, None]
    assert torch.equal(tiled_rows(fn, x, rows=4), x * 2)
    assert seen == [4, 4, 4]


@torch.inference_mode()
def test_mixture_experts_multiply_in_fixed_tiles():
    torch.manual_seed(0)
    moe = SparseMoE(64, MoESpec(num_experts=4, top_k=2, intermediate_size=96, renormalize=True,
                                shared_intermediate_size=0), torch.nn.functional.silu, None)
    for p in moe.parameters():
        nn.init.normal_(p, std=0.1)
    make_batch_invariant(moe)
    assert isinstance(moe.gate, RowTiled)
    x = torch.randn(24, 64)
    alone = torch.cat([moe(x[i:i + 1]) for i in range(24)])
    for m in (2, 5, 11, 24):  # a batch changes how many tokens each expert multiplies
        assert torch.equal(moe(x[:m]), alone[:m])


# --- attention over a random pool --------------------------------------------------------------

HEADS, KV_HEADS, HEAD_DIM = 6, 2, 16


def _pool() -> KVPool:
    torch.manual_seed(1)
    pool = KVPool(1, 4096, KV_HEADS, HEAD_DIM, torch.float32, "cpu")
    pool.k_buffer.normal_()
    pool.v_buffer.normal_()
    return pool


def _batch(tables: list[torch.Tensor], q_lens: list[int]) -> ForwardBatch:
    """Requests whose contexts are `tables` (slots), the last q_len of each computed now."""
    kv_lens = [len(t) for t in tables]
    width, max_q = max(kv_lens), max(q_lens)
    slot_table = torch.zeros(len(tables), width, dtype=torch.int64)
    for b, t in enumerate(tables):
        slot_table[b, :len(t)] = t
    positions = torch.cat([torch.arange(kv - q, kv) for kv, q in zip(kv_lens, q_lens)])
    offsets = torch.tensor([0, *q_lens[:-1]]).cumsum(0)
    q_index = torch.minimum(offsets[:, None] + torch.arange(max_q)[None],
                            (offsets + torch.tensor(q_lens) - 1)[:, None])
    return ForwardBatch(
        input_ids=torch.zeros(sum(q_lens), dtype=torch.int64), positions=positions,
        out_slots=torch.cat([t[len(t) - q:] for t, q in zip(tables, q_lens)]),
        q_lens=torch.tensor(q_lens), kv_lens=torch.tensor(kv_lens), slot_table=slot_table,
        q_index=q_index, logits_indices=torch.zeros(0, dtype=torch.int64), max_q_len=max_q,
        is_decode=max_q == 1)


def _run(attn, pool: KVPool, batch: ForwardBatch, q: torch.Tensor, seed: int = 2) -> torch.Tensor:
    """One layer's attention for `batch` with queries q; the new K/V are the pool's own values at
    those slots, so every run sees the same context."""
    k = pool.k_buffer[0][batch.out_slots].clone()
    v = pool.v_buffer[0][batch.out_slots].clone()
    return attn.forward(0, q, k, v, attn.prepare(batch))


@pytest.mark.parametrize("layers", [
    None, [AttentionLayerSpec(sliding_window=40, softcap=20.0)],
    [AttentionLayerSpec(sliding_window=40, alibi_slopes=alibi_slopes(HEADS))],
    # gpt-oss's sinks, large enough to take a real share of each row's softmax
    [AttentionLayerSpec(sliding_window=40, sinks=torch.linspace(-2.0, 3.0, HEADS))],
    [AttentionLayerSpec(sliding_window=40, alibi_slopes=alibi_slopes(HEADS),
                        sinks=torch.linspace(-2.0, 3.0, HEADS))]],
                         ids=["causal", "window+softcap", "window+alibi", "window+sinks",
                              "window+alibi+sinks"])
@torch.inference_mode()
def test_a_query_row_has_the_same_bits_alone_batched_padded_and_in_a_prefill(layers):
    pool = _pool()
    attn = BatchInvariantAttention(pool, HEADS, KV_HEADS, HEAD_DIM, layers)
    ref = TorchAttention(pool, HEADS, KV_HEADS, HEAD_DIM, layers)
    lengths = [150, 3, KEY_CHUNK, 2 * KEY_CHUNK + 17, 90]
    tables = [torch.randperm(4096)[:n] for n in lengths]
    queries = [torch.randn(n, HEADS, HEAD_DIM) for n in lengths]  # one per context position
    # Decode of the last token, each request alone:
    alone = [_run(attn, pool, _batch([t], [1]), qs[-1:]) for t, qs in zip(tables, queries)]
    # ... and all together (every context padded to the longest):
    together = _run(attn, pool, _batch(tables, [1] * len(tables)), torch.cat([qs[-1:] for qs in queries]))
    for b, out in enumerate(alone):
        assert torch.equal(together[b:b + 1], out), f"request {b} differs in a batch"
        expected = _run(ref, pool, _batch([tables[b]], [1]), queries[b][-1:])
        assert torch.allclose(out, expected, atol=1e-5), "not the attention TorchAttention computes"
    # A prefill of whole contexts (two requests, ragged) gives every row its decode bits:
    pre = _run(attn, pool, _batch([tables[0], tables[3]], [150, lengths[3]]),
               torch.cat([queries[0], queries[3]]))
    for b, (start, n) in enumerate([(0, 150), (150, lengths[3])]):
        for pos in (0, 1, n // 2, n - 1):
            row = _run(attn, pool, _batch([tables[(0, 3)[b]][:pos + 1]], [1]),
                       queries[(0, 3)[b]][pos:pos + 1])
            assert torch.equal(pre[start + pos:start + pos + 1], row), f"prefill row {pos} differs"
    # ... and a prefill chunk after a cached prefix gives the same rows as the whole prefill:
    tail = _run(attn, pool, _batch([tables[3]], [70]), queries[3][-70:])
    assert torch.equal(tail, pre[-70:])


def test_deterministic_inference_refuses_the_triton_backend():
    with pytest.raises(InvalidArgumentError, match="attention_backend"):
        EngineConfig(enable_deterministic_inference=True, attention_backend="triton")


# --- the default model --------------------------------------------------------------------------

SAMPLING = {"max_new_tokens": 24, "temperature": 0}


@pytest.fixture(scope="module")
def engine(make_engine):
    # dtype auto: float16 weights on an AVX2 CPU, bf16 with AVX-512-bf16: the dtypes whose
    # greedy output otherwise depends on the batch. Small prefill chunks so that chunking is
    # exercised too.
    return make_engine(dtype="auto", enable_deterministic_inference=True, chunked_prefill_size=32)


def _logprobs(result: dict) -> list[float]:
    return [entry[0] for entry in result["meta_info"]["output_token_logprobs"]]


@pytest.mark.slow
def test_output_is_bit_identical_alone_and_in_batches(engine):
    prompts = EVAL_QUESTIONS
    alone = [engine.generate(p, SAMPLING, return_logprob=True) for p in prompts[:3]]
    batched = engine.generate(prompts, SAMPLING, return_logprob=True)
    again = engine.generate(prompts[2::-1], SAMPLING, return_logprob=True)[::-1]  # cached prompts
    for a, b, c in zip(alone, batched, again):
        assert a["output_ids"] == b["output_ids"] == c["output_ids"]
        assert _logprobs(a) == _logprobs(b) == _logprobs(c)  # exact floats, not approximately
    assert_idle_and_clean(engine)


@pytest.mark.slow
def test_prefill_of_a_generated_text_reproduces_its_decode_logprobs(engine, tokenizer):
    """The prompt plus its output, prefilled (in chunks of 32, nothing cached) scores each output
    token exactly as decoding did: prefill and decode compute a position alike."""
    prompt = tokenizer.encode("Explain what a radix tree is in two sentences.")
    out = engine.generate(input_ids=prompt, sampling_params=SAMPLING, return_logprob=True)
    engine.flush_cache()
    rescored = engine.generate(input_ids=prompt + out["output_ids"],
                               sampling_params={"max_new_tokens": 1}, return_logprob=True,
                               logprob_start_len=len(prompt))
    got = [entry[0] for entry in rescored["meta_info"]["input_token_logprobs"]]
    assert got == _logprobs(out)


@pytest.mark.slow
def test_seeded_sampling_is_identical_alone_and_batched(engine):
    params = {"max_new_tokens": 16, "temperature": 0.9, "top_p": 0.95, "sampling_seed": 7}
    alone = engine.generate(EVAL_QUESTIONS[1], params)
    batched = engine.generate(EVAL_QUESTIONS[:6], params)
    assert batched[1]["output_ids"] == alone["output_ids"]
