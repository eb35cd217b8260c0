"""ModelSpec: what one decoder needs to know about a checkpoint's architecture, read once from its
Hugging Face config. Each supported `model_type` is a small function here; a config field that
would change the computation and that forklm does not honour is refused, never ignored."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from forklm.runtime.errors import UnsupportedModelError
from forklm.runtime.models.layers import NO_ROPE, alibi_slopes, mpt_alibi_slopes
from forklm.runtime.models.unsupported import missing_mechanism

# rope_type values whose tables do not depend on the sequence being decoded ("dynamic" NTK does).
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope", "proportional")
_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh",
                "gelu_new": "gelu_tanh", "gelu": "gelu", "relu2": "relu2"}


@dataclass(frozen=True)
class LayerSpec:
    sliding_window: int | None  # a query sees itself and the window - 1 keys before it
    rope_key: str  # which rotary table: "default", or a Gemma 3 layer type
    moe: bool  # a sparse mixture-of-experts block instead of the dense MLP
    # Gemma 4: full-attention layers have heads of their own width and KV head count (0: the
    # model's), may take the keys as values (k_eq_v), and the last layers read the K/V an
    # earlier layer stored (kv_source) instead of computing their own; they may have a wider MLP.
    head_dim: int = 0
    num_kv_heads: int = 0
    k_eq_v: bool = False
    kv_source: int | None = None
    intermediate_size: int = 0


@dataclass(frozen=True)
class MoESpec:
    num_experts: int
    top_k: int
    intermediate_size: int
    renormalize: bool  # top-k weights divided by their sum (Mixtral; Qwen's norm_topk_prob)
    shared_intermediate_size: int = 0  # Qwen2-MoE's always-on expert, gated by a sigmoid
    # gpt-oss: the router has a bias and softmaxes only the top-k logits ("topk_softmax"; the
    # others "softmax_topk": softmax over all experts, then top-k); experts have biases and a
    # clamped SwiGLU, (clamp(up, +-limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit).
    routing: str = "softmax_topk"
    bias: bool = False  # router and expert biases
    swiglu_limit: float | None = None  # None: the family's plain activation
    swiglu_alpha: float = 1.0

    def __post_init__(self) -> None:
        assert self.routing in ("softmax_topk", "topk_softmax"), self.routing


@dataclass(frozen=True)
class ModelSpec:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    norm_eps: float  # every norm's epsilon
    tie_word_embeddings: bool
    activation: str = "silu"  # "silu", "gelu_tanh", "gelu" or "relu2"
    qkv_bias: bool = False
    qkv_clip: float | None = None  # MPT's clip_qkv: the fused q/k/v clamped to [-clip, clip]
    o_bias: bool = False
    mlp_bias: bool = False
    norm_kind: str = "rms"  # "rms", or "layer": LayerNorm with a bias (StableLM, StarCoder 2)
    norm_bias: bool = True  # False: LayerNorms without a bias (MPT)
    norm_offset: float = 0.0  # Gemma (RMS) and Nemotron (Layer) store norm weights as w - 1
    embed_scale: float | None = None  # Gemma: sqrt(hidden_size); Granite: embedding_multiplier
    embed_norm: bool = False  # BLOOM: a norm of its own right after the token embedding
    # "head": one norm over each head's q and k (Qwen3, Gemma 3); "each_head": a norm of its own
    # per head (StableLM); "proj": over the whole q and k projections (OLMo 2). "": none.
    qk_norm: str = ""
    # Where a layer's norms are: "pre" (Llama: before attention and before the MLP), "sandwich"
    # (Gemma 2/3: also after each), "post" (OLMo 2: only after each, on the block's output).
    norm_placement: str = "pre"
    # Attention and MLP side by side, x + attn(norm(x)) + mlp(norm'(x)): "shared_norm" (StableLM,
    # Falcon 7B: norm' is norm) or "own_norm" (Falcon 40B+: the MLP's own norm). "": in sequence.
    parallel_residual: str = ""
    gated_mlp: bool = True  # False: down(act(up(x))) (StarCoder 2, Nemotron)
    residual_scale: float = 1.0  # Granite: each block's output times this before it is added
    logits_divisor: float = 1.0  # Granite's logits_scaling
    # GPT-2: rows of a learned absolute position table added to the embeddings; 0: none.
    position_embeddings: int = 0
    attn_scale: float = 0.0  # softmax scale; set from head_dim when 0
    # ALiBi (BLOOM, MPT): each head's slope of a linear bias on its scores, slope_h * (key
    # position - query position), in place of rotary positions (every layer's table is the
    # identity); () none.
    alibi_slopes: tuple[float, ...] = ()
    attn_softcap: float | None = None  # Gemma 2: scores -> cap * tanh(scores / cap)
    attn_sinks: bool = False  # gpt-oss: a learned logit per head joins each softmax's denominator
    final_softcap: float | None = None
    layers: tuple[LayerSpec, ...] = ()
    # rope_key -> rope parameters (rope_type, rope_theta, scaling fields)
    rope: dict[str, dict[str, Any]] = field(default_factory=dict)
    moe: MoESpec | None = None
    # Gemma 4's per-layer input embeddings: (vocabulary, width per layer); None: none.
    per_layer_input: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if not self.attn_scale:
            object.__setattr__(self, "attn_scale", self.head_dim**-0.5)
        assert self.norm_kind in ("rms", "layer"), self.norm_kind
        assert self.qk_norm in ("", "head", "each_head", "proj"), self.qk_norm
        assert self.norm_placement in ("pre", "sandwich", "post"), self.norm_placement
        assert self.parallel_residual in ("", "shared_norm", "own_norm"), self.parallel_residual
        assert not self.parallel_residual or self.norm_placement == "pre", "parallel: pre norms"
        assert not self.alibi_slopes or len(self.alibi_slopes) == self.num_heads, "a slope a head"
        assert self.residual_scale == 1.0 or (self.norm_placement == "pre"
                                              and not self.parallel_residual), "residual_scale"

    @property
    def has_sliding_window(self) -> bool:
        return any(layer.sliding_window for layer in self.layers)

    def layer_head_dim(self, i: int) -> int:
        return self.layers[i].head_dim or self.head_dim

    def layer_kv_heads(self, i: int) -> int:
        return self.layers[i].num_kv_heads or self.num_kv_heads

    @property
    def kv_pool_layers(self) -> tuple[int, ...]:
        """Each layer's layer of the KV pool: layers reading another layer's K/V (kv_source)
        have none of their own and read their source's."""
        own = [i for i, layer in enumerate(self.layers) if layer.kv_source is None]
        index = {layer: n for n, layer in enumerate(own)}
        return tuple(index[i if layer.kv_source is None else layer.kv_source]
                     for i, layer in enumerate(self.layers))

    @property
    def kv_pool_shape(self) -> tuple[int, int, int]:
        """(layers, kv_heads, head_dim) of the KV pool. Where layers differ (Gemma 4) every pool
        layer is as wide as the widest: narrower heads are zero-padded (scores and outputs are
        unchanged) and fewer KV heads repeated (each query head still meets its own)."""
        n = range(self.num_layers)
        return (len(set(self.kv_pool_layers)) if self.layers else self.num_layers,
                max((self.layer_kv_heads(i) for i in n), default=self.num_kv_heads),
                max((self.layer_head_dim(i) for i in n), default=self.head_dim))


def spec_from_config(config: Any) -> ModelSpec:
    """The ModelSpec of a transformers config; UnsupportedModelError for an unknown model_type or
    a field whose effect forklm does not implement."""
    family = _FAMILIES.get(config.model_type)
    if family is None:
        raise UnsupportedModelError(
            f"model_type {config.model_type!r} is not supported"
            f"{missing_mechanism(config.model_type)}; supported: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}")
    # "vision" (Gemma 4): only image tokens see each other both ways; text is causal.
    bidirectional = getattr(config, "use_bidirectional_attention", False)
    if bidirectional and bidirectional != "vision":
        _refuse(config, "use_bidirectional_attention", bidirectional,
                "only causal attention is implemented")
    return family(config)


def _refuse(config: Any, name: str, value: Any, why: str) -> None:
    raise UnsupportedModelError(f"{config.model_type} config {name}={value!r} is not supported: {why}")


def _common(config: Any, **overrides: Any) -> dict[str, Any]:
    # Gemma 4's head_dim and KV heads vary by layer: its family passes the sliding layers' own.
    head_dim = overrides.get("head_dim") or getattr(config, "head_dim", None) or (
        config.hidden_size // config.num_attention_heads)
    # Gemma's MLP reads hidden_activation, GPT-2's activation_function, Falcon's activation, the
    # others hidden_act.
    act_field = next((name for name in ("hidden_activation", "hidden_act", "activation_function",
                                        "activation") if getattr(config, name, None)), "hidden_act")
    act = str(getattr(config, act_field, "silu"))
    if act not in _ACTIVATIONS:
        _refuse(config, act_field, act, f"supported: {', '.join(_ACTIVATIONS)}")
    fields = dict(
        model_type=config.model_type, vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=getattr(config, "intermediate_size", None),
        num_layers=config.num_hidden_layers, num_heads=config.num_attention_heads,
        num_kv_heads=overrides.get("num_kv_heads") or getattr(config, "num_key_value_heads", None)
        or config.num_attention_heads,
        head_dim=head_dim, norm_eps=getattr(config, "rms_norm_eps", None),
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        activation=_ACTIVATIONS[act],
        qkv_bias=bool(getattr(config, "attention_bias", False)),
        o_bias=bool(getattr(config, "attention_bias", False)),
        mlp_bias=bool(getattr(config, "mlp_bias", False)),
    )
    fields.update(overrides)
    fields.setdefault("rope", {"default": _rope_parameters(config, getattr(config, "rope_parameters", None))})
    fields.setdefault("layers", _layers(config, _windows(config)))
    return fields


def _rope_parameters(config: Any, rope: dict | None) -> dict[str, Any]:
    rope = dict(rope or {})
    if not rope:  # older configs: rope_theta + rope_scaling
        rope = dict(getattr(config, "rope_scaling", None) or {})
        rope.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    rope["rope_type"] = rope.get("rope_type", rope.get("type", "default"))
    if rope["rope_type"] not in SUPPORTED_ROPE_TYPES:
        _refuse(config, "rope_type", rope["rope_type"],
                f"supported rope types: {', '.join(SUPPORTED_ROPE_TYPES)}")
    if rope["rope_type"] == "longrope" and config.model_type != "phi3":
        _refuse(config, "rope_type", "longrope", "implemented for phi3 only")
    if rope["rope_type"] == "proportional" and config.model_type != "gemma4_text":
        _refuse(config, "rope_type", "proportional", "implemented for gemma4 only")
    return rope


def _windows(config: Any) -> list[int | None]:
    """Each layer's sliding window. Configs with `layer_types` say it per layer; the others
    (Mistral, Mixtral, Phi-3, Qwen3-MoE) slide every layer when sliding_window is set."""
    window = getattr(config, "sliding_window", None) or None
    layer_types = getattr(config, "layer_types", None)
    if not layer_types:
        return [window] * config.num_hidden_layers
    unknown = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
    if unknown:
        _refuse(config, "layer_types", unknown, "only full_attention and sliding_attention layers")
    return [window if kind == "sliding_attention" else None for kind in layer_types]


def _layers(config: Any, windows: list[int | None], rope_keys: list[str] | None = None,
            moe: list[bool] | None = None) -> tuple[LayerSpec, ...]:
    n = config.num_hidden_layers
    return tuple(LayerSpec(windows[i], rope_keys[i] if rope_keys else "default",
                           bool(moe and moe[i])) for i in range(n))


# ---- families -------------------------------------------------------------------------------


def _llama(config: Any) -> ModelSpec:
    if getattr(config, "pretraining_tp", 1) not in (None, 1):
        _refuse(config, "pretraining_tp", config.pretraining_tp, "only 1")
    return ModelSpec(**_common(config))


def _qwen2(config: Any) -> ModelSpec:
    return ModelSpec(**_common(config, qkv_bias=True, o_bias=False))


def _qwen3(config: Any) -> ModelSpec:
    return ModelSpec(**_common(config, qk_norm="head"))


def _qwen3_vl(config: Any) -> ModelSpec:
    # Qwen3-VL's decoder: Qwen3's, its M-RoPE frequencies interleaved (row, column, time...)
    rope = {**_rope_parameters(config, config.rope_parameters), "mrope_interleaved": True}
    return ModelSpec(**_common(config, qk_norm="head", rope={"default": rope}))


def _phi3(config: Any) -> ModelSpec:
    return ModelSpec(**_common(config))


def _gemma(config: Any, qk_norm: str) -> dict[str, Any]:
    return dict(
        norm_offset=1.0, embed_scale=config.hidden_size**0.5, qk_norm=qk_norm,
        norm_placement="sandwich",
        attn_scale=config.query_pre_attn_scalar**-0.5,
        attn_softcap=getattr(config, "attn_logit_softcapping", None),
        final_softcap=getattr(config, "final_logit_softcapping", None),
    )


def _gemma2(config: Any) -> ModelSpec:
    return ModelSpec(**_common(config, **_gemma(config, qk_norm="")))


def _gemma3(config: Any) -> ModelSpec:
    # Gemma 3 keeps one rope table per layer type: local layers use rope_local_base_freq.
    rope = {kind: _rope_parameters(config, params)
            for kind, params in config.rope_parameters.items() if params is not None}
    return ModelSpec(**_common(config, **_gemma(config, qk_norm="head"), rope=rope,
                               layers=_layers(config, _windows(config), list(config.layer_types))))


def _gemma4(config: Any) -> ModelSpec:
    # Gemma 3's sandwich layers with plain (not 1 + w) norm weights, unscaled attention (the q/k
    # norms do it), RMS-normed values, a learned scalar per layer and per-layer input embeddings.
    if config.num_kv_shared_layers >= config.num_hidden_layers:
        _refuse(config, "num_kv_shared_layers", config.num_kv_shared_layers,
                "some layer must compute the K/V that the others share")
    rope = {kind: _rope_parameters(config, params)
            for kind, params in config.rope_parameters.items() if params is not None}
    windows, modes = _windows(config), config.kv_sharing_modes
    first_shared = config.num_hidden_layers - config.num_kv_shared_layers
    # A sharing layer reads the last non-sharing layer of its own type.
    source = {kind: max(i for i in range(first_shared) if config.layer_types[i] == kind)
              for kind in set(config.layer_types)}
    layers = []
    for i, kind in enumerate(config.layer_types):
        shared = modes[i] == "reuse"
        wide = 2 if shared and config.use_double_wide_mlp else 1
        layers.append(LayerSpec(
            windows[i], kind, bool(config.enable_moe_block),
            head_dim=config.per_layer_config[i].head_dim,
            num_kv_heads=config.per_layer_config[i].num_key_value_heads,
            k_eq_v=bool(config.attention_k_eq_v) and kind == "full_attention",
            kv_source=source[kind] if shared else None,
            intermediate_size=config.intermediate_size * wide))
    kv_heads = {layer.num_kv_heads for layer in layers}
    if any(max(kv_heads) % n for n in kv_heads):  # the pool repeats the fewer heads
        _refuse(config, "num_global_key_value_heads", sorted(kv_heads),
                "one layer type's KV heads must divide the other's")
    ple = config.hidden_size_per_layer_input
    sliding = config.per_layer_config[config.layer_types.index("sliding_attention")
                                      if "sliding_attention" in config.layer_types else 0]
    # Experts beside every layer's dense MLP (enable_moe_block)
    moe = (MoESpec(config.num_experts, config.top_k_experts, config.moe_intermediate_size,
                   renormalize=True) if config.enable_moe_block else None)
    return ModelSpec(**_common(
        config, head_dim=sliding.head_dim, num_kv_heads=sliding.num_key_value_heads, moe=moe,
        embed_scale=config.hidden_size**0.5, qk_norm="head", norm_placement="sandwich",
        attn_scale=1.0, final_softcap=config.final_logit_softcapping, rope=rope,
        layers=tuple(layers),
        per_layer_input=(config.vocab_size_per_layer_input, ple) if ple else None))


def _moe_layers(config: Any) -> list[bool]:
    step = getattr(config, "decoder_sparse_step", 1) or 1
    only_dense = set(getattr(config, "mlp_only_layers", None) or ())
    return [i not in only_dense and (i + 1) % step == 0 for i in range(config.num_hidden_layers)]


def _mixtral(config: Any) -> ModelSpec:
    moe = MoESpec(config.num_local_experts, config.num_experts_per_tok, config.intermediate_size,
                  renormalize=True)
    layers = _layers(config, _windows(config), moe=[True] * config.num_hidden_layers)
    return ModelSpec(**_common(config, moe=moe, layers=layers))


def _qwen_moe(config: Any) -> ModelSpec:
    moe = MoESpec(config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size,
                  renormalize=bool(config.norm_topk_prob),
                  shared_intermediate_size=getattr(config, "shared_expert_intermediate_size", 0) or 0)
    layers = _layers(config, _windows(config), moe=_moe_layers(config))
    extra = ({"qkv_bias": bool(getattr(config, "qkv_bias", True))}
             if config.model_type == "qwen2_moe" else {"qk_norm": "head"})
    return ModelSpec(**_common(config, moe=moe, layers=layers, **extra))


def _gpt_oss(config: Any) -> ModelSpec:
    # Sliding and full layers alternate (layer_types); q/k/v/o biases; a sink logit per head;
    # every layer's MLP is a mixture of experts with biases and a clamped SwiGLU.
    # The hub's checkpoints pack the experts in MXFP4 (checkpoint_layouts.py dequantizes them).
    quant = getattr(config, "quantization_config", None) or {}
    method = (quant.get("quant_method") if isinstance(quant, dict)
              else getattr(quant, "quant_method", None))
    if quant and method != "mxfp4":
        _refuse(config, "quantization_config", method, "only the hub's MXFP4 experts are read")
    moe = MoESpec(config.num_local_experts, config.num_experts_per_tok, config.intermediate_size,
                  renormalize=False, routing="topk_softmax", bias=True,
                  swiglu_limit=float(config.swiglu_limit), swiglu_alpha=float(config.swiglu_alpha))
    layers = _layers(config, _windows(config), moe=[True] * config.num_hidden_layers)
    return ModelSpec(**_common(config, moe=moe, layers=layers, attn_sinks=True))


def _smollm3(config: Any) -> ModelSpec:
    # no_rope_layers[i] == 0: layer i has no positions (NoPE), an identity rotary table.
    keys = ["default" if use_rope else NO_ROPE for use_rope in config.no_rope_layers]
    rope = {"default": _rope_parameters(config, config.rope_parameters)}
    if NO_ROPE in keys:
        rope[NO_ROPE] = {"rope_type": NO_ROPE}
    return ModelSpec(**_common(config, rope=rope, layers=_layers(config, _windows(config), keys)))


def _granite(config: Any) -> ModelSpec:
    embed = float(config.embedding_multiplier)
    return ModelSpec(**_common(
        config, embed_scale=None if embed == 1.0 else embed,
        residual_scale=float(config.residual_multiplier),
        attn_scale=float(config.attention_multiplier),
        logits_divisor=float(config.logits_scaling)))


def _olmo2(config: Any) -> ModelSpec:
    # OLMo 2's MLP has no biases whatever the config says.
    return ModelSpec(**_common(config, qk_norm="proj", norm_placement="post", mlp_bias=False))


def _stablelm(config: Any) -> ModelSpec:
    # LayerNorms with biases; q/k/v biases only (use_qkv_bias); partial rotary from rope params.
    return ModelSpec(**_common(
        config, norm_eps=config.layer_norm_eps, norm_kind="layer",
        qkv_bias=bool(config.use_qkv_bias), o_bias=False, mlp_bias=False,
        qk_norm="each_head" if config.qk_layernorm else "",
        parallel_residual="shared_norm" if config.use_parallel_residual else ""))


def _starcoder2(config: Any) -> ModelSpec:
    # LayerNorms and every linear with a bias (use_bias), a plain c_fc -> act -> c_proj MLP.
    bias = bool(config.use_bias)
    return ModelSpec(**_common(config, norm_eps=config.norm_epsilon, norm_kind="layer",
                               qkv_bias=bias, o_bias=bias, mlp_bias=bias, gated_mlp=False))


def _nemotron(config: Any) -> ModelSpec:
    # LayerNorm1P: weights stored as w - 1; a plain up -> relu2 -> down MLP; partial rotary.
    return ModelSpec(**_common(config, norm_eps=config.norm_eps, norm_kind="layer",
                               norm_offset=1.0, gated_mlp=False))


def _gpt2(config: Any) -> ModelSpec:
    # Learned absolute positions and no rotary (every layer's table is the identity), LayerNorms,
    # biases on every linear, a plain MLP n_inner (default 4 * hidden) wide, no GQA.
    if config.scale_attn_by_inverse_layer_idx:
        _refuse(config, "scale_attn_by_inverse_layer_idx", True, "one softmax scale for all layers")
    if config.add_cross_attention:
        _refuse(config, "add_cross_attention", True, "decoder-only models only")
    n = config.num_hidden_layers
    return ModelSpec(**_common(
        config, intermediate_size=config.n_inner or 4 * config.hidden_size,
        num_kv_heads=config.num_attention_heads, norm_eps=config.layer_norm_epsilon,
        norm_kind="layer", qkv_bias=True, o_bias=True, mlp_bias=True, gated_mlp=False,
        attn_scale=0.0 if config.scale_attn_weights else 1.0,
        position_embeddings=config.max_position_embeddings,
        rope={NO_ROPE: {"rope_type": NO_ROPE}}, layers=_layers(config, [None] * n, [NO_ROPE] * n)))


def _falcon(config: Any) -> ModelSpec:
    # Attention and MLP in parallel (one shared norm, or ln_attn and ln_mlp on the 40B+ layout)
    # or in sequence; multi-query, grouped or per-head q/k/v (checkpoint_layouts.py regroups it).
    if config.alibi:
        _refuse(config, "alibi", True, "Falcon's ALiBi (divided by sqrt(head_dim), rounded to "
                "bf16 per position) is not implemented; BLOOM's and MPT's are")
    if config.new_decoder_architecture and not config.parallel_attn:
        _refuse(config, "parallel_attn", False, "the new decoder architecture runs in parallel")
    two_norms = config.new_decoder_architecture and (config.num_ln_in_parallel_attn or 2) == 2
    parallel = ("own_norm" if two_norms else "shared_norm") if config.parallel_attn else ""
    return ModelSpec(**_common(
        config, intermediate_size=config.ffn_hidden_size, norm_eps=config.layer_norm_epsilon,
        norm_kind="layer", qkv_bias=bool(config.bias), o_bias=bool(config.bias),
        mlp_bias=bool(config.bias), gated_mlp=False, parallel_residual=parallel))


def _bloom(config: Any) -> ModelSpec:
    # ALiBi in place of positions, a LayerNorm after the embedding, LayerNorms and biases
    # everywhere, a plain 4 * hidden GELU (tanh) MLP, q/k/v fused per head
    # (checkpoint_layouts.py regroups them). pretraining_tp / slow_but_exact only change the
    # order of a sum (the output matmuls in slices), not what is computed.
    if config.apply_residual_connection_post_layernorm:
        _refuse(config, "apply_residual_connection_post_layernorm", True,
                "the residual is each block's input")
    n = config.num_hidden_layers
    return ModelSpec(**_common(
        config, intermediate_size=4 * config.hidden_size, norm_eps=config.layer_norm_epsilon,
        norm_kind="layer", activation="gelu_tanh", qkv_bias=True, o_bias=True, mlp_bias=True,
        gated_mlp=False, embed_norm=True, alibi_slopes=alibi_slopes(config.num_attention_heads),
        rope={NO_ROPE: {"rope_type": NO_ROPE}}, layers=_layers(config, [None] * n, [NO_ROPE] * n)))


def _mpt(config: Any) -> ModelSpec:
    # What transformers' MPT computes: ALiBi with MPT's slopes, LayerNorms and linears without
    # biases, a plain 4 * hidden exact-GELU MLP, q/k/v fused in order (Wqkv), clip_qkv, a tied
    # head. Fields it ignores but that would change the computation are refused here; a
    # checkpoint with biases or learned positions is refused by name when its weights load.
    attn = config.attn_config
    for name, value, honoured in (
            ("attn_config.alibi", attn.alibi, True), ("attn_config.qk_ln", attn.qk_ln, False),
            ("attn_config.prefix_lm", attn.prefix_lm, False),
            ("attn_config.attn_type", attn.attn_type, "multihead_attention"),
            ("expansion_ratio", config.expansion_ratio, 4), ("logit_scale", config.logit_scale, None)):
        if value != honoured:
            _refuse(config, name, value, f"only {honoured!r}")
    n = config.num_hidden_layers
    return ModelSpec(**_common(
        config, intermediate_size=4 * config.hidden_size, norm_eps=config.layer_norm_epsilon,
        norm_kind="layer", norm_bias=False, activation="gelu", gated_mlp=False,
        qkv_clip=attn.clip_qkv, attn_scale=attn.softmax_scale or 0.0,
        alibi_slopes=mpt_alibi_slopes(config.num_attention_heads, attn.alibi_bias_max),
        tie_word_embeddings=True, rope={NO_ROPE: {"rope_type": NO_ROPE}},
        layers=_layers(config, [None] * n, [NO_ROPE] * n)))


_FAMILIES: dict[str, Callable[[Any], ModelSpec]] = {
    "llama": _llama,
    "mistral": _llama,  # Llama with a sliding window on every layer
    "qwen2": _qwen2,
    "qwen2_5_vl_text": _qwen2,  # Qwen2.5-VL's decoder: Qwen2's, turned by M-RoPE (mrope_section)
    "qwen3": _qwen3,
    "qwen3_vl_text": _qwen3_vl,
    "gemma2": _gemma2,
    "gemma3_text": _gemma3,
    "gemma4_text": _gemma4,
    "phi3": _phi3,
    "mixtral": _mixtral,
    "qwen2_moe": _qwen_moe,
    "qwen3_moe": _qwen_moe,
    "gpt_oss": _gpt_oss,
    "smollm3": _smollm3,
    "granite": _granite,
    "olmo2": _olmo2,
    "stablelm": _stablelm,
    "starcoder2": _starcoder2,
    "nemotron": _nemotron,
    "gpt2": _gpt2,
    "falcon": _falcon,
    "bloom": _bloom,
    "mpt": _mpt,
}
SUPPORTED_MODEL_TYPES = tuple(sorted(_FAMILIES))
