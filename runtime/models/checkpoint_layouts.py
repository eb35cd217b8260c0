"""Checkpoints laid out otherwise than Llama's (GPT-2), their tensors renamed onto forklm's
modules and rearranged as they stream from a Hugging Face folder: GPT-2's Conv1D matrices are
stored [in, out] and are transposed to a Linear's [out, in]."""

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


LAYOUTS: dict[str, Callable[[Any, Weights], Weights]] = {"gpt2": gpt2_weights}


def forklm_layout(config: Any, weights: Weights) -> Weights:
    """`weights` (a Hugging Face folder's tensors) under forklm's names and layouts."""
    layout = LAYOUTS.get(config.model_type)
    return weights if layout is None else layout(config, weights)
