"""One decoder for every supported family, written against the paged KV pool; the differences
between families are ModelSpec switches (spec.py), never a copy of the decoder. Module names follow
the Hugging Face checkpoints, except that q/k/v and gate/up are fused into one matmul each
(fewer, larger GEMMs are faster on the CPU); weights.py maps checkpoint names onto them.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from forklm.runtime.attention.backends import AttentionBackend, AttentionLayerSpec
from forklm.runtime.errors import UnsupportedModelError
from forklm.runtime.models.batch_invariant import tiled_rows
from forklm.runtime.models.layers import (
    ACTIVATIONS,
    LayerNorm,
    RMSNorm,
    RotaryEmbedding,
    soft_cap,
)
from forklm.runtime.models.moe import SparseMoE
from forklm.runtime.models.weights import FusedLinear

if TYPE_CHECKING:
    from forklm.runtime.forward.batch import ForwardBatch
    from forklm.runtime.forward.torch_compile import CompiledLayerSteps
    from forklm.runtime.models.fused_layers import FusedDecodeLayers
    from forklm.runtime.models.onednn_linear import DenseCopyBuild
    from forklm.runtime.models.spec import ModelSpec


def make_norm(spec: ModelSpec, shape: int | tuple[int, ...], bias: bool = True) -> nn.Module:
    """The family's norm over the last axis; `bias` only matters for LayerNorm."""
    if spec.norm_kind == "layer":
        return LayerNorm(shape, spec.norm_eps, spec.norm_offset, bias and spec.norm_bias)
    assert isinstance(shape, int), "RMSNorm weights are one row"
    return RMSNorm(shape, spec.norm_eps, spec.norm_offset)


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec, layer_id: int, rotary: RotaryEmbedding):
        super().__init__()
        self.layer_id = layer_id
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        q_size, kv_size = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        self.qkv_proj = FusedLinear(spec.hidden_size, (q_size, kv_size, kv_size), spec.qkv_bias)
        self.o_proj = nn.Linear(q_size, spec.hidden_size, bias=spec.o_bias)
        self.sizes = (q_size, kv_size, kv_size)
        self.qkv_clip = spec.qkv_clip
        self.qk_norm = spec.qk_norm
        if spec.qk_norm:  # before RoPE; StableLM's q/k LayerNorms have no bias
            q_shape, k_shape = {"head": (spec.head_dim, spec.head_dim),
                                "each_head": ((spec.num_heads, spec.head_dim),
                                              (spec.num_kv_heads, spec.head_dim)),
                                "proj": (q_size, kv_size)}[spec.qk_norm]
            self.q_norm = make_norm(spec, q_shape, bias=False)
            self.k_norm = make_norm(spec, k_shape, bias=False)
        self.rotary = rotary
        if spec.attn_sinks:  # [heads] logits, read by the attention backend (attention_layers)
            self.sinks = nn.Parameter(torch.empty(spec.num_heads))

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> rotated q [T, heads, d], k and v [T, kv_heads, d]; cos/sin are this
        forward's rows of the rotary tables (RotaryEmbedding.tables_for)."""
        qkv = self.qkv_proj(x)
        if self.qkv_clip is not None:  # MPT's clip_qkv
            qkv = qkv.clamp(-self.qkv_clip, self.qkv_clip)
        q, k, v = qkv.split(self.sizes, dim=-1)
        if self.qk_norm == "proj":  # [T, heads * d], [T, kv_heads * d]
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.reshape(-1, self.num_heads, self.head_dim)  # [T, heads, d]
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)  # [T, kv_heads, d]
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm in ("head", "each_head"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary.rotate(q, k, cos, sin)
        return q, k, v


class MLP(nn.Module):
    """Gated: down(act(gate(x)) * up(x)), gate and up as one matmul; plain (gated=False):
    down(act(up(x)))."""

    def __init__(self, spec: ModelSpec, intermediate_size: int):
        super().__init__()
        self.gated = spec.gated_mlp
        if self.gated:
            self.gate_up_proj = FusedLinear(spec.hidden_size, (intermediate_size,) * 2,
                                            spec.mlp_bias)
        else:
            self.up_proj = nn.Linear(spec.hidden_size, intermediate_size, bias=spec.mlp_bias)
        self.down_proj = nn.Linear(intermediate_size, spec.hidden_size, bias=spec.mlp_bias)
        self.act = ACTIVATIONS[spec.activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.gated:
            return self.down_proj(self.act(self.up_proj(x)))
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)


class DecoderLayer(nn.Module):
    """Norm modules are named as the checkpoints name them, which depends on where they sit
    (spec.norm_placement): Llama names its pre-MLP norm post_attention_layernorm, Gemma and
    OLMo 2 the norm on the attention's output."""

    def __init__(self, spec: ModelSpec, layer_id: int, rotary: RotaryEmbedding):
        super().__init__()
        self.hidden_size = spec.hidden_size
        self.placement, self.parallel = spec.norm_placement, spec.parallel_residual
        self.residual_scale = spec.residual_scale
        norm = functools.partial(make_norm, spec, spec.hidden_size)
        if self.placement != "post":
            self.input_layernorm = norm()
        self.self_attn = Attention(spec, layer_id, rotary)
        if not self.parallel:
            self.post_attention_layernorm = norm()
        if self.placement == "sandwich" or self.parallel == "own_norm":  # the MLP's input norm
            self.pre_feedforward_layernorm = norm()
        if self.placement != "pre":
            self.post_feedforward_layernorm = norm()
        self.mlp: nn.Module
        if spec.moe is not None and spec.layers[layer_id].moe:
            shared = (MLP(spec, spec.moe.shared_intermediate_size)
                      if spec.moe.shared_intermediate_size else None)
            self.mlp = SparseMoE(spec.hidden_size, spec.moe, ACTIVATIONS[spec.activation], shared)
        else:
            self.mlp = MLP(spec, spec.intermediate_size)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, attn: AttentionBackend,
                steps: LayerSteps | None = None) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]. The dense work before and after attention runs through
        `steps` (eager by default; torch_compile.py passes compiled ones), attention outside."""
        steps = steps or EAGER_STEPS
        cos, sin = self.self_attn.rotary.tables_for(batch.rotary_positions, x.dtype)
        q, k, v = steps.before_attention(self, x, cos, sin)
        return steps.after_attention(self, x, attn.forward(self.self_attn.layer_id, q, k, v, batch))

    def before_attention(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Input norm, q/k/v projection and rotary: x [T, hidden] -> q, k, v."""
        return self.self_attn.project(x if self.placement == "post" else self.input_layernorm(x),
                                      cos, sin)

    def after_attention(self, x: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """Output projection, residuals, norms and MLP: attn_out [T, heads * d] -> [T, hidden]."""
        h = self.self_attn.o_proj(attn_out)
        if self.parallel == "shared_norm":  # the MLP reads the attention's input (recomputed)
            return x + h + self.mlp(self.input_layernorm(x))
        if self.parallel == "own_norm":
            return x + h + self.mlp(self.pre_feedforward_layernorm(x))
        if self.placement == "sandwich":
            x = x + self.post_attention_layernorm(h)
            return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        if self.placement == "post":
            x = x + self.post_attention_layernorm(h)
            return x + self.post_feedforward_layernorm(self.mlp(x))
        x = x + self._scaled(h)
        return x + self._scaled(self.mlp(self.post_attention_layernorm(x)))

    def _scaled(self, h: torch.Tensor) -> torch.Tensor:
        return h if self.residual_scale == 1.0 else h * self.residual_scale


class LayerSteps(NamedTuple):
    """How a DecoderLayer runs its dense work, as functions of (layer, tensors...): the unbound
    methods, or compiled versions of them that one graph serves for every layer."""

    before_attention: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    after_attention: Callable[..., torch.Tensor]


EAGER_STEPS = LayerSteps(DecoderLayer.before_attention, DecoderLayer.after_attention)


def unfilled_embedding(num_embeddings: int, dim: int) -> nn.Embedding:
    """An nn.Embedding whose table is left unset for the checkpoint to fill. nn.Embedding's own
    random init, run on the meta device the model is built on, imports torch._dynamo: 0.5-0.9 s
    of start-up for values that are thrown away."""
    return nn.Embedding(num_embeddings, dim, _weight=torch.empty(num_embeddings, dim))


class DecoderModel(nn.Module):
    def __init__(self, spec: ModelSpec, config, max_positions: int,
                 layer_class: type[nn.Module] = DecoderLayer):
        super().__init__()
        self.embed_tokens = unfilled_embedding(spec.vocab_size, spec.hidden_size)
        if spec.embed_norm:  # BLOOM's word_embeddings_layernorm
            self.embed_norm = make_norm(spec, spec.hidden_size)
        if spec.position_embeddings:
            if max_positions > spec.position_embeddings:
                raise UnsupportedModelError(
                    f"context length {max_positions} exceeds the {spec.position_embeddings} "
                    f"learned positions of this {spec.model_type} model")
            self.embed_positions = unfilled_embedding(spec.position_embeddings, spec.hidden_size)
        # A table is as wide as the heads of the layers it rotates (Gemma 4's differ by type).
        head_dims = {layer.rope_key: spec.layer_head_dim(i) for i, layer in enumerate(spec.layers)}
        rotaries = {key: RotaryEmbedding(config, rope, head_dims.get(key, spec.head_dim),
                                         max_positions,
                                         layer_type=None if key == "default" else key)
                    for key, rope in spec.rope.items()}
        self.layers = nn.ModuleList(layer_class(spec, i, rotaries[spec.layers[i].rope_key])
                                    for i in range(spec.num_layers))
        self.norm = make_norm(spec, spec.hidden_size)


class CausalLM(nn.Module):
    """forward(batch) -> fp32 logits for the rows in batch.logits_indices.

    The embedding and LM head may be QuantizedLinear modules (a GGUF kept quantized): anything
    with `embedding(ids)` serves as the embedding, anything callable on [T, hidden] as the head.
    """

    layer_class: type[nn.Module] = DecoderLayer
    compiles_layer_steps = True  # its layers run LayerSteps (torch_compile.py compiles them)

    def __init__(self, spec: ModelSpec, config, max_positions: int):
        super().__init__()
        self.spec, self.config = spec, config
        self.model = DecoderModel(spec, config, max_positions, self.layer_class)
        if not spec.tie_word_embeddings:
            self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        # A tied head's own copy of the table in a faster matmul layout (onednn_linear.py).
        self.tied_head: nn.Module | None = None
        # Rows per LM-head matmul call under deterministic inference (batch_invariant.py).
        self.head_tile_rows: int | None = None
        # Compiled layer steps for the batches they serve (torch_compile.py); None: all eager.
        self.compiled_steps: CompiledLayerSteps | None = None
        # The layers with fused C steps for decode-like CPU batches (fused_layers.py).
        self.fused_layers: FusedDecodeLayers | None = None
        # dense copies of the quantized matrices still to be built (build_model's
        # defer_dense_copies): the engine sizes its KV pool with their bytes, then starts them
        self.pending_dense_copies: DenseCopyBuild | None = None

    @property
    def attention_layers(self) -> list[AttentionLayerSpec]:
        """What the attention backend must do differently per layer."""
        return [AttentionLayerSpec(scale=self.spec.attn_scale, sliding_window=layer.sliding_window,
                                   softcap=self.spec.attn_softcap,
                                   alibi_slopes=self.spec.alibi_slopes or None,
                                   sinks=self._sinks(i))
                for i, layer in enumerate(self.spec.layers)]

    def _sinks(self, layer_id: int) -> torch.Tensor | None:
        if not self.spec.attn_sinks:
            return None
        sinks = self.model.get_parameter(f"layers.{layer_id}.self_attn.sinks")
        assert not sinks.is_meta, "attention_layers reads the sinks: load the weights first"
        return sinks.detach().float()

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, attn: AttentionBackend) -> torch.Tensor:
        batch = attn.prepare(batch)
        x = self._embedded(batch)
        fused = self._fused_for(batch, x)
        if fused is not None and batch.logits_indices.numel() == x.shape[0]:
            # every row's logits (a decode step: the rows are in order): the final norm in the
            # layers' C call, not ~7 small torch ops
            return self._logits(fused.run(x, batch, final_norm=self.model.norm))
        x = self._run_layers(x, batch, attn)
        return self._logits(self.model.norm(x[batch.logits_indices]))  # norm is per-row

    @torch.inference_mode()
    def forward_with_hidden(self, batch: ForwardBatch, attn: AttentionBackend,
                            hidden_indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """forward's logits, and the final-normed hidden states of the packed token rows
        `hidden_indices` ([len(hidden_indices), hidden] fp32: what embeddings pool)."""
        x = self._last_hidden(batch, attn)
        normed = self.model.norm(x[hidden_indices]).float()
        return self._logits(self.model.norm(x[batch.logits_indices])), normed

    def _last_hidden(self, batch: ForwardBatch, attn: AttentionBackend) -> torch.Tensor:
        """Embeddings and decoder layers: [T, hidden], before the final norm."""
        batch = attn.prepare(batch)
        return self._run_layers(self._embedded(batch), batch, attn)

    def _embedded(self, batch: ForwardBatch) -> torch.Tensor:
        """The layers' input [T, hidden]: token embeddings, image features, learned positions."""
        x = self._embed(batch.input_ids)  # [T, hidden]
        if batch.embed_rows is not None:  # image tokens: their features, not their embedding
            assert batch.embed_values is not None
            x = x.index_copy(0, batch.embed_rows, batch.embed_values.to(x.dtype))
        if self.spec.position_embeddings:  # GPT-2's learned absolute positions
            x = x + _rows(self.model.embed_positions, batch.positions)
        return x

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        """The head on final-normed rows [num_logits, hidden] -> fp32 [num_logits, vocab]."""
        logits = soft_cap(self._head(x), self.spec.final_softcap)  # [num_logits, vocab]
        if self.spec.logits_divisor != 1.0:
            logits = logits / self.spec.logits_divisor
        return logits.float()

    def _run_layers(self, x: torch.Tensor, batch: ForwardBatch, attn: AttentionBackend
                    ) -> torch.Tensor:
        """The decoder layers: embeddings [T, hidden] -> last hidden states [T, hidden]."""
        fused = self._fused_for(batch, x)
        if fused is not None:
            return fused.run(x, batch)
        deep = batch.deep_values  # Qwen3-VL: added to the image rows after the first layers
        with self._layer_steps(batch) as steps:
            for i, layer in enumerate(self.model.layers):
                x = layer(x, batch, attn, steps)
                if deep is not None and i < len(deep):
                    assert batch.embed_rows is not None
                    x = x.index_add(0, batch.embed_rows, deep[i].to(x.dtype))
        return x

    def _fused_for(self, batch: ForwardBatch, x: torch.Tensor) -> FusedDecodeLayers | None:
        """The fused layers where they take this batch (never with deepstack features)."""
        fused = self.fused_layers
        if fused is None or batch.deep_values is not None or not fused.takes(batch, x):
            return None
        return fused

    def _layer_steps(self, batch: ForwardBatch) -> contextlib.AbstractContextManager[LayerSteps]:
        if self.compiled_steps is None:
            return contextlib.nullcontext(EAGER_STEPS)
        return self.compiled_steps.session(batch)

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        x = _rows(self.model.embed_tokens, ids)
        if self.spec.embed_scale is not None:  # rounded to the model's dtype, as transformers does
            x = x * torch.tensor(self.spec.embed_scale, dtype=x.dtype)
        return self.model.embed_norm(x) if self.spec.embed_norm else x

    def _head(self, x: torch.Tensor) -> torch.Tensor:
        if self.head_tile_rows:
            return tiled_rows(self._head_rows, x, self.head_tile_rows)
        return self._head_rows(x)

    def _head_rows(self, x: torch.Tensor) -> torch.Tensor:
        if not self.spec.tie_word_embeddings:
            return self.lm_head(x)
        if self.tied_head is not None:
            return self.tied_head(x)
        table: Any = self.model.embed_tokens
        return table(x) if hasattr(table, "embedding") else F.linear(x, table.weight)


def _rows(table: Any, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of an embedding table, an nn.Embedding or a quantized one (`embedding(ids)`)."""
    return table.embedding(ids) if hasattr(table, "embedding") else table(ids)
