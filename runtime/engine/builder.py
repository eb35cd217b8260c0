"""Builds an engine's parts from an EngineConfig: model weights, KV pool, radix cache, scheduler,
grammar backend."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from forklm.runtime.attention.backends import AttentionBackend
from forklm.runtime.attention.native import NativeAttention
from forklm.runtime.engine.intake import RequestIntake
from forklm.runtime.errors import InvalidArgumentError
from forklm.runtime.forward.model_parts import build_kv_and_attention, build_model_for, kv_capacity
from forklm.runtime.forward.model_runner import ModelRunner
from forklm.runtime.kvcache.manager import KVCacheManager
from forklm.runtime.kvcache.pool import KVPool
from forklm.runtime.kvcache.radix_cache import RadixCache
from forklm.runtime.models import CausalLM, spec_from_config
from forklm.runtime.models.loader import LoadedModel, load_model
from forklm.runtime.sampling.constraints import GrammarBackend
from forklm.runtime.scheduling.scheduler import Scheduler

if TYPE_CHECKING:
    from forklm.runtime.config import EngineConfig
    from forklm.runtime.distributed.processes import WorkerProcesses
    from forklm.runtime.engine.idle_work import IdleWork
    from forklm.runtime.lora.registry import LoraRegistry
    from forklm.runtime.models.onednn_linear import DenseCopyBuild

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelInfo:
    """What clients may know of the served model (/get_model_info, /v1/models)."""

    model_path: str
    tokenizer_path: str
    context_len: int  # prompt + output tokens of one request, at most
    vocab_size: int  # the logits' width (may exceed the tokenizer's length)
    dtype: str  # the weights' torch dtype name (the KV cache's unless kv_cache_dtype is 8-bit)
    pooling: str  # embeddings' pooling: EngineConfig.pooling, else the model's own, else "last"


@dataclass
class EngineParts:
    config: EngineConfig
    model_config: Any
    tokenizer: Any
    eos_token_ids: frozenset[int]
    context_len: int
    vocab_size: int
    kv: KVCacheManager
    scheduler: Scheduler
    runner: ModelRunner
    grammar: GrammarBackend
    intake: RequestIntake
    pooling: str
    lora: LoraRegistry | None = None  # the LoRA adapters it serves (None: LoRA is off)
    # what the engine does once it is idle (runtime/engine/idle_work.py): dense weight copies
    # (or a call that needs one first builds them), the repacked weights written to disk for
    # the next load, weights moved to huge pages
    idle_work: list[IdleWork] = field(default_factory=list)

    def model_info(self) -> ModelInfo:
        return ModelInfo(self.config.model_path, self.config.tokenizer_path or self.config.model_path,
                         self.context_len, self.vocab_size, self.config.torch_dtype_name,
                         self.pooling)


def build_engine_parts(config: EngineConfig) -> EngineParts:
    if config.tp_size == 1:
        return _build_parts(config, None)
    from forklm.runtime.distributed import spawn_workers

    # This process is rank 0; the other ranks of this node start (and load) meanwhile.
    workers = spawn_workers(config)
    try:
        return _build_parts(config, workers)
    except BaseException:
        workers.stop(timeout_s=2.0)
        raise


def _build_parts(config: EngineConfig, workers: WorkerProcesses | None) -> EngineParts:
    loaded = load_model(config.model_path, config.revision, config.tokenizer_path)
    hf = loaded.config
    spec = spec_from_config(hf)
    dtype = getattr(torch, config.torch_dtype_name)
    context_len = config.context_length or hf.max_position_embeddings
    runner: ModelRunner
    lora: LoraRegistry | None = None
    vision: VisionStage | None = None
    deferred: DenseCopyBuild | None = None
    if loaded.vision_config is not None:
        if workers is not None:
            raise InvalidArgumentError("tp_size", config.tp_size, "a vision-language model's "
                                       "images are read by one process; use tp_size 1")
        from forklm.runtime.multimodal.vision import VisionStage

        vision = VisionStage(loaded, dtype)
    if workers is not None:
        from forklm.runtime.distributed import start_tensor_parallel

        if config.enable_torch_compile:
            logger.info("torch.compile off: it compiles single-process models only")
        tp = start_tensor_parallel(config, loaded, spec, workers)
        pool, capacity = tp.shard.pool, tp.shard.pool.capacity
        kv = build_kv_manager(config, pool, context_len)
        runner = tp.runner(kv, spec.vocab_size)
    else:
        # the dense copies (~0.2 s on the default model) are left to the engine's idle time
        # (EngineLoop), or to the first call that needs one (onednn_linear.DenseCopyBuild)
        model = build_model_for(config, loaded, spec, context_len, defer_dense_copies=True)
        deferred = model.pending_dense_copies
        model.pending_dense_copies = None
        capacity = kv_capacity(config, spec, context_len, deferred.nbytes if deferred else 0)
        pool, attn = build_kv_and_attention(config, spec, model, capacity)
        kv = build_kv_manager(config, pool, context_len)
        runner = ModelRunner(model, attn, kv, config.device)
        if config.lora_enabled:  # before fusing: the fused layers call the wrapped modules
            lora = _install_lora(config, runner, dtype)
        _fuse_layers(config, model, attn)
        _compile_layers(config, model)
        _capture_decode_graphs(config, runner, context_len)
    logger.info("model %s (%s, %s), KV capacity %d tokens of %s", loaded.source, spec.model_type,
                dtype, capacity, config.kv_torch_dtype_name)
    eos_token_ids = frozenset(loaded.eos_token_ids)
    return EngineParts(
        config=config, model_config=hf, tokenizer=loaded.tokenizer,
        eos_token_ids=eos_token_ids, context_len=context_len,
        vocab_size=spec.vocab_size, kv=kv, scheduler=Scheduler(config, kv),
        runner=runner,
        # The logits are vocab_size wide, which may exceed the tokenizer's length.
        grammar=GrammarBackend.for_tokenizer(
            loaded.tokenizer, spec.vocab_size, loaded.eos_token_ids,
            jump_forward=config.enable_jump_forward,
            compile_timeout_s=config.grammar_compile_timeout_s),
        intake=RequestIntake(loaded.tokenizer, spec.vocab_size, context_len, capacity,
                             eos_token_ids, config.random_seed, _priority_scheduling(config),
                             lora, vision),
        pooling=config.pooling or loaded.pooling or "last",
        lora=lora,
        idle_work=_idle_work(deferred, loaded),
    )


def _idle_work(dense_copies: DenseCopyBuild | None, loaded: LoadedModel) -> list[IdleWork]:
    """The dense copies first (larger batches wait on them), then the repacked weights this load
    built written to disk for the next one (runtime/quant/records_cache.py), then the weights
    this process built moved into huge pages (kernels/cpu/huge_pages.py: asked for at load,
    they cost a 1B model 1-2 s of start-up)."""
    from forklm.kernels.cpu import huge_pages
    from forklm.runtime.engine.idle_work import InSlices

    work: list[IdleWork] = [] if dense_copies is None else [dense_copies]
    if loaded.records_cache is not None and loaded.records_cache.unsaved:
        work.append(InSlices(loaded.records_cache.saving()))
    if huge_pages.pending_bytes():
        work.append(InSlices(huge_pages.collapse_weights()))
    return work


def _install_lora(config: EngineConfig, runner: ModelRunner, dtype: torch.dtype) -> LoraRegistry:
    """Wrap the model's projections for per-row LoRA updates and load --lora-paths."""
    from forklm.runtime.lora.adapter import parse_lora_paths
    from forklm.runtime.lora.layers import LoraBatch, install_lora
    from forklm.runtime.lora.registry import LoraRegistry

    batch = LoraBatch()
    slots = install_lora(runner.model, batch)
    # On the CPU adapters are held and applied in float32 whatever the model's dtype: their
    # small matmuls cost ~2.5x less there than in bf16 (oneDNN's per-call overhead) and round
    # less; the update is added in the model's dtype.
    lora_dtype = torch.float32 if torch.device(config.device).type == "cpu" else dtype
    registry = LoraRegistry(slots, lora_dtype, config.device, config.max_loaded_loras)
    for name, folder in parse_lora_paths(config.lora_paths).items():
        registry.load(name, folder)
    runner.lora_batch = batch
    logger.info("LoRA on: %d modules take adapters; loaded %s", len(slots),
                ", ".join(registry.names()) or "none yet")
    return registry


def _priority_scheduling(config: EngineConfig) -> str:
    if config.enable_priority_scheduling:
        return "on"
    return "refuse" if config.abort_on_priority_when_disabled else "ignore"


def _fuse_layers(config: EngineConfig, model: CausalLM, attn: AttentionBackend) -> None:
    """Fused C steps between the matmuls for decode-like CPU batches, where the model and the
    attention backend allow (runtime/models/fused_layers.py); torch.compile's graphs instead
    when the user asked for those."""
    if config.disable_fused_layers or config.enable_torch_compile:
        return
    from forklm.runtime.models.fused_layers import FusedDecodeLayers, unsupported_reason

    reason = unsupported_reason(model, attn)
    if reason:
        logger.info("fused decode layers off: %s", reason)
        return
    assert isinstance(attn, NativeAttention)
    model.fused_layers = FusedDecodeLayers(model, attn)


def _compile_layers(config: EngineConfig, model: CausalLM) -> None:
    """--enable-torch-compile: compile the layers' dense steps (runtime/forward/torch_compile.py), at
    start. Not under deterministic inference, whose fixed matmul tiles a compiled graph would
    not keep."""
    if not config.enable_torch_compile:
        return
    if config.lora_enabled:
        logger.info("torch.compile off: LoRA adapters' per-row updates run eagerly")
        return
    if config.enable_deterministic_inference:
        logger.info("torch.compile off: deterministic inference runs its own tiled matmuls")
        return
    if not model.compiles_layer_steps:
        logger.info("torch.compile off: %s runs its own layers eagerly", model.spec.model_type)
        return
    from forklm.runtime.forward.torch_compile import enable_torch_compile

    enable_torch_compile(model, config.torch_compile_max_bs)


def _capture_decode_graphs(config: EngineConfig, runner: ModelRunner, context_len: int) -> None:
    """CUDA graphs for decode on a GPU unless disabled; eager stand-ins when a test asks."""
    from forklm.runtime.forward.cuda_graphs import CudaGraph, EagerGraph, Graph

    new_graph: Callable[[], Graph]
    if config.lora_enabled:
        logger.info("decode runs eagerly: CUDA graphs are not captured with LoRA adapters")
        return
    if config.debug_eager_cuda_graph:
        new_graph = EagerGraph
    elif torch.device(config.device).type == "cuda" and not config.disable_cuda_graph:
        from forklm.runtime.attention.triton_backend import TritonAttention

        if not isinstance(runner.attn, TritonAttention):  # the torch path syncs with the host
            logger.info("decode runs eagerly: CUDA graphs need --attention-backend triton")
            return
        memory_pool = torch.cuda.graph_pool_handle()
        new_graph = lambda: CudaGraph(memory_pool)  # noqa: E731 - one pool for all buckets
    else:
        return
    max_bs = config.cuda_graph_max_bs or min(config.max_running_requests, 160)
    runner.capture_graphs(max_bs, context_len, new_graph)


def build_kv_manager(config: EngineConfig, pool: KVPool, context_len: int) -> KVCacheManager:
    """The request rows, radix cache and session pins over `pool`, as `config` asks."""
    cache = None if config.disable_radix_cache else RadixCache(pool.allocator)
    return KVCacheManager(pool, cache, max_rows=config.max_running_requests + 1,
                          max_context=min(context_len, pool.capacity),
                          pinned_fraction=config.session_pinned_fraction,
                          pin_idle_s=config.session_idle_timeout_s)
