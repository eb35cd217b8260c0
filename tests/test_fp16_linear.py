"""float32 linears with FBGEMM-packed float16 weights: the product of float32 activations with the
weights rounded to float16, accumulated in float32; chosen only by dtype "auto" on a CPU that
resolves it to float32, never by an explicit dtype="float32" (the token-exact path)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from benchmarks.profile_step import decode_batch, prefill_batch
from forklm.runtime.attention.registry import create_attention_backend
from forklm.runtime.config import EngineConfig
from forklm.runtime.forward import model_parts
from forklm.runtime.forward.model_parts import build_model, uses_fp16_weights
from forklm.runtime.kvcache.pool import KVPool
from forklm.runtime.models import spec_from_config
from forklm.runtime.models.fp16_linear import (
    Fp16WeightLinear,
    fp16_weights_available,
    pack_fp16_linears,
)
from forklm.runtime.models.loader import load_model
from forklm.runtime.models.weights import FusedLinear
from tests.tiny_models import build_tiny_model

needs_fbgemm = pytest.mark.skipif(not fp16_weights_available(),
                                  reason="this torch build has no FBGEMM fp16 matmul")


@needs_fbgemm
@pytest.mark.parametrize("rows", [1, 7, 16, 300])
def test_product_is_float32_math_on_float16_rounded_weights(rows):
    torch.manual_seed(rows)
    weight, bias = torch.randn(200, 96), torch.randn(200)
    x = torch.randn(rows, 96)
    out = Fp16WeightLinear(weight, bias)(x)
    assert out.dtype == torch.float32 and out.shape == (rows, 200)
    expected = x.double() @ weight.half().double().T + bias.double()
    assert (out.double() - expected).abs().max() <= 1e-4 * expected.abs().max()
    # ... and not the float32 weights' product: the rounding to float16 is really there
    exact = x.double() @ weight.double().T + bias.double()
    assert (out.double() - exact).abs().max() > 10 * (out.double() - expected).abs().max()


@needs_fbgemm
def test_pack_replaces_float32_plain_and_fused_linears_only():
    model = nn.Sequential(nn.Linear(16, 32), FusedLinear(32, (8, 8), bias=True),
                          nn.Linear(16, 4).to(torch.bfloat16), nn.Embedding(4, 16))
    x = torch.randn(3, 16)
    expected = model[1](model[0](x))
    assert pack_fp16_linears(model) == 2
    assert isinstance(model[0], Fp16WeightLinear) and isinstance(model[1], Fp16WeightLinear)
    assert model[1].part_sizes == (8, 8)
    assert type(model[2]) is nn.Linear and isinstance(model[3], nn.Embedding)
    assert torch.allclose(model[1](model[0](x)), expected, atol=1e-2)


def test_only_auto_dtype_resolving_to_float32_picks_fp16_weights(monkeypatch):
    monkeypatch.setattr(model_parts, "fp16_weights_available", lambda: True)
    monkeypatch.setattr(EngineConfig, "torch_dtype_name", property(lambda self: "float32"))
    assert uses_fp16_weights(EngineConfig(), keep_quantized=False)
    assert not uses_fp16_weights(EngineConfig(), keep_quantized=True)
    assert not uses_fp16_weights(EngineConfig(dtype="float32"), keep_quantized=False)
    assert not uses_fp16_weights(EngineConfig(quantization="none"), keep_quantized=False)
    monkeypatch.setattr(model_parts, "fp16_weights_available", lambda: False)
    assert not uses_fp16_weights(EngineConfig(), keep_quantized=False)
    monkeypatch.setattr(model_parts, "fp16_weights_available", lambda: True)
    monkeypatch.setattr(EngineConfig, "torch_dtype_name", property(lambda self: "bfloat16"))
    assert not uses_fp16_weights(EngineConfig(), keep_quantized=False)


def _run(model, spec, batch):
    pool = KVPool(spec.num_layers, 4096, spec.num_kv_heads, spec.head_dim, torch.float32)
    attn = create_attention_backend("torch", pool, spec.num_heads, spec.num_kv_heads,
                                    spec.head_dim, model.attention_layers)
    return model(batch, attn)


@needs_fbgemm
@pytest.mark.parametrize("arch", ["llama3", "qwen2"])  # tied head, untied head with biases
def test_fp16_weight_model_stays_close_to_the_float32_model(arch, tmp_path, tokenizer):
    torch.manual_seed(0)  # the batches' random token ids
    build_tiny_model(arch, tmp_path, tokenizer)
    loaded = load_model(str(tmp_path))
    spec = spec_from_config(loaded.config)
    fp16 = build_model(loaded, spec, torch.float32, "cpu", 256, fp16_weights=True)
    plain = build_model(loaded, spec, torch.float32, "cpu", 256)
    assert any(isinstance(m, Fp16WeightLinear) for m in fp16.modules())
    assert not any(isinstance(m, Fp16WeightLinear) for m in plain.modules())
    assert (fp16.tied_head is not None) == spec.tie_word_embeddings
    for batch in (decode_batch(1, 40), decode_batch(8, 40), prefill_batch(2, 100)):
        a, b = _run(fp16, spec, batch), _run(plain, spec, batch)
        assert a.dtype == torch.float32
        assert (a - b).abs().max() <= 1e-2 * b.abs().max()
        assert not torch.equal(a, b)


@needs_fbgemm
@pytest.mark.slow
def test_default_model_agrees_with_float32_teacher_forced(default_model, tokenizer):
    """On real text the fp16-weight model's next-token choice is the float32 model's at >= 99% of
    positions (measured: 99.8% of 600)."""
    text = ("The radix tree keeps every prompt that was served, so that a new request which starts "
            "with the same system prompt and few-shot examples reuses their keys and values. ") * 6
    ids = torch.tensor(tokenizer(text)["input_ids"][:400])
    n = len(ids)
    batch = prefill_batch(1, n)
    batch.input_ids, batch.logits_indices = ids, torch.arange(n)
    spec = spec_from_config(default_model.config)
    plain = _run(build_model(default_model, spec, torch.float32, "cpu", 1024), spec, batch)
    fast = _run(build_model(default_model, spec, torch.float32, "cpu", 1024, fp16_weights=True),
                spec, batch)
    agree = (fast.argmax(-1) == plain.argmax(-1)).float().mean().item()
    assert agree >= 0.99
