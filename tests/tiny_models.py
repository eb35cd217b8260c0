"""Tiny random transformers checkpoints, one per architecture forklm serves, saved as Hugging Face
folders (safetensors + the default model's tokenizer) so tests can load them in forklm and in
transformers. Every field that changes the computation is set to a non-default value."""

from __future__ import annotations

import functools
import pathlib
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import transformers

SLIDING_WINDOW = 8  # a query sees itself and the 7 keys before it (masking_utils: kv > q - window)


class TinyArch(NamedTuple):
    make_config: Callable[[dict[str, Any]], transformers.PretrainedConfig]  # from _common()
    model_class: type[transformers.PreTrainedModel]
    weight_scale: float  # random init gives near-uniform logits; scale so argmax is stable
    # EngineConfig fields a test must pass for forklm to match this reference (phi3_short: a
    # context length within the original context keeps longrope on its short factors).
    engine_config: dict[str, Any] = {}


def _common(tokenizer) -> dict[str, Any]:
    return dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=tokenizer.bos_token_id,
                eos_token_id=tokenizer.eos_token_id, pad_token_id=None)


def _llama3(c: dict) -> transformers.PretrainedConfig:
    # original context 64: rotations with wavelength > 64 are slowed 8x, 16..64 are blended.
    rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    return transformers.LlamaConfig(**c, tie_word_embeddings=True, rope_parameters=rope)


def _qwen2(c: dict, **extra: Any) -> transformers.PretrainedConfig:
    return transformers.Qwen2Config(**c, tie_word_embeddings=False,
                                    rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                                    **extra)


def _qwen2_sliding(c: dict) -> transformers.PretrainedConfig:
    # Qwen2 slides the layers i >= max_window_layers: here layers 1 and 2, layer 0 is global.
    return _qwen2({**c, "num_hidden_layers": 3}, use_sliding_window=True,
                  sliding_window=SLIDING_WINDOW, max_window_layers=1)


def _qwen3(c: dict) -> transformers.PretrainedConfig:
    return transformers.Qwen3Config(**c, head_dim=32, tie_word_embeddings=False,
                                    rope_parameters={"rope_type": "default", "rope_theta": 1e6})


def _gemma2(c: dict) -> transformers.PretrainedConfig:
    # Caps small enough that both tanh soft-caps bend real values (scores reach ~1.6 caps, logits
    # ~0.9 caps); untied, because a tied tiny Gemma greedily repeats one or two tokens.
    return transformers.Gemma2Config(
        **{**c, "num_hidden_layers": 3}, head_dim=32, query_pre_attn_scalar=24,
        hidden_activation="gelu_pytorch_tanh", attn_logit_softcapping=1.5,
        final_logit_softcapping=2.0, sliding_window=SLIDING_WINDOW,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=False)


def _gemma3(c: dict) -> transformers.PretrainedConfig:
    # Local layers rotate with their own base; the global layer with a linearly scaled one.
    # Untied like _gemma2.
    rope = {"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
    return transformers.Gemma3TextConfig(
        **{**c, "num_hidden_layers": 3}, head_dim=32, query_pre_attn_scalar=24,
        hidden_activation="gelu_pytorch_tanh", sliding_window=SLIDING_WINDOW,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters=rope, tie_word_embeddings=False)


def _gemma4(c: dict, **extra: Any) -> transformers.PretrainedConfig:
    # Five layers: 0-2 compute their own K/V, 3 (sliding) and 4 (full) read those of 2 and 1.
    # Full layers have wider heads (32) over one KV head whose keys are also its values, and
    # rotate a quarter of each head's angles (proportional rope); per-layer inputs 32 wide (the
    # packed table, 5 * 32, holds whole Q8_0 blocks: test_gguf_families keeps it quantized).
    # Untied like _gemma2.
    rope = {"full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                               "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
    kinds = ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention",
             "full_attention"]
    fields = dict(head_dim=16, global_head_dim=32, num_global_key_value_heads=1,
                  attention_k_eq_v=True, num_kv_shared_layers=2, use_double_wide_mlp=True,
                  hidden_size_per_layer_input=32, vocab_size_per_layer_input=c["vocab_size"],
                  hidden_activation="gelu_pytorch_tanh", sliding_window=SLIDING_WINDOW,
                  layer_types=kinds, rope_parameters=rope, final_logit_softcapping=2.0,
                  tie_word_embeddings=False)
    return transformers.Gemma4TextConfig(**{**c, "num_hidden_layers": 5}, **{**fields, **extra})


def _phi3(original_context: int) -> Callable[[dict], transformers.PretrainedConfig]:
    """longrope: transformers takes long_factor for a whole forward when its max position + 1
    exceeds original_max_position_embeddings, else short_factor (so with a KV cache, keys cached
    before the switch keep their short rotation); cos/sin of both are scaled by
    sqrt(1 + ln(max_position_embeddings / original) / ln(original))."""

    def make(c: dict) -> transformers.PretrainedConfig:
        half = 16 // 2  # head_dim 16
        rope = {"rope_type": "longrope", "rope_theta": 10000.0,
                "short_factor": [1.0 + 0.25 * i for i in range(half)],
                "long_factor": [2.0 + 3.0 * i for i in range(half)],
                "original_max_position_embeddings": original_context}
        return transformers.Phi3Config(**c, original_max_position_embeddings=original_context,
                                       rope_parameters=rope, tie_word_embeddings=False)

    return make


def _mistral(c: dict) -> transformers.PretrainedConfig:
    return transformers.MistralConfig(**c, sliding_window=SLIDING_WINDOW,
                                      rope_parameters={"rope_type": "default", "rope_theta": 1e4})


def _mixtral(c: dict) -> transformers.PretrainedConfig:
    return transformers.MixtralConfig(**c, num_local_experts=4, num_experts_per_tok=2,
                                      rope_parameters={"rope_type": "default", "rope_theta": 1e6})


def _qwen3_moe(c: dict) -> transformers.PretrainedConfig:
    return transformers.Qwen3MoeConfig(
        **c, head_dim=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        rope_parameters={"rope_type": "default", "rope_theta": 1e6})


def _qwen2_moe(c: dict) -> transformers.PretrainedConfig:
    return transformers.Qwen2MoeConfig(
        **c, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
        shared_expert_intermediate_size=64, norm_topk_prob=False, decoder_sparse_step=1,
        mlp_only_layers=[], rope_parameters={"rope_type": "default", "rope_theta": 1e6})


def _gpt_oss(c: dict) -> transformers.PretrainedConfig:
    # Sliding and full layers alternate; YaRN with an original context of 32, below the prompts;
    # a limit of 1.5 so the clamps bend real gate/up values (they reach ~3 here).
    rope = {"rope_type": "yarn", "rope_theta": 1.5e5, "factor": 8.0, "beta_fast": 32.0,
            "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 32}
    return transformers.GptOssConfig(
        **{**c, "num_hidden_layers": 3}, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
        sliding_window=SLIDING_WINDOW, swiglu_limit=1.5, swiglu_alpha=1.702,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters=rope, tie_word_embeddings=False)


def _smollm3(c: dict) -> transformers.PretrainedConfig:
    # Layers 1 and 3 have no positions (NoPE), layers 1 and 2 slide: each of the four pairings.
    return transformers.SmolLM3Config(
        **{**c, "num_hidden_layers": 4}, no_rope_layers=[1, 0, 1, 0], use_sliding_window=True,
        sliding_window=SLIDING_WINDOW,
        layer_types=["full_attention", "sliding_attention", "sliding_attention", "full_attention"],
        rope_parameters={"rope_type": "default", "rope_theta": 5e4}, tie_word_embeddings=True)


def _granite(c: dict) -> transformers.PretrainedConfig:
    # Softmax scale 0.2 where 1/sqrt(head_dim 16) would be 0.25.
    return transformers.GraniteConfig(
        **c, embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.2,
        logits_scaling=2.0, rope_parameters={"rope_type": "default", "rope_theta": 1e4},
        tie_word_embeddings=True)


def _olmo2(c: dict) -> transformers.PretrainedConfig:
    return transformers.Olmo2Config(**c, attention_bias=True, tie_word_embeddings=False,
                                    rope_parameters={"rope_type": "default", "rope_theta": 5e5})


def _stablelm(c: dict) -> transformers.PretrainedConfig:
    # StableLM 2 1.6B's shape: q/k/v biases, a quarter of each head rotated, norms in sequence.
    return transformers.StableLmConfig(
        **c, layer_norm_eps=1e-4, use_qkv_bias=True, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25})


def _stablelm_parallel(c: dict) -> transformers.PretrainedConfig:
    # StableLM 2 12B's: a LayerNorm of its own per q/k head, one norm feeding attention and MLP.
    return transformers.StableLmConfig(
        **c, layer_norm_eps=1e-4, qk_layernorm=True, use_parallel_residual=True,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5})


def _starcoder2(c: dict) -> transformers.PretrainedConfig:
    return transformers.Starcoder2Config(
        **c, norm_epsilon=1e-4, use_bias=True, sliding_window=SLIDING_WINDOW,
        hidden_act="gelu_pytorch_tanh", tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1e5})


def _nemotron(c: dict) -> transformers.PretrainedConfig:
    # Biases everywhere (Nemotron's own have none), 3/4 of each head rotated.
    return transformers.NemotronConfig(
        **c, norm_eps=1e-4, hidden_act="relu2", attention_bias=True, mlp_bias=True,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.75})


def _gpt2(c: dict) -> transformers.PretrainedConfig:
    # GPT-2 has no GQA and names its sizes otherwise; n_inner 96 where the default is 4 * 64.
    return transformers.GPT2Config(
        vocab_size=c["vocab_size"], n_embd=c["hidden_size"], n_inner=96,
        n_layer=c["num_hidden_layers"], n_head=c["num_attention_heads"],
        n_positions=c["max_position_embeddings"], layer_norm_epsilon=1e-4,
        activation_function="gelu_new", bos_token_id=c["bos_token_id"],
        eos_token_id=c["eos_token_id"], tie_word_embeddings=True)


def _falcon(**variant: Any) -> Callable[[dict], transformers.PretrainedConfig]:
    def make(c: dict) -> transformers.PretrainedConfig:
        common = {k: v for k, v in c.items() if k not in ("intermediate_size", "rms_norm_eps",
                                                          "num_key_value_heads")}
        return transformers.FalconConfig(
            **common, layer_norm_epsilon=1e-4, ffn_hidden_size=96, alibi=False,
            rope_parameters={"rope_type": "default", "rope_theta": 1e4}, **variant)

    return make


def _bloom(c: dict) -> transformers.PretrainedConfig:
    # 6 heads of 16: ALiBi's slopes for a head count that is no power of two (4, then 2 more).
    return transformers.BloomConfig(
        vocab_size=c["vocab_size"], hidden_size=96, n_layer=c["num_hidden_layers"], n_head=6,
        layer_norm_epsilon=1e-4, bos_token_id=c["bos_token_id"], eos_token_id=c["eos_token_id"],
        pad_token_id=None, tie_word_embeddings=True)


def _mpt(c: dict) -> transformers.PretrainedConfig:
    # 6 heads of 16 (MPT's ALiBi slopes for a head count that is no power of two), q/k/v
    # clipped where the scaled weights reach, a softmax scale of 0.2 (1/sqrt(16) would be 0.25).
    return transformers.MptConfig(
        vocab_size=c["vocab_size"], d_model=96, n_heads=6, n_layers=c["num_hidden_layers"],
        max_seq_len=c["max_position_embeddings"], layer_norm_epsilon=1e-4,
        attn_config={"clip_qkv": 2.0, "softmax_scale": 0.2, "alibi_bias_max": 8},
        bos_token_id=c["bos_token_id"], eos_token_id=c["eos_token_id"], pad_token_id=None)


ARCHITECTURES: dict[str, TinyArch] = {
    "llama3": TinyArch(_llama3, transformers.LlamaForCausalLM, 3.0),
    "qwen2": TinyArch(_qwen2, transformers.Qwen2ForCausalLM, 3.0),
    "qwen2_sliding": TinyArch(_qwen2_sliding, transformers.Qwen2ForCausalLM, 3.0),
    "qwen3": TinyArch(_qwen3, transformers.Qwen3ForCausalLM, 3.0),
    "gemma2": TinyArch(_gemma2, transformers.Gemma2ForCausalLM, 4.0),
    "gemma3": TinyArch(_gemma3, transformers.Gemma3ForCausalLM, 4.0),
    "gemma4": TinyArch(_gemma4, transformers.Gemma4ForCausalLM, 4.0),
    # Every layer its own K/V, its values from v_proj, no per-layer inputs; full layers still
    # have wider heads and their own rope.
    "gemma4_plain": TinyArch(functools.partial(_gemma4, hidden_size_per_layer_input=0,
                                               num_kv_shared_layers=0, attention_k_eq_v=False),
                             transformers.Gemma4ForCausalLM, 4.0),
    # Four experts (two per token) beside every layer's dense MLP.
    "gemma4_moe": TinyArch(functools.partial(_gemma4, enable_moe_block=True, num_experts=4,
                                             top_k_experts=2, moe_intermediate_size=32),
                           transformers.Gemma4ForCausalLM, 4.0),
    # original context 4, below every test prompt: transformers always takes the long factors,
    # and so does forklm (its context length, 256, exceeds 4).
    "phi3": TinyArch(_phi3(4), transformers.Phi3ForCausalLM, 3.0),
    # original context 128 = forklm's context length: short factors on both sides.
    "phi3_short": TinyArch(_phi3(128), transformers.Phi3ForCausalLM, 3.0,
                           {"context_length": 128}),
    "mistral": TinyArch(_mistral, transformers.MistralForCausalLM, 3.0),
    "mixtral": TinyArch(_mixtral, transformers.MixtralForCausalLM, 3.0),
    "qwen3_moe": TinyArch(_qwen3_moe, transformers.Qwen3MoeForCausalLM, 3.0),
    "qwen2_moe": TinyArch(_qwen2_moe, transformers.Qwen2MoeForCausalLM, 3.0),
    "gpt_oss": TinyArch(_gpt_oss, transformers.GptOssForCausalLM, 3.0),
    "smollm3": TinyArch(_smollm3, transformers.SmolLM3ForCausalLM, 3.0),
    "granite": TinyArch(_granite, transformers.GraniteForCausalLM, 3.0),
    "olmo2": TinyArch(_olmo2, transformers.Olmo2ForCausalLM, 3.0),
    "stablelm": TinyArch(_stablelm, transformers.StableLmForCausalLM, 3.0),
    "stablelm_parallel": TinyArch(_stablelm_parallel, transformers.StableLmForCausalLM, 3.0),
    "starcoder2": TinyArch(_starcoder2, transformers.Starcoder2ForCausalLM, 3.0),
    "nemotron": TinyArch(_nemotron, transformers.NemotronForCausalLM, 3.0),
    "gpt2": TinyArch(_gpt2, transformers.GPT2LMHeadModel, 3.0),
    # Falcon 7B's layout: one key/value head, attention and MLP in parallel from one norm.
    "falcon": TinyArch(_falcon(new_decoder_architecture=False, multi_query=True,
                               parallel_attn=True, bias=False, tie_word_embeddings=True),
                       transformers.FalconForCausalLM, 3.0),
    # Falcon 40B's: grouped q/k/v rows (2 KV heads), ln_attn and ln_mlp; biases added.
    "falcon_40b": TinyArch(_falcon(new_decoder_architecture=True, num_kv_heads=2,
                                   num_ln_in_parallel_attn=2, parallel_attn=True, bias=True,
                                   tie_word_embeddings=False),
                           transformers.FalconForCausalLM, 3.0),
    # In sequence, every head its own key and value, q/k/v interleaved per head.
    "falcon_sequential": TinyArch(_falcon(new_decoder_architecture=False, multi_query=False,
                                          parallel_attn=False, bias=True,
                                          tie_word_embeddings=True),
                                  transformers.FalconForCausalLM, 3.0),
    # ALiBi, a LayerNorm after the embedding, q/k/v interleaved per head.
    "bloom": TinyArch(_bloom, transformers.BloomForCausalLM, 3.0),
    # ALiBi with MPT's slopes, no biases anywhere, clip_qkv.
    "mpt": TinyArch(_mpt, transformers.MptForCausalLM, 3.0),
}


def tiny_config(name: str, tokenizer, **overrides: Any) -> transformers.PretrainedConfig:
    """ARCHITECTURES[name]'s config: 64 wide, 4 heads over 2 KV heads, the tokenizer's vocabulary
    (`overrides` replace any of those common fields)."""
    return ARCHITECTURES[name].make_config({**_common(tokenizer), **overrides})


def build_tiny_model(name: str, folder: pathlib.Path | str, tokenizer, seed: int = 0,
                     edit: Callable[[Any], None] | None = None,
                     **overrides: Any) -> transformers.PreTrainedModel:
    """Build ARCHITECTURES[name] with random fp32 weights (scaled by its weight_scale, norm weights
    jittered), save it and `tokenizer` into `folder` (safetensors), and return it in eval mode on
    transformers' eager attention. `overrides` change common config fields (tiny_config); `edit`
    changes the config in place before the model is built."""
    arch = ARCHITECTURES[name]
    config = tiny_config(name, tokenizer, **overrides)
    if edit is not None:
        edit(config)
    config._attn_implementation = "eager"  # the plainest reference: explicit masks and soft-caps
    torch.manual_seed(seed)
    model = randomized(arch.model_class(config), arch.weight_scale)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return model


def randomized(model: transformers.PreTrainedModel, weight_scale: float
               ) -> transformers.PreTrainedModel:
    """`model` in fp32 eval mode, its random init scaled by `weight_scale` (random init gives
    near-uniform logits) and its norm weights jittered (they start as constants, which would hide
    a misread one)."""
    model = model.float().eval()
    # Gemma 4 scales no attention score (its q/k norms set the scale): norm weights of ~4 would
    # make scores of ~256, a softmax that fp32 and fp64 already disagree on by 1e-2.
    unscaled_scores = model.config.model_type.startswith("gemma4")
    with torch.no_grad():
        for param_name, p in model.named_parameters():
            p.mul_(weight_scale)
            if "norm" in param_name or ".ln_" in f".{param_name}":  # GPT-2, Falcon: ln_1, ln_f
                p.add_(torch.randn_like(p) * 0.5)
            if unscaled_scores and param_name.endswith(("q_norm.weight", "k_norm.weight")):
                p.mul_(1 / 8)  # scores of unit-RMS heads times ~16: a softmax fp32 resolves
        for buffer_name, b in model.named_buffers():
            if buffer_name.endswith("layer_scalar"):  # Gemma 4's, saved though a buffer
                b.uniform_(0.5, 1.5)
    return model
