"""The model, its KV pool and the attention backend over it, as an EngineConfig asks: what the
engine's builder (runtime/engine/builder.py) and each tensor-parallel worker (runtime/distributed/)
both build, so it lives below both."""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING

import psutil
import torch

from forklm.runtime.attention.backends import AttentionBackend
from forklm.runtime.attention.batch_invariant import BatchInvariantAttention
from forklm.runtime.attention.registry import create_attention_backend
from forklm.runtime.kvcache import sizing as kv_sizing
from forklm.runtime.kvcache.pool import KVPool
from forklm.runtime.models import CausalLM, ModelSpec, WeightLoader
from forklm.runtime.models.batch_invariant import make_batch_invariant
from forklm.runtime.models.fp16_linear import (
    fp16_tied_head,
    fp16_weights_available,
    pack_fp16_linears,
)
from forklm.runtime.models.gemma4 import Gemma4CausalLM
from forklm.runtime.models.onednn_linear import (
    can_pack,
    pack_linears,
    packed_tied_head,
    plan_dense_copies,
)

if TYPE_CHECKING:
    from forklm.runtime.config import EngineConfig
    from forklm.runtime.models.loader import LoadedModel

logger = logging.getLogger(__name__)


def build_model_for(config: EngineConfig, loaded: LoadedModel, spec: ModelSpec,
                    context_len: int, defer_dense_copies: bool = False) -> CausalLM:
    """The model `config` asks for (dtype, device, quantized or not) with `loaded`'s weights;
    under tensor parallelism `spec` and `loaded` are this rank's shard of them. With
    `defer_dense_copies` (and no torch.compile, whose graphs must see them built) its dense
    copies are left to the caller: model.pending_dense_copies."""
    keep_quantized = keeps_gguf_quantized(config, loaded)
    return build_model(loaded, spec, getattr(torch, config.torch_dtype_name), config.device,
                       context_len, keep_quantized=keep_quantized,
                       dense_copies=config.quantization is None,
                       fp16_weights=uses_fp16_weights(config, keep_quantized),
                       int8_activations=not config.disable_int8_activations,
                       defer_dense_copies=defer_dense_copies and not config.enable_torch_compile)


def causal_lm_class(spec: ModelSpec) -> type[CausalLM]:
    """The CausalLM that serves `spec`: Gemma 4 (per-layer inputs, shared K/V) has its own."""
    return Gemma4CausalLM if spec.model_type == "gemma4_text" else CausalLM


def build_model(loaded: LoadedModel, spec: ModelSpec, dtype: torch.dtype, device: str,
                max_positions: int, keep_quantized: bool = False,
                dense_copies: bool = False, fp16_weights: bool = False,
                int8_activations: bool = False, defer_dense_copies: bool = False) -> CausalLM:
    """The model on the meta device (no memory), then its weights streamed in one by one.
    bf16 linears on a CPU with oneDNN bf16 get packed weights; with `dense_copies` a small
    quantized model also gets packed bf16 copies of its quantized matrices for larger batches;
    with `fp16_weights` float32 linears keep FBGEMM-packed float16 weights (fp16_linear.py);
    with `int8_activations` quantized matrices multiply decode-sized calls with int8 dot
    products where the CPU has them (quant/linear.py); with `defer_dense_copies` the dense
    copies are planned, not built (model.pending_dense_copies: run or start it)."""
    with torch.device("meta"):
        model = causal_lm_class(spec)(spec, loaded.config, max_positions)
    factory = None
    if keep_quantized:
        from forklm.runtime.quant.linear import QuantizedLinear

        # int8 activations allowed: K-quant matrices become their compact records
        factory = functools.partial(QuantizedLinear.from_gguf, kquant_records=int8_activations)
    WeightLoader(model, dtype, device, factory).load(loaded.weights(keep_quantized))
    if can_pack(dtype, device):
        pack_linears(model)
        build = plan_dense_copies(model) if keep_quantized and dense_copies else None
        if build is not None and defer_dense_copies:
            model.pending_dense_copies = build
        elif build is not None:
            build.run()
        if keep_quantized and int8_activations:
            from forklm.runtime.quant.linear import use_int8_activations

            use_int8_activations(model)
        table = getattr(model.model.embed_tokens, "weight", None)
        if spec.tie_word_embeddings and isinstance(table, torch.Tensor):
            model.tied_head = packed_tied_head(table)
    if fp16_weights and dtype == torch.float32:
        pack_fp16_linears(model)
        table = getattr(model.model.embed_tokens, "weight", None)
        if spec.tie_word_embeddings and isinstance(table, torch.Tensor):
            model.tied_head = fp16_tied_head(table)
    return model.eval()


def uses_fp16_weights(config: EngineConfig, keep_quantized: bool) -> bool:
    """dtype "auto" resolved to float32 on a CPU (no native bf16) with quantization unset: the
    linears keep float16 weights (2-3x faster matmuls, fp16_linear.py). An explicit
    dtype="float32" or quantization="none" keeps float32 weights, the token-exact path."""
    return (config.dtype == "auto" and config.quantization is None and not keep_quantized
            and config.device == "cpu" and config.torch_dtype_name == "float32"
            and fp16_weights_available())


def keeps_gguf_quantized(config: EngineConfig, loaded: LoadedModel) -> bool:
    """quantization="gguf" keeps a GGUF's blocks; "none" dequantizes; unset (auto) keeps them
    where that is faster at batch 1 (see runtime/quant/), never under dtype="float32", which is
    the exact path (token-identical to transformers' own GGUF load), nor split over ranks."""
    if not loaded.is_gguf or config.quantization == "none" or config.tp_size > 1:
        return False
    if config.quantization == "gguf":
        return True
    from forklm.runtime.quant import quantized_is_faster

    return config.dtype != "float32" and quantized_is_faster(config.device)


def kv_capacity(config: EngineConfig, spec: ModelSpec, context_len: int,
                pending_bytes: int = 0) -> int:
    """KV slots for `spec`'s KV heads (a rank's own under tensor parallelism). Called after the
    weights are loaded (a GPU's free memory then counts them); `pending_bytes`: CPU memory
    weights still to be built will take (deferred dense copies)."""
    if config.max_total_tokens is not None:
        return config.max_total_tokens
    kv_dtype = getattr(torch, config.kv_torch_dtype_name)
    per_token = KVPool.bytes_per_token(*spec.kv_pool_shape, kv_dtype)
    if config.device.startswith("cuda"):
        device = torch.device(config.device)
        torch.cuda.synchronize(device)
        free, total = torch.cuda.mem_get_info(device)
        fraction = config.mem_fraction_static or kv_sizing.DEFAULT_MEM_FRACTION_STATIC
        tokens = kv_sizing.gpu_kv_tokens(kv_sizing.DeviceMemory(total, free), fraction, per_token)
    else:
        tokens = kv_sizing.cpu_kv_tokens(psutil.virtual_memory().available - pending_bytes,
                                         config.max_total_tokens_fraction, per_token)
    capacity = kv_sizing.capped(tokens, config.max_running_requests, context_len)
    logger.info("KV pool: %d tokens, %.2f GiB", capacity, capacity * per_token / kv_sizing.GIB)
    return capacity


def build_kv_and_attention(config: EngineConfig, spec: ModelSpec, model: CausalLM,
                           capacity: int) -> tuple[KVPool, AttentionBackend]:
    """The KV pool of `capacity` slots for `spec`'s KV heads and the attention backend over it."""
    dtype = getattr(torch, config.torch_dtype_name)
    num_layers, num_kv_heads, head_dim = spec.kv_pool_shape
    pool = KVPool(num_layers, capacity, num_kv_heads, head_dim, dtype, config.device,
                  kv_dtype=getattr(torch, config.kv_torch_dtype_name))
    if config.enable_deterministic_inference:
        make_batch_invariant(model)
        return pool, BatchInvariantAttention(pool, spec.num_heads, num_kv_heads, head_dim,
                                             model.attention_layers)
    return pool, create_attention_backend(config.resolved_attention_backend, pool, spec.num_heads,
                                          num_kv_heads, head_dim, model.attention_layers)
