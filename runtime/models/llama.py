"""Llama-family decoder (Llama, SmolLM2, Qwen2 with q/k/v biases) over the paged KV pool.

Parameter names follow Hugging Face's, so a HF state dict loads directly; q/k/v and gate/up are
fused into one matmul each at load time (fewer, larger GEMMs are faster on the CPU).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from forklm.runtime.attention import AttentionBackend
from forklm.runtime.forward_batch import ForwardBatch


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalize in fp32 and cast back before the weight, exactly as HF does (bf16 parity).
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position, built once with HF's rope-scaling functions."""

    def __init__(self, config: PretrainedConfig, head_dim: int, max_positions: int):
        super().__init__()
        rope = _rope_parameters(config)
        if rope.get("rope_type", "default") == "default":
            inv_freq = 1.0 / (rope["rope_theta"] ** (torch.arange(0, head_dim, 2).float() / head_dim))
            scaling = 1.0
        else:
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope["rope_type"]](config, torch.device("cpu"))
        freqs = torch.arange(max_positions).float()[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_positions, head_dim]
        # Plain attributes, not buffers: module.to(bfloat16) must not round the fp32 tables.
        self.cos = emb.cos() * scaling
        self.sin = emb.sin() * scaling
        self._rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor):
        """q [T, heads, d], k [T, kv_heads, d] -> rotated copies."""
        cos, sin = self._tables_for(positions, q.dtype)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin

    def _tables_for(self, positions: torch.Tensor, dtype: torch.dtype):
        """cos/sin rows [T, 1, d] for this forward's positions, looked up once for all layers."""
        if self._rows is None or self._rows[0] is not positions:
            if self.cos.device != positions.device:  # the tables follow the model's device
                self.cos, self.sin = self.cos.to(positions.device), self.sin.to(positions.device)
            cos = self.cos[positions].to(dtype)[:, None, :]
            sin = self.sin[positions].to(dtype)[:, None, :]
            self._rows = (positions, cos, sin)
        return self._rows[1], self._rows[2]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _rope_parameters(config: PretrainedConfig) -> dict:
    rope = getattr(config, "rope_parameters", None)
    if rope:
        return dict(rope)
    scaling = dict(getattr(config, "rope_scaling", None) or {})
    scaling.setdefault("rope_type", scaling.get("type", "default"))
    scaling.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    return scaling


class Attention(nn.Module):
    def __init__(self, config: PretrainedConfig, layer_id: int, rotary: RotaryEmbedding):
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = head_dim_of(config)
        bias = config.model_type == "qwen2" or bool(getattr(config, "attention_bias", False))
        h, q_size, kv_size = config.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(h, q_size + 2 * kv_size, bias=bias)
        self.o_proj = nn.Linear(q_size, h, bias=bool(getattr(config, "attention_bias", False)))
        self.sizes = (q_size, kv_size, kv_size)
        self.rotary = rotary

    def forward(self, x: torch.Tensor, batch: ForwardBatch, attn: AttentionBackend) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split(self.sizes, dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)  # [T, heads, d]
        k = k.view(-1, self.num_kv_heads, self.head_dim)  # [T, kv_heads, d]
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        q, k = self.rotary(q, k, batch.positions)
        return self.o_proj(attn.forward(self.layer_id, q, k, v, batch))


class MLP(nn.Module):
    def __init__(self, config: PretrainedConfig):
        super().__init__()
        bias = bool(getattr(config, "mlp_bias", False))
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, layer_id: int, rotary: RotaryEmbedding):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_id, rotary)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, attn: AttentionBackend) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), batch, attn)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, config: PretrainedConfig, max_positions: int):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        rotary = RotaryEmbedding(config, head_dim_of(config), max_positions)
        self.layers = nn.ModuleList(DecoderLayer(config, i, rotary) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """forward(batch) -> fp32 logits for the rows in batch.logits_indices."""

    def __init__(self, config: PretrainedConfig, max_positions: int):
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, max_positions)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if not self.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, attn: AttentionBackend) -> torch.Tensor:
        attn.prepare(batch)
        x = self.model.embed_tokens(batch.input_ids)  # [T, hidden]
        for layer in self.model.layers:
            x = layer(x, batch, attn)
        x = self.model.norm(x[batch.logits_indices])  # norm is per-row: only the rows we need
        head = self.model.embed_tokens.weight if self.tie_word_embeddings else self.lm_head.weight
        return F.linear(x, head).float()  # [num_logits, vocab]

    def load_hf_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load HF-named weights, fusing q/k/v and gate/up; every parameter must be filled."""
        fused = _fuse(state_dict, self.config.num_hidden_layers)
        if self.tie_word_embeddings:
            fused.pop("lm_head.weight", None)
        missing, unexpected = self.load_state_dict(fused, strict=False)
        if missing or unexpected:
            raise ValueError(f"weights do not fit the model: missing={missing} unexpected={unexpected}")


def _fuse(sd: dict[str, torch.Tensor], num_layers: int) -> dict[str, torch.Tensor]:
    out = dict(sd)
    for i in range(num_layers):
        p = f"model.layers.{i}."
        for suffix in ("weight", "bias"):
            names = [f"{p}self_attn.{n}_proj.{suffix}" for n in "qkv"]
            if all(n in out for n in names):
                out[f"{p}self_attn.qkv_proj.{suffix}"] = torch.cat([out.pop(n) for n in names])
            names = [f"{p}mlp.{n}_proj.{suffix}" for n in ("gate", "up")]
            if all(n in out for n in names):
                out[f"{p}mlp.gate_up_proj.{suffix}"] = torch.cat([out.pop(n) for n in names])
    return out


def head_dim_of(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
