"""A multimodal checkpoint served for text (the Gemma 3 and 4 repositories most users download): forklm
loads its language model alone, skipping the vision tower, and generates the greedy tokens
transformers' multimodal model does on text."""

from __future__ import annotations

import torch
import transformers

from forklm.runtime.engine.engine import Engine
from forklm.runtime.models.loader import language_model_name
from tests.conftest import hf_greedy
from tests.tiny_models import ARCHITECTURES, randomized, tiny_config

NUM_NEW = 12


def test_gemma3_multimodal_checkpoint_generates_as_transformers(tokenizer, tmp_path):
    text = tiny_config("gemma3", tokenizer)
    vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64,
                                             num_hidden_layers=1, num_attention_heads=2,
                                             image_size=32, patch_size=8)
    config = transformers.Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(),
                                       mm_tokens_per_image=4)
    config._attn_implementation = "eager"
    config.text_config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = randomized(transformers.Gemma3ForConditionalGeneration(config),
                       ARCHITECTURES["gemma3"].weight_scale)
    _check_text_generation(model, tokenizer, tmp_path)


def test_gemma4_multimodal_checkpoint_generates_as_transformers(tokenizer, tmp_path):
    text = tiny_config("gemma4", tokenizer, pad_token_id=0)  # its multimodal model needs one
    text.use_bidirectional_attention = "vision"  # the larger models': text stays causal
    vision = transformers.Gemma4VisionConfig(hidden_size=32, intermediate_size=64,
                                             num_hidden_layers=1, num_attention_heads=2,
                                             num_key_value_heads=2, head_dim=16)
    config = transformers.Gemma4Config(text_config=text.to_dict(), vision_config=vision.to_dict(),
                                       audio_config=None)
    config._attn_implementation = "eager"
    config.text_config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = randomized(transformers.Gemma4ForConditionalGeneration(config),
                       ARCHITECTURES["gemma4"].weight_scale)
    _check_text_generation(model, tokenizer, tmp_path)


def _check_text_generation(model, tokenizer, folder) -> None:
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    prompts = [tokenizer.encode("Paris is the capital of"),
               tokenizer.encode("The quick brown fox jumps over the lazy dog near the river.")]
    expected = [hf_greedy(model, ids, NUM_NEW) for ids in prompts]
    engine = Engine(model_path=str(folder), dtype="float32", max_total_tokens=2048)
    try:
        outs = engine.generate(input_ids=prompts, sampling_params={
            "temperature": 0, "max_new_tokens": NUM_NEW, "ignore_eos": True})
        assert [out["output_ids"] for out in outs] == expected
    finally:
        engine.shutdown()


def test_the_language_models_names_under_either_layout():
    assert language_model_name("language_model.model.layers.0.mlp.up_proj.weight") == (
        "model.layers.0.mlp.up_proj.weight")  # the Hub's checkpoints
    assert language_model_name("model.language_model.norm.weight") == "model.norm.weight"
    assert language_model_name("language_model.lm_head.weight") == "lm_head.weight"
    assert language_model_name("lm_head.weight") == "lm_head.weight"
    assert language_model_name("vision_tower.vision_model.embeddings.patch_embedding.weight") is None
    assert language_model_name("multi_modal_projector.mm_soft_emb_norm.weight") is None
