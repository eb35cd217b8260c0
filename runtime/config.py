"""EngineConfig: every engine knob in one frozen dataclass, named as SGLang's server flags are."""

from __future__ import annotations

import dataclasses
import functools
import os
import pathlib
from dataclasses import dataclass
from typing import Any, TypeVar

from forklm.runtime.errors import InvalidArgumentError

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
QUANTIZATION_CHOICES = (None, "gguf", "none")
# How embedding requests pool their prompt's hidden states (EngineConfig.pooling).
POOLING_MODES = ("last", "mean", "cls")
SPECULATIVE_ALGORITHMS = (None, "NGRAM")
# SGLang's --kv-cache-dtype names -> the torch dtype the KV pool then holds ("auto": the model's).
KV_CACHE_DTYPES = {"fp8_e5m2": "float8_e5m2", "fp8_e4m3": "float8_e4m3fn", "int8": "int8"}


@dataclass(frozen=True)
class EngineConfig:
    # A .gguf file, a Hugging Face folder, or a Hub id ("org/name") resolved through
    # huggingface_hub (HF_HOME, HF_HUB_OFFLINE and HF_TOKEN are honoured).
    model_path: str = DEFAULT_MODEL
    # Hub revision (branch, tag or commit) of a Hub id model_path; None = the default branch.
    revision: str | None = None
    # Where the tokenizer comes from when not from the model itself (a folder or a Hub id).
    tokenizer_path: str | None = None
    # SGLang's --quantization: None = auto (a GGUF keeps its quantized blocks where that is
    # faster at batch 1, see runtime/quant/, and a small one also a packed bf16 copy for larger
    # batches, see models/onednn_linear.py), "gguf" = keep only the blocks (the least memory),
    # "none" = dequantize at load.
    quantization: str | None = None
    # "auto" = bfloat16 on a GPU or a CPU with native bf16 dot products (AVX-512-bf16 or AMX: about
    # 3x faster matmuls than fp32), else float32 (on an AVX2-only CPU bf16 matmuls are emulated and
    # 2.6-5x slower than fp32 at batch 16-512).
    dtype: str = "auto"
    # SGLang's --kv-cache-dtype: "auto" = the model's dtype; "fp8_e5m2" / "fp8_e4m3" = an 8-bit
    # float pool (each K/V value rounded to 2 / 3 mantissa bits, no scales), "int8" = int8 codes
    # with a float32 scale per token and KV head (runtime/kvcache/pool.py): about twice the
    # tokens per GB and half the bytes decode attention reads (benchmarks/kv_dtype.py measures
    # what each costs in agreement with the 16-bit cache). Read by the CPU attention backends
    # (native and torch), not by the Triton kernels.
    kv_cache_dtype: str = "auto"
    device: str = "cpu"
    # KV capacity in tokens; None = sized from the device's memory (mem_fraction_static of a GPU,
    # max_total_tokens_fraction of free RAM on the CPU), capped by what max_running_requests
    # full-context requests could ever use.
    max_total_tokens: int | None = None
    max_running_requests: int = 64
    # New prompt tokens computed in one prefill step (all admitted requests together).
    max_prefill_tokens: int = 4096
    # A prompt longer than this is prefilled in chunks of this many tokens; -1 disables chunking.
    chunked_prefill_size: int = 1024
    schedule_policy: str = "lpm"
    disable_radix_cache: bool = False
    page_size: int = 1
    attention_backend: str = "auto"
    random_seed: int = 0
    # None = the model's max_position_embeddings.
    context_length: int | None = None
    # Scales the KV reserved for running requests' future tokens when admitting new ones (SGLang's
    # --schedule-conservativeness); lower admits more and relies on retraction.
    schedule_conservativeness: float = 1.0
    # SGLang's priority scheduling: a request's `priority` orders the waiting queue (larger
    # first, or smaller with schedule_low_priority_values_first), and a waiting request more
    # urgent by priority_scheduling_preemption_threshold than a running one takes its place
    # when the running set is full (that one is retracted and resumes later). Off: priorities
    # are ignored, or refused with abort_on_priority_when_disabled.
    enable_priority_scheduling: bool = False
    schedule_low_priority_values_first: bool = False
    priority_scheduling_preemption_threshold: int = 10
    abort_on_priority_when_disabled: bool = False
    num_threads: int | None = None
    max_total_tokens_fraction: float = 0.1
    # SGLang's --mem-fraction-static, on a GPU: weights + KV pool use at most this fraction of the
    # device's memory, the rest is left for activations and CUDA graphs (runtime/kvcache/sizing.py);
    # None = 0.85. On the CPU the pool is max_total_tokens_fraction of free RAM instead.
    mem_fraction_static: float | None = None
    # Check the KV accounting after every step (tests; costs a pass over all slots per step).
    debug_check_invariants: bool = False
    # Constrained requests append the text their grammar forces next (a JSON key, say) without
    # sampling it token by token. Off by default: see runtime/sampling/constraints.py for why.
    enable_jump_forward: bool = False
    # Seconds a constraint's grammar may take to compile (queueing included) before its request
    # fails with a 400 naming the constraint. Real schemas compile in 1-100 ms; the slowest of
    # JSONSchemaBench takes 47 s, and xgrammar cannot be interrupted, so an overrunning compile
    # runs on in the background (runtime/sampling/grammar_pool.py) and its result is cached.
    grammar_compile_timeout_s: float = 10.0
    # SGLang's --speculative-algorithm: None = off, "NGRAM" = prompt lookup (drafts copied from
    # where the sequence's own suffix occurred earlier, verified in one forward; same output).
    speculative_algorithm: str | None = None
    # Most draft tokens verified per request and step (4 keeps a CPU verify forward cheap; SGLang
    # sizes it per GPU model).
    speculative_num_draft_tokens: int = 4
    # Suffix lengths matched against earlier text, longest first (SGLang's defaults, 1 and 12).
    speculative_ngram_min_match_window_size: int = 1
    speculative_ngram_max_match_window_size: int = 12
    # SGLang's --enable-deterministic-inference: batch-invariant matmuls and attention, so that a
    # request's logits (hence its greedy tokens, and its seeded samples) do not depend on the
    # other requests in its batch, on prefill chunking or on radix-cache hits. Costs speed
    # (benchmarks/RESULTS.md); the torch attention path only.
    enable_deterministic_inference: bool = False
    # Sessions (Engine.open_session, /open_session, programs while they run) pin the sequence
    # each of their requests ends with, so LRU eviction cannot take a live program's context:
    # pins may hold at most this fraction of the KV pool (a pin beyond it is not made) ...
    session_pinned_fraction: float = 0.25
    # ... and a session idle this long loses its pins (it stays open).
    session_idle_timeout_s: float = 120.0
    # SGLang's CUDA graphs for decode (runtime/forward/cuda_graphs.py): captured on CUDA for batch-size
    # buckets up to cuda_graph_max_bs (None: max_running_requests, at most 160) and replayed
    # with padded batches; --disable-cuda-graph runs every step eagerly. debug_eager_cuda_graph
    # serves decode through the same buffers and padding on any device with eager re-runs in
    # place of graph replays (how the CPU tests the runner).
    disable_cuda_graph: bool = False
    cuda_graph_max_bs: int | None = None
    debug_eager_cuda_graph: bool = False
    # SGLang's --num-continuous-decode-steps: decode steps run back to back before the
    # scheduler looks again (new requests, aborts), with each step's tokens applied, checked
    # and streamed after the last. Saves the per-step scheduling and output work, a large share
    # of a small model's CPU step (benchmarks/NOTES.md, session 32); a request arriving meanwhile
    # waits up to that many steps. Steps run one at a time while requests wait to be prefilled
    # and for requests whose next token depends on the one before outside the model: a grammar,
    # penalties, a pending min_new_tokens, images, drafts (runtime/scheduling/scheduler.py).
    num_continuous_decode_steps: int = 1
    # SGLang's --disable-overlap-schedule: with the overlap scheduler consecutive decode steps
    # pipeline (the next forward runs while this step's samples are applied; runtime/engine/overlap.py;
    # same tokens). None = on with a GPU, off on the CPU, where the forward thread competes with
    # the engine thread for the same cores (a tie when quiet, up to 17% slower when busy or at
    # batch 64: benchmarks/NOTES.md); False (--no-disable-overlap-schedule) turns it on anywhere.
    disable_overlap_schedule: bool | None = None
    # SGLang's --enable-torch-compile / --torch-compile-max-bs: each layer's dense work (not
    # attention) compiled with torch.compile (inductor, runtime/forward/torch_compile.py) for batches of
    # at most torch_compile_max_bs requests; larger ones, and any model the compiler cannot
    # take, run eagerly. Off by default (20-50 s of compiling at start with a cold cache, about
    # 5-7% off batch-1 decode on a 2-core CPU).
    enable_torch_compile: bool = False
    torch_compile_max_bs: int = 32
    # Decode-like batches on the CPU run each layer's small steps (residual add + RMSNorm, rotary
    # + K/V write, SiLU * up) as fused C calls between the matmuls (runtime/models/
    # fused_layers.py) where the native attention kernel runs and the model is Llama-shaped;
    # this turns that off (the eager torch ops, for A/B runs).
    disable_fused_layers: bool = False
    # A GGUF kept quantized multiplies decode-sized calls (1-16 rows) with int8 dot products on
    # CPUs with AVX512-VNNI, its activations quantized per group of 32 to int8 as llama.cpp does
    # (runtime/quant/linear.py, use_int8_activations); this keeps bf16 activations (bf16 dot
    # products: slower, closer to the dequantized weights' exact product).
    disable_int8_activations: bool = False
    # SGLang's --tp-size: the model split Megatron-style over this many ranks (processes; one GPU
    # each on CUDA), see runtime/distributed/. Rank 0 schedules and samples; the others forward
    # their shard only. Token-identical to tp_size=1 in float32 up to the summation order.
    tp_size: int = 1
    # SGLang's --nnodes / --node-rank / --dist-init-addr: the tp_size ranks spread evenly over
    # machines. Node 0 serves; the others (`forklm serve --node-rank N`) run workers only.
    # dist_init_addr is node 0's host:port for torch.distributed's TCP rendezvous; None = a free
    # port on 127.0.0.1 (one machine only).
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None
    # How an embedding request (/v1/embeddings, Engine.encode) pools the final-normed hidden
    # states of its prompt: "last" token (Qwen3-Embedding and most decoder embedders), "mean" or
    # "cls" (the first token). Mean and cls read every position, so they take no cached prefix.
    # None = the model's own (sentence-transformers' Pooling module, a GGUF's pooling_type;
    # runtime/models/pooling_config.py), else "last". Resolved in ModelInfo.pooling.
    pooling: str | None = None
    # SGLang's LoRA serving (runtime/lora/): --lora-paths loads PEFT adapter folders at start
    # (`name=path`, or a path that is also the name); --enable-lora (implied by lora_paths) also
    # lets adapters be loaded at run time. A request names its adapter in lora_path; one batch
    # mixes requests of at most max_loras_per_batch adapters (and the base model), and the
    # weights of at most max_loaded_loras adapters stay in memory (None: all; least recently
    # used first out, read again from their folder when next named).
    enable_lora: bool | None = None
    lora_paths: tuple[str, ...] = ()
    max_loras_per_batch: int = 8
    max_loaded_loras: int | None = None

    @property
    def lora_enabled(self) -> bool:
        return bool(self.lora_paths) if self.enable_lora is None else self.enable_lora

    def __post_init__(self) -> None:
        check_field(self.pooling is None or self.pooling in POOLING_MODES, "pooling",
                    self.pooling, f"expected one of {', '.join(POOLING_MODES)} (or unset: the "
                    "model's own)")
        check_field(self.dtype in ("auto", "float32", "bfloat16", "float16"), "dtype", self.dtype,
               "expected one of auto, float32, bfloat16, float16")
        check_field(self.kv_cache_dtype == "auto" or self.kv_cache_dtype in KV_CACHE_DTYPES,
                    "kv_cache_dtype", self.kv_cache_dtype,
                    f"expected auto, {', '.join(KV_CACHE_DTYPES)}")
        triton = self.attention_backend == "triton" or (self.attention_backend == "auto"
                                                        and self.device.startswith("cuda"))
        check_field(self.kv_cache_dtype == "auto" or not triton,
                    "kv_cache_dtype", self.kv_cache_dtype,
                    "8-bit KV pools are read by the CPU attention backends (native, torch); the "
                    "Triton kernels read the model's dtype: leave kv_cache_dtype at auto")
        check_field(self.quantization in QUANTIZATION_CHOICES, "quantization",
                    self.quantization, "expected one of gguf, none (or unset for auto)")
        check_field(self.quantization != "gguf" or self.device == "cpu", "quantization",
                    self.quantization, "GGUF blocks are multiplied by a CPU kernel; on a GPU "
                    "leave it unset (the GGUF is dequantized)")
        check_field(self.device == "cpu" or self.device.startswith("cuda"), "device", self.device,
               "expected 'cpu' or 'cuda[:N]'")
        check_field(self.max_total_tokens is None or self.max_total_tokens >= 16, "max_total_tokens",
               self.max_total_tokens, "need at least 16 KV slots")
        check_field(1 <= self.num_continuous_decode_steps <= 64, "num_continuous_decode_steps",
                    self.num_continuous_decode_steps, "expected 1 (one step at a time) to 64")
        check_field(self.max_running_requests >= 1, "max_running_requests", self.max_running_requests,
               "must be >= 1")
        check_field(self.cuda_graph_max_bs is None or self.cuda_graph_max_bs >= 1,
                    "cuda_graph_max_bs", self.cuda_graph_max_bs, "must be >= 1")
        check_field(self.torch_compile_max_bs >= 1, "torch_compile_max_bs",
                    self.torch_compile_max_bs, "must be >= 1")
        check_field(self.max_prefill_tokens >= 1, "max_prefill_tokens", self.max_prefill_tokens,
               "must be >= 1")
        check_field(self.chunked_prefill_size == -1 or self.chunked_prefill_size >= 1,
               "chunked_prefill_size", self.chunked_prefill_size, "must be -1 (off) or >= 1")
        check_field(self.schedule_policy in ("lpm", "fcfs"), "schedule_policy", self.schedule_policy,
               "expected 'lpm' or 'fcfs'")
        check_field(self.page_size == 1, "page_size", self.page_size,
               "only page_size=1 is implemented so far")
        check_field(self.attention_backend in ("auto", "torch", "triton", "native"),
                    "attention_backend", self.attention_backend,
                    "expected auto, torch, triton or native")
        check_field(not (self.enable_deterministic_inference
                         and self.attention_backend in ("triton", "native")),
                    "attention_backend", self.attention_backend,
                    "enable_deterministic_inference runs its own batch-invariant attention; "
                    "leave attention_backend at auto or torch")
        check_field(0 <= self.session_pinned_fraction <= 0.9, "session_pinned_fraction",
                    self.session_pinned_fraction, "must be in [0, 0.9]")
        check_field(self.session_idle_timeout_s > 0, "session_idle_timeout_s",
                    self.session_idle_timeout_s, "must be > 0")
        check_field(self.context_length is None or self.context_length >= 1, "context_length",
               self.context_length, "must be >= 1")
        check_field(self.schedule_conservativeness > 0, "schedule_conservativeness",
               self.schedule_conservativeness, "must be > 0")
        check_field(self.priority_scheduling_preemption_threshold >= 0,
                    "priority_scheduling_preemption_threshold",
                    self.priority_scheduling_preemption_threshold, "must be >= 0")
        check_field(self.num_threads is None or self.num_threads >= 1, "num_threads",
               self.num_threads, "must be >= 1")
        check_field(self.grammar_compile_timeout_s > 0, "grammar_compile_timeout_s",
                    self.grammar_compile_timeout_s, "must be > 0")
        check_field(0 < self.max_total_tokens_fraction <= 0.9, "max_total_tokens_fraction",
               self.max_total_tokens_fraction, "must be in (0, 0.9]")
        check_field(self.mem_fraction_static is None or 0 < self.mem_fraction_static < 1,
                    "mem_fraction_static", self.mem_fraction_static, "must be in (0, 1)")
        check_field(self.mem_fraction_static is None or self.device.startswith("cuda"),
                    "mem_fraction_static", self.mem_fraction_static,
                    "sizes the KV pool from a GPU's memory; on the CPU set "
                    "max_total_tokens_fraction (of free RAM) or max_total_tokens")
        self._check_speculative()
        self._check_parallel()
        self._check_lora()

    def _check_lora(self) -> None:
        paths = self.lora_paths
        if isinstance(paths, str):
            paths = (paths,)
        check_field(isinstance(paths, (list, tuple)) and all(isinstance(p, str) for p in paths),
                    "lora_paths", self.lora_paths, "expected a list of name=path strings")
        object.__setattr__(self, "lora_paths", tuple(paths))  # hashable whatever was given
        check_field(self.max_loras_per_batch >= 1, "max_loras_per_batch",
                    self.max_loras_per_batch, "must be >= 1")
        check_field(self.max_loaded_loras is None or self.max_loaded_loras >= 1,
                    "max_loaded_loras", self.max_loaded_loras, "must be >= 1 (or unset: all)")
        check_field(not (self.enable_lora is False and self.lora_paths), "enable_lora", False,
                    "lora_paths were given; leave enable_lora unset or True")
        if not self.lora_enabled:
            return
        check_field(self.tp_size == 1, "tp_size", self.tp_size,
                    "LoRA adapters are applied by one process; use tp_size 1 (or data "
                    "parallelism: every replica loads the adapters)")
        check_field(not self.enable_deterministic_inference, "enable_deterministic_inference",
                    True, "not implemented with LoRA adapters (their updates are computed per "
                    "batch's adapter rows)")

    def _check_parallel(self) -> None:
        check_field(self.tp_size >= 1, "tp_size", self.tp_size, "must be >= 1")
        check_field(self.nnodes >= 1 and self.tp_size % self.nnodes == 0, "nnodes", self.nnodes,
                    f"must be >= 1 and divide tp_size ({self.tp_size})")
        check_field(0 <= self.node_rank < self.nnodes, "node_rank", self.node_rank,
                    f"must be in [0, nnodes={self.nnodes})")
        check_field(self.nnodes == 1 or self.dist_init_addr is not None, "dist_init_addr",
                    self.dist_init_addr, "several nodes need node 0's host:port to meet at")
        check_field(self.dist_init_addr is None or _is_host_port(self.dist_init_addr),
                    "dist_init_addr", self.dist_init_addr,
                    "expected host:port (or tcp://host:port)")
        if self.tp_size == 1:
            return
        check_field(self.quantization != "gguf", "quantization", self.quantization,
                    "GGUF blocks kept quantized are not split across ranks; with tp_size > 1 "
                    "leave it unset or 'none' (the GGUF is dequantized)")
        check_field(not self.enable_deterministic_inference, "enable_deterministic_inference",
                    True, "not implemented with tp_size > 1")
        check_field(self.device == "cpu" or self.device == "cuda", "device", self.device,
                    "with tp_size > 1 use 'cuda' (rank r takes the node's r-th GPU) or 'cpu'")

    @property
    def local_tp_size(self) -> int:
        """Tensor-parallel ranks on each node."""
        return self.tp_size // self.nnodes

    @property
    def threads_per_rank(self) -> int | None:
        """CPU threads each rank's torch uses: num_threads, or under tensor parallelism this
        node's cores shared evenly by its ranks (None = torch's default)."""
        if self.num_threads or self.tp_size == 1:
            return self.num_threads
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        return max(1, (cores or 1) // self.local_tp_size)

    def _check_speculative(self) -> None:
        check_field(self.speculative_algorithm in SPECULATIVE_ALGORITHMS, "speculative_algorithm",
                    self.speculative_algorithm, "expected NGRAM (or unset for off)")
        check_field(self.speculative_num_draft_tokens >= 1, "speculative_num_draft_tokens",
                    self.speculative_num_draft_tokens, "must be >= 1")
        check_field(self.speculative_ngram_min_match_window_size >= 1,
                    "speculative_ngram_min_match_window_size",
                    self.speculative_ngram_min_match_window_size, "must be >= 1")
        check_field(self.speculative_ngram_max_match_window_size
                    >= self.speculative_ngram_min_match_window_size,
                    "speculative_ngram_max_match_window_size",
                    self.speculative_ngram_max_match_window_size,
                    "must be >= speculative_ngram_min_match_window_size")

    @property
    def torch_dtype_name(self) -> str:
        return resolved_dtype_name(self.dtype, self.device)

    @property
    def kv_torch_dtype_name(self) -> str:
        """The torch dtype (by name) the KV pool holds: the model's, or an 8-bit one."""
        return KV_CACHE_DTYPES.get(self.kv_cache_dtype, self.torch_dtype_name)

    @property
    def resolved_attention_backend(self) -> str:
        if self.attention_backend != "auto":
            return self.attention_backend
        if self.device.startswith("cuda"):
            return "triton"
        # The C kernel for decode when this machine compiles it (kernels/cpu/bindings.py).
        from forklm.kernels.cpu import bindings as native_kernels

        return "native" if native_kernels.available() else "torch"

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        """Build from keyword arguments, rejecting unknown names with the list of known ones."""
        return config_from_kwargs(cls, "engine", kwargs)


def resolved_dtype_name(dtype: str, device: str = "cpu") -> str:
    """`dtype` itself, or for "auto" the fast dtype for `device`: bfloat16 where the hardware
    multiplies bf16 natively, else float32."""
    if dtype != "auto":
        return dtype
    if device.startswith("cuda") or cpu_has_native_bf16():
        return "bfloat16"
    return "float32"


def cpu_has_native_bf16() -> bool:
    """True when this CPU has bf16 dot-product instructions (x86 AVX-512-bf16 or AMX-bf16)."""
    return bool(cpu_flags() & {"avx512_bf16", "amx_bf16"})


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none to read)."""
    try:
        cpuinfo = pathlib.Path("/proc/cpuinfo").read_text()
    except OSError:  # not Linux: no way to tell cheaply, so every fast path stays off
        return frozenset()
    return frozenset(next((line.split(":", 1)[1].split() for line in cpuinfo.splitlines()
                           if line.startswith("flags")), []))


C = TypeVar("C")


def config_from_kwargs(cls: type[C], kind: str, kwargs: dict[str, Any]) -> C:
    """A config dataclass from keyword arguments; an unknown name is an InvalidArgumentError
    that lists the known ones."""
    known = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise InvalidArgumentError(unknown[0], kwargs[unknown[0]],
                                   f"unknown {kind} option; known: {', '.join(sorted(known))}")
    return cls(**kwargs)


def check_field(ok: bool, name: str, value: object, why: str) -> None:
    """Config validation: raise InvalidArgumentError naming the field unless `ok`."""
    if not ok:
        raise InvalidArgumentError(name, value, why)


def _is_host_port(addr: str) -> bool:
    host, sep, port = addr.removeprefix("tcp://").rpartition(":")
    return bool(host and sep and port.isdigit() and 0 < int(port) < 65536)
