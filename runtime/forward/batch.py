"""ForwardBatch: the tensors one model forward needs, built by the ModelRunner from scheduled requests."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class ForwardBatch:
    """A ragged batch of requests, each contributing q_len new tokens after a cached context.

    Request b's new tokens sit at positions [prefix_len_b, prefix_len_b + q_len_b) and attend to its
    whole context kv_len_b = prefix_len_b + q_len_b, read from the KV pool through slot_table[b].
    """

    input_ids: torch.Tensor  # [num_tokens] int64, the new tokens of all requests, packed
    positions: torch.Tensor  # [num_tokens] int64
    out_slots: torch.Tensor  # [num_tokens] int64, KV slots the new tokens' K/V are written to
    q_lens: torch.Tensor  # [batch] int64
    kv_lens: torch.Tensor  # [batch] int64, prefix + new tokens
    slot_table: torch.Tensor  # [batch, max_kv_len] int64, context slots per request (padded)
    # [batch, max_q_len] int64: index into the packed tokens of request b's i-th new token
    # (padding repeats a valid index; its outputs are dropped).
    q_index: torch.Tensor
    logits_indices: torch.Tensor  # [num_logits] int64, packed rows whose logits are wanted
    max_q_len: int
    is_decode: bool
    # Packed rows whose input embedding is given (image tokens' features) instead of looked up.
    embed_rows: torch.Tensor | None = None  # [m] int64
    embed_values: torch.Tensor | None = None  # [m, hidden]
    # Qwen3-VL's deepstack: [layers, m, hidden] features added to those rows after each of the
    # first decoder layers (layer i's output gets deep_values[i]); None: nothing added.
    deep_values: torch.Tensor | None = None
    # [num_tokens] int64: the end of the keys each packed token sees, where some token sees past
    # its own position (an image token sees its whole image: MultimodalPrompt.blocks); None
    # where every token's keys end at itself (causal).
    key_ends: torch.Tensor | None = None
    # [num_tokens, 3] int64 M-RoPE positions (Qwen2.5-VL) where a request of the batch has images;
    # None: the rotary turns every token by its position.
    rope_positions: torch.Tensor | None = None
    # The attention backend's per-batch state (masks, index tensors on its device), set by its
    # prepare() on the copy of the batch the layers then run with.
    attn_meta: Any = None

    @property
    def rotary_positions(self) -> torch.Tensor:
        """What the rotary tables are read at: the M-RoPE positions, or the positions."""
        return self.positions if self.rope_positions is None else self.rope_positions

    @property
    def batch_size(self) -> int:
        return int(self.q_lens.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    def to(self, device: torch.device) -> ForwardBatch:
        """This batch with its tensors on `device` (itself when they are there already)."""
        if self.input_ids.device == device:
            return self
        moved = {f.name: getattr(self, f.name).to(device, non_blocking=True)
                 for f in dataclasses.fields(self) if isinstance(getattr(self, f.name), torch.Tensor)}
        return dataclasses.replace(self, **moved)
