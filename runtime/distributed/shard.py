"""One rank's part of the engine: its slice of the weights, wrapped to join the collectives, and
its slice of the KV pool (every rank's pool has the same slots; rank 0's allocator numbers them)."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from forklm.runtime import builder
from forklm.runtime.attention import AttentionBackend
from forklm.runtime.config import EngineConfig
from forklm.runtime.distributed.group import TPGroup
from forklm.runtime.distributed.layers import parallelize
from forklm.runtime.distributed.sharding import ShardPlan, shard_weights
from forklm.runtime.kv_pool import KVPool
from forklm.runtime.model_loader import LoadedModel
from forklm.runtime.models import CausalLM, ModelSpec

logger = logging.getLogger(__name__)


@dataclass
class ModelShard:
    plan: ShardPlan
    model: CausalLM  # forward -> this rank's logits slice [rows, plan.vocab_size]
    pool: KVPool
    attn: AttentionBackend
    # Rank 0 only: bytes of weights each rank holds (its checkpoint slices in the engine's dtype,
    # however packed), in rank order; None on the others.
    weight_bytes: list[int] | None


def build_model_shard(config: EngineConfig, loaded: LoadedModel, spec: ModelSpec, group: TPGroup,
                      kv_capacity: Callable[[ModelSpec], int] | None) -> ModelShard:
    """Every rank calls this together. Rank 0 passes kv_capacity (slots from its own memory,
    for its shard's KV heads) and the others adopt that number."""
    plan = ShardPlan(spec, group.rank, group.size)
    numel = [0]  # of the slices streamed in: the rank's weights as dense tensors

    def counted(keep_quantized: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in shard_weights(loaded.weights(False), plan):
            numel[0] += tensor.numel()
            yield name, tensor

    sliced = dataclasses.replace(loaded, weights=counted)
    context_len = config.context_length or loaded.config.max_position_embeddings
    model = parallelize(builder.build_model_for(config, sliced, plan.local_spec, context_len),
                        plan, group)
    capacity = group.share_from_first(kv_capacity(plan.local_spec) if kv_capacity else None)
    pool, attn = builder.build_kv_and_attention(config, plan.local_spec, model, capacity)
    own = numel[0] * getattr(torch, config.torch_dtype_name).itemsize
    weight_bytes = group.gather_objects(own)
    logger.info("rank %d: %d/%d heads, KV heads %s, %.1f MiB of weights", group.rank,
                plan.num_heads, spec.num_heads, plan.kv_heads, own / 2**20)
    return ModelShard(plan, model, pool, attn, weight_bytes)
