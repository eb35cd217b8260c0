"""TritonAttention under TRITON_INTERPRET=1: equal to TorchAttention on engine-shaped batches, and
the engine gives the same greedy tokens with attention_backend="triton" as with "torch"."""

from __future__ import annotations

import dataclasses
import os

# Before anything imports Triton: @triton.jit reads it when the kernel modules are imported.
os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

from forklm.runtime.attention.backends import AttentionLayerSpec, TorchAttention  # noqa: E402
from forklm.runtime.attention.registry import create_attention_backend  # noqa: E402
from forklm.runtime.config import EngineConfig  # noqa: E402
from forklm.runtime.engine.engine import Engine  # noqa: E402
from forklm.runtime.errors import InvalidArgumentError  # noqa: E402
from forklm.runtime.forward.batch import ForwardBatch  # noqa: E402
from forklm.runtime.kvcache.pool import KVPool  # noqa: E402
from forklm.runtime.models.layers import alibi_slopes  # noqa: E402
from tests.conftest import hf_greedy  # noqa: E402
from tests.tiny_models import build_tiny_model  # noqa: E402

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 6, 2, 64


def make_forward_batch(gen: torch.Generator, kv_lens: list[int], q_lens: list[int],
                       capacity: int, shared: int = 0) -> ForwardBatch:
    """A batch as ModelRunner builds it: a padded slot table of scattered slots; the new tokens'
    slots are the last q_len of each row. The first `shared` slots are common to every request
    (a radix-cached prefix)."""
    perm = torch.randperm(capacity, generator=gen)
    common, perm = perm[:shared], perm[shared : shared + sum(kv_lens) - shared * len(kv_lens)]
    rows = [torch.cat((common, own)) for own in torch.split(perm, [n - shared for n in kv_lens])]
    table = torch.zeros(len(kv_lens), max(kv_lens), dtype=torch.int64)
    for b, slots in enumerate(rows):
        table[b, : kv_lens[b]] = slots
    q_lens_t = torch.tensor(q_lens)
    starts = torch.cumsum(q_lens_t, 0) - q_lens_t
    q_index = starts[:, None] + torch.arange(max(q_lens))[None, :]
    q_index = torch.minimum(q_index, (starts + q_lens_t - 1)[:, None])
    num_tokens = sum(q_lens)
    return ForwardBatch(
        input_ids=torch.zeros(num_tokens, dtype=torch.int64),
        positions=torch.cat([torch.arange(c - n, c) for c, n in zip(kv_lens, q_lens)]),
        out_slots=torch.cat([r[c - n :] for r, c, n in zip(rows, kv_lens, q_lens)]),
        q_lens=q_lens_t, kv_lens=torch.tensor(kv_lens), slot_table=table, q_index=q_index,
        logits_indices=torch.arange(num_tokens), max_q_len=max(q_lens),
        is_decode=all(n == 1 for n in q_lens),
    )


@pytest.mark.parametrize("alibi", [False, True], ids=["plain", "alibi"])
@pytest.mark.parametrize(("kv_lens", "q_lens"), [([7, 1, 130], [1, 1, 1]),
                                                 ([5, 1, 90, 40], [2, 1, 33, 40])],
                         ids=["decode", "extend"])
@pytest.mark.parametrize("layer", [
    AttentionLayerSpec(), AttentionLayerSpec(sinks=torch.linspace(-2.0, 3.0, NUM_HEADS)),
    # gpt-oss's sliding layers: a window shorter than the longer contexts and chunks
    AttentionLayerSpec(sliding_window=20, sinks=torch.linspace(-2.0, 3.0, NUM_HEADS))],
                         ids=["dense", "sinks", "window+sinks"])
def test_triton_backend_matches_torch_backend(kv_lens, q_lens, alibi, layer):
    gen = torch.Generator().manual_seed(len(kv_lens))
    capacity = 300
    batch = make_forward_batch(gen, kv_lens, q_lens, capacity)
    pools = [KVPool(2, capacity, NUM_KV_HEADS, HEAD_DIM, torch.float32) for _ in range(2)]
    for buf in ("k_buffer", "v_buffer"):  # the same cached prefixes in both pools
        fill = torch.randn(pools[0].k_buffer.shape, generator=gen)
        for pool in pools:
            getattr(pool, buf).copy_(fill)
    n = batch.num_tokens
    q = torch.randn(n, NUM_HEADS, HEAD_DIM, generator=gen)
    kv = torch.randn(n, 2 * NUM_KV_HEADS * HEAD_DIM, generator=gen)  # k, v as strided views
    k, v = (t.reshape(n, NUM_KV_HEADS, HEAD_DIM) for t in kv.chunk(2, dim=1))
    # ALiBi's slopes of 6 heads (4, then 2 more) on every layer, with the sinks or without
    slopes = alibi_slopes(NUM_HEADS) if alibi else None
    layers = [dataclasses.replace(spec, alibi_slopes=slopes) for spec in (AttentionLayerSpec(), layer)]
    backends = [TorchAttention(pools[0], NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, layers),
                create_attention_backend("triton", pools[1], NUM_HEADS, NUM_KV_HEADS, HEAD_DIM,
                                         layers)]
    outs = []
    for backend in backends:
        prepared = backend.prepare(batch)
        outs.append(backend.forward(1, q, k, v, prepared))
    assert outs[1].shape == (n, NUM_HEADS * HEAD_DIM)
    assert torch.allclose(outs[1], outs[0], atol=1e-5)
    assert torch.equal(pools[1].k_buffer, pools[0].k_buffer)
    assert torch.equal(pools[1].v_buffer, pools[0].v_buffer)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("kv_lens", "q_lens"), [([40, 41, 90], [1, 1, 1]),
                                                 ([60, 45, 90, 40], [2, 1, 33, 4])],
                         ids=["decode", "extend"])
def test_shared_prefix_split_equals_plain_attention(monkeypatch, kv_lens, q_lens, dtype):
    """With a common 36-slot prefix TorchAttention gathers it once (split path, with torch's
    flash op and with the plain-ops fallback); the result must equal the plain padded SDPA
    path's (split disabled), to rounding."""
    import forklm.runtime.attention.backends as attention

    gen = torch.Generator().manual_seed(7)
    batch = make_forward_batch(gen, kv_lens, q_lens, capacity=400, shared=36)
    pool = KVPool(2, 400, NUM_KV_HEADS, HEAD_DIM, dtype)
    pool.k_buffer.copy_(torch.randn(pool.k_buffer.shape, generator=gen))
    pool.v_buffer.copy_(torch.randn(pool.v_buffer.shape, generator=gen))
    n = batch.num_tokens
    q, k, v = (torch.randn(n, h, HEAD_DIM, generator=gen).to(dtype)
               for h in (NUM_HEADS, NUM_KV_HEADS, NUM_KV_HEADS))
    flash = attention._FLASH_WITH_LSE
    outs = []
    for min_shared, op in ((10**9, flash), (32, flash), (32, None)):  # plain, split, fallback
        monkeypatch.setattr(attention, "MIN_SHARED_PREFIX", min_shared)
        monkeypatch.setattr(attention, "_FLASH_WITH_LSE", op)
        backend = TorchAttention(pool, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM)
        backend.min_split_batch = 2
        prepared = backend.prepare(batch)
        assert (prepared.attn_meta.shared_slots is not None) == (min_shared == 32)
        outs.append(backend.forward(1, q, k, v, prepared).float())
    atol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(outs[1], outs[0], atol=atol, rtol=0)
    torch.testing.assert_close(outs[2], outs[0], atol=atol, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 20])
@pytest.mark.parametrize("alibi", [False, True], ids=["no-alibi", "alibi"])
def test_sinks_through_the_flash_op_equal_plain_ops(monkeypatch, window, dtype, alibi):
    """TorchAttention's sinks on the CPU flash op (output scaled by sigmoid(lse - sink)) equal
    the plain-ops softmax with the sink as one more column, on a prefill and a decode batch,
    with boolean masks or ALiBi's additive biases."""
    import forklm.runtime.attention.backends as attention

    gen = torch.Generator().manual_seed(5)
    slopes = alibi_slopes(NUM_HEADS) if alibi else None
    layers = [AttentionLayerSpec(alibi_slopes=slopes), AttentionLayerSpec(
        sliding_window=window, sinks=torch.linspace(-3.0, 4.0, NUM_HEADS), alibi_slopes=slopes)]
    for kv_lens, q_lens in (([5, 1, 90, 40], [2, 1, 33, 40]), ([7, 1, 130], [1, 1, 1])):
        batch = make_forward_batch(gen, kv_lens, q_lens, 300)
        pool = KVPool(2, 300, NUM_KV_HEADS, HEAD_DIM, dtype)
        pool.k_buffer.copy_(torch.randn(pool.k_buffer.shape, generator=gen))
        pool.v_buffer.copy_(torch.randn(pool.v_buffer.shape, generator=gen))
        n = batch.num_tokens
        q, k, v = (torch.randn(n, h, HEAD_DIM, generator=gen).to(dtype)
                   for h in (NUM_HEADS, NUM_KV_HEADS, NUM_KV_HEADS))
        flash = attention._FLASH_WITH_LSE
        outs = []
        for op in (flash, None):
            monkeypatch.setattr(attention, "_FLASH_WITH_LSE", op)
            backend = TorchAttention(pool, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, layers)
            outs.append(backend.forward(1, q, k, v, backend.prepare(batch)).float())
        atol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(outs[0], outs[1], atol=atol, rtol=0)


def test_auto_backend_is_triton_on_cuda_only(monkeypatch):
    assert EngineConfig(device="cuda").resolved_attention_backend == "triton"
    assert EngineConfig(device="cpu").resolved_attention_backend in ("torch", "native")
    monkeypatch.delenv("TRITON_INTERPRET")
    pool = KVPool(1, 16, NUM_KV_HEADS, HEAD_DIM, torch.float32)
    with pytest.raises(InvalidArgumentError, match="needs a CUDA device"):
        create_attention_backend("triton", pool, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM)


def test_engine_greedy_tokens_equal_torch_backend(tmp_path, tokenizer):
    """A tiny random Llama (2 layers, hidden 64, GQA 2): prefill, chunked prefill, a cached prefix
    and decode all go through the Triton kernels; greedy tokens equal the torch backend's and
    transformers'."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, tie_word_embeddings=True)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():  # random init gives near-uniform logits; sharpen so argmax is stable
        for p in model.parameters():
            p.mul_(4.0)
    model.eval().save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    texts = ["hello world", "the quick brown fox jumps over the lazy dog", "the quick brown cat"]
    prompts = [tokenizer.encode(t) for t in texts]
    greedy = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
    outputs = {}
    for backend in ("torch", "triton"):
        with Engine(model_path=str(tmp_path), dtype="float32", max_total_tokens=256,
                    attention_backend=backend, chunked_prefill_size=4,
                    debug_check_invariants=True) as engine:
            engine.generate(input_ids=prompts[1][:5], sampling_params=greedy)  # cache a prefix
            results = engine.generate(input_ids=prompts, sampling_params=greedy)
            assert engine.last_error is None
        outputs[backend] = [r["output_ids"] for r in results]
        assert results[1]["meta_info"]["cached_tokens"] >= 4
    assert outputs["triton"] == outputs["torch"]
    assert outputs["torch"] == [hf_greedy(model, ids, 6) for ids in prompts]


def test_engine_alibi_model_equals_transformers(tmp_path, tokenizer):
    """A tiny BLOOM (4 heads of 16: ALiBi) through the Triton kernels: chunked prefill over a
    cached prefix and decode give transformers' greedy tokens."""
    def four_heads(config) -> None:
        config.hidden_size, config.n_head = 64, 4

    model = build_tiny_model("bloom", tmp_path, tokenizer, edit=four_heads)
    _greedy_through_triton(model, tmp_path, tokenizer, 6,
                           ["the quick brown fox jumps over the lazy dog", "the quick brown cat"])


def _greedy_through_triton(model, folder, tokenizer, new_tokens: int, texts: list[str]) -> None:
    """The model saved in `folder` through the Triton kernels, chunked prefill of 4 over a cached
    prefix of the first prompt: greedy tokens equal transformers'."""
    prompts = [tokenizer.encode(t) for t in texts]
    greedy = {"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True}
    with Engine(model_path=str(folder), dtype="float32", max_total_tokens=256,
                attention_backend="triton", chunked_prefill_size=4,
                debug_check_invariants=True) as engine:
        engine.generate(input_ids=prompts[0][:5], sampling_params=greedy)  # cache a prefix
        results = engine.generate(input_ids=prompts, sampling_params=greedy)
        assert engine.last_error is None
    assert results[0]["meta_info"]["cached_tokens"] >= 4
    expected = [hf_greedy(model, ids, new_tokens) for ids in prompts]
    assert [r["output_ids"] for r in results] == expected


def test_gpt_oss_through_the_triton_kernels(tmp_path, tokenizer):
    """The tiny gpt-oss (sinks on every layer, sliding windows of 8 on two of three) with
    prompts past its window, chunked prefill and a cached prefix: greedy tokens equal
    transformers'."""
    model = build_tiny_model("gpt_oss", tmp_path, tokenizer)
    _greedy_through_triton(model, tmp_path, tokenizer, 8,
                           ["the quick brown fox jumps over the lazy dog near the river bank",
                            "hello world"])
