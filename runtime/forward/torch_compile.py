"""--enable-torch-compile: the dense work of every decoder layer compiled with torch.compile
(inductor), attention left eager.

A layer runs in three parts: `before_attention` (input norm, q/k/v matmul, rotary), attention over
the paged KV pool, `after_attention` (output matmul, residuals, norms, MLP). The two dense parts are
functions of (layer, tensors) that write nothing else, so one compiled graph serves all layers:
their weights are graph inputs of equal shapes, nothing per layer is baked in. Attention stays
eager: it reads per-batch metadata and writes the pool, which is where compiling a whole forward
broke before (benchmarks/NOTES.md, session 6). One token (batch-1 decode) has a static graph;
other token counts share a dynamic one (one per range of rows a linear branches on).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from forklm.runtime.models.decoder import EAGER_STEPS, CausalLM, DecoderLayer, LayerSteps
from forklm.runtime.quant.kquant import keep_matmul_out_of_compiled_graphs
from forklm.runtime.quant.linear import DENSE_COPY_MIN_ROWS, DENSE_MIN_ROWS

if TYPE_CHECKING:
    from forklm.runtime.forward.batch import ForwardBatch

logger = logging.getLogger(__name__)

# Token counts every layer runs at start: one, a few, and the row counts from which quantized
# linears switch kernels (quant/linear.py: DENSE_COPY_MIN_ROWS, DENSE_MIN_ROWS), so that every
# graph a forward needs exists before the first request.
WARM_UP_TOKENS = (1, 2, DENSE_COPY_MIN_ROWS, DENSE_MIN_ROWS)
INDUCTOR_OPTIONS: dict[str, Any] = {
    # Keep every rounding to bf16 that eager makes, also inside a fused kernel: without it a
    # compiled bf16 layer differed from eager by bf16 ulps at every call; with it, it is equal
    # bit for bit except where inductor's fp32 math (rsqrt, exp) rounds differently from aten's.
    "emulate_precision_casts": True,
    # No pattern rewrites: one fuses a residual add into oneDNN's linear (one rounding fewer).
    "pattern_matcher": False,
    # The generated wrapper in C++ rather than Python, without its per-call shape checks: most
    # of what a compiled call costs beyond its kernels and dynamo's entry.
    "cpp_wrapper": True,
    "size_asserts": False,
    # Serial kernels: a dynamic-shape kernel cannot tell a 16-row norm from a large one and
    # always woke the second OpenMP thread, which made batch-16 steps slower than eager.
    "cpp.threads": 1,
}


class CompiledLayerSteps:
    """Compiled layer steps for forwards of at most max_bs requests; larger ones, and every
    forward after a compiled call has failed, run the eager steps."""

    def __init__(self, max_bs: int):
        self.max_bs = max_bs
        self.failed = False
        self.compiled_forwards = self.eager_forwards = 0
        self.one_token = LayerSteps(self._guarded(_compile(_before_one_token, False), 0),
                                    self._guarded(_compile(_after_one_token, False), 1))
        self.tokens = LayerSteps(self._guarded(_compile(_before_tokens, True), 0),
                                 self._guarded(_compile(_after_tokens, True), 1))

    def steps_for(self, num_tokens: int) -> LayerSteps:
        return self.one_token if num_tokens == 1 else self.tokens

    @contextlib.contextmanager
    def session(self, batch: ForwardBatch) -> Iterator[LayerSteps]:
        """The steps for one forward of `batch`. Graphs are picked without evaluating dynamo's
        guards, which re-check the layer modules (they never change once built) at 20-35 us a
        call, as much as the work compiled: the warm-up ran every layer at every token-count range,
        so only the guards telling those graphs apart are needed, and a call that no graph fits
        raises rather than recompiling (it then runs eagerly)."""
        if self.failed or batch.batch_size > self.max_bs:
            self.eager_forwards += 1
            yield EAGER_STEPS
            return
        self.compiled_forwards += 1
        with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
            yield self.steps_for(batch.num_tokens)

    def _guarded(self, compiled: Callable[..., Any], index: int) -> Callable[..., Any]:
        """compiled(...), or the eager step when the compiler cannot take a call: the steps
        write nothing outside their outputs, so running one again eagerly is safe."""
        eager = EAGER_STEPS[index]

        def call(*args: Any) -> Any:
            if self.failed:
                return eager(*args)
            try:
                return compiled(*args)
            except Exception as e:  # noqa: BLE001 - any compiler failure falls back
                logger.warning("torch.compile failed (%s: %s); layers run eagerly from now on",
                               type(e).__name__, e)
                self.failed = True
                return eager(*args)

        return call


# The steps twice over, as functions of their own: dynamo keeps one cache of graphs per code
# object, and picking among several graphs costs guard checks at every call. One token (batch-1
# decode, the latency users feel) gets a cache holding its one static graph.
def _before_one_token(layer: DecoderLayer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return layer.before_attention(x, cos, sin)


def _after_one_token(layer: DecoderLayer, x: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
    return layer.after_attention(x, attn_out)


def _before_tokens(layer: DecoderLayer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return layer.before_attention(x, cos, sin)


def _after_tokens(layer: DecoderLayer, x: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
    return layer.after_attention(x, attn_out)


def _compile(fn: Callable[..., Any], dynamic: bool) -> Callable[..., Any]:
    # fullgraph: a graph break would split a step into pieces with Python between them, which
    # costs more than it saves; better to fail and run eagerly.
    return torch.compile(fn, dynamic=dynamic, fullgraph=True, options=INDUCTOR_OPTIONS)


def _call_packed_linears_as_they_are() -> None:
    """Make inductor call oneDNN's packed linear (onednn_linear.py) as an opaque op. Its own
    lowering of that op only takes weights frozen into the graph as constants; here they are
    graph inputs (one graph serves every layer), so the lowering fails."""
    from torch._inductor import lowering, mkldnn_lowerings  # noqa: F401 - registers the lowering

    op = getattr(torch.ops.mkldnn, "_linear_pointwise", None)
    if op is not None and op.default in lowering.lowerings:
        lowering.make_fallback(op.default)


def enable_torch_compile(model: CausalLM, max_bs: int,
                         warm_up_tokens: tuple[int, ...] = WARM_UP_TOKENS) -> CompiledLayerSteps:
    """Compile `model`'s layer steps, run every layer once at each of warm_up_tokens (compiling
    at start, not at a user's first request) and set model.compiled_steps. The compiled steps
    replace the fused decode layers (models/fused_layers.py) where the model had them: what a
    user who asks for torch.compile wants to run."""
    _call_packed_linears_as_they_are()
    keep_matmul_out_of_compiled_graphs()
    compiled = CompiledLayerSteps(max_bs)
    t0 = time.perf_counter()
    with torch.inference_mode():
        for num_tokens in warm_up_tokens:
            for layer in model.model.layers:
                _run_steps(compiled.steps_for(num_tokens), layer, num_tokens)
    logger.info("torch.compile: layer steps compiled for %s tokens in %.1f s%s", warm_up_tokens,
                time.perf_counter() - t0, " (failed: eager)" if compiled.failed else "")
    model.compiled_steps = compiled
    model.fused_layers = None
    return compiled


def _run_steps(steps: LayerSteps, layer: DecoderLayer, num_tokens: int) -> None:
    """Both steps of `layer` on zero inputs of num_tokens rows, shaped and strided as a forward
    passes them."""
    attn = layer.self_attn
    # a norm's weight: in the model's dtype, whatever the linears hold (every layer has a norm)
    norm_weight = next(p for name, p in layer.named_parameters() if "norm" in name)
    x = torch.zeros(num_tokens, layer.hidden_size, dtype=norm_weight.dtype,
                    device=norm_weight.device)
    # cos and sin as two tensors: dynamo guards on whether arguments alias each other
    cos, sin = (torch.zeros(num_tokens, 1, attn.rotary.rotary_dim, dtype=x.dtype,
                            device=x.device) for _ in range(2))
    steps.before_attention(layer, x, cos, sin)
    steps.after_attention(layer, x, x.new_zeros(num_tokens, attn.num_heads * attn.head_dim))
