"""Batch-invariant paged attention for deterministic inference (--enable-deterministic-inference).

TorchAttention pads each batch to its longest context and lets SDPA (or a split over a shared
prefix) pick its blocking from the batch's shapes, so a query's result depends in its last bits
on the other requests, on its own prefill chunking and on what came from the radix cache. Here
every query row is computed by one fixed procedure whatever the batch:

- keys are split into chunks of KEY_CHUNK aligned at position 0 (flash-decoding's split-KV with a
  fixed split size). Each chunk gets its own max, exp-sum and output; the chunks are then merged
  by a running (cumulative, so strictly sequential) sum in chunk order. A chunk a row cannot see,
  such as the padding up to a longer neighbour's context, adds exact zeros, so padding never
  changes a bit;
- scores and outputs are products of fixed shapes, [tile, head_dim] x [head_dim, KEY_CHUNK]
  and [tile, KEY_CHUNK] x [KEY_CHUNK, head_dim]: a CPU GEMM's result for a row depends on the
  shape of the call, never on where the row sits in it or on how many such products one batched
  call holds (tests/test_deterministic.py checks this). A request's query rows (its GQA group
  folded in) fill tiles of `query_tile` rows, padding the last;
- all of it in float32.

Linear layers get the same treatment in models/batch_invariant.py.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from forklm.runtime.attention.backends import (
    AttentionLayerSpec,
    alibi_slopes_of,
    layer_specs,
    packed_rows,
)

if TYPE_CHECKING:
    from forklm.runtime.forward.batch import ForwardBatch
    from forklm.runtime.kvcache.pool import KVPool

KEY_CHUNK = 64  # keys per split: the padding computed per request is under one chunk
# Stands in for a chunk's max when the row sees none of its keys (exp(-inf - -inf) is nan).
_NO_SCORE = -1e30


@dataclass(frozen=True)
class InvariantAttentionMeta:
    """Per-batch state built by prepare()."""

    slots: torch.Tensor  # [batch * chunks * KEY_CHUNK] context slots (padding: slot 0)
    # window (None: plain causal) -> [1, batch, chunks, tiles, tile, KEY_CHUNK], True = hidden
    hidden: dict[int | None, torch.Tensor]
    num_rows: int  # real folded query rows per (request, kv head): group * max_q
    packed_rows: torch.Tensor | None  # real rows of the padded output; None: all (decode)
    # ALiBi's slope * (key - query position), [kvh, batch, chunks, tiles, tile, KEY_CHUNK]
    # float32: a function of each row's head and position only; None: no ALiBi
    alibi_bias: torch.Tensor | None = None


class BatchInvariantAttention:
    """Attention whose result for a query row depends only on that row and its own context."""

    def __init__(self, pool: KVPool, num_heads: int, num_kv_heads: int, head_dim: int,
                 layers: Sequence[AttentionLayerSpec] | None = None):
        self.pool = pool
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.group = num_heads // num_kv_heads
        # A decode step's rows per (request, kv head) are its GQA group: a tile of at least 4
        # rows keeps a long prefill's tile count (each reads its chunk's keys) moderate.
        self.query_tile = max(4, 1 << (self.group - 1).bit_length())
        self.layers = layer_specs(layers, pool.num_layers)
        self.scales = [spec.scale or head_dim**-0.5 for spec in self.layers]
        self.windows = sorted({spec.sliding_window for spec in self.layers if spec.sliding_window})
        self.alibi = alibi_slopes_of(self.layers, pool.device)  # [num_heads] float32 or None

    def prepare(self, batch: ForwardBatch) -> ForwardBatch:
        device = batch.q_lens.device
        bsz, max_q, tile = batch.batch_size, batch.max_q_len, self.query_tile
        rows = self.group * max_q
        tiles = -(-rows // tile)
        # Folded row r = g * max_q + i is query i of its request: position prefix + i. Padded
        # queries and padded rows take a real query's position, whose keys exist.
        r = torch.arange(tiles * tile, device=device)
        i = torch.where(r < rows, r % max_q, 0)
        i = torch.minimum(i[None, :], batch.q_lens[:, None] - 1)  # [b, tiles*tile]
        q_pos = (batch.kv_lens - batch.q_lens)[:, None, None] + i[:, :, None]
        chunks = -(-batch.slot_table.shape[1] // KEY_CHUNK)
        table = F.pad(batch.slot_table, (0, chunks * KEY_CHUNK - batch.slot_table.shape[1]))
        k_pos = torch.arange(chunks * KEY_CHUNK, device=device)[None, None, :]
        if batch.key_ends is None:
            after = k_pos > q_pos  # [b, tiles*tile, keys]
        else:  # an image token sees its whole image: keys from its key end on are hidden
            rows_q = batch.q_index.gather(1, i)  # [b, tiles*tile] packed index of each row
            after = k_pos >= batch.key_ends[rows_q][:, :, None]
        hidden: dict[int | None, torch.Tensor] = {None: after}
        for w in self.windows:
            hidden[w] = after | (k_pos <= q_pos - w)
        def tiled(m: torch.Tensor) -> torch.Tensor:  # [b, tiles*tile, keys] -> scores' layout
            return m.view(1, bsz, tiles, tile, chunks, KEY_CHUNK).permute(0, 1, 4, 2, 3, 5)

        alibi_bias = None
        if self.alibi is not None:  # row r's head within its KV group is r // max_q
            group_of = torch.clamp(r // max_q, max=self.group - 1)  # [tiles*tile]
            slopes = self.alibi.to(device).view(self.num_kv_heads, self.group)[:, group_of]
            alibi_bias = (slopes.view(-1, 1, 1, tiles, tile, 1)
                          * tiled((k_pos - q_pos).float())).contiguous()
        meta = InvariantAttentionMeta(
            slots=table.reshape(-1),
            hidden={w: tiled(m).contiguous() for w, m in hidden.items()},
            num_rows=rows,
            packed_rows=None if batch.is_decode else packed_rows(batch), alibi_bias=alibi_bias)
        return dataclasses.replace(batch, attn_meta=meta)

    def forward(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                batch: ForwardBatch) -> torch.Tensor:
        self.pool.store(layer_id, batch.out_slots, k, v)
        meta = batch.attn_meta
        assert isinstance(meta, InvariantAttentionMeta), "run the batch prepare() returned"
        bsz, max_q = batch.batch_size, batch.max_q_len
        kvh, g, d, tile = self.num_kv_heads, self.group, self.head_dim, self.query_tile
        spec = self.layers[layer_id]
        hidden = meta.hidden[spec.sliding_window]  # [1, b, chunks, tiles, tile, chunk]
        chunks, tiles = hidden.shape[2], hidden.shape[3]
        # q as [kvh, b, tiles, tile, d]: row g * max_q + i of (head, request), scaled, float32
        q_pad = q if batch.is_decode else q.index_select(0, batch.q_index.reshape(-1))
        q_pad = q_pad.view(bsz, max_q, kvh, g, d).permute(2, 0, 3, 1, 4).reshape(kvh, bsz, -1, d)
        q_pad = F.pad(q_pad.float() * self.scales[layer_id], (0, 0, 0, tiles * tile - meta.num_rows))
        q_tiles = q_pad.view(kvh, bsz, 1, tiles, tile, d)
        # Each request's keys and values by chunk, [b, chunks, chunk, kvh, d]: the products read
        # them in place, each (request, chunk, head)'s [chunk, d] matrix as a strided view.
        ctx_shape = (bsz, chunks, KEY_CHUNK, kvh, d)
        k_ctx = self.pool.read_k(layer_id, meta.slots).view(ctx_shape).float()
        v_ctx = self.pool.read_v(layer_id, meta.slots).view(ctx_shape).float()
        scores = _chunk_products(q_tiles, k_ctx, transpose=True)  # [kvh, b, chunks, tiles, tile, chunk]
        if spec.softcap is not None:
            scores = torch.tanh(scores / spec.softcap) * spec.softcap
        if meta.alibi_bias is not None:
            scores += meta.alibi_bias
        scores.masked_fill_(hidden, float("-inf"))
        chunk_max = scores.amax(dim=-1, keepdim=True).clamp_min(_NO_SCORE)
        p = torch.exp(scores - chunk_max)
        chunk_out = _chunk_products(p, v_ctx, transpose=False)  # [kvh, b, chunks, tiles, tile, d]
        # Merge the chunks in order: a cumulative sum is sequential, so a hidden chunk (weight
        # exactly 0) at the end leaves every earlier partial sum, hence the total, unchanged.
        top = chunk_max.amax(dim=2, keepdim=True)  # [kvh, b, 1, tiles, tile, 1]
        sinks = None if spec.sinks is None else self._sink_rows(spec.sinks, max_q, tiles)
        if sinks is not None:  # one more score with no value: it joins the max and the total
            top = torch.maximum(top, sinks)
        weight = torch.exp(chunk_max - top)
        total = (weight * p.sum(dim=-1, keepdim=True)).cumsum(dim=2)[:, :, -1]
        if sinks is not None:
            total = total + torch.exp(sinks - top)[:, :, 0]
        out = (weight * chunk_out).cumsum(dim=2)[:, :, -1] / total  # [kvh, b, tiles, tile, d]
        out = out.reshape(kvh, bsz, -1, d)[:, :, :meta.num_rows]
        out = out.reshape(kvh, bsz, g, max_q, d).permute(1, 3, 0, 2, 4).reshape(bsz * max_q, -1)
        out = out.to(q.dtype)
        return out if meta.packed_rows is None else out.index_select(0, meta.packed_rows)

    def _sink_rows(self, sinks: torch.Tensor, max_q: int, tiles: int) -> torch.Tensor:
        """[num_heads] sinks -> [kvh, 1, 1, tiles, tile, 1]: folded row g * max_q + i takes
        head kv_head * group + g's (padding rows any real one's)."""
        tile = self.query_tile
        g = (torch.arange(tiles * tile, device=sinks.device) // max_q).clamp(max=self.group - 1)
        rows = sinks.float().view(self.num_kv_heads, self.group)[:, g]  # [kvh, tiles * tile]
        return rows.view(self.num_kv_heads, 1, 1, tiles, tile, 1)


def _chunk_products(x: torch.Tensor, kv: torch.Tensor, transpose: bool) -> torch.Tensor:
    """x [kvh, b, chunks or 1, tiles, tile, n] times each (request, chunk, head)'s keys
    (transpose: [chunk, d]^T, giving scores) or values ([chunk, d], giving outputs) out of kv
    [b, chunks, chunk, kvh, d] -> [kvh, b, chunks, tiles, tile, m].

    Every product is one [tile, n] x [n, m] matrix of a batched matmul, on strided views of kv
    (no copy; neither the batch count nor the batch stride changes a product). A decode step
    (one tile per request) is one call per head over all requests and chunks; a prefill's tiles
    share their chunk's keys through a zero stride, one call per (head, request, chunk)."""
    bsz, chunks, size, kvh, d = kv.shape
    tiles, tile, n = x.shape[3], x.shape[4], x.shape[5]
    m = size if transpose else d
    out = x.new_empty(kvh, bsz, chunks, tiles, tile, m)

    def operand(y: torch.Tensor) -> torch.Tensor:  # y [..., chunk, d]
        return y.transpose(-1, -2) if transpose else y

    for h in range(kvh):
        if tiles == 1:
            xh = x[h].expand(bsz, chunks, 1, tile, n).reshape(-1, tile, n)
            torch.bmm(xh, operand(kv[:, :, :, h].reshape(-1, size, d)), out=out[h].view(-1, tile, m))
            continue
        for b in range(bsz):
            for c in range(chunks):
                xc = x[h, b, c if x.shape[2] > 1 else 0]
                torch.bmm(xc, operand(kv[b, c, :, h].expand(tiles, size, d)), out=out[h, b, c])
    return out
