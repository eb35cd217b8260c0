"""Builds an engine's parts from an EngineConfig: model weights, KV pool, radix cache, scheduler,
grammar backend."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import psutil
import torch

from forklm.runtime.attention import create_attention_backend
from forklm.runtime.config import EngineConfig
from forklm.runtime.constrained import GrammarBackend
from forklm.runtime.kv_manager import KVCacheManager
from forklm.runtime.kv_pool import KVPool
from forklm.runtime.model_loader import load_model
from forklm.runtime.model_runner import ModelRunner
from forklm.runtime.models.llama import LlamaForCausalLM, head_dim_of
from forklm.runtime.radix_cache import RadixCache
from forklm.runtime.scheduler import Scheduler

logger = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral")


@dataclass
class EngineParts:
    config: EngineConfig
    model_config: Any
    tokenizer: Any
    eos_token_ids: frozenset[int]
    context_len: int
    vocab_size: int
    kv: KVCacheManager
    scheduler: Scheduler
    runner: ModelRunner
    grammar: GrammarBackend


def build_engine_parts(config: EngineConfig) -> EngineParts:
    loaded = load_model(config.model_path)
    hf = loaded.config
    if hf.model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model_type {hf.model_type!r} is not supported; "
                         f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    dtype = getattr(torch, config.torch_dtype_name)
    context_len = config.context_length or hf.max_position_embeddings
    model = LlamaForCausalLM(hf, max_positions=context_len)
    model.load_hf_state_dict(loaded.state_dict)
    model.to(dtype=dtype, device=config.device).eval()
    capacity = _kv_capacity(config, hf, dtype, context_len)
    head_dim = head_dim_of(hf)
    pool = KVPool(hf.num_hidden_layers, capacity, hf.num_key_value_heads, head_dim, dtype,
                  config.device)
    cache = None if config.disable_radix_cache else RadixCache(pool.allocator)
    kv = KVCacheManager(pool, cache, max_rows=config.max_running_requests + 1,
                        max_context=min(context_len, capacity))
    attn = create_attention_backend(config.resolved_attention_backend, pool,
                                    hf.num_attention_heads, hf.num_key_value_heads, head_dim)
    logger.info("model %s (%s), KV capacity %d tokens", loaded.source, dtype, capacity)
    return EngineParts(
        config=config, model_config=hf, tokenizer=loaded.tokenizer,
        eos_token_ids=frozenset(loaded.eos_token_ids), context_len=context_len,
        vocab_size=hf.vocab_size, kv=kv, scheduler=Scheduler(config, kv),
        runner=ModelRunner(model, attn, kv, config.device),
        # The logits are vocab_size wide, which may exceed the tokenizer's length.
        grammar=GrammarBackend.for_tokenizer(loaded.tokenizer, hf.vocab_size, loaded.eos_token_ids,
                                             jump_forward=config.enable_jump_forward),
    )


def _kv_capacity(config: EngineConfig, hf: Any, dtype: torch.dtype, context_len: int) -> int:
    if config.max_total_tokens is not None:
        return config.max_total_tokens
    per_token = KVPool.bytes_per_token(hf.num_hidden_layers, hf.num_key_value_heads,
                                       head_dim_of(hf), dtype)
    by_memory = int(psutil.virtual_memory().available * config.max_total_tokens_fraction) // per_token
    return max(16, min(by_memory, config.max_running_requests * context_len))
