"""Attention backends over the paged KV pool, chosen by name through a small registry."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from forklm.runtime.forward.batch import ForwardBatch
    from forklm.runtime.kvcache.pool import KVPool


@dataclass(frozen=True)
class AttentionLayerSpec:
    """How one layer's attention differs from plain causal softmax(q k^T / sqrt(d)) v."""

    scale: float | None = None  # None = head_dim ** -0.5
    # A query at position p sees keys at positions (p - sliding_window, p]; None = all before it.
    # The window is a mask over absolute positions, so it holds whatever part of the context came
    # from the radix cache or an earlier prefill chunk (their KV is all still in the pool).
    sliding_window: int | None = None
    softcap: float | None = None  # scores -> softcap * tanh(scores / softcap) before the mask
    # ALiBi: head h's scores get alibi_slopes[h] * (key position - query position), <= 0 for
    # the keys a query sees (the same softmax as BLOOM's slope * key position, with smaller
    # numbers). Positions are absolute in the request's context, so the bias holds for keys that
    # came from the radix cache or an earlier chunk. None: no bias.
    alibi_slopes: tuple[float, ...] | None = None
    # gpt-oss: [num_heads] fp32 logits, one per head, that join the softmax's denominator as a
    # score with no value (a query may so give its keys less than weight 1 in all). None: none.
    sinks: torch.Tensor | None = field(default=None, compare=False)


def layer_specs(layers: Sequence[AttentionLayerSpec] | None, num_layers: int) -> list[AttentionLayerSpec]:
    """One spec per layer; None means plain causal attention everywhere."""
    return list(layers) if layers else [AttentionLayerSpec()] * num_layers


def alibi_slopes_of(layers: Sequence[AttentionLayerSpec], device: torch.device | str
                    ) -> torch.Tensor | None:
    """The layers' ALiBi slopes as one float32 tensor [num_heads] on `device`; None: no ALiBi.
    The backends build a batch's bias once for all layers, so every layer must share them."""
    slopes = {spec.alibi_slopes for spec in layers}
    assert len(slopes) == 1, "ALiBi on every layer alike, or on none"
    first = slopes.pop()
    return None if first is None else torch.tensor(first, dtype=torch.float32, device=device)


class AttentionBackend(Protocol):
    """Stores the new tokens' K/V into the pool, then attends over each request's context."""

    def prepare(self, batch: ForwardBatch) -> ForwardBatch:
        """Called once per forward, before the layers: `batch` with this backend's per-batch
        state (masks, index tensors) in `attn_meta`; the backend itself keeps none."""
        ...

    def forward(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                batch: ForwardBatch) -> torch.Tensor:
        """q [num_tokens, num_heads, head_dim], k/v [num_tokens, num_kv_heads, head_dim]
        -> [num_tokens, num_heads * head_dim]; `batch` is the one prepare() returned."""
        ...


@dataclass(frozen=True)
class TorchAttentionMeta:
    """TorchAttention's per-batch state, built by prepare()."""

    # [batch, 1, group*max_q, max_kv] bool, causal over the padded queries; None when every
    # query sees every key (a decode batch whose contexts are all as long: batch 1, say). With
    # ALiBi an additive float bias instead, [batch, kv_heads, group*max_q, max_kv] (-inf: hidden).
    mask: torch.Tensor | None
    window_masks: dict[int, torch.Tensor]  # sliding window -> mask of the same kind
    packed_rows: torch.Tensor | None  # real rows of the padded output; None: all (decode)
    flat_slots: torch.Tensor  # [batch * (max_kv - shared)] each request's own context slots
    shared_slots: torch.Tensor | None  # [shared_len] or None: no split
    suffix_bias: torch.Tensor | None  # [batch, 1, rows, suffix] additive mask of a split


class TorchAttention:
    """Pure-torch paged attention: gather each request's K/V from the pool into a padded batch
    and run one SDPA call for the whole batch, with the GQA group folded into the query length so
    K/V are never expanded to all query heads.

    When every request of the batch starts with the same KV slots (a prefix shared through the
    radix cache, e.g. a common few-shot prompt), those keys are gathered once and scored against all the
    batch's queries in one GEMM; only each request's own suffix is gathered per request. The
    softmax runs over both parts' scores together, so the result is ordinary attention.

    Layers with a sliding window use their own mask (and never the split); layers with
    soft-capped scores or sinks run the attention in plain ops, since SDPA has neither. ALiBi
    models (every layer biased alike) take their masks as additive biases, built once per batch.
    """

    def __init__(self, pool: KVPool, num_heads: int, num_kv_heads: int, head_dim: int,
                 layers: Sequence[AttentionLayerSpec] | None = None):
        self.pool = pool
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.group = num_heads // num_kv_heads
        self.layers = layer_specs(layers, pool.num_layers)
        self.scales = [spec.scale or head_dim**-0.5 for spec in self.layers]
        self.windows = sorted({spec.sliding_window for spec in self.layers if spec.sliding_window})
        self.alibi = alibi_slopes_of(self.layers, pool.device)  # [num_heads] float32 or None
        assert self.alibi is None or all(spec.softcap is None for spec in self.layers), (
            "ALiBi with soft-capping")
        # plain-ops layers, which read the whole context: no split
        self.softcapped = any(spec.softcap is not None or spec.sinks is not None
                              for spec in self.layers)
        self.min_split_batch = MIN_SPLIT_BATCH.get(pool.dtype, MIN_SPLIT_BATCH_DEFAULT)

    def prepare(self, batch: ForwardBatch) -> ForwardBatch:
        # Query i of request b sits at position prefix_b + i and sees keys j <= prefix_b + i
        # (or j < its key end, where the batch gives one: an image token sees its image).
        prefix = (batch.kv_lens - batch.q_lens)[:, None, None]  # [batch, 1, 1]
        device = batch.q_lens.device
        q_pos = torch.arange(batch.max_q_len, device=device)[None, :, None] + prefix  # [batch, max_q, 1]
        k_pos = torch.arange(batch.slot_table.shape[1], device=device)[None, None, :]  # [1, 1, max_kv]
        if batch.key_ends is None:
            mask = k_pos <= q_pos  # [batch, max_q, max_kv]; padded queries still see key 0
        else:  # padded queries repeat a real one's index, so they see its keys
            mask = k_pos < batch.key_ends[batch.q_index][:, :, None]
        # The GQA group is folded into the query axis: row g * max_q + i.
        folded = mask.repeat(1, self.group, 1)[:, None]  # [batch, 1, group*max_q, max_kv]
        window_masks = {}
        if self.windows:  # padded query rows keep key 0 visible, so no row is all masked
            padded = torch.arange(batch.max_q_len, device=device)[None, :, None] >= batch.q_lens[:, None, None]
            window_masks = {
                w: ((mask & (k_pos > q_pos - w)) | (padded & (k_pos == 0))).repeat(1, self.group, 1)[:, None]
                for w in self.windows}
        # The split gathers only each request's suffix for every layer, so a model with a
        # windowed or soft-capped layer (which reads the whole context) never splits.
        shared = 0 if (self.windows or self.softcapped or self.alibi is not None
                       or batch.key_ends is not None) else (
            _shared_prefix_len(batch, self.min_split_batch))
        table = batch.slot_table
        # Additive mask for the own-suffix part of a split (the flash op takes q's dtype).
        suffix_bias = None
        if shared:
            dtype = self.pool.dtype
            visible = folded[..., shared:]  # [batch, 1, rows, suffix]
            suffix_bias = torch.zeros(visible.shape, dtype=dtype, device=device).masked_fill(
                ~visible, float("-inf"))
        mask = None if _all_keys_visible(batch) else folded
        if self.alibi is not None:  # every mask becomes the bias it leaves visible
            bias = self._alibi_bias(k_pos - q_pos)
            mask = bias.masked_fill(~folded, float("-inf"))
            window_masks = {w: bias.masked_fill(~m, float("-inf")) for w, m in window_masks.items()}
        meta = TorchAttentionMeta(
            mask=mask, window_masks=window_masks,
            packed_rows=None if batch.is_decode else packed_rows(batch),
            # index_select on a flat index is ~6x faster on the CPU than advanced indexing with
            # the 2-D table (0.09 vs 0.54 ms per batch-16 K gather, benchmarks/NOTES.md).
            flat_slots=table[:, shared:].reshape(-1),
            shared_slots=table[0, :shared] if shared else None, suffix_bias=suffix_bias)
        return dataclasses.replace(batch, attn_meta=meta)

    def _alibi_bias(self, distance: torch.Tensor) -> torch.Tensor:
        """distance [batch, max_q, max_kv] (key minus query position) -> ALiBi's bias [batch,
        kv_heads, group*max_q, max_kv] in the pool's dtype, folded as the queries are: row
        g * max_q + i of KV head h is query i of head h * group + g."""
        assert self.alibi is not None
        max_q = distance.shape[1]
        slopes = self.alibi.to(distance.device).view(self.num_kv_heads, self.group)
        rows = slopes.repeat_interleave(max_q, dim=1)  # [kvh, group*max_q]
        folded = distance.float().repeat(1, self.group, 1)[:, None]  # [batch, 1, rows, max_kv]
        return (rows[None, :, :, None] * folded).to(self.pool.dtype)

    def forward(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                batch: ForwardBatch) -> torch.Tensor:
        self.pool.store(layer_id, batch.out_slots, k, v)
        bsz, max_q = batch.batch_size, batch.max_q_len
        kvh, g, d = self.num_kv_heads, self.group, self.head_dim
        meta = batch.attn_meta
        assert isinstance(meta, TorchAttentionMeta), "run the batch prepare() returned"
        ctx_shape = (bsz, -1, kvh, d)  # [batch, max_kv - shared, kvh, d]
        k_ctx = self.pool.read_k(layer_id, meta.flat_slots).view(ctx_shape)
        v_ctx = self.pool.read_v(layer_id, meta.flat_slots).view(ctx_shape)
        # [batch, max_q, heads, d]; a decode batch is already in that order (one token each)
        if batch.is_decode:
            q_pad = q.view(bsz, 1, -1, d)
        else:
            q_pad = q.index_select(0, batch.q_index.reshape(-1))
        q_pad = q_pad.view(bsz, max_q, kvh, g, d).permute(0, 2, 3, 1, 4).reshape(bsz, kvh, g * max_q, d)
        spec = self.layers[layer_id]
        if (spec.softcap is not None or spec.sinks is not None or spec.sliding_window
                or meta.shared_slots is None):
            window = spec.sliding_window
            mask = meta.window_masks[window] if window else meta.mask
            # [1, kvh, g*max_q, 1]: folded row g * max_q + i is query head kv_head * g + g's
            sinks = (None if spec.sinks is None else
                     spec.sinks.view(kvh, g, 1).expand(kvh, g, max_q).reshape(1, kvh, -1, 1))
            out = _attention(q_pad, k_ctx.transpose(1, 2), v_ctx.transpose(1, 2), mask,
                             self.scales[layer_id], spec.softcap, sinks)  # [batch, kvh, g*max_q, d]
        else:
            out = self._split_attention(layer_id, q_pad, k_ctx, v_ctx, meta).to(q.dtype)
        out = out.view(bsz, kvh, g, max_q, d).permute(0, 3, 1, 2, 4).reshape(bsz * max_q, kvh * g * d)
        return out if meta.packed_rows is None else out.index_select(0, meta.packed_rows)

    def _split_attention(self, layer_id: int, q_pad: torch.Tensor, k_own: torch.Tensor,
                         v_own: torch.Tensor, meta: TorchAttentionMeta) -> torch.Tensor:
        """Attention over [shared prefix | own suffix]: one flash-attention call for all the
        batch's queries against the shared keys, one for each request's own keys, merged by
        their log-sum-exps. q_pad [batch, kvh, rows, d]; k_own/v_own [batch, suffix, kvh, d]
        -> [batch, kvh, rows, d]."""
        assert meta.shared_slots is not None and meta.suffix_bias is not None
        if _FLASH_WITH_LSE is None or q_pad.device.type != "cpu":  # the op is CPU-only
            return self._split_attention_math(layer_id, q_pad, k_own, v_own, meta)
        bsz, kvh, rows, d = q_pad.shape
        k_sh = self.pool.read_k(layer_id, meta.shared_slots).transpose(0, 1)
        v_sh = self.pool.read_v(layer_id, meta.shared_slots).transpose(0, 1)
        q_all = q_pad.transpose(0, 1).reshape(1, kvh, bsz * rows, d)  # every query, one "request"
        scale = self.scales[layer_id]
        out_sh, lse_sh = _FLASH_WITH_LSE(q_all, k_sh[None], v_sh[None], scale=scale)[:2]
        out_sh = out_sh.reshape(kvh, bsz, rows, d).transpose(0, 1)  # [batch, kvh, rows, d]
        lse_sh = lse_sh.reshape(kvh, bsz, rows).transpose(0, 1)  # [batch, kvh, rows]
        out_own, lse_own = _FLASH_WITH_LSE(q_pad, k_own.transpose(1, 2), v_own.transpose(1, 2),
                                           attn_mask=meta.suffix_bias, scale=scale)[:2]
        lse = torch.logaddexp(lse_sh, lse_own)
        w_sh, w_own = (lse_sh - lse).exp()[..., None], (lse_own - lse).exp()[..., None]
        return out_sh.float() * w_sh + out_own.float() * w_own

    def _split_attention_math(self, layer_id: int, q_pad: torch.Tensor, k_own: torch.Tensor,
                              v_own: torch.Tensor, meta: TorchAttentionMeta) -> torch.Tensor:
        """The same in plain fp32 torch ops (one softmax over both parts' scores), for torch
        builds without the CPU flash-attention op that returns the log-sum-exp."""
        assert meta.shared_slots is not None
        bsz, kvh, rows, d = q_pad.shape
        shared = meta.shared_slots.numel()
        # [kvh, shared, d]: the shared keys once, for every query of the batch
        k_sh = self.pool.read_k(layer_id, meta.shared_slots).float().transpose(0, 1)
        v_sh = self.pool.read_v(layer_id, meta.shared_slots).float().transpose(0, 1)
        qf = q_pad.float() * self.scales[layer_id]
        q_all = qf.transpose(0, 1).reshape(kvh, bsz * rows, d)  # [kvh, batch*rows, d]
        s_sh = torch.matmul(q_all, k_sh.transpose(1, 2))  # [kvh, batch*rows, shared]
        s_sh = s_sh.view(kvh, bsz, rows, shared).transpose(0, 1)  # [batch, kvh, rows, shared]
        k_own_t = k_own.float().permute(0, 2, 3, 1)  # [batch, kvh, d, suffix]
        s_own = torch.matmul(qf, k_own_t)  # [batch, kvh, rows, suffix]
        if meta.mask is not None:
            s_own.masked_fill_(~meta.mask[..., shared:], float("-inf"))
        p = torch.softmax(torch.cat((s_sh, s_own), dim=-1), dim=-1)
        p_sh = p[..., :shared].transpose(0, 1).reshape(kvh, bsz * rows, shared)
        out = torch.matmul(p_sh, v_sh).view(kvh, bsz, rows, d).transpose(0, 1)
        return out + torch.matmul(p[..., shared:], v_own.float().transpose(1, 2))


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
               scale: float, softcap: float | None, sinks: torch.Tensor | None = None
               ) -> torch.Tensor:
    """q [batch, kvh, rows, d], k/v [batch, kvh, keys, d], mask [batch, 1, rows, keys] bool or
    None (all visible), or an ALiBi bias [batch, kvh, rows, keys] (-inf: hidden), sinks [1, kvh,
    rows, 1] or None."""
    if softcap is None and sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    if softcap is None and sinks is not None and _FLASH_WITH_LSE is not None and (
            q.device.type == "cpu"):
        return _attention_with_sinks(q, k, v, mask, scale, sinks)
    # As transformers' eager path: scale, cap, mask, fp32 softmax, back to q's dtype.
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is not None and mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, float("-inf"))
    elif mask is not None:  # ALiBi's bias
        scores = scores + mask
    if sinks is None:
        return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)
    # the sink is one more column of the softmax, dropped before the values
    sink = sinks.to(scores.dtype).expand(*scores.shape[:-1], 1)
    p = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1, dtype=torch.float32)
    return torch.matmul(p[..., :-1].to(q.dtype), v)


def _attention_with_sinks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          mask: torch.Tensor | None, scale: float, sinks: torch.Tensor
                          ) -> torch.Tensor:
    """_attention with sinks through the CPU flash op, never a [rows, keys] score matrix per head
    (a long prefill's would take gigabytes): with the keys' log-sum-exp L, a sink s only scales
    the output, by sum(exp(scores)) / (sum(exp(scores)) + exp(s)) = sigmoid(L - s)."""
    assert _FLASH_WITH_LSE is not None
    bias = mask  # None, or ALiBi's bias already additive
    if mask is not None and mask.dtype == torch.bool:
        bias = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(
            ~mask, float("-inf"))
    out, lse = _FLASH_WITH_LSE(q, k, v, attn_mask=bias, scale=scale)[:2]  # lse [b, kvh, rows]
    weight = torch.sigmoid(lse - sinks[..., 0].float())[..., None]  # [b, kvh, rows, 1]
    return (out.float() * weight).to(q.dtype)


# torch's CPU flash attention returning (out, logsumexp): a private op, so looked up once and
# optional (the plain-ops fallback gives the same result, slower).
_FLASH_WITH_LSE = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
# A split pays only at larger batches. Whole decode step with 420 of 500 keys shared, split /
# plain: bf16 on an AVX-512-bf16 CPU 1.12x at batch 4, 1.03x at 8, 0.92x at 16, 0.62x at
# 32; fp32 on an AVX2 CPU (gathers move twice the bytes) 1.00x at 4, 0.87x at 8, 0.89x at 16,
# 0.37x at 32 (NOTES.md).
MIN_SPLIT_BATCH = {torch.float32: 8}
MIN_SPLIT_BATCH_DEFAULT = 16
# Below this many shared keys a split costs more small ops than the gathers it saves.
MIN_SHARED_PREFIX = 32


def _shared_prefix_len(batch: ForwardBatch, min_batch: int) -> int:
    """Leading slot-table columns equal across all requests and visible to every query (before
    each request's first new token); 0 when below MIN_SHARED_PREFIX or fewer than `min_batch`
    requests."""
    table = batch.slot_table
    if batch.batch_size < max(2, min_batch):
        return 0
    limit = int((batch.kv_lens - batch.q_lens).min())
    if limit < MIN_SHARED_PREFIX:
        return 0
    same = (table[:, :limit] == table[:1, :limit]).all(dim=0)  # [limit]
    shared = limit if bool(same.all()) else int(same.to(torch.int8).argmin())
    return shared if shared >= MIN_SHARED_PREFIX else 0


def _all_keys_visible(batch: ForwardBatch) -> bool:
    """A decode batch whose contexts all fill the slot table has no masked key: SDPA then runs
    without a mask (the same values; the mask's per-layer conversion is about 40 us at batch 1).
    A captured batch's table is wider than its contexts: it keeps the mask."""
    return batch.is_decode and bool((batch.kv_lens == batch.slot_table.shape[1]).all())


def packed_rows(batch: ForwardBatch) -> torch.Tensor:
    """Rows of the flattened [batch * max_q] output that hold real (non-padding) tokens, in order."""
    i = torch.arange(batch.max_q_len, device=batch.q_lens.device)[None, :]
    keep = i < batch.q_lens[:, None]  # [batch, max_q]
    return keep.flatten().nonzero().squeeze(1)
