"""Checkpoints laid out otherwise than Llama's (GPT-2, Falcon, BLOOM, MPT, gpt-oss, Gemma 4), their
tensors renamed onto forklm's modules and rearranged as they stream from a Hugging Face folder:
GPT-2's Conv1D matrices are stored [in, out] and are transposed to a Linear's [out, in]; Falcon's
and BLOOM's fused q/k/v rows are regrouped into all q heads, then all k heads, then all v heads;
gpt-oss's stacked experts (gate and up interleaved; dense [in, out] per expert, or the hub's MXFP4
blocks) become one Llama-style matrix each; Gemma 4's shared layers' leftover k/v are skipped."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Any

import torch

from forklm.runtime.errors import ModelNotFoundError

Weights = Iterator[tuple[str, torch.Tensor]]

_GPT2_LAYER = re.compile(r"^(?:transformer\.)?h\.(?P<layer>\d+)\.(?P<module>.+)\.(?P<kind>weight|bias)$")
_GPT2_LAYER_NAMES = {"ln_1": "input_layernorm", "attn.c_attn": "self_attn.qkv_proj",
                     "attn.c_proj": "self_attn.o_proj", "ln_2": "post_attention_layernorm",
                     "mlp.c_fc": "mlp.up_proj", "mlp.c_proj": "mlp.down_proj"}
_GPT2_CONV1D = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
_GPT2_GLOBAL = re.compile(r"^(?:transformer\.)?(?P<module>wte|wpe|ln_f)\.(?P<kind>weight|bias)$")
_GPT2_GLOBAL_NAMES = {"wte": "model.embed_tokens", "wpe": "model.embed_positions",
                      "ln_f": "model.norm"}
# the causal-mask buffers some GPT-2 checkpoints carry; forklm masks in its attention
_GPT2_BUFFERS = re.compile(r".*\.attn\.(masked_)?bias$")


def gpt2_weights(config: Any, weights: Weights) -> Weights:
    for name, tensor in weights:
        if m := _GPT2_GLOBAL.match(name):
            yield f"{_GPT2_GLOBAL_NAMES[m['module']]}.{m['kind']}", tensor
        elif (m := _GPT2_LAYER.match(name)) and m["module"] in _GPT2_LAYER_NAMES:
            if m["kind"] == "weight" and m["module"] in _GPT2_CONV1D:
                tensor = tensor.t()  # Conv1D [in, out] -> [out, in]
            yield f"model.layers.{m['layer']}.{_GPT2_LAYER_NAMES[m['module']]}.{m['kind']}", tensor
        elif not _GPT2_BUFFERS.match(name):
            yield name, tensor  # lm_head, or a name the weight loader will refuse


# BLOOM names its tensors as Falcon does; some BLOOM checkpoints drop the `transformer.` prefix.
_FALCON_LAYER = re.compile(r"^(?:transformer\.)?h\.(?P<layer>\d+)\.(?P<module>.+)\.(?P<kind>weight|bias)$")
_FALCON_LAYER_NAMES = {"input_layernorm": "input_layernorm", "ln_attn": "input_layernorm",
                       "ln_mlp": "pre_feedforward_layernorm",
                       "post_attention_layernorm": "post_attention_layernorm",
                       "self_attention.query_key_value": "self_attn.qkv_proj",
                       "self_attention.dense": "self_attn.o_proj",
                       "mlp.dense_h_to_4h": "mlp.up_proj", "mlp.dense_4h_to_h": "mlp.down_proj"}
_FALCON_GLOBAL_NAMES = {"word_embeddings": "model.embed_tokens", "ln_f": "model.norm",
                        "lm_head": "lm_head",
                        "word_embeddings_layernorm": "model.embed_norm"}  # BLOOM's


def falcon_weights(config: Any, weights: Weights) -> Weights:
    return _falcon_named(weights, _falcon_qkv_rows(config))


def bloom_weights(config: Any, weights: Weights) -> Weights:
    heads = config.num_attention_heads  # per head: its query, key and value
    return _falcon_named(weights, _per_head_qkv_rows(heads, config.hidden_size // heads))


def _falcon_named(weights: Weights, rows: torch.Tensor | None) -> Weights:
    """Falcon's (and BLOOM's) tensors under forklm's names, query_key_value's rows in `rows`'
    order (None: as they are)."""
    for name, tensor in weights:
        module, _, kind = name.rpartition(".")
        module = module.removeprefix("transformer.")
        if module in _FALCON_GLOBAL_NAMES:
            yield f"{_FALCON_GLOBAL_NAMES[module]}.{kind}", tensor
            continue
        m = _FALCON_LAYER.match(name)
        if m is None or m["module"] not in _FALCON_LAYER_NAMES:
            yield name, tensor  # the weight loader refuses it by name
            continue
        if m["module"] == "self_attention.query_key_value" and rows is not None:
            tensor = tensor[rows]
        yield f"model.layers.{m['layer']}.{_FALCON_LAYER_NAMES[m['module']]}.{m['kind']}", tensor


def _falcon_qkv_rows(config: Any) -> torch.Tensor | None:
    """Row order of Falcon's query_key_value as q heads, k heads, v heads (None: it is so)."""
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = config.hidden_size // heads
    if config.new_decoder_architecture:  # per KV group: its query heads, its key, its value
        slots = torch.arange(kv_heads * (heads // kv_heads + 2)).view(kv_heads, -1)
        order = torch.cat((slots[:, :-2].reshape(-1), slots[:, -2], slots[:, -1]))
    elif config.multi_query:  # all query heads, one key, one value: already in order
        return None
    else:  # per head: its query, key and value
        return _per_head_qkv_rows(heads, head_dim)
    return _head_rows(order, head_dim)


def _per_head_qkv_rows(heads: int, head_dim: int) -> torch.Tensor:
    """Row order of a q/k/v matrix stored per head (its query, key, value) as all q heads, all k
    heads, all v heads."""
    return _head_rows(torch.arange(heads * 3).view(heads, 3).t().reshape(-1), head_dim)


def _head_rows(order: torch.Tensor, head_dim: int) -> torch.Tensor:
    """[slots] head slots -> [slots * head_dim] rows."""
    return (order[:, None] * head_dim + torch.arange(head_dim)[None, :]).reshape(-1)


_MPT_NAMES = {"wte": "model.embed_tokens", "norm_f": "model.norm", "norm_1": "input_layernorm",
              "attn.Wqkv": "self_attn.qkv_proj", "attn.out_proj": "self_attn.o_proj",
              "norm_2": "post_attention_layernorm", "ffn.up_proj": "mlp.up_proj",
              "ffn.down_proj": "mlp.down_proj"}
_MPT_LAYER = re.compile(r"^transformer\.blocks\.(?P<layer>\d+)\.(?P<module>.+)\.(?P<kind>weight|bias)$")


def mpt_weights(config: Any, weights: Weights) -> Weights:
    # MPT's Wqkv holds q, k, v in order already: only names change.
    for name, tensor in weights:
        module, _, kind = name.rpartition(".")
        if (m := _MPT_LAYER.match(name)) and m["module"] in _MPT_NAMES:
            yield f"model.layers.{m['layer']}.{_MPT_NAMES[m['module']]}.{kind}", tensor
        elif module.removeprefix("transformer.") in ("wte", "norm_f"):
            yield f"{_MPT_NAMES[module.removeprefix('transformer.')]}.{kind}", tensor
        else:
            yield name, tensor  # lm_head, or a name the weight loader will refuse


_GPT_OSS_EXPERTS = re.compile(r"^(?P<mlp>.*\.mlp)\.experts\.(?P<part>gate_up_proj|down_proj)"
                              r"(?P<suffix>_bias|_blocks|_scales)?$")
# MXFP4's E2M1 values by 4-bit code (the sign is the high bit)
_FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def gpt_oss_weights(config: Any, weights: Weights) -> Weights:
    """The router is forklm's `mlp.gate`; experts are stored stacked with gate and up interleaved
    (gate 2j, up 2j + 1): dense as [experts, in, out], or (the hub's checkpoints) as MXFP4
    `_blocks` [experts, out, in / 32, 16] and `_scales` [experts, out, in / 32], dequantized here
    one expert at a time. Each expert's gate/up/down weight [out, in] and bias are yielded under
    Mixtral-style per-expert names."""
    packed: dict[str, torch.Tensor] = {}  # a `_blocks` or `_scales` waiting for its other half
    for name, tensor in weights:
        m = _GPT_OSS_EXPERTS.match(name)
        if m is None:
            yield name.replace(".mlp.router.", ".mlp.gate."), tensor
            continue
        prefix = f"{m['mlp']}.experts.{{}}.{m['part']}"
        if m["suffix"] == "_bias":
            yield from _gpt_oss_expert_rows(prefix, "bias", tensor)
        elif m["suffix"] is None:  # [experts, in, out]
            yield from _gpt_oss_expert_rows(prefix, "weight", tensor.transpose(1, 2))
        else:
            packed[name] = tensor
            stem = name.removesuffix(m["suffix"])
            if f"{stem}_blocks" in packed and f"{stem}_scales" in packed:
                blocks, scales = packed.pop(f"{stem}_blocks"), packed.pop(f"{stem}_scales")
                dequantized = (mxfp4_dequantize(b, s) for b, s in zip(blocks, scales))
                yield from _gpt_oss_expert_rows(prefix, "weight", dequantized)
    if packed:
        raise ModelNotFoundError(f"MXFP4 tensors without their blocks or scales: {sorted(packed)}")


def _gpt_oss_expert_rows(prefix: str, kind: str, per_expert: Any) -> Weights:
    """Each expert's [out, ...] rows of `per_expert` (a stacked tensor or an iterator of them):
    down_proj whole, gate_up_proj's even rows as gate_proj and odd rows as up_proj."""
    for e, rows in enumerate(per_expert):
        name = prefix.format(e)
        if name.endswith("down_proj"):
            yield f"{name}.{kind}", rows
        else:
            stem = name.removesuffix("gate_up_proj")
            yield f"{stem}gate_proj.{kind}", rows[0::2]
            yield f"{stem}up_proj.{kind}", rows[1::2]


def mxfp4_dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """blocks [rows, groups, 16] uint8 (two E2M1 codes a byte, the low nibble first), scales
    [rows, groups] uint8 (E8M0: 2^(s - 127)) -> [rows, groups * 32] float32."""
    values = torch.tensor(_FP4_VALUES)
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).long()  # [rows, groups, 16, 2]
    out = values[codes].flatten(2)  # [rows, groups, 32]
    out = torch.ldexp(out, scales.long()[..., None] - 127)
    return out.flatten(1)


_GEMMA4_KV = re.compile(r"^model\.layers\.(?P<layer>\d+)\.self_attn\.[kv]_(proj|norm)\.")


# Gemma 4's router and stacked experts onto forklm's Gemma4MoE (SparseMoE's parameter names).
_GEMMA4_MOE = {"router.proj.weight": "moe.gate.weight", "router.scale": "moe.router_scale",
               "router.per_expert_scale": "moe.per_expert_scale",
               "experts.gate_up_proj": "moe.w13", "experts.down_proj": "moe.w2"}
_GEMMA4_MOE_NAME = re.compile(r"^(?P<layer>model\.layers\.\d+)\.(?P<part>" +
                              "|".join(re.escape(k) for k in _GEMMA4_MOE) + ")$")


def gemma4_weights(config: Any, weights: Weights) -> Weights:
    """Without the k/v projections and norms some checkpoints keep for the layers that read
    another layer's K/V (transformers skips them too); router and experts renamed."""
    first_shared = config.num_hidden_layers - config.num_kv_shared_layers
    for name, tensor in weights:
        m = _GEMMA4_KV.match(name)
        if m is not None and int(m["layer"]) >= first_shared:
            continue
        if moe := _GEMMA4_MOE_NAME.match(name):
            name = f"{moe['layer']}.{_GEMMA4_MOE[moe['part']]}"
        yield name, tensor


LAYOUTS: dict[str, Callable[[Any, Weights], Weights]] = {"gpt2": gpt2_weights,
                                                          "falcon": falcon_weights,
                                                          "bloom": bloom_weights,
                                                          "mpt": mpt_weights,
                                                          "gpt_oss": gpt_oss_weights,
                                                          "gemma4_text": gemma4_weights}


def forklm_layout(config: Any, weights: Weights) -> Weights:
    """`weights` (a Hugging Face folder's tensors) under forklm's names and layouts."""
    layout = LAYOUTS.get(config.model_type)
    return weights if layout is None else layout(config, weights)
