"""bf16 linears with oneDNN-packed weights give the plain F.linear path's values: bit-identical in
decode steps, within bf16 accumulation-order rounding in prefills."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType
from torch import nn

from benchmarks.profile_step import decode_batch, prefill_batch
from forklm.runtime.attention.registry import create_attention_backend
from forklm.runtime.forward import model_parts
from forklm.runtime.forward.model_parts import build_model
from forklm.runtime.kvcache.pool import KVPool
from forklm.runtime.models import spec_from_config
from forklm.runtime.models.loader import load_model
from forklm.runtime.models.onednn_linear import (
    OneDNNLinear,
    can_pack,
    pack_linears,
    plan_dense_copies,
)
from forklm.runtime.models.weights import FusedLinear
from forklm.runtime.quant.linear import (
    DENSE_COPY_MIN_ROWS,
    NATIVE_DENSE_COPY_MIN_ROWS,
    NATIVE_SPLIT_DENSE_COPY_MIN_ROWS,
    QuantizedLinear,
)
from tests.test_quant import make_weight
from tests.tiny_models import build_tiny_model

needs_bf16_onednn = pytest.mark.skipif(not can_pack(torch.bfloat16, "cpu"),
                                       reason="this CPU has no oneDNN bf16 matmuls")


def test_only_bf16_on_the_cpu_is_packed():
    assert not can_pack(torch.float32, "cpu")
    assert not can_pack(torch.bfloat16, "cuda")


@needs_bf16_onednn
def test_pack_linears_replaces_plain_and_fused_linears_only():
    model = nn.Sequential(nn.Linear(16, 32), FusedLinear(32, (8, 8), bias=True), nn.Embedding(4, 16))
    model.to(torch.bfloat16)
    x = torch.randn(3, 16, dtype=torch.bfloat16)
    expected = model[1](model[0](x))
    assert pack_linears(model) == 2
    assert isinstance(model[0], OneDNNLinear) and isinstance(model[1], OneDNNLinear)
    assert model[1].part_sizes == (8, 8)
    assert isinstance(model[2], nn.Embedding)
    assert torch.equal(model[1](model[0](x)), expected)


def _run(model, spec, batch, dtype=torch.bfloat16):
    pool = KVPool(spec.num_layers, 4096, spec.num_kv_heads, spec.head_dim, dtype)
    attn = create_attention_backend("torch", pool, spec.num_heads, spec.num_kv_heads,
                                    spec.head_dim, model.attention_layers)
    return model(batch, attn)


@needs_bf16_onednn
@pytest.mark.parametrize("arch", ["llama3", "qwen2"])  # tied head, untied head with biases
def test_packed_model_matches_plain_model(arch, tmp_path, tokenizer, monkeypatch):
    torch.manual_seed(0)  # the batches' random token ids
    build_tiny_model(arch, tmp_path, tokenizer)
    loaded = load_model(str(tmp_path))
    spec = spec_from_config(loaded.config)
    packed = build_model(loaded, spec, torch.bfloat16, "cpu", 256)
    monkeypatch.setattr(model_parts, "can_pack", lambda *args: False)
    plain = build_model(loaded, spec, torch.bfloat16, "cpu", 256)
    assert any(isinstance(m, OneDNNLinear) for m in packed.modules())
    assert not any(isinstance(m, OneDNNLinear) for m in plain.modules())
    assert (packed.tied_head is not None) == spec.tie_word_embeddings
    for batch in (decode_batch(1, 40), decode_batch(8, 40)):
        assert torch.equal(_run(packed, spec, batch), _run(plain, spec, batch))
    big = prefill_batch(2, 200)
    a, b = _run(packed, spec, big), _run(plain, spec, big)
    assert (a - b).abs().max() <= 0.05 * b.abs().max()


@needs_bf16_onednn
@pytest.mark.parametrize("ggml_type", [GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q8_0],
                         ids=lambda t: t.name)
def test_dense_copies_serve_larger_batches_of_quantized_layers(ggml_type):
    weight = make_weight(ggml_type, 80, 512)
    model = nn.Sequential(QuantizedLinear.from_gguf([weight], None, torch.bfloat16))
    assert plan_dense_copies(model, max_bytes=80 * 512 * 2 - 1) is None  # too large: none
    assert model[0].dense is None
    build = plan_dense_copies(model)
    assert build is not None and build.nbytes == 80 * 512 * 2
    build.run()
    ref = model[0].dequantize().double()
    dense_rows: list[int] = []
    model[0].dense.register_forward_hook(lambda m, args, out: dense_rows.append(args[0].shape[0]))
    # With kernels/cpu/int4_gemv.c the copy takes over after the rows the native kernel does
    # better (fewer for a split 8-bit matrix); after torch's kernel's 8 rows without it.
    first = model[0].dense_copy_min_rows()
    if model[0].matrices[0].native() is None:
        assert first == DENSE_COPY_MIN_ROWS
    elif ggml_type == GGMLQuantizationType.Q8_0:
        assert first == NATIVE_SPLIT_DENSE_COPY_MIN_ROWS
    else:
        assert first == NATIVE_DENSE_COPY_MIN_ROWS
    for rows in (1, first - 1, first, 40):
        x = torch.randn(rows, 512, dtype=torch.bfloat16)
        expected = x.double() @ ref.T
        # bf16 rounding of x, the weight and the output on either path
        assert (model(x).double() - expected).abs().max() <= 2e-2 * expected.abs().max()
    assert dense_rows == [first, 40]  # the int4 kernel below, the copy from there


@needs_bf16_onednn
def test_a_deferred_dense_copy_is_built_by_the_first_call_that_needs_it(monkeypatch):
    """A planned copy not yet built: calls below its rows run on the quantized kernels and build
    nothing; the first call of its rows builds it (or waits for a background build) and gives
    what the copy gives. A build that fails leaves every call on the quantized kernels."""
    from forklm.runtime.models import onednn_linear

    weight = make_weight(GGMLQuantizationType.Q4_K, 80, 512)
    layer = QuantizedLinear.from_gguf([weight], None, torch.bfloat16)
    build = plan_dense_copies(nn.Sequential(layer))
    assert build is not None and layer.has_dense_copy and layer.dense is None
    call = layer.direct()  # made before the copy exists, as the fused decode layers do
    first = layer.dense_copy_min_rows()
    small, large = (torch.randn(n, 512, dtype=torch.bfloat16) for n in (1, first + 3))
    call(small)
    assert layer.dense is None and not build.done.is_set()  # not needed yet
    y = call(large)
    assert build.done.is_set() and layer.dense is not None and layer.dense_build is None
    assert torch.equal(y, layer.dense(large))

    background = QuantizedLinear.from_gguf([weight], None, torch.bfloat16)
    started = plan_dense_copies(nn.Sequential(background))
    assert started is not None
    started.start()
    assert torch.equal(background(large), y)  # waited for the background build, or built
    started.start()  # a second start builds nothing more
    assert started.done.wait(60) and background.dense is not None

    failing = QuantizedLinear.from_gguf([weight], None, torch.bfloat16)
    broken = plan_dense_copies(nn.Sequential(failing))
    assert broken is not None
    monkeypatch.setattr(onednn_linear, "_attach", lambda module: 1 / 0)
    y = failing(large)  # the build fails; the quantized kernels answer
    assert failing.dense is None and not failing.has_dense_copy
    assert torch.equal(y, failing(large))
    reference = large.double() @ failing.dequantize().double().T
    assert (y.double() - reference).abs().max() <= 2e-2 * reference.abs().max()
