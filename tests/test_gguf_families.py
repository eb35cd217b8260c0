"""Every family forklm serves from Hugging Face folders, written as a GGUF the way llama.cpp's
converter writes it (gguf-py's tensor names for the architecture, Gemma's norms as 1 + w, Llama's
q/k rows interleaved, MoE experts stacked, the shared-expert gate flattened) and loaded back by
forklm: greedy tokens equal transformers' on the original model, in fp32. The tiny models are
tests/tiny_models.py's, with the fields a GGUF cannot carry set to what llama.cpp assumes."""

from __future__ import annotations

import functools
from collections.abc import Callable

import gguf
import numpy as np
import pytest
import torch

from forklm.runtime.engine.engine import Engine
from forklm.runtime.models.gguf_file import GGUFFile
from forklm.runtime.models.source import default_model_gguf
from tests.conftest import hf_greedy
from tests.test_model_loader import _permute_qk, write_shape
from tests.tiny_models import ARCHITECTURES, build_tiny_model

NUM_NEW = 12
Q8_0 = gguf.GGMLQuantizationType.Q8_0
MXFP4 = gguf.GGMLQuantizationType.MXFP4
PROMPT_TEXTS = ["Paris is the capital of",
                "The quick brown fox jumps over the lazy dog near the river bank."]


def _gemma_defaults(config) -> None:
    # llama.cpp scales attention by 1/sqrt(head_dim) (no GGUF key for query_pre_attn_scalar).
    config.query_pre_attn_scalar = config.head_dim


def _gemma3_pattern(config) -> None:
    # A file that says its pattern (one global layer in two) and its local rope base.
    _gemma_defaults(config)
    config.num_hidden_layers = 4
    config.layer_types = ["sliding_attention", "full_attention"] * 2
    config.rope_parameters["sliding_attention"]["rope_theta"] = 20000.0


def _gemma3_defaults(config) -> None:
    # ... and slides every layer but each sixth: six layers, the last one global.
    _gemma_defaults(config)
    config.num_hidden_layers = 6
    config.layer_types = ["sliding_attention"] * 5 + ["full_attention"]


def _plain_rope(config) -> None:
    # Llama 3's rope scaling travels as a rope_freqs tensor: test_model_loader.py covers it.
    config.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}


def _smollm3_defaults(config) -> None:
    # llama.cpp drops RoPE on every fourth layer and slides no window (no GGUF key for either).
    config.num_hidden_layers = 4
    config.no_rope_layers = [1, 1, 1, 0]
    config.use_sliding_window, config.sliding_window = False, None
    config.layer_types = ["full_attention"] * 4


def _no_sliding_window(config) -> None:
    config.sliding_window = None  # llama.cpp's StarCoder 2 has no window (and no key for one)


def _mlp_four_times_wider(config) -> None:
    config.n_inner = None  # llama.cpp's converter writes feed_forward_length = 4 * n_embd


def _falcon_defaults(config) -> None:
    # llama.cpp's Falcon reads no biases, and its converter writes feed_forward_length 4 * hidden.
    config.bias, config.ffn_hidden_size = False, 4 * config.hidden_size


def _falcon_qkv(array: np.ndarray, config) -> np.ndarray:
    """llama.cpp's converter: Falcon's query_key_value rows, [kv groups, group queries + k + v,
    head_dim] (Falcon 7B: one group), regrouped as all q, all k, all v."""
    kv, heads = config.num_key_value_heads, config.num_attention_heads
    qkv = array.reshape(kv, heads // kv + 2, -1, *array.shape[1:])
    parts = (qkv[:, :-2], qkv[:, -2:-1], qkv[:, -1:])
    return np.concatenate([p.reshape(-1, *array.shape[1:]) for p in parts])


def _bloom_context(config) -> None:
    # BLOOM's config states no context length; llama.cpp's converter writes seq_length.
    config.max_position_embeddings = 256


def _mpt_defaults(config) -> None:
    # MPT's context length is max_seq_len; llama.cpp scales attention by 1/sqrt(head_dim).
    config.max_position_embeddings = config.max_seq_len
    config.attn_config.softmax_scale = None


def _bloom_qkv(array: np.ndarray, config) -> np.ndarray:
    """llama.cpp's converter: BLOOM's query_key_value rows, [heads, q + k + v, head_dim],
    regrouped as all q, all k, all v."""
    qkv = array.reshape(config.num_attention_heads, 3, -1, *array.shape[1:])
    return np.concatenate([qkv[:, i].reshape(-1, *array.shape[1:]) for i in range(3)])


def _gpt_oss_defaults(config) -> None:
    # llama.cpp clamps gpt-oss's SwiGLU at 7 with alpha 1.702 (constants, no GGUF key); layers
    # 0 and 2 slide, as its pattern of two has them. Weights twice as large as the other tiny
    # models' so that gate/up values (up to ~12) still cross the clamp.
    config.swiglu_limit, config.swiglu_alpha = 7.0, 1.702
    config.initializer_range = 0.04
    assert config.layer_types == ["sliding_attention", "full_attention", "sliding_attention"]


def _gpt_oss_tensors(name: str, array: np.ndarray, layer: str | None) -> list | None:
    """llama.cpp's converter on a gpt-oss tensor: experts stored [experts, in, out] with gate and
    up columns interleaved become [experts, out, in] stacks (and their biases split alike); the
    sinks get a `.weight`. None: not one of these."""
    if name.endswith("mlp.experts.gate_up_proj"):
        return [(f"blk.{layer}.ffn_gate_exps.weight", array[:, :, 0::2].transpose(0, 2, 1)),
                (f"blk.{layer}.ffn_up_exps.weight", array[:, :, 1::2].transpose(0, 2, 1))]
    if name.endswith("mlp.experts.gate_up_proj_bias"):
        return [(f"blk.{layer}.ffn_gate_exps.bias", array[:, 0::2]),
                (f"blk.{layer}.ffn_up_exps.bias", array[:, 1::2])]
    if name.endswith("mlp.experts.down_proj"):
        return [(f"blk.{layer}.ffn_down_exps.weight", array.transpose(0, 2, 1))]
    if name.endswith("mlp.experts.down_proj_bias"):
        return [(f"blk.{layer}.ffn_down_exps.bias", array)]
    if name.endswith("self_attn.sinks"):
        return [(f"blk.{layer}.attn_sinks.weight", array)]
    return None


def _no_attention_bias(config) -> None:
    config.attention_bias = False  # llama.cpp's OLMo 2 reads no attention biases


# case -> (tiny_models architecture, GGUF architecture, config edit)
CASES = {
    "llama": ("llama3", "llama", _plain_rope),
    "qwen3": ("qwen3", "qwen3", None),
    "gemma2": ("gemma2", "gemma2", _gemma_defaults),
    "gemma3": ("gemma3", "gemma3", _gemma3_defaults),
    "gemma3_pattern": ("gemma3", "gemma3", _gemma3_pattern),
    "gemma4": ("gemma4", "gemma4", None),
    "gemma4_plain": ("gemma4_plain", "gemma4", None),
    "phi3": ("phi3_short", "phi3", None),
    "mixtral": ("mixtral", "llama", None),  # llama.cpp writes Mixtral as llama with experts
    "qwen2_moe": ("qwen2_moe", "qwen2moe", None),
    "qwen3_moe": ("qwen3_moe", "qwen3moe", None),
    "smollm3": ("smollm3", "smollm3", _smollm3_defaults),
    "granite": ("granite", "granite", None),
    "olmo2": ("olmo2", "olmo2", _no_attention_bias),
    "stablelm": ("stablelm", "stablelm", None),
    "stablelm_parallel": ("stablelm_parallel", "stablelm", None),
    "starcoder2": ("starcoder2", "starcoder2", _no_sliding_window),
    "nemotron": ("nemotron", "nemotron", None),
    "gpt2": ("gpt2", "gpt2", _mlp_four_times_wider),
    "falcon": ("falcon", "falcon", _falcon_defaults),
    "falcon_40b": ("falcon_40b", "falcon", _falcon_defaults),
    "bloom": ("bloom", "bloom", _bloom_context),
    "mpt": ("mpt", "mpt", _mpt_defaults),
    "gpt_oss": ("gpt_oss", "gpt-oss", _gpt_oss_defaults),
}
# The LayerNorm families' epsilon field (llama.cpp's attention.layer_norm_epsilon).
LAYER_NORM_EPS = {"stablelm": "layer_norm_eps", "starcoder2": "norm_epsilon",
                  "nemotron": "norm_eps", "gpt2": "layer_norm_epsilon",
                  "falcon": "layer_norm_epsilon", "bloom": "layer_norm_epsilon",
                  "mpt": "layer_norm_epsilon"}
# GPT-2's Conv1D matrices, [in, out]: the converter transposes them.
GPT2_CONV1D = (".c_attn.weight", ".c_proj.weight", ".c_fc.weight")
# llama.cpp's converter stores these families' norm weights as 1 + w (Gemma 4's as they are).
NORM_PLUS_ONE = ("gemma", "gemma2", "gemma3", "nemotron")
# llama.cpp's converter interleaves each q/k head's rotary halves for these (LlamaModel's).
PERMUTED_QK = {"llama", "smollm3", "granite"}


# (GGUF tensor name, float array) -> (its blocks, their type), or None to write it as it is
Quantizer = Callable[[str, np.ndarray], "tuple[np.ndarray, gguf.GGMLQuantizationType] | None"]


def write_gguf(path, model, arch: str, q8_0: bool = False,
               quantizer: Quantizer | None = None) -> None:
    """`model` (a transformers CausalLM) as llama.cpp's converter would write it, with the
    default model's tokenizer; `q8_0`: its matrices and expert stacks in Q8_0 blocks (where
    rows hold whole blocks; norms and biases stay float32), gpt-oss's expert stacks in MXFP4 as
    llama.cpp's converter writes them; `quantizer`: each tensor's blocks as it decides."""
    config = model.config
    writer = gguf.GGUFWriter(path, arch)
    if arch == "gemma4":
        _write_gemma4_metadata(writer, config)
    else:
        _write_metadata(writer, config)
    _copy_tokenizer(writer)
    def add(gguf_name: str, array: np.ndarray) -> None:
        array = np.ascontiguousarray(array)
        blocks = quantizer(gguf_name, array) if quantizer is not None else None
        if blocks is not None:
            writer.add_tensor(gguf_name, blocks[0], raw_dtype=blocks[1])
        elif q8_0 and array.ndim >= 2 and array.shape[-1] % 32 == 0 and ".bias" not in gguf_name:
            kind = MXFP4 if arch == "gpt-oss" and "_exps.weight" in gguf_name else Q8_0
            writer.add_tensor(gguf_name, gguf.quants.quantize(array, kind), raw_dtype=kind)
        else:
            writer.add_tensor(gguf_name, np.ascontiguousarray(array))

    march = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    names = gguf.get_tensor_name_map(march, config.num_hidden_layers)
    for name, tensor in _stacked_per_head_norms(model.state_dict()).items():
        array = tensor.float().numpy()
        if arch == "bloom":  # the converter drops BLOOM's `transformer.` prefix
            name = name.removeprefix("transformer.")
        if arch in NORM_PLUS_ONE and name.endswith("norm.weight"):
            array = array + 1
        if arch in PERMUTED_QK and (".q_proj." in name or ".k_proj." in name):
            heads = config.num_attention_heads if ".q_proj." in name else config.num_key_value_heads
            array = _permute_qk(array, heads)
        layer = name.split(".")[2] if name.startswith("model.layers.") else None
        if arch == "gpt-oss" and (converted := _gpt_oss_tensors(name, array, layer)) is not None:
            for gguf_name, part in converted:
                add(gguf_name, part)
            continue
        if name.endswith("mlp.experts.gate_up_proj"):  # [experts, 2 * ff, hidden]: gate, then up
            gate, up = np.split(array, 2, axis=1)
            add(f"blk.{layer}.ffn_gate_exps.weight", np.ascontiguousarray(gate))
            add(f"blk.{layer}.ffn_up_exps.weight", np.ascontiguousarray(up))
            continue
        if name.endswith("mlp.experts.down_proj"):
            add(f"blk.{layer}.ffn_down_exps.weight", array)
            continue
        if name.endswith("shared_expert_gate.weight"):
            array = array[0]
        if name.endswith("rotary_emb.inv_freq"):
            continue
        if arch == "gpt2" and name.endswith(GPT2_CONV1D):
            array = array.T
        if arch == "falcon" and ".query_key_value." in name:
            array = _falcon_qkv(array, config)
        if arch == "bloom" and ".query_key_value." in name:
            array = _bloom_qkv(array, config)
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None and name == "lm_head.weight":  # gguf-py's Gemma 2 map has it tied
            gguf_name = "output.weight"
        if name.endswith(".layer_scalar"):  # the converter names Gemma 4's buffer a weight
            gguf_name = f"{gguf_name}.weight"
        assert gguf_name is not None, name
        add(gguf_name, array)
    rope = getattr(config, "rope_parameters", None) or {}  # GPT-2 has none
    if arch == "gemma4":  # the full layers' proportional rope, as freq factors
        full, head_dim = rope["full_attention"], config.per_layer_config["full_attention"].head_dim
        rotated = int(head_dim * full["partial_rotary_factor"] / 2)
        writer.add_tensor("rope_freqs.weight", np.asarray(
            [1.0] * rotated + [1e30] * (head_dim // 2 - rotated), np.float32))
    if rope.get("rope_type") == "longrope":
        writer.add_tensor("rope_factors_long.weight", np.asarray(rope["long_factor"], np.float32))
        writer.add_tensor("rope_factors_short.weight",
                          np.asarray(rope["short_factor"], np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _stacked_per_head_norms(state: dict) -> dict:
    """StableLM's per-head q/k LayerNorms stacked into one [heads, head_dim] tensor each, as
    llama.cpp's converter stacks them."""
    out, heads = {}, {}
    for name, tensor in state.items():
        stem, sep, rest = name.partition("_layernorm.norms.")
        if not sep:
            out[name] = tensor
            continue
        heads.setdefault(f"{stem}_layernorm.weight", []).append((int(rest.split(".")[0]), tensor))
    for name, rows in heads.items():
        out[name] = torch.stack([tensor for _, tensor in sorted(rows, key=lambda row: row[0])])
    return out


def _write_rope(writer, config, head_dim: int) -> None:
    rope = config.rope_parameters.get("full_attention", config.rope_parameters)
    writer.add_rope_freq_base(rope["rope_theta"])
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        writer.add_rope_dimension_count(int(head_dim * rope["partial_rotary_factor"]))
    if rope["rope_type"] == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    if rope["rope_type"] == "longrope":
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    if rope["rope_type"] == "yarn":  # gpt-oss
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])


def _write_metadata(writer, config) -> None:
    write_shape(writer, config)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    if config.model_type in LAYER_NORM_EPS:
        writer.add_layer_norm_eps(getattr(config, LAYER_NORM_EPS[config.model_type]))
    else:
        writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    if getattr(config, "rope_parameters", None):  # GPT-2 has learned positions instead
        _write_rope(writer, config, head_dim)
    if hasattr(config, "use_parallel_residual"):
        writer.add_parallel_residual(config.use_parallel_residual)
    if getattr(config, "sliding_window", None):
        writer.add_sliding_window(config.sliding_window)
    if config.model_type == "gemma3_text" and config.layer_types[:6] != (
            ["sliding_attention"] * 5 + ["full_attention"]):  # not llama.cpp's default
        writer.add_array("gemma3.attention.sliding_window_pattern",
                         [kind == "sliding_attention" for kind in config.layer_types])
        writer.add_float32("gemma3.rope.freq_base_swa",
                           config.rope_parameters["sliding_attention"]["rope_theta"])
    if config.model_type == "mpt":  # ALiBi's bias maximum and clip_qkv
        writer.add_max_alibi_bias(float(config.attn_config.alibi_bias_max))
        if config.attn_config.clip_qkv:
            writer.add_clamp_kqv(config.attn_config.clip_qkv)
    if getattr(config, "attn_logit_softcapping", None):
        writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
    if getattr(config, "final_logit_softcapping", None):
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
    if config.model_type == "granite":  # the converter renames Granite's multipliers
        writer.add_embedding_scale(config.embedding_multiplier)
        writer.add_residual_scale(config.residual_multiplier)
        writer.add_attention_scale(config.attention_multiplier)
        writer.add_logit_scale(config.logits_scaling)
    if getattr(config, "moe_intermediate_size", None):  # Qwen-MoE
        writer.add_expert_count(config.num_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
        if getattr(config, "shared_expert_intermediate_size", 0):
            writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
    elif getattr(config, "num_local_experts", None):  # Mixtral: experts as wide as the MLP
        writer.add_expert_count(config.num_local_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        if config.model_type == "gpt_oss":  # llama.cpp's converter writes it for gpt-oss
            writer.add_expert_feed_forward_length(config.intermediate_size)


def _write_gemma4_metadata(writer, config) -> None:
    """As llama.cpp's Gemma 4 converter: key_length is the full layers' head width, *_swa the
    sliding layers'; per-layer arrays for the sliding pattern, the KV heads (when the full
    layers have their own count) and the MLP widths (when the KV-sharing layers' are double)."""
    n, kinds = config.num_hidden_layers, config.layer_types
    full, swa = config.per_layer_config["full_attention"], config.per_layer_config["sliding_attention"]
    writer.add_block_count(n)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_key_length(full.head_dim)
    writer.add_value_length(full.head_dim)
    writer.add_key_length_swa(swa.head_dim)
    writer.add_value_length_swa(swa.head_dim)
    kv_heads = [swa.num_key_value_heads if kind == "sliding_attention"
                else full.num_key_value_heads for kind in kinds]
    writer.add_head_count_kv(kv_heads if len(set(kv_heads)) > 1 else kv_heads[0])
    first_shared, ff = n - config.num_kv_shared_layers, config.intermediate_size
    writer.add_feed_forward_length([ff if i < first_shared else 2 * ff for i in range(n)]
                                   if config.use_double_wide_mlp else ff)
    writer.add_sliding_window(config.sliding_window)
    writer.add_sliding_window_pattern([kind == "sliding_attention" for kind in kinds])
    writer.add_shared_kv_layers(config.num_kv_shared_layers)
    writer.add_embedding_length_per_layer_input(config.hidden_size_per_layer_input or 0)
    rope = config.rope_parameters
    writer.add_rope_freq_base(rope["full_attention"]["rope_theta"])
    writer.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
    writer.add_rope_dimension_count(full.head_dim)
    writer.add_rope_dimension_count_swa(swa.head_dim)
    if config.final_logit_softcapping:
        writer.add_final_logit_softcapping(config.final_logit_softcapping)


@functools.cache
def _default_tokenizer_fields() -> dict:
    fields = GGUFFile(default_model_gguf()).fields
    return {name: value for name, value in fields.items() if name.startswith("tokenizer.")}


def _copy_tokenizer(writer) -> None:
    value = _default_tokenizer_fields()
    writer.add_tokenizer_model(value["tokenizer.ggml.model"])
    writer.add_tokenizer_pre(value["tokenizer.ggml.pre"])
    writer.add_token_list(value["tokenizer.ggml.tokens"])
    writer.add_token_types(value["tokenizer.ggml.token_type"].tolist())
    writer.add_token_merges(value["tokenizer.ggml.merges"])
    writer.add_bos_token_id(value["tokenizer.ggml.bos_token_id"])
    writer.add_eos_token_id(value["tokenizer.ggml.eos_token_id"])


@pytest.mark.parametrize("case", list(CASES))
def test_a_family_from_gguf_generates_as_transformers(case, tokenizer, tmp_path, monkeypatch):
    monkeypatch.setenv("FORKLM_CACHE_DIR", str(tmp_path / "cache"))
    tiny, arch, edit = CASES[case]
    model = build_tiny_model(tiny, tmp_path / "hf", tokenizer, edit=edit)
    write_gguf(tmp_path / f"{case}.gguf", model, arch)
    prompts = [tokenizer.encode(text) for text in PROMPT_TEXTS]
    expected = [hf_greedy(model, ids, NUM_NEW) for ids in prompts]
    engine = Engine(model_path=str(tmp_path / f"{case}.gguf"), dtype="float32",
                    max_total_tokens=2048, **ARCHITECTURES[tiny].engine_config)
    try:
        assert engine.parts.runner.model.spec.model_type == model.config.model_type
        outs = engine.generate(input_ids=prompts, sampling_params={
            "temperature": 0, "max_new_tokens": NUM_NEW, "ignore_eos": True})
        assert [out["output_ids"] for out in outs] == expected
        _check_cached_config(case, tmp_path / f"{case}.gguf", engine.parts.model_config)
    finally:
        engine.shutdown()


def _check_cached_config(case: str, path, first) -> None:
    """A reload reads the config forklm cached on the first load: as transformers' base class
    where that stands in for the family's own (no family config class imported at start-up),
    which must then hold every value the family's class held and give the same ModelSpec."""
    from forklm.runtime.models import gguf_loader, spec_from_config

    cached = gguf_loader.GGUFModel(path).config
    stands_in = (gguf_loader._cache_dir_for(path) / gguf_loader._PLAIN_CONFIG).is_file()
    assert (type(cached) is gguf_loader._plain_config_class(first.model_type)) == stands_in
    for name in {n for n in vars(first) if not n.startswith("_")} - {"transformers_version"}:
        assert vars(cached)[name] == vars(first)[name], name
    assert cached.model_type == first.model_type
    assert {**cached.to_dict(), "_name_or_path": ""} == {**first.to_dict(), "_name_or_path": ""}
    assert spec_from_config(cached) == spec_from_config(first)
    # the families whose config classes add nothing but validation use the base class
    assert stands_in or case not in ("llama", "qwen3", "qwen2_moe", "gemma2", "olmo2", "granite")


@pytest.mark.parametrize("case", list(CASES))
def test_a_family_kept_quantized_computes_as_dequantized(case, tokenizer, tmp_path, monkeypatch):
    """The family's GGUF in Q8_0, its blocks kept (QuantizedLinear) and dequantized at load:
    prompt logprobs agree, so the quantized path stacks, fuses and reorders each family's
    matrices as the dense path does (the dense path equals transformers, above). The kept
    blocks run the int4 kernel in float32 (a kernel dtype QuantizedLinear offers; the engine
    picks bf16, whose rounding would hide small differences)."""
    monkeypatch.setenv("FORKLM_CACHE_DIR", str(tmp_path / "cache"))
    from forklm.runtime.models.moe import SparseMoE
    from forklm.runtime.quant.linear import QuantizedLinear

    build = QuantizedLinear.from_gguf
    monkeypatch.setattr(QuantizedLinear, "from_gguf", staticmethod(
        lambda parts, bias, dtype, **_: build(parts, bias, dtype, kernel_dtype=torch.float32)))

    tiny, arch, edit = CASES[case]
    model = build_tiny_model(tiny, tmp_path / "hf", tokenizer, edit=edit)
    path = str(tmp_path / f"{case}.gguf")
    write_gguf(path, model, arch, q8_0=True)
    ids = tokenizer.encode(PROMPT_TEXTS[1])
    logprobs = {}
    for mode in ("gguf", "none"):
        engine = Engine(model_path=path, dtype="float32", quantization=mode,
                        max_total_tokens=1024, **ARCHITECTURES[tiny].engine_config)
        try:
            modules = list(engine.parts.runner.model.modules())
            assert any(isinstance(m, QuantizedLinear) for m in modules) == (mode == "gguf")
            # a mixture of experts keeps its expert stacks quantized too
            assert all((m.quantized_experts is not None) == (mode == "gguf")
                       for m in modules if isinstance(m, SparseMoE))
            res = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 0},
                                  return_logprob=True, logprob_start_len=0)
            logprobs[mode] = torch.tensor(
                [lp for lp, _, _ in res["meta_info"]["input_token_logprobs"][1:]])
        finally:
            engine.shutdown()
    torch.testing.assert_close(logprobs["gguf"], logprobs["none"], atol=1e-4, rtol=0)


def test_an_architecture_forklm_lacks_is_refused_by_name(tmp_path):
    from forklm.runtime.errors import UnsupportedModelError
    from forklm.runtime.models.gguf_loader import GGUFModel

    writer = gguf.GGUFWriter(tmp_path / "mamba.gguf", "mamba")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedModelError,
                       match="'mamba' is not supported .it needs state-space .* layers.*gemma3"):
        GGUFModel(tmp_path / "mamba.gguf")


def test_bloom_gguf_reads_as_transformers_gguf_loader(tokenizer, tmp_path, monkeypatch):
    """transformers' own GGUF loader (its BloomTensorProcessor undoes the converter's q/k/v
    regrouping) and forklm, each from the one file: the same greedy tokens in fp32."""
    import transformers

    monkeypatch.setenv("FORKLM_CACHE_DIR", str(tmp_path / "cache"))
    model = build_tiny_model("bloom", tmp_path / "hf", tokenizer, edit=_bloom_context)
    write_gguf(tmp_path / "bloom.gguf", model, "bloom")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file="bloom.gguf", dtype=torch.float32).eval()
    prompts = [tokenizer.encode(text) for text in PROMPT_TEXTS]
    with Engine(model_path=str(tmp_path / "bloom.gguf"), dtype="float32",
                max_total_tokens=1024) as engine:
        outs = engine.generate(input_ids=prompts, sampling_params={
            "temperature": 0, "max_new_tokens": NUM_NEW, "ignore_eos": True})
    assert [out["output_ids"] for out in outs] == [hf_greedy(theirs, ids, NUM_NEW)
                                                   for ids in prompts]

