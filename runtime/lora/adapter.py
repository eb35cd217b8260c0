"""A LoRA adapter in PEFT's format (adapter_config.json + adapter_model.safetensors) read into the
shapes forklm's layers apply: per wrapped module, one A [R, in] and one B [out, R] matrix.

PEFT keeps one pair per checkpoint matrix (q_proj, k_proj, ...). forklm fuses q/k/v and gate/up
into one matmul each, so an adapter's pairs for the parts of one fused module are stacked: their
A matrices one above the other, their B matrices block-diagonally into the module's output rows
(rows of parts the adapter leaves alone stay zero). Then (x A^T) B^T is, row for row, the sum
PEFT computes per part, and one module costs two small matmuls whatever it targets.
"""

from __future__ import annotations

import json
import math
import pathlib
import re
from dataclasses import dataclass
from typing import Any

import torch

from forklm.runtime.errors import InvalidArgumentError
from forklm.runtime.models.weights import target_of

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# PEFT's key for a matrix: the base model's module path, lora_A or lora_B, an optional adapter
# name (older saves), weight.
_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight$")
# The checkpoint names of the matrices an adapter may target (Llama's naming, which most
# families' checkpoints share); Phi-3's fused ones are its own names for the same modules.
SUPPORTED_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                     "qkv_proj", "gate_up_proj")
# Fields of adapter_config.json that change the computation in ways forklm does not apply.
_REFUSED_FIELDS = {
    "use_dora": "DoRA's magnitude vectors",
    "modules_to_save": "fully trained extra modules (modules_to_save)",
    "rank_pattern": "per-module ranks (rank_pattern)",
    "alpha_pattern": "per-module alphas (alpha_pattern)",
    "fan_in_fan_out": "transposed (fan_in_fan_out) weights",
    "lora_bias": "LoRA bias vectors",
    "layers_to_transform": "layers_to_transform",
}


@dataclass(frozen=True)
class ModuleSlot:
    """A module LoRA may be applied to: its input width and its output parts (one for a plain
    matrix; q/k/v or gate/up for a fused one)."""

    in_features: int
    part_sizes: tuple[int, ...]


@dataclass(frozen=True)
class LoraConfig:
    """What forklm reads of adapter_config.json."""

    rank: int
    alpha: float
    use_rslora: bool

    @property
    def scaling(self) -> float:
        """PEFT's: alpha / r, or alpha / sqrt(r) with rsLoRA."""
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)

    @classmethod
    def read(cls, folder: pathlib.Path, name: str) -> LoraConfig:
        path = folder / CONFIG_FILE
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise InvalidArgumentError("lora_path", str(folder),
                                       f"no {CONFIG_FILE} there (a PEFT adapter folder)") from None
        except (OSError, json.JSONDecodeError) as e:
            raise InvalidArgumentError("lora_path", str(folder),
                                       f"{CONFIG_FILE} is not readable JSON: {e}") from None
        if not isinstance(raw, dict):
            raise InvalidArgumentError("lora_path", str(folder), f"{CONFIG_FILE} is not an object")
        peft_type = raw.get("peft_type", "LORA")
        if peft_type != "LORA":
            raise InvalidArgumentError("lora_path", str(folder),
                                       f"adapter {name!r} is {peft_type}; forklm applies LORA")
        for key, what in _REFUSED_FIELDS.items():
            if raw.get(key):
                raise InvalidArgumentError("lora_path", str(folder),
                                           f"adapter {name!r} uses {what}, which forklm does "
                                           "not apply")
        if raw.get("bias", "none") != "none":
            raise InvalidArgumentError("lora_path", str(folder), f"adapter {name!r} trains "
                                       f"biases (bias={raw['bias']!r}); forklm applies none")
        rank, alpha = raw.get("r"), raw.get("lora_alpha", raw.get("r"))
        if not isinstance(rank, int) or rank < 1:
            raise InvalidArgumentError("lora_path", str(folder), f"r={rank!r}: expected an int >= 1")
        if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
            raise InvalidArgumentError("lora_path", str(folder),
                                       f"lora_alpha={alpha!r}: expected a number")
        return cls(rank, float(alpha), bool(raw.get("use_rslora", False)))


@dataclass
class ModuleDelta:
    """One module's low-rank update: out += (x A^T) B^T * scaling."""

    a: torch.Tensor  # [R, in]
    b: torch.Tensor  # [out, R]
    scaling: float


class LoraWeights:
    """An adapter's matrices, by the path of the module they update."""

    def __init__(self, name: str, uid: int, modules: dict[str, ModuleDelta]):
        self.name, self.uid, self.modules = name, uid, modules

    @property
    def nbytes(self) -> int:
        return sum(d.a.nbytes + d.b.nbytes for d in self.modules.values())


def read_adapter(folder: str | pathlib.Path, name: str, uid: int,
                 slots: dict[str, ModuleSlot], dtype: torch.dtype,
                 device: torch.device | str = "cpu") -> LoraWeights:
    """Read the adapter in `folder` onto the model's modules `slots` (path -> ModuleSlot), in
    `dtype`. Raises InvalidArgumentError (argument lora_path) naming what does not fit."""
    from safetensors.torch import load_file

    folder = pathlib.Path(folder)
    if not folder.is_dir():
        raise InvalidArgumentError("lora_path", str(folder), "not a folder")
    config = LoraConfig.read(folder, name)
    weights_path = folder / WEIGHTS_FILE
    if not weights_path.is_file():
        raise InvalidArgumentError("lora_path", str(folder), f"no {WEIGHTS_FILE} there (forklm "
                                   "reads safetensors only, never pickled .bin files)")
    try:
        tensors = load_file(str(weights_path))
    except Exception as e:  # noqa: BLE001 - a corrupt file's error type is the library's
        raise InvalidArgumentError("lora_path", str(folder),
                                   f"{WEIGHTS_FILE} is not readable: {e}") from None
    pairs = _pairs(tensors, folder)
    parts: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
    for module_name, (a, b) in pairs.items():
        path, shard = _place(module_name, slots, folder)
        slot = slots[path]
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
            raise InvalidArgumentError("lora_path", str(folder),
                                       f"{module_name}: lora_A {tuple(a.shape)} and lora_B "
                                       f"{tuple(b.shape)} are not a rank-r pair")
        out = slot.part_sizes[shard] if shard is not None else sum(slot.part_sizes)
        if a.shape[1] != slot.in_features or b.shape[0] != out:
            raise InvalidArgumentError(
                "lora_path", str(folder), f"{module_name}: a [{b.shape[0]} x {a.shape[1]}] "
                f"update, but the model's matrix is [{out} x {slot.in_features}] (an adapter "
                "trained for another base model?)")
        key = -1 if shard is None else shard
        existing = parts.setdefault(path, {})
        if key in existing or (existing and (key == -1 or -1 in existing)):
            raise InvalidArgumentError("lora_path", str(folder),
                                       f"{module_name} updates {path} twice")
        parts[path][key] = (a, b)
    modules = {path: _stack(by_shard, slots[path], config.scaling, dtype, device)
               for path, by_shard in parts.items()}
    return LoraWeights(name, uid, modules)


def _pairs(tensors: dict[str, torch.Tensor], folder: pathlib.Path
           ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """PEFT's tensors as (A, B) per base-model module name."""
    found: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = _KEY.match(key)
        if m is None:
            raise InvalidArgumentError("lora_path", str(folder), f"tensor {key!r} is not a LoRA "
                                       "matrix (embedding and head adapters are not applied)")
        found.setdefault(m["module"], {})[m["ab"]] = tensor
    if not found:
        raise InvalidArgumentError("lora_path", str(folder), f"{WEIGHTS_FILE} holds no matrices")
    for module, ab in found.items():
        if set(ab) != {"A", "B"}:
            raise InvalidArgumentError("lora_path", str(folder),
                                       f"{module} has lora_{''.join(ab)} without its pair")
    return {module: (ab["A"], ab["B"]) for module, ab in found.items()}


def _place(module_name: str, slots: dict[str, ModuleSlot], folder: pathlib.Path
           ) -> tuple[str, int | None]:
    """The wrapped module (and part of it) a checkpoint module's update goes to."""
    target = target_of(module_name + ".weight")
    if target.module not in slots and target.shard is not None:
        target = target_of(module_name + ".weight", fused=False)  # a module kept unfused
    if target.module in slots and target.expert is None:
        return target.module, target.shard
    raise InvalidArgumentError(
        "lora_path", str(folder),
        f"the adapter targets {module_name}, which forklm cannot update: LoRA applies to "
        f"{', '.join(SUPPORTED_TARGETS)} of the decoder layers (not to experts of a mixture, "
        "embeddings or the head)")


def _stack(by_shard: dict[int, tuple[torch.Tensor, torch.Tensor]], slot: ModuleSlot,
           scaling: float, dtype: torch.dtype, device: torch.device | str) -> ModuleDelta:
    """One module's pairs as one A (stacked) and one B (block-diagonal into the output rows)."""
    if -1 in by_shard:
        a, b = by_shard[-1]
        return ModuleDelta(a.to(device, dtype).contiguous(), b.to(device, dtype).contiguous(),
                           scaling)
    starts = [sum(slot.part_sizes[:i]) for i in range(len(slot.part_sizes))]
    order = sorted(by_shard)
    a = torch.cat([by_shard[s][0] for s in order]).to(device, dtype)
    b = torch.zeros(sum(slot.part_sizes), a.shape[0], dtype=dtype, device=device)
    col = 0
    for s in order:
        part_b = by_shard[s][1]
        b[starts[s]: starts[s] + part_b.shape[0], col: col + part_b.shape[1]] = part_b
        col += part_b.shape[1]
    return ModuleDelta(a.contiguous(), b, scaling)


def parse_lora_paths(specs: tuple[str, ...] | list[str]) -> dict[str, str]:
    """SGLang's --lora-paths entries, `name=path` or a bare path (named by itself), as
    name -> path. Raises InvalidArgumentError on an empty name or a repeated one."""
    named: dict[str, str] = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep:
            name, path = spec, spec
        if not name or not path:
            raise InvalidArgumentError("lora_paths", spec, "expected name=path or a path")
        if name in named:
            raise InvalidArgumentError("lora_paths", spec, f"adapter name {name!r} given twice")
        named[name] = path
    return named


def adapter_summary(weights: LoraWeights) -> dict[str, Any]:
    """What /v1/models and the load endpoint say about a loaded adapter."""
    return {"name": weights.name, "modules": len(weights.modules), "bytes": weights.nbytes}
