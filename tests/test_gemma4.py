"""Gemma 4 beyond greedy equality (tests/test_architectures.py): the layers that read another
layer's K/V take no KV pool layer of their own, checkpoints that still carry their k/v matrices
load, and a GGUF of the mixture-of-experts variant is refused naming what it lacks."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from forklm.runtime.engine.engine import Engine
from forklm.runtime.errors import UnsupportedModelError
from tests.conftest import hf_greedy
from tests.tiny_models import build_tiny_model

GREEDY = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
PROMPT = "The quick brown fox jumps over the lazy dog near the river bank."


def test_shared_kv_layers_take_no_pool_layer_and_leftover_kv_weights_are_skipped(
        tmp_path, tokenizer):
    model = build_tiny_model("gemma4", tmp_path, tokenizer)
    shard = next(tmp_path.glob("*.safetensors"))
    tensors = load_file(shard)
    # Layers 3 and 4 read layers 2's and 1's K/V; some checkpoints keep unused k/v for them.
    tensors["model.layers.3.self_attn.k_proj.weight"] = torch.randn(2 * 16, 64)
    tensors["model.layers.4.self_attn.k_norm.weight"] = torch.randn(32)
    save_file(tensors, shard, metadata={"format": "pt"})
    ids = tokenizer.encode(PROMPT)
    engine = Engine(model_path=str(tmp_path), dtype="float32", max_total_tokens=512)
    try:
        assert engine.generate(input_ids=ids, sampling_params=GREEDY)["output_ids"] == (
            hf_greedy(model, ids, GREEDY["max_new_tokens"]))
        spec = engine.parts.runner.model.spec
        assert spec.kv_pool_layers == (0, 1, 2, 2, 1)
        # 3 layers, 2 KV heads (the full layers' one repeated), 32 wide (the sliding ones padded)
        assert spec.kv_pool_shape == (3, 2, 32)
        pool = engine.parts.runner.kv.pool
        assert tuple(pool.k_buffer.shape[i] for i in (0, 2, 3)) == (3, 2, 32)
    finally:
        engine.shutdown()


def test_a_gguf_of_the_mixture_of_experts_variant_is_refused_naming_it(tmp_path, monkeypatch):
    import gguf

    from forklm.runtime.models.gguf_loader import GGUFModel

    monkeypatch.setenv("FORKLM_CACHE_DIR", str(tmp_path / "cache"))
    writer = gguf.GGUFWriter(tmp_path / "moe.gguf", "gemma4")
    writer.add_block_count(1)
    writer.add_expert_count(4)
    writer.add_token_list(["a", "b"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedModelError, match="'gemma4' with experts.*Gemma 4's experts"):
        GGUFModel(tmp_path / "moe.gguf")


@pytest.mark.parametrize("config", [{"enable_deterministic_inference": True},
                                    {"enable_torch_compile": True}],
                         ids=["deterministic", "torch_compile_asked"])
def test_other_engine_modes_generate_as_transformers(tmp_path, tokenizer, config):
    """Deterministic inference tiles Gemma 4's matmuls too; asked for torch.compile, Gemma 4
    runs its layers eagerly (its layers are not LayerSteps) and still serves."""
    model = build_tiny_model("gemma4", tmp_path, tokenizer)
    prompts = [tokenizer.encode(PROMPT), tokenizer.encode("Paris is the capital of")]
    engine = Engine(model_path=str(tmp_path), dtype="float32", max_total_tokens=512, **config)
    try:
        outs = engine.generate(input_ids=prompts, sampling_params=GREEDY)
        assert [out["output_ids"] for out in outs] == [
            hf_greedy(model, ids, GREEDY["max_new_tokens"]) for ids in prompts]
        assert engine.parts.runner.model.compiled_steps is None
    finally:
        engine.shutdown()


def test_tensor_parallelism_is_refused_naming_why(tokenizer):
    from forklm.runtime.distributed.sharding import check_shardable
    from forklm.runtime.models.spec import spec_from_config
    from tests.tiny_models import tiny_config

    spec = spec_from_config(tiny_config("gemma4", tokenizer))
    with pytest.raises(UnsupportedModelError, match="tp_size=2: gemma4_text has per-layer inputs"):
        check_shardable(spec, 2)


def test_a_q8_0_gguf_keeps_the_per_layer_table_quantized(tmp_path, tokenizer, monkeypatch):
    """The per-layer embedding table and projections stay in their blocks (test_gguf_families
    checks the logprobs of this path against the dequantized one)."""
    from forklm.runtime.quant.linear import QuantizedLinear
    from tests.test_gguf_families import write_gguf

    monkeypatch.setenv("FORKLM_CACHE_DIR", str(tmp_path / "cache"))
    model = build_tiny_model("gemma4", tmp_path / "hf", tokenizer)
    write_gguf(tmp_path / "gemma4.gguf", model, "gemma4", q8_0=True)
    engine = Engine(model_path=str(tmp_path / "gemma4.gguf"), quantization="gguf",
                    max_total_tokens=256)
    try:
        lm = engine.parts.runner.model
        assert isinstance(lm.model.embed_tokens_per_layer, QuantizedLinear)
        assert isinstance(lm.model.per_layer_model_projection, QuantizedLinear)
        assert isinstance(lm.model.layers[0].per_layer_input_gate, QuantizedLinear)
        out = engine.generate(input_ids=tokenizer.encode(PROMPT), sampling_params=GREEDY)
        assert len(out["output_ids"]) == GREEDY["max_new_tokens"]
    finally:
        engine.shutdown()


def test_bidirectional_attention_over_all_tokens_is_refused(tmp_path, tokenizer):
    """"vision" (text causal, images both ways) is served; "all" (an encoder) is not."""
    import json

    build_tiny_model("gemma4", tmp_path, tokenizer)
    config_file = tmp_path / "config.json"
    config = json.loads(config_file.read_text())
    config["use_bidirectional_attention"] = "all"
    config_file.write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="use_bidirectional_attention='all'"):
        Engine(model_path=str(tmp_path), dtype="float32", max_total_tokens=256)
