"""fused_layer_ops.c's decode runner (runtime/models/fused_layers.py's NativeDecodeRunner): a bf16
forward's layers in one C call give FusedDecodeLayers.run_loop's output stream and K/V writes
bit for bit, for every kind of matmul it takes (K-quant records in one segment and in several,
the legacy records, the int4 kernels with int8 and with bf16 dot products, a q/k/v bias) and
every batch shape it takes; it stands aside where a matmul has no entry point for the rows."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import quantize as gguf_quantize

from forklm.runtime.attention.native import NativeAttention
from forklm.runtime.forward.model_parts import build_model
from forklm.runtime.kvcache.pool import KVPool
from forklm.runtime.models import spec_from_config
from forklm.runtime.models.fused_layers import FusedDecodeLayers
from forklm.runtime.models.loader import load_model
from forklm.runtime.quant.kquant import KQuantMatrix, kquant_available
from forklm.runtime.quant.linear import Int4Matrix
from tests.test_fused_layers import decode_like_batch
from tests.test_kquant import _k_mix, _legacy_mix

pytestmark = pytest.mark.skipif(not kquant_available(),
                                reason="K-quant kernel off (no AVX512-VNNI/BW/BF16 or no build)")


def _q4_1(name: str, array: np.ndarray):
    """Every matrix in Q4_1, which forklm keeps as int4 (the default model's type)."""
    if array.ndim != 2 or array.shape[-1] % 32:
        return None
    return gguf_quantize(array.astype(np.float32), T.Q4_1), T.Q4_1


# case: tiny_models architecture, GGUF architecture, quantizer, int8 activations, matrix kinds
CASES = {
    # q and k Q4_K, v Q5_K: qkv in two record segments
    "k-quants": ("llama3", "llama", _k_mix, True, {KQuantMatrix}),
    "legacy": ("llama3", "llama", _legacy_mix, True, {KQuantMatrix}),
    "qwen2-bias": ("qwen2", "qwen2", _k_mix, True, {KQuantMatrix}),
    "int4-vnni": ("llama3", "llama", _q4_1, True, {Int4Matrix}),
    "int4-bf16-dots": ("llama3", "llama", _q4_1, False, {Int4Matrix}),
}


@pytest.fixture(scope="module")
def models(tokenizer, tmp_path_factory):
    """Each case's model, bf16, its GGUF matrices kept quantized as the engine keeps them."""
    from tests.test_gguf_families import write_gguf
    from tests.tiny_models import build_tiny_model

    folder = tmp_path_factory.mktemp("runner")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("FORKLM_CACHE_DIR", str(folder / "cache"))
        built = {}
        for case, (tiny, arch, quantizer, int8, kinds) in CASES.items():
            hf = build_tiny_model(tiny, folder / case, tokenizer, hidden_size=256,
                                  intermediate_size=512)
            gen = torch.Generator().manual_seed(7)
            for name, param in hf.named_parameters():  # transformers starts biases at zero
                if name.endswith("proj.bias"):
                    param.data.copy_(torch.randn(param.shape, generator=gen))
            path = str(folder / f"{case}.gguf")
            write_gguf(path, hf, arch, quantizer=quantizer)
            loaded = load_model(path)
            model = build_model(loaded, spec_from_config(loaded.config), torch.bfloat16, "cpu",
                                1024, keep_quantized=True, int8_activations=int8)
            layer_matrices = {type(m) for layer in model.model.layers for m in layer.modules()
                              if isinstance(m, (KQuantMatrix, Int4Matrix))}
            assert layer_matrices == kinds, case
            qkv = model.model.layers[0].self_attn.qkv_proj
            assert (qkv.bias is not None and bool(qkv.bias.abs().min() > 0)) == (
                case == "qwen2-bias")
            built[case] = model
        yield built


def pools_of(model, slots: int, kv_dtype=None, seed: int = 4) -> list[KVPool]:
    """Two bf16 pools holding the same random K/V (codes and scales for int8)."""
    spec = model.spec
    pools = [KVPool(spec.num_layers, slots, spec.num_kv_heads, spec.head_dim, torch.bfloat16,
                    kv_dtype=kv_dtype) for _ in range(2)]
    gen = torch.Generator().manual_seed(seed)
    for name in ("k_buffer", "v_buffer", "k_scale", "v_scale"):
        first = getattr(pools[0], name, None)
        if first is None:
            continue
        fill = (torch.randn(first.shape, generator=gen) * (40 if kv_dtype else 1)).to(first.dtype)
        if name.endswith("scale"):
            fill = torch.rand(first.shape, generator=gen) / 20 + 0.005
        for pool in pools:
            getattr(pool, name).copy_(fill)
    return pools


def runner_and_loop(model, pools: list[KVPool], batch, final_norm=None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """`batch`'s layers (and `final_norm`) by the runner over pools[0] and by run_loop over
    pools[1]."""
    spec = model.spec
    backends = [NativeAttention(pool, spec.num_heads, spec.num_kv_heads, spec.head_dim,
                                model.attention_layers) for pool in pools]
    fused = [FusedDecodeLayers(model, backend) for backend in backends]
    runner = fused[0].runner
    assert runner is not None and runner.max_rows == 16
    with torch.inference_mode():
        prepared = [backend.prepare(batch) for backend in backends]
        x = model._embed(batch.input_ids)
        assert x.shape[0] <= runner.max_rows
        return (runner.run(x.clone(), prepared[0], final_norm),
                fused[1].run_loop(x.clone(), prepared[1], final_norm))


# (kv_lens, q_lens): one request; three decoding; two verifying several tokens each; 16 decoding
BATCHES = [([40], [1]), ([40, 9, 130], [1, 1, 1]), ([30, 12], [5, 3]),
           ([20 + 7 * i for i in range(16)], [1] * 16)]


@pytest.mark.parametrize("case", list(CASES))
def test_runner_equals_the_loop_bit_for_bit(models, case):
    model = models[case]
    for kv_lens, q_lens in BATCHES:
        pools = pools_of(model, 1000 * len(kv_lens))
        ran, looped = runner_and_loop(model, pools, decode_like_batch(kv_lens, q_lens))
        assert torch.equal(ran, looped), (case, q_lens)
        assert ran.abs().max() > 0
        for name in ("k_buffer", "v_buffer"):
            assert torch.equal(getattr(pools[0], name), getattr(pools[1], name)), (case, name)


@pytest.mark.parametrize("case", ["k-quants", "int4-vnni"])
def test_the_final_norm_in_the_runner_equals_the_loop_and_torch(models, case):
    """With the model's final norm: the runner and run_loop bit for bit, and torch's RMSNorm of
    the stream within a bf16 rounding (the C norm sums its squares in another order)."""
    model = models[case]
    for kv_lens, q_lens in BATCHES:
        batch = decode_like_batch(kv_lens, q_lens)
        stream, _ = runner_and_loop(model, pools_of(model, 1000 * len(kv_lens)), batch)
        ran, looped = runner_and_loop(model, pools_of(model, 1000 * len(kv_lens)), batch,
                                      model.model.norm)
        assert torch.equal(ran, looped), (case, q_lens)
        with torch.inference_mode():
            expected = model.model.norm(stream)
        assert not torch.equal(ran, stream)
        torch.testing.assert_close(ran, expected, atol=0, rtol=2 ** -7)  # a bf16 step
        assert (ran != expected).float().mean() < 0.01


def test_runner_over_an_int8_pool_writes_the_same_codes_and_scales(models):
    model = models["k-quants"]
    pools = pools_of(model, 3000, kv_dtype=torch.int8)
    batch = decode_like_batch([40, 9, 130], [1, 1, 1])
    ran, looped = runner_and_loop(model, pools, batch)
    assert torch.equal(ran, looped)
    for name in ("k_buffer", "v_buffer", "k_scale", "v_scale"):
        first, second = getattr(pools[0], name), getattr(pools[1], name)
        assert torch.equal(first, second), name
    # the batch's rows were written: each row's largest code is 127
    assert (pools[0].k_buffer[:, batch.out_slots].abs().amax(-1) == 127).all()


def test_run_takes_the_runner_up_to_its_rows_then_the_loop(models, monkeypatch):
    model = models["k-quants"]
    spec = model.spec
    pool = KVPool(spec.num_layers, 20_000, spec.num_kv_heads, spec.head_dim, torch.bfloat16)
    backend = NativeAttention(pool, spec.num_heads, spec.num_kv_heads, spec.head_dim,
                              model.attention_layers)
    fused = FusedDecodeLayers(model, backend)
    assert fused.runner is not None
    took = []
    monkeypatch.setattr(fused.runner, "run",
                        lambda x, batch, final_norm: took.append(x.shape[0]) or x)
    with torch.inference_mode():
        for requests in (1, 16, 17):
            batch = backend.prepare(decode_like_batch([50] * requests, [1] * requests))
            fused.run(model._embed(batch.input_ids), batch)
    assert took == [1, 16]  # 17 rows: the many-row product, through run_loop


def test_no_runner_for_float32_or_dense_matrices(default_model):
    """An fp32 model (the kernels' outputs are bf16) and a dense bf16 model have none; their
    forwards keep run_loop."""
    loaded = default_model
    spec = spec_from_config(loaded.config)
    for dtype, quantized in ((torch.float32, True), (torch.bfloat16, False)):
        model = build_model(loaded, spec, dtype, "cpu", 256, keep_quantized=quantized,
                            int8_activations=True)
        pool = KVPool(spec.num_layers, 64, spec.num_kv_heads, spec.head_dim, dtype)
        backend = NativeAttention(pool, spec.num_heads, spec.num_kv_heads, spec.head_dim,
                                  model.attention_layers)
        assert FusedDecodeLayers(model, backend).runner is None, (dtype, quantized)
    quantized = build_model(loaded, spec, torch.bfloat16, "cpu", 256, keep_quantized=True,
                            int8_activations=True)
    pool = KVPool(spec.num_layers, 64, spec.num_kv_heads, spec.head_dim, torch.bfloat16)
    backend = NativeAttention(pool, spec.num_heads, spec.num_kv_heads, spec.head_dim,
                              quantized.attention_layers)
    assert FusedDecodeLayers(quantized, backend).runner is not None  # the default model's own
