"""Checkpoints laid out otherwise than Llama's (GPT-2, Falcon, BLOOM, MPT), their tensors renamed onto
forklm's modules and rearranged as they stream from a Hugging Face folder: GPT-2's Conv1D
matrices are stored [in, out] and are transposed to a Linear's [out, in]; Falcon's and BLOOM's
fused q/k/v rows are regrouped into all q heads, then all k heads, then all v heads."""

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


LAYOUTS: dict[str, Callable[[Any, Weights], Weights]] = {"gpt2": gpt2_weights,
                                                          "falcon": falcon_weights,
                                                          "bloom": bloom_weights,
                                                          "mpt": mpt_weights}


def forklm_layout(config: Any, weights: Weights) -> Weights:
    """`weights` (a Hugging Face folder's tensors) under forklm's names and layouts."""
    layout = LAYOUTS.get(config.model_type)
    return weights if layout is None else layout(config, weights)
