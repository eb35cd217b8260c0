"""Checkpoints laid out otherwise than Llama's (GPT-2, Falcon, Gemma 4), their tensors renamed onto
forklm's modules and rearranged as they stream from a Hugging Face folder: GPT-2's Conv1D
matrices are stored [in, out] and are transposed to a Linear's [out, in]; Falcon's fused q/k/v
rows are regrouped into all q heads, then all k heads, then all v heads."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Any

import torch

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


_FALCON_LAYER = re.compile(r"^transformer\.h\.(?P<layer>\d+)\.(?P<module>.+)\.(?P<kind>weight|bias)$")
_FALCON_LAYER_NAMES = {"input_layernorm": "input_layernorm", "ln_attn": "input_layernorm",
                       "ln_mlp": "pre_feedforward_layernorm",
                       "post_attention_layernorm": "post_attention_layernorm",
                       "self_attention.query_key_value": "self_attn.qkv_proj",
                       "self_attention.dense": "self_attn.o_proj",
                       "mlp.dense_h_to_4h": "mlp.up_proj", "mlp.dense_4h_to_h": "mlp.down_proj"}
_FALCON_GLOBAL_NAMES = {"transformer.word_embeddings": "model.embed_tokens",
                        "transformer.ln_f": "model.norm", "lm_head": "lm_head"}


def falcon_weights(config: Any, weights: Weights) -> Weights:
    rows = _falcon_qkv_rows(config)
    for name, tensor in weights:
        module, _, kind = name.rpartition(".")
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
        order = torch.arange(heads * 3).view(heads, 3).t().reshape(-1)
    # [slots] head slots -> [slots * head_dim] rows
    return (order[:, None] * head_dim + torch.arange(head_dim)[None, :]).reshape(-1)


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
                                                          "gemma4_text": gemma4_weights}


def forklm_layout(config: Any, weights: Weights) -> Weights:
    """`weights` (a Hugging Face folder's tensors) under forklm's names and layouts."""
    layout = LAYOUTS.get(config.model_type)
    return weights if layout is None else layout(config, weights)
