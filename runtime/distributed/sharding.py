"""Which slice of each checkpoint tensor a rank holds (Megatron's split): q/k/v and gate/up by
output rows (column-parallel), o_proj and down_proj by input columns (row-parallel, summed by one
all-reduce), the embedding and LM head by vocabulary rows, norms whole. The stream is sliced
tensor by tensor as it is read, so no rank ever holds more than its shard plus one tensor."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from forklm.runtime.errors import UnsupportedModelError

if TYPE_CHECKING:
    from forklm.runtime.models.spec import ModelSpec


def check_shardable(spec: ModelSpec, tp_size: int) -> None:
    """UnsupportedModelError naming tp_size when `spec` cannot be split over tp_size ranks."""
    def refuse(why: str) -> None:
        raise UnsupportedModelError(f"tp_size={tp_size}: {spec.model_type} {why}; use --tp-size 1")

    if spec.moe is not None:
        refuse("has mixture-of-experts blocks, which are not split across ranks yet")
    if spec.model_type == "gemma4_text":
        refuse("has per-layer inputs and layers of different head widths, not split across ranks yet")
    if spec.qk_norm in ("proj", "each_head"):  # the norm spans all heads / has per-head rows
        refuse(f"has {spec.qk_norm!r} q/k norms, which are not split across ranks yet")
    if spec.num_kv_heads < tp_size and spec.num_heads % tp_size:
        refuse(f"has {spec.num_kv_heads} KV heads, fewer than the ranks, and {spec.num_heads} "
               "attention heads, not divisible by tp_size")
    if spec.intermediate_size < tp_size:
        refuse(f"has intermediate_size {spec.intermediate_size}, less than tp_size")


def split(total: int, parts: int, index: int) -> tuple[int, int]:
    """(start, size) of part `index` when `total` items are split in `parts` contiguous parts as
    evenly as they go (the first total % parts get one more)."""
    size, extra = divmod(total, parts)
    return index * size + min(index, extra), size + (index < extra)


@dataclass(frozen=True)
class ShardPlan:
    """Rank `rank` of `size`: its heads, MLP columns and vocabulary rows of the model `spec`.

    Heads: with at least as many KV heads as ranks, each rank takes whole GQA groups (a KV head
    and the query heads reading it), as evenly as they split: 3 KV heads over 2 ranks give 2 and 1
    groups (SmolLM2's 9 heads: 6 and 3). Nothing is replicated, at the cost of uneven attention
    work. With fewer KV heads than ranks the query heads split evenly, and each rank keeps the KV
    heads its block reads, one per `kv_group` query heads (replicated across ranks).
    """

    spec: ModelSpec
    rank: int
    size: int

    def __post_init__(self) -> None:
        check_shardable(self.spec, self.size)

    @property
    def group(self) -> int:
        """The checkpoint's query heads per KV head."""
        return self.spec.num_heads // self.spec.num_kv_heads

    @property
    def head_start(self) -> int:
        return self._heads[0]

    @property
    def num_heads(self) -> int:
        return self._heads[1]

    @property
    def _heads(self) -> tuple[int, int]:
        if self.spec.num_kv_heads >= self.size:
            start, groups = split(self.spec.num_kv_heads, self.size, self.rank)
            return start * self.group, groups * self.group
        return split(self.spec.num_heads, self.size, self.rank)

    @property
    def kv_group(self) -> int:
        """Query heads per local KV head: a divisor of the GQA group and of the rank's heads, so
        no block of them straddles two groups."""
        return math.gcd(self.group, self.num_heads)

    @property
    def kv_heads(self) -> list[int]:
        """The checkpoint's KV heads this rank keeps, in local order."""
        return [(self.head_start + i) // self.group
                for i in range(0, self.num_heads, self.kv_group)]

    @property
    def intermediate(self) -> tuple[int, int]:
        """(start, size) of this rank's MLP columns."""
        return split(self.spec.intermediate_size, self.size, self.rank)

    @property
    def vocab_size(self) -> int:
        """Rows of the embedding and LM head per rank (the vocabulary padded to size ranks, so
        that the ranks' logits slices gather into one tensor)."""
        return -(-self.spec.vocab_size // self.size)

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_size

    @property
    def local_spec(self) -> ModelSpec:
        """The model this rank builds: fewer heads, MLP columns and vocabulary rows."""
        heads = slice(self.head_start, self.head_start + self.num_heads)
        return dataclasses.replace(self.spec, num_heads=self.num_heads,
                                   alibi_slopes=self.spec.alibi_slopes[heads],  # its heads' own
                                   num_kv_heads=len(self.kv_heads),
                                   intermediate_size=self.intermediate[1],
                                   vocab_size=self.vocab_size)

    def shard(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """This rank's part of checkpoint tensor `name` (a fused one comes back split)."""
        base, _, kind = name.rpartition(".")
        module, _, layer = base.rpartition(".")
        d = self.spec.head_dim
        if layer == "qkv_proj":  # Phi-3 stores q/k/v fused
            kv = self.spec.num_kv_heads * d
            parts = tensor.split((self.spec.num_heads * d, kv, kv))
            return [out for part, p in zip("qkv", parts)
                    for out in self.shard(f"{module}.{part}_proj.{kind}", p)]
        if layer == "gate_up_proj":  # so does its MLP
            gate, up = tensor.chunk(2)
            return (self.shard(f"{module}.gate_proj.{kind}", gate)
                    + self.shard(f"{module}.up_proj.{kind}", up))
        return [(name, self._slice(layer, kind, tensor).contiguous())]

    def _slice(self, layer: str, kind: str, t: torch.Tensor) -> torch.Tensor:
        d = self.spec.head_dim
        if layer == "q_proj":
            return t.narrow(0, self.head_start * d, self.num_heads * d)
        if layer in ("k_proj", "v_proj"):
            heads = t.reshape(self.spec.num_kv_heads, d, *t.shape[1:])
            return heads[self.kv_heads].reshape(-1, *t.shape[1:])
        if layer in ("gate_proj", "up_proj"):
            return t.narrow(0, *self.intermediate)
        if layer in ("o_proj", "down_proj"):
            if kind == "bias":  # added once: rank 0 keeps it, the others add zeros
                return t if self.rank == 0 else torch.zeros_like(t)
            if layer == "o_proj":
                return t.narrow(1, self.head_start * d, self.num_heads * d)
            return t.narrow(1, *self.intermediate)
        if layer in ("embed_tokens", "lm_head"):
            rows = t[self.vocab_start: self.vocab_start + self.vocab_size]
            pad = self.vocab_size - rows.shape[0]  # the last rank's rows past the vocabulary
            return torch.cat((rows, rows.new_zeros(pad, *rows.shape[1:]))) if pad else rows
        return t  # norms: every rank applies them whole


def shard_weights(weights: Iterator[tuple[str, Any]], plan: ShardPlan
                  ) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint stream `weights` cut to `plan`'s rank, tensor by tensor."""
    for name, tensor in weights:
        if not isinstance(tensor, torch.Tensor):
            raise UnsupportedModelError(f"tp_size={plan.size}: {name} is kept quantized, which is "
                                        "not split across ranks; set --quantization none")
        yield from plan.shard(name, tensor)
