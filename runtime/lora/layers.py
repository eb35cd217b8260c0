"""LoRA applied per row of a batch: every linear module of the decoder layers is wrapped once, at
start, and each forward tells the wrappers which packed token rows belong to which adapter.

One batch mixes requests of several adapters and of the base model (S-LoRA's and Punica's point):
the base matmul runs once for all rows, then the adapters add their low-rank updates, never
merged into the base weights. One adapter: (x A^T) B^T on its rows. Several: their A matrices
stacked into one and their B matrices side by side, so two matmuls serve every adapter of the
batch (Punica's segmented products, done densely: each row's products with the other adapters'
columns are zeroed before the second matmul; with ranks of 8-64 that waste is far cheaper on a
CPU than a pair of small matmuls and a gather/scatter per adapter). A batch with no adapter row
runs the base modules alone.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from forklm.runtime.lora.adapter import LoraWeights, ModuleSlot


@dataclass
class LoraBatch:
    """The adapters of the forward now running: each with the packed token rows it updates
    (None: every row), set by the ModelRunner around a forward."""

    groups: list[tuple[LoraWeights, torch.Tensor | None]] = field(default_factory=list)
    # With several groups: each packed row's group index (-1: the base model's rows), and the
    # groups' adapter uids (what a module's stacked matrices are cached under).
    row_groups: torch.Tensor | None = None
    key: tuple[int, ...] = ()


@dataclass(frozen=True)
class _Stack:
    """One module's matrices of several adapters, side by side (see the module docstring)."""

    a_t: torch.Tensor  # [in, R]: every adapter's A^T, R = the sum of their ranks here
    b_t: torch.Tensor  # [R, out]
    col_group: torch.Tensor  # [R] int64: the batch group each column belongs to
    col_scale: torch.Tensor  # [R]: that adapter's scaling


_STACKS_KEPT = 2  # per module: the batch compositions whose stacks are kept


class LoraLinear(nn.Module):
    """`base` (any linear module: dense, quantized, fused q/k/v) plus the updates of the current
    batch's adapters that target `path`."""

    def __init__(self, base: nn.Module, path: str, batch: LoraBatch):
        super().__init__()
        self.base, self.path, self.batch = base, path, batch
        self._stacks: collections.OrderedDict[tuple[int, ...], _Stack | None] = (
            collections.OrderedDict())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._add_updates(x, self.base(x))

    def direct(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """A plain function of x, for the fused decode layers (which call modules directly)."""
        from forklm.runtime.models.fused_layers import direct_call

        base = direct_call(self.base)
        return lambda x: self._add_updates(x, base(x))

    def _add_updates(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if len(self.batch.groups) > 1:
            return self._add_stacked(x, y)
        for weights, rows in self.batch.groups:
            delta = weights.modules.get(self.path)
            if delta is None:  # this adapter leaves this module alone
                continue
            xs = (x if rows is None else x.index_select(0, rows)).to(delta.a.dtype)
            update = ((xs @ delta.a.t()) @ delta.b.t() * delta.scaling).to(y.dtype)
            y = y + update if rows is None else y.index_add(0, rows, update)
        return y

    def _add_stacked(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        stack = self._stack(x.dtype)
        if stack is None:  # no adapter of the batch updates this module
            return y
        row_groups = self.batch.row_groups
        assert row_groups is not None, "several groups come with their rows' group indices"
        mine = row_groups[:, None] == stack.col_group[None, :]  # [T, R]
        h = (x @ stack.a_t) * torch.where(mine, stack.col_scale, 0.0)
        return y + h @ stack.b_t

    def _stack(self, dtype: torch.dtype) -> _Stack | None:
        """The batch's adapters' matrices stacked, in the activations' dtype: these matmuls are
        wide enough (R = the sum of the ranks) for bf16 to beat float32 on the CPU."""
        key = self.batch.key
        if key in self._stacks:
            self._stacks.move_to_end(key)
            return self._stacks[key]
        parts = [(i, d) for i, (weights, _) in enumerate(self.batch.groups)
                 if (d := weights.modules.get(self.path)) is not None]
        stack = None
        if parts:
            a = torch.cat([d.a for _, d in parts]).to(dtype)
            ranks = [d.a.shape[0] for _, d in parts]
            b = torch.cat([d.b for _, d in parts], 1).to(dtype)
            stack = _Stack(a.t().contiguous(), b.t().contiguous(),
                           torch.tensor([i for (i, _), r in zip(parts, ranks) for _ in range(r)],
                                        device=a.device),
                           torch.tensor([d.scaling for _, d in parts for _ in range(d.a.shape[0])],
                                        dtype=a.dtype, device=a.device))
        self._stacks[key] = stack
        while len(self._stacks) > _STACKS_KEPT:
            self._stacks.popitem(last=False)
        return stack


def install_lora(model: nn.Module, batch: LoraBatch) -> dict[str, ModuleSlot]:
    """Wrap every q/k/v, output, gate/up and down projection of `model`'s decoder layers (not a
    mixture's experts) in a LoraLinear reading `batch`; returns each wrapped module's path and
    shape, which adapters are read onto (adapter.read_adapter)."""
    from forklm.runtime.models.decoder import MLP, Attention, DecoderLayer

    slots: dict[str, ModuleSlot] = {}
    for i, layer in enumerate(model.model.layers):  # type: ignore[union-attr, arg-type]
        if not (isinstance(layer, DecoderLayer) and isinstance(layer.self_attn, Attention)):
            continue  # a family with its own layers (Gemma 4): no adapter reaches them
        attn = layer.self_attn
        prefix = f"model.layers.{i}"
        q_size = attn.sizes[0]
        _wrap(attn, "qkv_proj", f"{prefix}.self_attn", slots, batch,
              ModuleSlot(layer.hidden_size, tuple(attn.sizes)))
        _wrap(attn, "o_proj", f"{prefix}.self_attn", slots, batch,
              ModuleSlot(q_size, (layer.hidden_size,)))
        mlp = layer.mlp
        if not isinstance(mlp, MLP):
            continue  # a mixture of experts: its experts take no adapter
        if hasattr(mlp, "gate_up_proj"):
            intermediate = _out_features(mlp.gate_up_proj) // 2
            _wrap(mlp, "gate_up_proj", f"{prefix}.mlp", slots, batch,
                  ModuleSlot(layer.hidden_size, (intermediate, intermediate)))
        else:
            intermediate = _out_features(mlp.up_proj)
            _wrap(mlp, "up_proj", f"{prefix}.mlp", slots, batch,
                  ModuleSlot(layer.hidden_size, (intermediate,)))
        _wrap(mlp, "down_proj", f"{prefix}.mlp", slots, batch,
              ModuleSlot(intermediate, (layer.hidden_size,)))
    return slots


def _wrap(parent: nn.Module, name: str, prefix: str, slots: dict[str, ModuleSlot],
          batch: LoraBatch, slot: ModuleSlot) -> None:
    path = f"{prefix}.{name}"
    setattr(parent, name, LoraLinear(getattr(parent, name), path, batch))
    slots[path] = slot


def _out_features(module: nn.Module) -> int:
    """A linear module's output width: nn.Linear's, or a quantized module's."""
    out = getattr(module, "out_features", None)
    if isinstance(out, int):
        return out
    weight = getattr(module, "weight", None)
    if isinstance(weight, torch.Tensor):
        return int(weight.shape[0])
    raise TypeError(f"cannot tell the output width of {type(module).__name__}")
