"""Sparse mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE, gpt-oss): softmax router, top-k
experts per token, optional renormalisation, Qwen2-MoE's sigmoid-gated shared expert, and gpt-oss's
router and expert biases with its clamped SwiGLU."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from forklm.runtime.models.spec import MoESpec


class SparseMoE(nn.Module):
    """Experts are stacked: w13 [experts, 2 * inter, hidden] (gate rows, then up rows) and
    w2 [experts, hidden, inter]. Tokens are grouped by expert, so each expert runs one GEMM over
    the tokens routed to it."""

    def __init__(self, hidden: int, spec: MoESpec, act: Callable[[torch.Tensor], torch.Tensor],
                 shared_expert: nn.Module | None):
        super().__init__()
        self.spec, self.act = spec, act
        self.gate = nn.Linear(hidden, spec.num_experts, bias=spec.bias)  # the router
        self.w13 = nn.Parameter(torch.empty(spec.num_experts, 2 * spec.intermediate_size, hidden))
        self.w2 = nn.Parameter(torch.empty(spec.num_experts, hidden, spec.intermediate_size))
        if spec.bias:  # gpt-oss: [experts, 2 * inter] and [experts, hidden]
            self.w13_bias = nn.Parameter(torch.empty(spec.num_experts, 2 * spec.intermediate_size))
            self.w2_bias = nn.Parameter(torch.empty(spec.num_experts, hidden))
        self.shared_expert = shared_expert
        self.shared_expert_gate = nn.Linear(hidden, 1, bias=False) if shared_expert else None
        # How an expert multiplies its tokens (batch_invariant.py swaps in a row-tiled one).
        self.expert_linear: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = F.linear
        # A GGUF's experts kept in their blocks: per expert (gate+up, down) QuantizedLinears
        # that replace w13 and w2 (use_quantized_experts)
        self.quantized_experts: nn.ModuleList | None = None

    def use_quantized_experts(self, experts: nn.ModuleList) -> None:
        """Multiply with `experts` (per expert a ModuleList [gate+up, down]) instead of the
        stacked parameters, which are dropped."""
        assert len(experts) == self.spec.num_experts
        self.quantized_experts = experts
        self.w13 = self.w2 = None  # type: ignore[assignment]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]."""
        weights, experts = self.route(x)
        out = self.run_experts(x, weights, experts)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            shared = self.shared_expert(x)
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * shared
        return out

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> each token's expert weights (fp32) and experts, [T, top_k] each."""
        logits = self.gate(x).float()  # [T, experts]
        if self.spec.routing == "topk_softmax":  # gpt-oss: softmax over the chosen logits only
            top, experts = logits.topk(self.spec.top_k, dim=-1)
            return torch.softmax(top, dim=-1), experts
        weights, experts = torch.softmax(logits, dim=-1).topk(self.spec.top_k, dim=-1)
        if self.spec.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, experts

    def run_experts(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor
                    ) -> torch.Tensor:
        """Sum over each token's experts of weight * expert(x): x [T, hidden] -> [T, hidden]."""
        weights = weights.to(x.dtype)
        out = torch.zeros_like(x)
        flat = experts.reshape(-1)  # [T * top_k], token t's picks at t * top_k + j
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=self.spec.num_experts).tolist()
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            picks = order[start:start + n]
            start += n
            tokens = picks // self.spec.top_k  # [n]
            gate, up = self._gate_up(e, x[tokens]).chunk(2, dim=-1)
            y = self._down(e, self._glu(gate, up))  # [n, hidden]
            out.index_add_(0, tokens, y * weights.reshape(-1)[picks, None])
        return out

    def _glu(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        limit = self.spec.swiglu_limit
        if limit is None:
            return self.act(gate) * up
        # gpt-oss's clamped SwiGLU, in transformers' order of operations
        gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.spec.swiglu_alpha))

    def _gate_up(self, e: int, x: torch.Tensor) -> torch.Tensor:
        return self._expert_matmul(e, 0, x)

    def _down(self, e: int, x: torch.Tensor) -> torch.Tensor:
        return self._expert_matmul(e, 1, x)

    def _expert_matmul(self, e: int, which: int, x: torch.Tensor) -> torch.Tensor:
        """Expert e's gate+up (which 0) or down (1) matrix times x, plus its bias if any."""
        if self.quantized_experts is not None:
            y = self._quantized(e, which)(x)
        else:
            y = self.expert_linear(x, (self.w13, self.w2)[which][e])
        return y + (self.w13_bias, self.w2_bias)[which][e] if self.spec.bias else y

    def _quantized(self, e: int, which: int) -> nn.Module:
        assert self.quantized_experts is not None
        pair = self.quantized_experts[e]
        assert isinstance(pair, nn.ModuleList)
        return pair[which]
