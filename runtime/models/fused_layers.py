"""FusedDecodeLayers: a decoder's layers for decode-like batches on the CPU with the small steps
between its matmuls fused into C calls (kernels/cpu/fused_layer_ops.c), for the batches the native
attention kernel takes.

A batch-1 step of the default model spends about as long in ~1700 small torch ops (norms, rotary,
the K/V write, SiLU, residual adds: each a dispatch of a few microseconds) as in its matmuls. Per
layer this runs 4 matmuls (the model's own modules: int4, dense or tensor-parallel alike) and 4
C calls. The residual stream is carried as in vLLM's fused add + RMSNorm: each norm first adds
the previous block's output into it. Values round where the eager path rounds; only the RMS
sum's order and exp's last bit differ (tests/test_fused_layers.py bounds the difference and
checks greedy tokens against the eager layers).
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from forklm.kernels.cpu import bindings as native_kernels
from forklm.kernels.cpu.bindings import NativeMatmul
from forklm.runtime.attention.native import NativeAttention, NativeAttentionMeta
from forklm.runtime.models.weights import FusedLinear

if TYPE_CHECKING:
    from forklm.runtime.forward.batch import ForwardBatch
    from forklm.runtime.models.decoder import CausalLM, DecoderLayer
    from forklm.runtime.models.layers import RMSNorm, RotaryEmbedding
    from forklm.runtime.models.spec import ModelSpec

_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


def unsupported_reason(model: CausalLM, attn: object) -> str:
    """Why FusedDecodeLayers cannot run this model ('' when it can)."""
    spec = model.spec
    if not isinstance(attn, NativeAttention) or not attn.enabled:
        return "the attention backend is not the native kernel"
    lib = native_kernels.fused_ops()
    if lib is None:
        return f"the fused layer steps did not build: {native_kernels.fused_unavailable_reason()}"
    checks = {
        f"{spec.norm_placement} norms": spec.norm_placement != "pre",
        f"{spec.norm_kind} norms": spec.norm_kind != "rms",
        f"{spec.qk_norm} q/k norms": spec.qk_norm not in ("", "head"),
        "a parallel residual": bool(spec.parallel_residual),
        "a plain (ungated) MLP": not spec.gated_mlp,
        "a residual scale": spec.residual_scale != 1.0,
        f"head_dim {spec.head_dim}": spec.head_dim > lib.fused_max_head_dim(),
        f"activation {spec.activation}": spec.activation != "silu",
        "a mixture of experts": spec.moe is not None,
        "ALiBi": bool(spec.alibi_slopes),
        "q/k/v clipping": spec.qkv_clip is not None,
        "attention sinks": spec.attn_sinks,
        "an embedding scale": spec.embed_scale is not None,
        "partial rotary": any(layer.self_attn.rotary.rotary_dim != spec.head_dim
                              for layer in model.model.layers),
    }
    found = [name for name, present in checks.items() if present]
    return f"the model has {', '.join(found)}" if found else ""


class FusedDecodeLayers:
    """Runs CausalLM's layers for batches whose attention_meta is the native kernel's plan."""

    def __init__(self, model: CausalLM, attn: NativeAttention):
        lib = native_kernels.fused_ops()
        assert lib is not None, "fused layer steps unavailable"
        self.lib, self.attn = lib, attn
        self.spec = model.spec
        self.layers: list[DecoderLayer] = list(model.model.layers)  # type: ignore[arg-type]
        # Per layer, its matmuls as plain functions of x (direct_call): modules are read once
        # here, so a layer's weights must be updated in place, never replaced.
        self.matmuls = [tuple(direct_call(m) for m in (layer.self_attn.qkv_proj,
                                                        layer.self_attn.o_proj,
                                                        layer.mlp.gate_up_proj,
                                                        layer.mlp.down_proj))
                        for layer in self.layers]
        # Per layer, what its C calls read, as plain ints (attribute lookups and data_ptr()
        # calls were ~0.6 ms of a batch-16 forward): the norm weights, Qwen3's per-head q/k norm
        # weights (None: no such norm), the pool's K/V layers, the attention kernel's arguments.
        self.layer_args = [(layer.self_attn.rotary,
                            _norm_weight(layer.input_layernorm, attn.pool.dtype),
                            _norm_weight(layer.post_attention_layernorm, attn.pool.dtype),
                            _qk_norm_weights(layer),
                            attn.k_layers[layer.self_attn.layer_id].data_ptr(),
                            attn.v_layers[layer.self_attn.layer_id].data_ptr(),
                            tuple(0 if x is None else x.data_ptr()
                                  for x in attn.scales_of(layer.self_attn.layer_id)),
                            attn.kernel_specs[layer.self_attn.layer_id])
                           for layer in self.layers]
        self.pool_ptrs = (attn.pool.k_buffer.data_ptr(), attn.pool.v_buffer.data_ptr())
        self.runner = NativeDecodeRunner.build(model, attn, self.layer_args)

    def takes(self, batch: ForwardBatch, x: torch.Tensor) -> bool:
        return (isinstance(batch.attn_meta, NativeAttentionMeta) and x.dtype in _DTYPES
                and x.dtype == self.attn.pool.dtype and x.device.type == "cpu")

    def run(self, x: torch.Tensor, batch: ForwardBatch, final_norm: RMSNorm | None = None
            ) -> torch.Tensor:
        """x [T, hidden] embeddings -> the last layer's output stream [T, hidden] (before the
        final norm), as the eager layers compute it: in one C call where every matmul has a
        native entry point for T rows (NativeDecodeRunner), else run_loop. With `final_norm`
        (the model's, an RMSNorm like the layers'): that norm of it, by the layers' C norm."""
        runner = self.runner
        if runner is not None and x.dtype == torch.bfloat16 and 0 < x.shape[0] <= runner.max_rows:
            return runner.run(x, batch, final_norm)
        return self.run_loop(x, batch, final_norm)

    def run_loop(self, x: torch.Tensor, batch: ForwardBatch, final_norm: RMSNorm | None = None
                 ) -> torch.Tensor:
        """run() as a Python loop over the layers' C steps and matmul calls."""
        meta = batch.attn_meta
        assert isinstance(meta, NativeAttentionMeta)
        spec, attn, lib = self.spec, self.attn, self.lib
        # the pool's buffers are the ones the layer pointers were taken from
        assert self.pool_ptrs == (attn.pool.k_buffer.data_ptr(), attn.pool.v_buffer.data_ptr())
        num_tokens, hidden = x.shape
        dtype = _DTYPES[x.dtype]
        heads, kv_heads, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
        # K/V rows written by the C call: NativeAttention.prepare checked them against the pool
        out_slots = batch.out_slots.to(torch.int64).contiguous()
        slots_ptr = out_slots.data_ptr()
        residual = x.contiguous()  # updated in place: x is this forward's own embedding tensor
        normed = torch.empty_like(residual)
        q = residual.new_empty(num_tokens, heads * d)
        attn_out = torch.empty_like(q)
        res_ptr, normed_ptr, q_ptr = residual.data_ptr(), normed.data_ptr(), q.data_ptr()
        eps, offset = spec.norm_eps, spec.norm_offset
        add_rms_norm, rope_store, silu_mul = (lib.fused_add_rms_norm, lib.fused_rope_store,
                                              lib.fused_silu_mul)
        run_attention, positions = meta.plan.run_addresses, batch.rotary_positions
        out_ptr, kernel_dtype, kv_dtype = attn_out.data_ptr(), attn.dtype_code, attn.kv_dtype_code
        h: torch.Tensor | None = None
        for (qkv_proj, o_proj, gate_up_proj, down_proj), (
                rotary, in_norm, post_norm, (q_norm, k_norm), k_layer, v_layer,
                (k_scale, v_scale), (scale, softcap, window)) in zip(self.matmuls,
                                                                     self.layer_args):
            add_rms_norm(num_tokens, hidden, res_ptr, _ptr_of(h, residual), in_norm, normed_ptr,
                         eps, offset, dtype)
            qkv = qkv_proj(normed).contiguous()  # [T, (heads + 2 kv_heads) * d]
            # [T, 1, d] rows, looked up once per forward and table (tables_for keeps them)
            cos, sin = rotary.tables_for(positions, x.dtype)
            assert cos.is_contiguous() and sin.is_contiguous()
            rope_store(num_tokens, qkv.data_ptr(), qkv.shape[1], heads, kv_heads, d,
                       cos.data_ptr(), sin.data_ptr(), slots_ptr, k_layer, v_layer, k_scale,
                       v_scale, q_ptr, q_norm, k_norm, eps, offset, dtype, kv_dtype)
            run_attention(q_ptr, k_layer, v_layer, out_ptr, scale, softcap, window, kernel_dtype,
                          kv_dtype, 0, 0, k_scale, v_scale)
            h = o_proj(attn_out).contiguous()
            add_rms_norm(num_tokens, hidden, res_ptr, _ptr_of(h, residual), post_norm,
                         normed_ptr, eps, offset, dtype)
            gate_up = gate_up_proj(normed).contiguous()  # [T, 2 * inter]
            act = gate_up.new_empty(num_tokens, gate_up.shape[1] // 2)
            silu_mul(num_tokens, act.shape[1], gate_up.data_ptr(), act.data_ptr(), dtype)
            h = down_proj(act).contiguous()
        if final_norm is not None:
            add_rms_norm(num_tokens, hidden, res_ptr, _ptr_of(h, residual),
                         _norm_weight(final_norm, x.dtype), normed_ptr, eps, offset, dtype)
            return normed
        return residual if h is None else residual + h


# fused_decode_layers' steps that can refuse, by the code it returns (1 + 8 layer + step)
_RUNNER_STEPS = ("qkv matmul", "attention", "o matmul", "gate_up matmul", "down matmul")


class NativeDecodeRunner:
    """FusedDecodeLayers.run_loop as one C call (fused_layer_ops.c's fused_decode_layers), for
    bf16 models whose every layer matmul has a native entry point (QuantizedLinear's
    native_matmul: the K-quant and int4 kernels): the same calls in the same order on the same
    values, without the loop's Python between them (benchmarks/NOTES.md, session 27)."""

    def __init__(self, lib: ctypes.CDLL, layers: ctypes.Array, matmuls: list[NativeMatmul],
                 rotaries: list[RotaryEmbedding], spec: ModelSpec, attn: NativeAttention):
        self.lib, self.layers, self.matmuls, self.rotaries = lib, layers, matmuls, rotaries
        self.spec, self.attn = spec, attn
        self.max_rows = min(m.max_rows for m in matmuls)
        self.qkv_width = matmuls[0].out_features
        self.inter = matmuls[2].out_features // 2
        self.attention = native_kernels.attention_batch_address()
        self._work: _Workspace | None = None
        self._final_norm: tuple[RMSNorm, int] | None = None  # (norm, its weight's address)

    @classmethod
    def build(cls, model: CausalLM, attn: NativeAttention, layer_args: list[tuple]
              ) -> NativeDecodeRunner | None:
        """The runner for `model`'s layers (layer_args: FusedDecodeLayers'), or None where a
        matmul has no native entry point or the model is not bf16."""
        lib = native_kernels.fused_ops()
        layers: list[DecoderLayer] = list(model.model.layers)  # type: ignore[arg-type]
        if lib is None or not layers or attn.pool.dtype != torch.bfloat16:
            return None
        matmuls: list[NativeMatmul] = []
        for layer in layers:
            for module in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                           layer.mlp.gate_up_proj, layer.mlp.down_proj):
                native = getattr(module, "native_matmul", None)
                op = native() if callable(native) else None
                if op is None:
                    return None
                matmuls.append(op)
        if len({m.out_features for m in matmuls[0::4]}) != 1 or len(
                {m.out_features for m in matmuls[2::4]}) != 1:
            return None  # the step's buffers are sized once
        rotaries: list[RotaryEmbedding] = []
        descs = (native_kernels.DecodeLayer * len(layers))()
        for i, (desc, args) in enumerate(zip(descs, layer_args)):
            (rotary, in_norm, post_norm, (q_norm, k_norm), k_layer, v_layer,
             (k_scale, v_scale), (scale, softcap, window)) = args
            if rotary not in rotaries:
                rotaries.append(rotary)
            desc.qkv, desc.o, desc.gate_up, desc.down = (
                native_kernels.DecodeMatmul.of(m) for m in matmuls[4 * i:4 * i + 4])
            desc.in_norm, desc.post_norm, desc.q_norm, desc.k_norm = (
                in_norm, post_norm, q_norm, k_norm)
            desc.k_layer, desc.v_layer = k_layer, v_layer
            desc.k_scale, desc.v_scale = k_scale or None, v_scale or None
            desc.scale, desc.softcap, desc.window = scale, softcap, window
            desc.rotary = rotaries.index(rotary)
        return cls(lib, descs, matmuls, rotaries, model.spec, attn)

    def run(self, x: torch.Tensor, batch: ForwardBatch, final_norm: RMSNorm | None = None
            ) -> torch.Tensor:
        """FusedDecodeLayers.run for bf16 x [T, hidden], 1 <= T <= max_rows."""
        meta = batch.attn_meta
        assert isinstance(meta, NativeAttentionMeta)
        tokens, hidden = x.shape
        work = self._workspace(tokens, hidden)
        out_slots = batch.out_slots.to(torch.int64).contiguous()
        residual = x.contiguous()  # updated in place: x is this forward's own embedding tensor
        tables = [rotary.tables_for(batch.rotary_positions, torch.bfloat16)
                  for rotary in self.rotaries]  # held until the call returns
        for i, (cos, sin) in enumerate(tables):
            assert cos.is_contiguous() and sin.is_contiguous()
            work.cos[i], work.sin[i] = cos.data_ptr(), sin.data_ptr()
        step = work.step
        step.out_slots, step.plan, step.residual = (out_slots.data_ptr(), meta.plan.address,
                                                    residual.data_ptr())
        failed = self.lib.fused_decode_layers(ctypes.byref(step), self.layers, len(self.layers))
        assert failed == 0, (f"fused_decode_layers: layer {(failed - 1) // 8}'s "
                             f"{_RUNNER_STEPS[(failed - 1) % 8]} refused {tokens} rows")
        last = work.buffers[4]  # the last layer's MLP output, not yet added into residual
        if final_norm is None:
            return residual + last
        normed = torch.empty_like(residual)  # the caller's own tensor: the workspace is reused
        self.lib.fused_add_rms_norm(tokens, hidden, residual.data_ptr(), last.data_ptr(),
                                    self._norm_address(final_norm), normed.data_ptr(),
                                    self.spec.norm_eps, self.spec.norm_offset,
                                    _DTYPES[torch.bfloat16])
        return normed

    def _workspace(self, tokens: int, hidden: int) -> _Workspace:
        """The step's buffers and its C arguments for `tokens` rows, made when the row count
        changes: a decode batch keeps its size for many steps, and building them cost ~40 us of
        a 4 ms token on the default model. Each run fills in its own inputs' addresses."""
        work = self._work
        if work is not None and (work.tokens, work.hidden) == (tokens, hidden):
            return work
        attn, spec, empty, bf16 = self.attn, self.spec, torch.empty, torch.bfloat16
        heads_width = attn.num_heads * attn.head_dim
        buffers = (empty(tokens, hidden, dtype=bf16), empty(tokens, heads_width, dtype=bf16),
                   empty(tokens, heads_width, dtype=bf16), empty(tokens, self.qkv_width, dtype=bf16),
                   empty(tokens, hidden, dtype=bf16), empty(tokens, 2 * self.inter, dtype=bf16),
                   empty(tokens, self.inter, dtype=bf16))
        cos = (ctypes.c_void_p * len(self.rotaries))()
        sin = (ctypes.c_void_p * len(self.rotaries))()
        step = native_kernels.DecodeStep(
            tokens, hidden, attn.num_heads, attn.num_kv_heads, attn.head_dim, spec.norm_eps,
            spec.norm_offset, attn.kv_dtype_code, 0, ctypes.addressof(cos), ctypes.addressof(sin),
            self.attention, 0, 0, *(b.data_ptr() for b in buffers))
        self._work = work = _Workspace(tokens, hidden, buffers, cos, sin, step)
        return work

    def _norm_address(self, norm: RMSNorm) -> int:
        """_norm_weight(norm), looked up once per norm (weights are updated in place)."""
        if self._final_norm is None or self._final_norm[0] is not norm:
            self._final_norm = (norm, _norm_weight(norm, torch.bfloat16))
        return self._final_norm[1]


class _Workspace(NamedTuple):
    """NativeDecodeRunner's buffers for one row count, and the C step that points at them."""

    tokens: int
    hidden: int
    buffers: tuple[torch.Tensor, ...]  # normed, q, attn_out, qkv, h, gate_up, act
    cos: ctypes.Array  # per rotary table: this step's cos rows (set by each run)
    sin: ctypes.Array
    step: native_kernels.DecodeStep


def _ptr_of(h: torch.Tensor | None, residual: torch.Tensor) -> int | None:
    """The address of a block's contiguous output, for the C call that adds it into `residual`
    (None: no block yet)."""
    if h is None:
        return None
    assert h.dtype == residual.dtype and h.shape == residual.shape and h.is_contiguous()
    return h.data_ptr()


def _norm_weight(norm: RMSNorm, dtype: torch.dtype) -> int:
    """The address of a norm's weight (it lives as long as the model, updated in place)."""
    weight = norm.weight
    assert weight.dtype == dtype and weight.is_contiguous()
    return weight.data_ptr()


def _qk_norm_weights(layer: DecoderLayer) -> tuple[int | None, int | None]:
    """Addresses of the layer's q_norm and k_norm weights, or (None, None). The weights live as
    long as the model; they must stay where they are (updated in place, never replaced)."""
    attn = layer.self_attn
    if not attn.qk_norm:
        return None, None
    weights = (attn.q_norm.weight, attn.k_norm.weight)
    assert all(w.is_contiguous() for w in weights)
    return weights[0].data_ptr(), weights[1].data_ptr()


def direct_call(module: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """A linear module as a plain function of its [M, in] input: its own `direct()` where it
    has one (QuantizedLinear), F.linear on its tensors for a plain nn.Linear, else the module."""
    direct = getattr(module, "direct", None)
    if callable(direct):
        return direct()
    if type(module) in (nn.Linear, FusedLinear):
        assert isinstance(module, nn.Linear)
        return functools.partial(F.linear, weight=module.weight, bias=module.bias)
    return module
