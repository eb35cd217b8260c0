"""What differs per GGUF architecture: the Hugging Face config its metadata makes, the Hugging Face
names of its tensors, and what llama.cpp's converter changed in them (q/k row order, Gemma's norm
weights). Metadata keys are llama.cpp's (`{arch}.attention.head_count`, ...)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import transformers

from forklm.runtime.errors import UnsupportedModelError

Key = Callable[..., Any]  # key(name, default=None): the metadata value `{arch}.{name}`

# GGUF layer tensor -> Hugging Face module, for the Llama layout every family starts from.
LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
                "output": "lm_head", "position_embd": "model.embed_positions",
                "token_embd_norm": "model.embed_norm",  # BLOOM's norm after the embedding
                # Gemma 4's per-layer input embeddings
                "per_layer_token_embd": "model.embed_tokens_per_layer",
                "per_layer_model_proj": "model.per_layer_model_projection",
                "per_layer_proj_norm": "model.per_layer_projection_norm"}
# Stacked experts [experts, rows, cols]: one Hugging Face matrix per expert.
EXPERT_NAMES = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj",
                "ffn_down_exps": "down_proj"}
_MOE_NAMES = {
    "ffn_gate_inp": "mlp.gate",  # the router
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",  # stored as [hidden], a [1, hidden] Linear
}
# Gemma's four norms: llama.cpp names the pre-MLP one ffn_norm, as Llama's only second norm.
_GEMMA_NAMES = {"post_attention_norm": "post_attention_layernorm",
                "ffn_norm": "pre_feedforward_layernorm",
                "post_ffw_norm": "post_feedforward_layernorm"}
# Gemma 4's per-layer input residual and its layer scalar (layer_output_scale.weight, [1]).
_GEMMA4_NAMES = {**_GEMMA_NAMES, "inp_gate": "per_layer_input_gate",
                 "proj": "per_layer_projection", "post_norm": "post_per_layer_input_norm",
                 "layer_output_scale": "layer_scalar"}
# OLMo 2 has only the norms after attention and after the MLP.
_POST_NORM_NAMES = {"post_attention_norm": "post_attention_layernorm",
                    "post_ffw_norm": "post_feedforward_layernorm"}
# Phi-3 keeps q/k/v and gate/up fused, as its Hugging Face checkpoints do.
_PHI3_NAMES = {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}


@dataclass(frozen=True)
class GGUFArch:
    """One GGUF architecture: its config class (named: importing one costs ~0.9 s, which a cached
    config skips) and the fields its metadata adds to the common
    ones; `tensor_config`: fields told by which tensors the file has (biases, optional norms);
    `eps_field`: the config field of the norms' epsilon (LayerNorm families read llama.cpp's
    `attention.layer_norm_epsilon`, the others `attention.layer_norm_rms_epsilon`);
    `permuted_qk`: llama.cpp interleaved each q/k head's rotary halves; `norm_plus_one`:
    llama.cpp stored Gemma's RMSNorm weights as 1 + w (Hugging Face stores w)."""

    config_class_name: str
    extra_config: Callable[[Key, int, int], dict[str, Any]] = lambda key, hidden, heads: {}
    layer_names: Mapping[str, str] = field(default_factory=lambda: LAYER_NAMES)
    tensor_config: Callable[[set[str]], dict[str, Any]] = lambda names: {}
    eps_field: str = "rms_norm_eps"
    permuted_qk: bool = False
    norm_plus_one: bool = False

    @property
    def config_class(self) -> type[transformers.PretrainedConfig]:
        return getattr(transformers, self.config_class_name)


def _head_dim(key: Key, hidden: int, heads: int) -> dict[str, Any]:
    return {"head_dim": key("attention.key_length") or hidden // heads}


def _moe(key: Key, norm_topk_prob: bool) -> dict[str, Any]:
    return {"num_experts": key("expert_count"), "num_experts_per_tok": key("expert_used_count"),
            "moe_intermediate_size": key("expert_feed_forward_length"),
            "shared_expert_intermediate_size": key("expert_shared_feed_forward_length", 0),
            "norm_topk_prob": bool(key("expert_weights_norm", norm_topk_prob)),
            "decoder_sparse_step": 1, "mlp_only_layers": []}


def _gemma(key: Key, hidden: int, heads: int, num_layers_27b: int) -> dict[str, Any]:
    """llama.cpp scales Gemma's attention by 1/sqrt(head_dim) except on the 27B models (by their
    layer count), which use hidden / heads: the GGUF has no key for query_pre_attn_scalar."""
    head_dim = _head_dim(key, hidden, heads)["head_dim"]
    scalar = hidden // heads if key("block_count") == num_layers_27b else head_dim
    return {"head_dim": head_dim, "query_pre_attn_scalar": scalar,
            "sliding_window": key("attention.sliding_window")}


def _gemma2(key: Key, hidden: int, heads: int) -> dict[str, Any]:
    return {**_gemma(key, hidden, heads, num_layers_27b=46),
            "attn_logit_softcapping": key("attn_logit_softcapping"),
            "final_logit_softcapping": key("final_logit_softcapping")}


def _gemma3(key: Key, hidden: int, heads: int) -> dict[str, Any]:
    # Global layers take the file's RoPE (with its scaling); local ones rope.freq_base_swa, 10k
    # where the file has none (llama.cpp's default).
    full = {"rope_type": "default", "rope_theta": float(key("rope.freq_base", 1e6))}
    if key("rope.scaling.type") not in (None, "none"):
        full.update(rope_type=key("rope.scaling.type"), factor=float(key("rope.scaling.factor")))
    local = {"rope_type": "default", "rope_theta": float(key("rope.freq_base_swa", 10000.0))}
    return {**_gemma(key, hidden, heads, num_layers_27b=62),
            "rope_parameters": {"full_attention": full, "sliding_attention": local},
            "layer_types": _gemma3_layer_types(key), "final_logit_softcapping": None,
            "attn_logit_softcapping": None}


def _gemma3_layer_types(key: Key) -> list[str]:
    """Which layers slide, as llama.cpp reads a Gemma 3 file: none without a window; else the
    per-layer `attention.sliding_window_pattern` array, or its period n (layers i with
    i % n < n - 1 slide: five local, one global for the default 6; n = 0: all slide)."""
    layers = key("block_count")
    if not key("attention.sliding_window"):
        return ["full_attention"] * layers
    pattern = key("attention.sliding_window_pattern", 6)
    if isinstance(pattern, list):
        slides = [bool(p) for p in pattern][:layers]
    else:
        slides = [pattern == 0 or i % pattern < pattern - 1 for i in range(layers)]
    return ["sliding_attention" if slide else "full_attention" for slide in slides]


def _gemma4(key: Key, hidden: int, heads: int) -> dict[str, Any]:
    """key_length is the full layers' head width, key_length_swa the sliding ones'; KV head
    counts and MLP widths may be per-layer arrays (full layers' KV heads; the KV-sharing layers'
    double-wide MLPs). The full layers' proportional rope is in the rope_freqs tensor
    (gguf_loader.py); sliding layers rotate rope.dimension_count_swa of their dims."""
    if key("expert_count"):
        raise UnsupportedModelError(
            "GGUF architecture 'gemma4' with experts is not supported: it needs llama.cpp's "
            "layout of Gemma 4's experts (fused gate/up stacks, per-expert scales on the down "
            "stack), which forklm does not read (the Hugging Face folder is served)")
    layer_types = _gemma3_layer_types(key)
    kv_heads, ff = key("attention.head_count_kv", heads), key("feed_forward_length")
    kv_heads = kv_heads if isinstance(kv_heads, list) else [kv_heads] * len(layer_types)
    ff = ff if isinstance(ff, list) else [ff] * len(layer_types)
    swa = layer_types.index("sliding_attention") if "sliding_attention" in layer_types else 0
    full = layer_types.index("full_attention")
    head_dim = key("attention.key_length_swa") or key("attention.key_length")
    local = {"rope_type": "default", "rope_theta": float(key("rope.freq_base_swa", 10000.0))}
    if key("rope.dimension_count_swa", head_dim) != head_dim:
        local["partial_rotary_factor"] = key("rope.dimension_count_swa") / head_dim
    return {"head_dim": head_dim, "global_head_dim": key("attention.key_length"),
            "num_key_value_heads": kv_heads[swa], "num_global_key_value_heads": kv_heads[full],
            "intermediate_size": ff[0], "use_double_wide_mlp": ff[-1] == 2 * ff[0],
            "layer_types": layer_types, "sliding_window": key("attention.sliding_window"),
            "num_kv_shared_layers": key("attention.shared_kv_layers", 0),
            "hidden_size_per_layer_input": key("embedding_length_per_layer_input", 0),
            "vocab_size_per_layer_input": key("vocab_size"),  # no key of its own: as llama.cpp
            "final_logit_softcapping": key("final_logit_softcapping"),
            "sliding_rope": local}


def gemma4_rope(full: dict[str, Any], sliding: dict[str, Any], head_dim: int) -> dict[str, Any]:
    """Gemma 4's rope per layer type. llama.cpp's converter writes the full layers' proportional
    rope as freq factors (rope_freqs): 1 for each rotated angle, 1e30 (frequency 0) for the rest."""
    factors = full.get("freq_factors")
    rotated = sum(f == 1.0 for f in factors) if factors else head_dim // 2
    return {"sliding_attention": sliding,
            "full_attention": {"rope_type": "proportional", "rope_theta": full["rope_theta"],
                               "partial_rotary_factor": 2 * rotated / head_dim}}


def _gemma4_tensors(names: set[str]) -> dict[str, Any]:
    # A layer with keys but no values takes its keys as values (attention_k_eq_v).
    layers = {name.split(".")[1] for name in names if name.startswith("blk.")}
    return {"attention_k_eq_v": any(f"blk.{i}.attn_k.weight" in names
                                    and f"blk.{i}.attn_v.weight" not in names for i in layers)}


def _partial_rotary(key: Key, hidden: int, heads: int) -> dict[str, Any]:
    # Phi-4-mini rotates 3/4 of each head, StableLM 1/4, Nemotron 1/2
    rotary, head_dim = key("rope.dimension_count"), _head_dim(key, hidden, heads)["head_dim"]
    return {"rope": {"partial_rotary_factor": rotary / head_dim}} if rotary else {}


def _nemotron(key: Key, hidden: int, heads: int) -> dict[str, Any]:
    return {**_head_dim(key, hidden, heads), **_partial_rotary(key, hidden, heads)}


def _gpt2(key: Key, hidden: int, heads: int) -> dict[str, Any]:
    # GPT-2's config names the MLP width n_inner (llama.cpp's converter writes 4 * n_embd).
    return {"n_inner": key("feed_forward_length")}


def _falcon(key: Key, hidden: int, heads: int) -> dict[str, Any]:
    # llama.cpp runs every Falcon layout as the new decoder architecture does: q/k/v already
    # regrouped by the converter, attention and MLP in parallel.
    return {"num_kv_heads": key("attention.head_count_kv", 1), "alibi": False,
            "ffn_hidden_size": key("feed_forward_length"), "new_decoder_architecture": True,
            "parallel_attn": True}


def _falcon_tensors(names: set[str]) -> dict[str, Any]:
    return {"num_ln_in_parallel_attn": 2 if "blk.0.attn_norm_2.weight" in names else 1,
            "bias": "blk.0.attn_qkv.bias" in names}


def _mlp_bias(names: set[str]) -> dict[str, Any]:
    return {"mlp_bias": "blk.0.ffn_up.bias" in names}


def _stablelm_tensors(names: set[str]) -> dict[str, Any]:
    # As llama.cpp decides: a layer without ffn_norm runs attention and MLP in parallel.
    return {"use_qkv_bias": "blk.0.attn_q.bias" in names,
            "qk_layernorm": "blk.0.attn_q_norm.weight" in names,
            "use_parallel_residual": "blk.0.ffn_norm.weight" not in names}


def _mixtral(key: Key, hidden: int, heads: int) -> dict[str, Any]:
    return {**_head_dim(key, hidden, heads), "num_local_experts": key("expert_count"),
            "num_experts_per_tok": key("expert_used_count")}


def _smollm3(key: Key, hidden: int, heads: int) -> dict[str, Any]:
    # The GGUF has no key for the NoPE layers: llama.cpp drops RoPE on every fourth layer (the
    # default of SmolLM3's config) and slides no window.
    return {**_head_dim(key, hidden, heads), "no_rope_layer_interval": 4,
            "use_sliding_window": False}


def _granite(key: Key, hidden: int, heads: int) -> dict[str, Any]:
    """llama.cpp scales nothing for a missing (or 0) scale key, and takes 1/sqrt(head_dim) as
    the softmax scale; Granite's config defaults would multiply by 1 instead."""
    return {"embedding_multiplier": key("embedding_scale") or 1.0,
            "residual_multiplier": key("residual_scale") or 1.0,
            "attention_multiplier": key("attention.scale") or (hidden // heads) ** -0.5,
            "logits_scaling": key("logit_scale", 1.0)}


def _mpt(key: Key, hidden: int, heads: int) -> dict[str, Any]:
    # MPT's context length is max_seq_len; ALiBi's bias maximum and clip_qkv (llama.cpp's
    # clamp_kqv) from the file, the softmax scale 1/sqrt(head_dim) (no key). The slopes are MPT's
    # own rule (spec.py), which for a head count that is no power of two is not ggml's.
    bias_max = key("attention.max_alibi_bias", 8.0)
    return {"max_seq_len": key("context_length"), "attn_config": {
        "alibi_bias_max": int(bias_max) if float(bias_max).is_integer() else bias_max,
        "clip_qkv": key("attention.clamp_kqv")}}


def _bloom_tensors(names: set[str]) -> dict[str, Any]:
    # BLOOM's head is its embedding: llama.cpp's converter writes a copy of it as output.weight,
    # which transformers ignores (it ties BLOOM whatever the file has), and so does forklm.
    return {"tie_word_embeddings": True}


def _gpt_oss(key: Key, hidden: int, heads: int) -> dict[str, Any]:
    """As llama.cpp runs gpt-oss: layers 0, 2, 4, ... slide (its SWA pattern of 2), the experts'
    SwiGLU clamped at 7 with alpha 1.702 (constants in llama.cpp, not keys of the file), top-k
    softmax routing. YaRN untruncated, as gpt-oss's own config has it."""
    layers = key("block_count")
    read = {"num_local_experts": key("expert_count"), "num_experts_per_tok": key("expert_used_count"),
            "intermediate_size": key("expert_feed_forward_length") or key("feed_forward_length"),
            "sliding_window": key("attention.sliding_window")}
    return {**_head_dim(key, hidden, heads),
            **{name: value for name, value in read.items() if value is not None},
            "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention"
                            for i in range(layers)],
            "swiglu_limit": 7.0, "swiglu_alpha": 1.702, "rope": {"truncate": False}}


# gpt-oss's second norm is llama.cpp's post_attention_norm; the router has a bias.
_GPT_OSS_NAMES = {**LAYER_NAMES, "post_attention_norm": "post_attention_layernorm",
                  "attn_sinks": "self_attn.sinks", "ffn_gate_inp": "mlp.gate"}

_FALCON_NAMES = {**LAYER_NAMES, "attn_qkv": "self_attn.qkv_proj"}
# Falcon 40B's two norms: llama.cpp calls the MLP's (ln_mlp) attn_norm, the attention's (ln_attn)
# attn_norm_2; Falcon 7B's one norm (attn_norm) feeds both.
FALCON_TWO_NORMS = GGUFArch("FalconConfig", _falcon,
                            {**_FALCON_NAMES, "attn_norm": "pre_feedforward_layernorm",
                             "attn_norm_2": "input_layernorm"},
                            tensor_config=_falcon_tensors, eps_field="layer_norm_epsilon")

# llama.cpp writes Mixtral as `llama` whose layers have experts (`llama.expert_count`).
LLAMA_WITH_EXPERTS = GGUFArch("MixtralConfig", _mixtral,
                              {**LAYER_NAMES, "ffn_gate_inp": "mlp.gate"}, permuted_qk=True)

GGUF_ARCHS = {
    "llama": GGUFArch("LlamaConfig", _head_dim, permuted_qk=True),
    "qwen2": GGUFArch("Qwen2Config"),
    "qwen3": GGUFArch("Qwen3Config", _head_dim),
    "qwen2moe": GGUFArch("Qwen2MoeConfig", lambda key, hidden, heads: _moe(key, False),
                         {**LAYER_NAMES, **_MOE_NAMES}),
    "qwen3moe": GGUFArch("Qwen3MoeConfig",
                         lambda key, hidden, heads: {**_head_dim(key, hidden, heads),
                                                     **_moe(key, True)},
                         {**LAYER_NAMES, **_MOE_NAMES}),
    "gemma2": GGUFArch("Gemma2Config", _gemma2, {**LAYER_NAMES, **_GEMMA_NAMES},
                       norm_plus_one=True),
    "gemma3": GGUFArch("Gemma3TextConfig", _gemma3, {**LAYER_NAMES, **_GEMMA_NAMES},
                       norm_plus_one=True),
    # Gemma 4's norms are stored as they are (w, not 1 + w).
    "gemma4": GGUFArch("Gemma4TextConfig", _gemma4, {**LAYER_NAMES, **_GEMMA4_NAMES},
                       tensor_config=_gemma4_tensors),
    "phi3": GGUFArch("Phi3Config", _partial_rotary, {**LAYER_NAMES, **_PHI3_NAMES}),
    "smollm3": GGUFArch("SmolLM3Config", _smollm3, permuted_qk=True),
    "granite": GGUFArch("GraniteConfig", _granite, permuted_qk=True),
    "olmo2": GGUFArch("Olmo2Config", _head_dim, {**LAYER_NAMES, **_POST_NORM_NAMES}),
    # StableLM's per-head q/k norms arrive stacked, [heads, head_dim]: forklm's own layout.
    "stablelm": GGUFArch("StableLmConfig", _partial_rotary,
                         tensor_config=_stablelm_tensors, eps_field="layer_norm_eps"),
    # llama.cpp reads no sliding window for StarCoder 2: every layer attends to all keys.
    "starcoder2": GGUFArch("Starcoder2Config",
                           tensor_config=lambda names: {"use_bias": "blk.0.attn_q.bias" in names,
                                                        "sliding_window": None},
                           eps_field="norm_epsilon"),
    # llama.cpp's converter stores Nemotron's LayerNorm1P weights w - 1 as w (adds the 1).
    "nemotron": GGUFArch("NemotronConfig", _nemotron, tensor_config=_mlp_bias,
                         eps_field="norm_eps", norm_plus_one=True),
    # llama.cpp's converter transposed GPT-2's Conv1D matrices; q/k/v stay fused as in its
    # checkpoints; the learned positions are position_embd.
    "gpt2": GGUFArch("GPT2Config", _gpt2,
                     {**LAYER_NAMES, "attn_qkv": "self_attn.qkv_proj"},
                     eps_field="layer_norm_epsilon"),
    "gpt-oss": GGUFArch("GptOssConfig", _gpt_oss, _GPT_OSS_NAMES),
    # GELU: llama.cpp's Falcon takes ggml's tanh approximation, transformers (and forklm) the
    # exact GELU Falcon's config names.
    "falcon": GGUFArch("FalconConfig", _falcon, _FALCON_NAMES,
                       tensor_config=_falcon_tensors, eps_field="layer_norm_epsilon"),
    # llama.cpp's converter regrouped BLOOM's per-head q/k/v rows as all q, all k, all v:
    # forklm's fused order. ALiBi, the MLP width (4 * hidden) and GELU come from the family.
    "bloom": GGUFArch("BloomConfig", layer_names=_FALCON_NAMES,
                      tensor_config=_bloom_tensors, eps_field="layer_norm_epsilon"),
    # MPT's Wqkv is q, k, v in order; its head is the embedding (spec.py ties it).
    "mpt": GGUFArch("MptConfig", _mpt, _FALCON_NAMES, eps_field="layer_norm_epsilon"),
}


def arch_of(name: str, expert_count: int | None, tensor_names: set[str]) -> GGUFArch:
    """The GGUFArch of a file's `general.architecture` (KeyError: not one forklm reads)."""
    if name == "llama" and expert_count:
        return LLAMA_WITH_EXPERTS
    if name == "falcon" and "blk.0.attn_norm_2.weight" in tensor_names:
        return FALCON_TWO_NORMS
    return GGUF_ARCHS[name]
