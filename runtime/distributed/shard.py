"""One rank's part of the engine: its slice of the weights, wrapped to join the collectives, and
its slice of the KV pool (every rank's pool has the same slots; rank 0's allocator numbers them)."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from forklm.runtime.distributed.layers import parallelize
from forklm.runtime.distributed.sharding import ShardPlan, shard_weights
from forklm.runtime.forward import model_parts

if TYPE_CHECKING:
    from forklm.runtime.attention.backends import AttentionBackend
    from forklm.runtime.config import EngineConfig
    from forklm.runtime.distributed.group import TPGroup
    from forklm.runtime.kvcache.pool import KVPool
    from forklm.runtime.models import CausalLM, ModelSpec
    from forklm.runtime.models.loader import LoadedModel

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


@dataclass
class LoadedShard:
    """A rank's weights, loaded before it joins the group (no collective needed for that)."""

    plan: ShardPlan
    model: CausalLM
    weight_bytes: int  # its checkpoint slices in the engine's dtype, however packed


def load_shard(config: EngineConfig, loaded: LoadedModel, spec: ModelSpec, rank: int,
               size: int) -> LoadedShard:
    """Rank `rank`'s slice of the weights, streamed in tensor by tensor."""
    plan = ShardPlan(spec, rank, size)
    numel = [0]

    def counted(keep_quantized: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in shard_weights(loaded.weights(False), plan):
            numel[0] += tensor.numel()
            yield name, tensor

    sliced = dataclasses.replace(loaded, weights=counted)
    context_len = config.context_length or loaded.config.max_position_embeddings
    model = model_parts.build_model_for(config, sliced, plan.local_spec, context_len)
    own = numel[0] * getattr(torch, config.torch_dtype_name).itemsize
    logger.info("rank %d: %d/%d heads, KV heads %s, %.1f MiB of weights", rank, plan.num_heads,
                spec.num_heads, plan.kv_heads, own / 2**20)
    return LoadedShard(plan, model, own)


def connect_shard(config: EngineConfig, shard: LoadedShard, group: TPGroup,
                  kv_capacity: Callable[[ModelSpec], int] | None) -> ModelShard:
    """Every rank calls this together, once loaded: the model joins the group's collectives and
    gets its KV pool. Rank 0 passes kv_capacity (slots from its own memory, for its shard's KV
    heads) and the others adopt that number."""
    local = shard.plan.local_spec
    model = parallelize(shard.model, shard.plan, group)
    capacity = group.share_from_first(kv_capacity(local) if kv_capacity else None)
    pool, attn = model_parts.build_kv_and_attention(config, local, model, capacity)
    return ModelShard(shard.plan, model, pool, attn, group.gather_objects(shard.weight_bytes))
