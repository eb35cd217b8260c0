"""The two layers tensor parallelism adds around a rank's shard of the decoder: a row-parallel
linear (partial products summed over the ranks) and a vocabulary-parallel embedding. Column-
parallel layers need nothing: a rank's qkv/gate_up matrices are simply narrower."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from forklm.runtime.distributed.group import TPGroup
    from forklm.runtime.distributed.sharding import ShardPlan
    from forklm.runtime.models import CausalLM


class RowParallel(nn.Module):
    """Wraps a linear whose input is this rank's slice of the features (o_proj: its heads,
    down_proj: its MLP columns): each rank's product is a partial sum, all-reduced once."""

    def __init__(self, linear: nn.Module, group: TPGroup):
        super().__init__()
        self.linear, self.group = linear, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(self.linear(x))  # [T, hidden], the same on every rank


class VocabParallelEmbedding(nn.Module):
    """This rank's rows [start, start + n) of the embedding table: ids outside them look up zeros,
    so the all-reduced sum is every id's own row (exactly: the other terms are 0)."""

    def __init__(self, table: nn.Embedding, start: int, group: TPGroup):
        super().__init__()
        self.table, self.start, self.group = table, start, group

    @property
    def weight(self) -> torch.Tensor:
        """The local rows, which a tied LM head multiplies by for this rank's logits slice."""
        return self.table.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.table.num_embeddings)
        x = self.table(local.masked_fill(outside, 0))  # [T, hidden]
        return self.group.all_reduce(x.masked_fill(outside[:, None], 0))


def parallelize(model: CausalLM, plan: ShardPlan, group: TPGroup) -> CausalLM:
    """Wrap `model` (built from plan.local_spec, its shard loaded) so that its forward joins the
    group's collectives: it then returns this rank's slice of the vocabulary's logits."""
    decoder = model.model
    decoder.embed_tokens = VocabParallelEmbedding(decoder.embed_tokens, plan.vocab_start, group)
    for layer in decoder.layers:
        layer.self_attn.o_proj = RowParallel(layer.self_attn.o_proj, group)
        layer.mlp.down_proj = RowParallel(layer.mlp.down_proj, group)
    return model
