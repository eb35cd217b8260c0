"""Gemma 4's decoder on the shared layers: per-layer input embeddings (PLE), late layers that read
the K/V an earlier layer stored, sliding and full layers with heads of different widths and KV
counts (one KV pool holds both: ModelSpec.kv_pool_shape), RMS-normed values and a learned scalar
per layer."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from forklm.runtime.attention.backends import AttentionBackend, AttentionLayerSpec
from forklm.runtime.models.decoder import MLP, CausalLM, _rows, unfilled_embedding
from forklm.runtime.models.layers import ACTIVATIONS, RMSNorm, RotaryEmbedding
from forklm.runtime.models.moe import SparseMoE
from forklm.runtime.models.weights import FusedLinear

if TYPE_CHECKING:
    from forklm.runtime.forward.batch import ForwardBatch
    from forklm.runtime.models.spec import ModelSpec, MoESpec

# A layer's K/V as the pool holds them, by pool layer: [T, pool_kv_heads, pool_head_dim] each.
SharedKV = dict[int, tuple[torch.Tensor, torch.Tensor]]


class Gemma4Attention(nn.Module):
    """Unscaled attention (the q/k norms set the scale) over values RMS-normed without weights.
    A full layer with k_eq_v has no v_proj: its values are its keys before their norm and
    rotation. A layer with a kv_source has neither k nor v: it reads its source's."""

    def __init__(self, spec: ModelSpec, layer_id: int, rotary: RotaryEmbedding):
        super().__init__()
        layer = spec.layers[layer_id]
        self.num_heads, self.head_dim = spec.num_heads, spec.layer_head_dim(layer_id)
        self.num_kv_heads = spec.layer_kv_heads(layer_id)
        _, self.pool_kv_heads, self.pool_head_dim = spec.kv_pool_shape
        self.pool_layer = spec.kv_pool_layers[layer_id]
        self.reads_shared_kv = layer.kv_source is not None
        # Keep this layer's K/V through the forward only if a later layer reads them.
        self.shares_kv = any(other.kv_source == layer_id for other in spec.layers)
        self.eps = spec.norm_eps
        q_size, kv_size = spec.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if self.reads_shared_kv:
            self.q_proj = nn.Linear(spec.hidden_size, q_size, bias=spec.qkv_bias)
        else:
            self.sizes = (q_size, kv_size) if layer.k_eq_v else (q_size, kv_size, kv_size)
            self.qkv_proj = FusedLinear(spec.hidden_size, self.sizes, spec.qkv_bias)
            self.k_norm = RMSNorm(self.head_dim, spec.norm_eps)
        self.q_norm = RMSNorm(self.head_dim, spec.norm_eps)
        self.o_proj = nn.Linear(q_size, spec.hidden_size, bias=spec.o_bias)
        self.rotary = rotary

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """x [T, hidden] -> rotated q [T, heads, d] and k, v as the pool holds them
        [T, pool_kv_heads, pool_d]; k and v are None for a layer that reads shared K/V."""
        if self.reads_shared_kv:
            q = self.q_norm(self.q_proj(x).view(-1, self.num_heads, self.head_dim))
            return self.rotary.rotate(q, q[:, :0], cos, sin)[0], None, None  # no keys to turn
        parts = self.qkv_proj(x).split(self.sizes, dim=-1)
        q = parts[0].reshape(-1, self.num_heads, self.head_dim)  # [T, heads, d]
        k = parts[1].reshape(-1, self.num_kv_heads, self.head_dim)  # [T, kv_heads, d]
        v = parts[-1].reshape(-1, self.num_kv_heads, self.head_dim)  # k_eq_v: parts[1]
        q, k = self.rotary.rotate(self.q_norm(q), self.k_norm(k), cos, sin)
        return q, self._as_pooled(k), self._as_pooled(_unit_rms(v, self.eps))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch,
               attn: AttentionBackend) -> torch.Tensor:
        """Store k, v in this layer's pool layer (a sharing layer stores its source's again, the
        same values) and attend: -> o_proj output [T, hidden]."""
        pad = self.pool_head_dim - self.head_dim
        out = attn.forward(self.pool_layer, F.pad(q, (0, pad)) if pad else q, k, v, batch)
        if pad:  # zero value columns past head_dim: drop them
            out = out.view(-1, self.num_heads, self.pool_head_dim)[..., : self.head_dim]
            out = out.reshape(-1, self.num_heads * self.head_dim)
        return self.o_proj(out)

    def _as_pooled(self, t: torch.Tensor) -> torch.Tensor:
        """[T, kv_heads, d] -> [T, pool_kv_heads, pool_d]: each KV head repeated for the query
        heads it serves, zero columns appended (zero keys add nothing to a score)."""
        if self.pool_kv_heads != self.num_kv_heads:
            t = t.repeat_interleave(self.pool_kv_heads // self.num_kv_heads, dim=1)
        pad = self.pool_head_dim - self.head_dim
        return F.pad(t, (0, pad)) if pad else t


def _unit_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm without a weight (Gemma 4's value norm), in fp32 as transformers computes it."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class Gemma4MoE(SparseMoE):
    """Gemma 4's experts, beside its dense MLP. The router reads the RMS-normed input times a
    learned scale and 1/sqrt(hidden); the top-k weights, renormalised, are scaled per expert."""

    def __init__(self, hidden: int, spec: MoESpec, act, eps: float):
        super().__init__(hidden, spec, act, None)
        self.eps, self.root = eps, hidden**-0.5
        self.router_scale = nn.Parameter(torch.ones(hidden))
        self.per_expert_scale = nn.Parameter(torch.ones(spec.num_experts))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        weights, experts = super().route(_unit_rms(x, self.eps) * self.router_scale * self.root)
        return weights * self.per_expert_scale[experts], experts


class Gemma4DecoderLayer(nn.Module):
    """Gemma's sandwich norms, then the per-layer input's gated residual, all times a scalar.
    With experts (enable_moe_block) the MLP's output and the experts' (routed by the layer's
    input) are normed and summed before the post-MLP norm."""

    def __init__(self, spec: ModelSpec, layer_id: int, rotary: RotaryEmbedding):
        super().__init__()
        norm = functools.partial(RMSNorm, spec.hidden_size, spec.norm_eps)
        self.input_layernorm, self.post_attention_layernorm = norm(), norm()
        self.pre_feedforward_layernorm, self.post_feedforward_layernorm = norm(), norm()
        self.self_attn = Gemma4Attention(spec, layer_id, rotary)
        self.mlp = MLP(spec, spec.layers[layer_id].intermediate_size or spec.intermediate_size)
        self.moe: Gemma4MoE | None = None
        if spec.moe is not None:
            self.moe = Gemma4MoE(spec.hidden_size, spec.moe, ACTIVATIONS[spec.activation],
                                 spec.norm_eps)
            self.post_feedforward_layernorm_1, self.pre_feedforward_layernorm_2 = norm(), norm()
            self.post_feedforward_layernorm_2 = norm()
        self.act = ACTIVATIONS[spec.activation]
        if spec.per_layer_input is not None:
            width = spec.per_layer_input[1]
            self.per_layer_input_gate = nn.Linear(spec.hidden_size, width, bias=False)
            self.per_layer_projection = nn.Linear(width, spec.hidden_size, bias=False)
            self.post_per_layer_input_norm = norm()
        self.layer_scalar = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor, batch: ForwardBatch, attn: AttentionBackend,
                per_layer_input: torch.Tensor | None, shared_kv: SharedKV) -> torch.Tensor:
        """x [T, hidden], per_layer_input [T, per_layer_width] -> [T, hidden]; `shared_kv`
        carries the K/V of the layers that later ones read, within this forward."""
        attn_mod = self.self_attn
        cos, sin = attn_mod.rotary.tables_for(batch.rotary_positions, x.dtype)
        q, k, v = attn_mod.project(self.input_layernorm(x), cos, sin)
        if k is None or v is None:
            k, v = shared_kv[attn_mod.pool_layer]
        elif attn_mod.shares_kv:
            shared_kv[attn_mod.pool_layer] = (k, v)
        x = x + self.post_attention_layernorm(attn_mod.attend(q, k, v, batch, attn))
        x = x + self.post_feedforward_layernorm(self._feed_forward(x))
        if per_layer_input is not None:
            gated = self.act(self.per_layer_input_gate(x)) * per_layer_input
            x = x + self.post_per_layer_input_norm(self.per_layer_projection(gated))
        return x * self.layer_scalar

    def _feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.mlp(self.pre_feedforward_layernorm(x))
        if self.moe is None:
            return h
        weights, experts = self.moe.route(x)
        routed = self.moe.run_experts(self.pre_feedforward_layernorm_2(x), weights, experts)
        return self.post_feedforward_layernorm_1(h) + self.post_feedforward_layernorm_2(routed)


class Gemma4CausalLM(CausalLM):
    """CausalLM with Gemma 4's layers and per-layer inputs: each token's row of a second
    embedding table (num_layers * width wide) plus a projection of its embedding, one slice per
    layer. Its layers always run eagerly (no fused C steps, no compiled ones)."""

    layer_class = Gemma4DecoderLayer
    compiles_layer_steps = False

    def __init__(self, spec: ModelSpec, config, max_positions: int):
        super().__init__(spec, config, max_positions)
        if spec.per_layer_input is not None:
            vocab, width = spec.per_layer_input
            packed = spec.num_layers * width
            self.model.embed_tokens_per_layer = unfilled_embedding(vocab, packed)
            self.model.per_layer_model_projection = nn.Linear(spec.hidden_size, packed, bias=False)
            self.model.per_layer_projection_norm = RMSNorm(width, spec.norm_eps)

    @property
    def attention_layers(self) -> list[AttentionLayerSpec]:
        """One per KV pool layer: the layers that compute their own K/V."""
        return [AttentionLayerSpec(scale=self.spec.attn_scale, sliding_window=layer.sliding_window,
                                   softcap=self.spec.attn_softcap)
                for layer in self.spec.layers if layer.kv_source is None]

    def _run_layers(self, x: torch.Tensor, batch: ForwardBatch, attn: AttentionBackend
                    ) -> torch.Tensor:
        per_layer = self._per_layer_inputs(batch.input_ids, x)  # [T, layers, width] or None
        shared_kv: SharedKV = {}
        for i, layer in enumerate(self.model.layers):
            x = layer(x, batch, attn, None if per_layer is None else per_layer[:, i], shared_kv)
        return x

    def _per_layer_inputs(self, ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor | None:
        """(token rows * sqrt(width) + rms_norm(projection of x / sqrt(hidden))) / sqrt(2)."""
        if self.spec.per_layer_input is None:
            return None
        width, model = self.spec.per_layer_input[1], self.model
        shape = (x.shape[0], self.spec.num_layers, width)
        rows = _rows(model.embed_tokens_per_layer, ids).view(shape)
        rows = rows * torch.tensor(width**0.5, dtype=rows.dtype)  # rounded as transformers does
        projected = model.per_layer_model_projection(x) * self.spec.hidden_size**-0.5
        projected = model.per_layer_projection_norm(projected.view(shape))
        return (projected + rows) * 2**-0.5
