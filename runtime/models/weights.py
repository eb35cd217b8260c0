"""Streams checkpoint tensors into a model built on the meta device, one tensor at a time, so
loading never holds more than the final weights plus the tensor being copied.

Checkpoint names (Hugging Face's) map onto forklm's modules: q/k/v and gate/up go into slices of
one fused parameter (unless the model keeps them apart: a plain MLP's up_proj), each expert's
matrices into a slice of the stacked expert parameters, StableLM's per-head q/k norms into rows of
one [heads, d] weight, and Mixtral's `block_sparse_moe` is `mlp`. A value that is not a tensor is a quantized weight (a GGUF
kept quantized): its parts are collected and the Linear is replaced by the module that
`quantized_factory` builds from them once the stream ends.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from forklm.runtime.errors import ModelNotFoundError
from forklm.runtime.models.layers import LayerNorm

# (quantized parts in shard order, dense bias or None, dtype) -> module with forward/embedding
QuantizedFactory = Callable[[list[Any], "torch.Tensor | None", torch.dtype], nn.Module]

_FUSED = re.compile(r"(?P<prefix>.*)\.(?P<part>q|k|v|gate|up)_proj\.(?P<kind>weight|bias)$")
_FUSED_SHARD = {"q": ("qkv_proj", 0), "k": ("qkv_proj", 1), "v": ("qkv_proj", 2),
                "gate": ("gate_up_proj", 0), "up": ("gate_up_proj", 1)}
_EXPERT = re.compile(r"(?P<prefix>.*\.mlp)\.experts\.(?P<e>\d+)\.(?P<part>\w+)\."
                     r"(?P<kind>weight|bias)$")
_EXPERT_SHARD = {"gate_proj": ("w13", 0), "w1": ("w13", 0), "up_proj": ("w13", 1),
                 "w3": ("w13", 1), "down_proj": ("w2", None), "w2": ("w2", None)}
# StableLM's per-head q/k norms: one LayerNorm per head, stacked into one [heads, d] weight.
_PER_HEAD = re.compile(r"(?P<prefix>.*\.self_attn)\.(?P<part>q|k)_layernorm\.norms\.(?P<h>\d+)\."
                       r"(?P<kind>weight|bias)$")
# Checkpoint module names forklm calls otherwise (StarCoder 2's plain MLP, Mixtral's experts).
_RENAMED = ((".block_sparse_moe.", ".mlp."), (".mlp.c_fc.", ".mlp.up_proj."),
            (".layer_scalar.weight", ".layer_scalar"),  # Gemma 4 from GGUF
            (".mlp.c_proj.", ".mlp.down_proj."))
_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")


# The quantized part key of a checkpoint matrix that fills a whole (possibly fused) layer.
_WHOLE = -1
BUILD_THREADS = 2  # threads building quantized matrices at load (their C repacks)


@dataclass(frozen=True)
class Target:
    module: str  # dotted path of the module holding the parameter
    param: str  # "weight", "bias", "w13", ...
    shard: int | None = None  # slice of a fused parameter (q, k, v / gate, up)
    expert: int | None = None  # first-axis index of a stacked parameter (experts, per-head norms)


def target_of(name: str, fused: bool = True) -> Target:
    """Where the checkpoint tensor `name` goes in forklm's module tree; fused=False: a q/k/v or
    gate/up matrix goes to its own module (a plain MLP's up_proj)."""
    if m := _PER_HEAD.match(name):
        return Target(f"{m['prefix']}.{m['part']}_norm", m["kind"], None, int(m["h"]))
    for old, new in _RENAMED:
        name = name.replace(old, new)
    if m := _EXPERT.match(name):
        if m["part"] not in _EXPERT_SHARD:
            raise ModelNotFoundError(f"checkpoint tensor {name!r}: unknown expert matrix")
        param, shard = _EXPERT_SHARD[m["part"]]
        if m["kind"] == "bias":  # gpt-oss's experts: w13_bias, w2_bias
            param = f"{param}_bias"
        return Target(m["prefix"], param, shard, int(m["e"]))
    if fused and (m := _FUSED.match(name)) and not m["prefix"].endswith("experts"):
        fused_module, shard = _FUSED_SHARD[m["part"]]
        return Target(f"{m['prefix']}.{fused_module}", m["kind"], shard)
    module, _, param = name.rpartition(".")
    return Target(module, param)


class WeightLoader:
    """load(model, weights) fills every parameter of a meta-device model, in `dtype` on `device`."""

    def __init__(self, model: nn.Module, dtype: torch.dtype, device: torch.device | str,
                 quantized_factory: QuantizedFactory | None = None):
        self.model, self.dtype, self.device = model, dtype, torch.device(device)
        self.quantized_factory = quantized_factory
        self.tied = bool(getattr(getattr(model, "spec", None), "tie_word_embeddings", False))
        self.filled: dict[tuple[str, str], set[tuple[int | None, int | None]]] = {}
        self.quantized: dict[str, dict[int, Any]] = {}  # module path -> shard -> quantized part
        # MoE module path -> (param, expert) -> shard -> quantized part
        self.quantized_experts: dict[str, dict[tuple[str, int], dict[int, Any]]] = {}

    def load(self, weights: Iterable[tuple[str, Any]]) -> None:
        for name, value in weights:
            if _IGNORED.match(name) or (self.tied and name == "lm_head.weight"):
                continue
            target = target_of(name)
            if target.shard is not None and not self._has_module(target.module):
                target = target_of(name, fused=False)  # a module the model keeps unfused
            if isinstance(value, torch.Tensor):
                self._copy(name, target, value)
            else:
                self._collect_quantized(name, target, value)
        self._build_quantized()
        self._check_complete()

    def _has_module(self, path: str) -> bool:
        try:
            self.model.get_submodule(path)
        except AttributeError:
            return False
        return True

    def _param(self, name: str, target: Target) -> tuple[nn.Module, torch.Tensor]:
        try:
            module = self.model.get_submodule(target.module)
            param = getattr(module, target.param)
        except AttributeError:
            raise ModelNotFoundError(f"checkpoint tensor {name!r} has no place in the model") from None
        if not isinstance(param, torch.Tensor):
            raise ModelNotFoundError(f"checkpoint tensor {name!r} has no place in the model")
        if param.is_meta:  # first write: allocate it in its final dtype and device
            param = nn.Parameter(torch.empty(param.shape, dtype=self.dtype, device=self.device),
                                 requires_grad=False)
            setattr(module, target.param, param)
        return module, param

    def _copy(self, name: str, target: Target, value: torch.Tensor) -> None:
        module, param = self._param(name, target)
        dst = param if target.expert is None else param[target.expert]
        if target.shard is not None:
            sizes = _shard_sizes(module, target.param)
            dst = dst.narrow(0, sum(sizes[: target.shard]), sizes[target.shard])
        if tuple(dst.shape) != tuple(value.shape):
            raise ModelNotFoundError(f"checkpoint tensor {name!r} has shape {tuple(value.shape)}, "
                                     f"the model expects {tuple(dst.shape)}")
        with torch.no_grad():
            dst.copy_(value)
        # A whole fused matrix in the checkpoint (Phi-3's qkv_proj) fills every part at once,
        # a whole stacked one (a GGUF's [heads, d] q/k norm) every slice.
        shards = ([target.shard] if target.shard is not None
                  else range(_num_shards(module, target.param)))
        stack = _stack_size(module, target.param)
        slices = [target.expert] if target.expert is not None or not stack else range(stack)
        self.filled.setdefault((target.module, target.param), set()).update(
            (index, shard) for index in slices for shard in shards)

    def _collect_quantized(self, name: str, target: Target, value: Any) -> None:
        if (self.quantized_factory is not None and target.expert is not None
                and target.param in ("w13", "w2")):  # one expert's matrix of a stacked MoE
            experts = self.quantized_experts.setdefault(target.module, {})
            experts.setdefault((target.param, target.expert), {})[target.shard or 0] = value
            return
        if self.quantized_factory is None or target.param != "weight" or target.expert is not None:
            raise ModelNotFoundError(f"checkpoint tensor {name!r} is quantized where the model "
                                     "takes only dense weights")
        part = _WHOLE if target.shard is None else target.shard
        self.quantized.setdefault(target.module, {})[part] = value

    def _build_quantized(self) -> None:
        assert self.quantized_factory is not None or not (self.quantized or self.quantized_experts)
        for path, experts in self.quantized_experts.items():
            self._build_quantized_experts(path, experts)
        jobs = []
        for path, parts in self.quantized.items():
            module = self.model.get_submodule(path)
            expected = len(module.part_sizes) if isinstance(module, FusedLinear) else 1
            if list(parts) == [_WHOLE]:  # one matrix for the whole layer (Phi-3's fused qkv)
                ordered = [parts[_WHOLE]]
                weight = module.weight  # a Linear's [out, in], an Embedding's [rows, dim]
                assert isinstance(weight, torch.Tensor)
                rows = weight.shape[0]
                if ordered[0].shape[0] != rows:
                    raise ModelNotFoundError(f"{path}: quantized matrix of {ordered[0].shape[0]} "
                                             f"rows, the model expects {rows}")
            elif sorted(parts) == list(range(expected)):
                ordered = [parts[i] for i in range(expected)]
            else:
                raise ModelNotFoundError(f"{path}: quantized parts {sorted(parts)} of {expected}")
            bias = getattr(module, "bias", None)
            bias_parts = self.filled.pop((path, "bias"), set())  # its module is replaced below
            if bias is not None and (bias.is_meta or len(bias_parts) != expected):
                raise ModelNotFoundError(f"{path}.bias is missing from the checkpoint")
            jobs.append((path, ordered, bias))
        if not jobs:
            return
        factory = self.quantized_factory
        assert factory is not None
        # Each factory call is mostly one C repack that lets go of the GIL: two threads build
        # two matrices at once (a 1B model's 800 MB of K-quant records in about half the time).
        with ThreadPoolExecutor(BUILD_THREADS, thread_name_prefix="forklm-weights") as pool:
            built = pool.map(lambda job: factory(job[1], job[2], self.dtype), jobs)
            for (path, _, _), new in zip(jobs, built):
                parent, _, child = path.rpartition(".")
                setattr(self.model.get_submodule(parent) if parent else self.model, child, new)

    def _build_quantized_experts(self, path: str,
                                 experts: dict[tuple[str, int], dict[int, Any]]) -> None:
        """A SparseMoE's experts kept quantized: one QuantizedLinear per expert for gate+up
        (w13) and one for down (w2), in place of its stacked parameters."""
        from forklm.runtime.models.moe import SparseMoE

        module = self.model.get_submodule(path)
        assert isinstance(module, SparseMoE), f"{path} holds experts but is not a SparseMoE"
        count = module.spec.num_experts
        linears = []
        for e in range(count):
            w13, w2 = experts.get(("w13", e), {}), experts.get(("w2", e), {})
            if sorted(w13) != [0, 1] or sorted(w2) != [0]:
                raise ModelNotFoundError(f"{path}: expert {e}'s quantized matrices are incomplete "
                                         f"(gate/up parts {sorted(w13)}, down {sorted(w2)})")
            assert self.quantized_factory is not None
            linears.append(nn.ModuleList([self.quantized_factory([w13[0], w13[1]], None, self.dtype),
                                          self.quantized_factory([w2[0]], None, self.dtype)]))
        if len(experts) != 2 * count:
            raise ModelNotFoundError(f"{path}: quantized experts beyond its {count}")
        module.use_quantized_experts(nn.ModuleList(linears))

    def _check_complete(self) -> None:
        missing = [f"{module}.{param}" for module, param in self._meta_params()]
        partial = [f"{m}.{p}" for (m, p), got in self.filled.items()
                   if len(got) != _parts_expected(self.model.get_submodule(m), p)]
        if missing or partial:
            raise ModelNotFoundError(f"weights do not fit the model: missing {missing or partial}")

    def _meta_params(self) -> list[tuple[str, str]]:
        return [(path, name) for path, module in self.model.named_modules()
                for name, p in module.named_parameters(recurse=False) if p.is_meta]


class FusedLinear(nn.Linear):
    """A Linear whose output rows are several checkpoint matrices stacked (q/k/v, gate/up)."""

    def __init__(self, in_features: int, part_sizes: tuple[int, ...], bias: bool):
        super().__init__(in_features, sum(part_sizes), bias=bias)
        self.part_sizes = part_sizes


def replace_linears(model: nn.Module, weight_dtype: torch.dtype,
                    make: Callable[[torch.Tensor, torch.Tensor | None], nn.Module]) -> int:
    """Replace every plain nn.Linear or FusedLinear under `model` whose weight is `weight_dtype`
    (not quantized or expert-stacked weights) by make(weight, bias), keeping a fused layer's
    part_sizes; returns how many. Each old weight is freed once its replacement exists, so memory
    never holds both forms of more than one matrix."""
    # (parent, name) only: holding the children here would keep every old weight alive.
    targets = [(parent, name) for parent in model.modules()
               for name, child in parent.named_children()
               if type(child) in (nn.Linear, FusedLinear) and child.weight.dtype == weight_dtype]
    for parent, name in targets:
        child = getattr(parent, name)
        new = make(child.weight, child.bias)
        if isinstance(child, FusedLinear):
            new.part_sizes = child.part_sizes  # type: ignore[assignment]
        setattr(parent, name, new)
        del child
    return len(targets)


def _shard_sizes(module: nn.Module, param: str) -> tuple[int, ...]:
    """Rows of each fused part of `module.param` (of one expert's slice for stacked experts)."""
    if isinstance(module, FusedLinear):
        return module.part_sizes
    assert param in ("w13", "w13_bias"), f"{param} has no fused parts"
    inter = getattr(module, param).shape[1] // 2  # gate rows, then up rows
    return (inter, inter)


def _num_shards(module: nn.Module, param: str) -> int:
    fused = isinstance(module, FusedLinear) or param in ("w13", "w13_bias")
    return len(_shard_sizes(module, param)) if fused else 1


def _stack_size(module: nn.Module, param: str) -> int | None:
    """First-axis count of a stacked parameter (experts; per-head norm weights, [heads, d]),
    which the checkpoint may give slice by slice; None: not stacked."""
    if param in ("w13", "w2", "w13_bias", "w2_bias") or (isinstance(module, LayerNorm)
                                  and getattr(module, param).dim() == 2):
        return getattr(module, param).shape[0]
    return None


def _parts_expected(module: nn.Module, param: str) -> int:
    return (_stack_size(module, param) or 1) * _num_shards(module, param)
