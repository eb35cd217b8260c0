"""GGUF files: config, tokenizer and weights under Hugging Face names.

Weights stream one tensor at a time from the memory-mapped file, either dequantized (float32) or,
for the block formats forklm multiplies with directly, as quantized parts (runtime/quant/).
Building the tokenizer from a GGUF vocabulary takes seconds, so the config and tokenizer are
cached once as a small Hugging Face folder (no weights) under ~/.cache/forklm.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import pathlib
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch
import transformers

from forklm.runtime.errors import ModelNotFoundError, UnsupportedModelError
from forklm.runtime.models.gguf_archs import (
    EXPERT_NAMES,
    GGUF_ARCHS,
    GLOBAL_NAMES,
    GGUFArch,
    arch_of,
    gemma4_rope,
)
from forklm.runtime.models.gguf_file import GGUFFile
from forklm.runtime.models.gguf_tokenizer import (
    TOKENIZER_ARRAYS,
    gguf_tokenizer,
    load_saved_tokenizer,
)
from forklm.runtime.models.unsupported import missing_mechanism
from forklm.runtime.quant.records_cache import RecordsCache, RecordsOrigin
from forklm.runtime.quant.records_cache import enabled as records_cache_enabled

logger = logging.getLogger(__name__)

# Bump when the cached files change meaning, so caches written by an older loader are not reused.
# 3: the tokenizer as llama.cpp reads the GGUF; 4: end-of-generation tokens; 5: plain_config.json
# and added_tokens_decoder
_CACHE_VERSION = 5
# The config's values for transformers' base config class (see _plain_stand_in).
_PLAIN_CONFIG = "plain_config.json"
# What a family's config class may define beyond the base class for the base class, holding the
# same values, to stand in for it: construction and validation only.
_CONSTRUCTION_ONLY = frozenset({"__eq__", "__init__", "__post_init__", "__setattr__", "validate",
                                "validate_architecture"})
# Values nothing in forklm reads, which the base class fills differently.
_IGNORED_VALUES = frozenset({"transformers_version"})

# Tokens that end generation wherever a vocabulary has them, as llama.cpp reads a GGUF (its
# converter often writes only one eos id: a Qwen chat turn ends with <|im_end|>, a base model's
# text with <|endoftext|>).
END_OF_GENERATION_TEXTS = frozenset({
    "<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
    "<|end_of_text|>", "<EOT>", "<end_of_utterance>", "<\uff5cend\u2581of\u2581sentence\uff5c>"})
# Harmony (gpt-oss): a turn ends at <|return|> (the answer) or <|call|> (a tool call); its <|end|>
# closes one message of the turn (the reasoning before the answer), so llama.cpp does not end there.
_HARMONY_ENDS = ("<|return|>", "<|call|>")
_ROPE_FREQS = "rope_freqs.weight"  # llama.cpp's Llama 3 rope scaling
_ROPE_FACTORS = ("rope_factors_long.weight", "rope_factors_short.weight")  # Phi-3's LongRoPE


class GGUFModel:
    """One GGUF file: `config`, `tokenizer`, `eos_token_ids`, and `weights()` streamed."""

    def __init__(self, path: pathlib.Path):
        self.path = path
        self.tokenizer: transformers.PreTrainedTokenizerBase
        try:
            self.file = GGUFFile(path)
        except ValueError as exc:
            raise ModelNotFoundError(str(exc)) from exc
        arch = self.file.fields["general.architecture"]
        if arch not in GGUF_ARCHS:
            raise UnsupportedModelError(
                f"{path}: GGUF architecture {arch!r} is not supported{missing_mechanism(arch)}; "
                f"expected one of {sorted(GGUF_ARCHS)}")
        self.arch, self.spec = arch, arch_of(arch, self.file.fields.get(f"{arch}.expert_count"),
                                             {t.name for t in self.file.tensors})
        cached = _cache_dir_for(path)
        # the repacked weights cached beside the config (read where an earlier load wrote them)
        self.records_cache = RecordsCache(cached) if records_cache_enabled() else None
        if cached.is_dir():
            logger.info("config and tokenizer of %s from cache %s", path.name, cached)
            self.config = _cached_config(cached)
            self.tokenizer = load_saved_tokenizer(cached)
            generation = transformers.GenerationConfig.from_pretrained(cached)
            eos = generation.eos_token_id
            self.eos_token_ids = [eos] if isinstance(eos, int) else list(eos or [])
            return
        meta = {k: v.tolist() if isinstance(v, np.ndarray) else v
                for k, v in self.file.fields.items() if k not in TOKENIZER_ARRAYS}
        meta.setdefault(f"{arch}.vocab_size", len(self.file.fields["tokenizer.ggml.tokens"]))
        self.config = _gguf_config(meta, arch, self.spec, {t.name: t for t in self.file.tensors})
        self.tokenizer = gguf_tokenizer(path, meta)
        self.eos_token_ids = _end_of_generation_ids(self.file.fields["tokenizer.ggml.tokens"], meta)
        _write_cache(self, cached)

    def weights(self, keep_quantized: bool = False) -> Iterator[tuple[str, Any]]:
        """(HF name, value) per tensor: a float32 tensor, or with keep_quantized a GGUFWeight
        for 2-D tensors in a format forklm multiplies with (the others are dequantized)."""
        from gguf.quants import dequantize

        supported: Any = None
        if keep_quantized:
            from forklm.runtime.quant.gguf_formats import GGUFWeight
            from forklm.runtime.quant.linear import supported_gguf_type

            supported = supported_gguf_type
        cache = self.records_cache

        def origin(name: str) -> RecordsOrigin | None:
            return None if cache is None else RecordsOrigin(cache, name)

        dequantized = set()
        for tensor in self.file.tensors:
            if tensor.name == _ROPE_FREQS or tensor.name in _ROPE_FACTORS:
                continue  # in the config's rope parameters, not a weight
            name = _hf_name(tensor.name, self.spec.layer_names, self.path)
            shape = tensor.shape[::-1]  # GGUF lists dims fastest-first
            rows = self._qk_row_order(name, shape[0])
            if supported is not None and len(shape) == 2 and supported(tensor.tensor_type):
                if rows is None:  # the mapped blocks: their pages are let go once packed
                    release = functools.partial(self.file.release, tensor)
                    yield name, GGUFWeight(tensor.data, tensor.tensor_type, (shape[0], shape[1]),
                                           release=release, release_rows=release,
                                           origin=origin(tensor.name))
                else:  # reordered rows: a copy, so the mapped pages can go at once
                    reordered = np.ascontiguousarray(tensor.data[rows.numpy()])
                    self.file.release(tensor)
                    yield name, GGUFWeight(reordered, tensor.tensor_type, (shape[0], shape[1]),
                                           origin=origin(tensor.name))
                continue
            if (supported is not None and len(shape) == 3 and "{expert}" in name
                    and supported(tensor.tensor_type)):  # a stack of experts: one matrix each
                for expert in range(shape[0]):
                    yield name.format(expert=expert), GGUFWeight(
                        tensor.data[expert], tensor.tensor_type, (shape[1], shape[2]),
                        release=functools.partial(self.file.release, tensor, expert, 1),
                        origin=origin(f"{tensor.name}[{expert}]"))
                continue
            if keep_quantized and len(shape) == 2 and not name.endswith(".bias"):
                dequantized.add(tensor.tensor_type.name)
            array = dequantize(tensor.data, tensor.tensor_type).reshape(shape)
            weight = torch.from_numpy(np.require(array, np.float32, ["C", "W"]))  # a copy
            self.file.release(tensor)
            if rows is not None:
                weight = weight[rows]
            if self.spec.norm_plus_one and name.endswith("norm.weight"):
                weight = weight - 1  # llama.cpp stored Gemma's 1 + w
            if name.endswith("shared_expert_gate.weight") and weight.dim() == 1:
                weight = weight[None]  # llama.cpp keeps the [1, hidden] gate as [hidden]
            if "{expert}" in name:  # stacked experts [experts, rows, cols]: one matrix each
                for expert, matrix in enumerate(weight):
                    yield name.format(expert=expert), matrix
                continue
            yield name, weight
        if dequantized:
            logger.info("%s: %s tensors have no quantized kernel here; dequantized at load",
                        self.path.name, ", ".join(sorted(dequantized)))

    def _qk_row_order(self, name: str, rows: int) -> torch.Tensor | None:
        """Row order that undoes llama.cpp's RoPE permutation of q/k (None: rows are as HF's)."""
        if not self.spec.permuted_qk or not (".q_proj." in name or ".k_proj." in name):
            return None
        heads = (self.config.num_attention_heads if ".q_proj." in name
                 else self.config.num_key_value_heads)
        # llama.cpp interleaves each head's two rotary halves: [heads, half, 2] -> [heads, 2, half]
        return torch.arange(rows).reshape(heads, rows // heads // 2, 2).transpose(1, 2).reshape(-1)


def _end_of_generation_ids(tokens: list[str], meta: dict) -> list[int]:
    """The file's eos, eot and eom ids (llama.cpp ends generation at each: Llama 3.1's <|eom_id|>
    ends a tool call's turn), then the END_OF_GENERATION_TEXTS tokens; a harmony vocabulary's
    ends instead of its <|end|>."""
    keys = [f"tokenizer.ggml.{k}_token_id" for k in ("eos", "eot", "eom")]
    ids = [*(meta[k] for k in keys if k in meta),
           *(i for i, text in enumerate(tokens) if text in END_OF_GENERATION_TEXTS)]
    harmony = [i for i, text in enumerate(tokens) if text in _HARMONY_ENDS]
    if len(harmony) == len(_HARMONY_ENDS):
        ids = [i for i in ids if tokens[i] != "<|end|>"] + harmony
    return list(dict.fromkeys(ids))


def _gguf_config(meta: dict, arch: str, spec: GGUFArch,
                 tensors: dict[str, Any]) -> transformers.PretrainedConfig:
    def key(name: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{name}", default)

    tensor_names = set(tensors)
    heads, hidden = key("attention.head_count"), key("embedding_length")
    extra = {**spec.tensor_config(tensor_names), **spec.extra_config(key, hidden, heads)}
    rope = {"rope_type": "default", "rope_theta": float(key("rope.freq_base", 10000.0)),
            **extra.pop("rope", {})}
    original_context = key("rope.scaling.original_context_length")
    if key("rope.scaling.type") not in (None, "none"):
        rope.update(rope_type=key("rope.scaling.type"), factor=float(key("rope.scaling.factor")))
        if original_context:
            rope["original_max_position_embeddings"] = original_context
    if _ROPE_FREQS in tensors:  # llama.cpp's form of Llama 3 rope scaling: inv_freq / factors
        rope["freq_factors"] = _floats(tensors[_ROPE_FREQS])
    if all(name in tensors for name in _ROPE_FACTORS):  # Phi-3's LongRoPE
        rope.update(rope_type="longrope", long_factor=_floats(tensors[_ROPE_FACTORS[0]]),
                    short_factor=_floats(tensors[_ROPE_FACTORS[1]]),
                    original_max_position_embeddings=original_context)
        extra["original_max_position_embeddings"] = original_context
    if "sliding_rope" in extra:  # Gemma 4: a rope per layer type
        extra["rope_parameters"] = gemma4_rope(rope, extra.pop("sliding_rope"),
                                               extra["global_head_dim"])
    if hasattr(spec.config_class(), "attention_bias"):
        extra.setdefault("attention_bias", "blk.0.attn_q.bias" in tensor_names)
    # The GGUF stores eps as float32 (9.9999997e-06); its shortest repr is the intended 1e-05.
    rms = spec.eps_field == "rms_norm_eps"
    eps = np.float32(key("attention.layer_norm_rms_epsilon" if rms else
                         "attention.layer_norm_epsilon", 1e-6 if rms else 1e-5))
    fields = dict(
        vocab_size=key("vocab_size"),
        hidden_size=hidden,
        intermediate_size=key("feed_forward_length"),
        num_hidden_layers=key("block_count"),
        num_attention_heads=heads,
        num_key_value_heads=key("attention.head_count_kv", heads),
        max_position_embeddings=key("context_length"),
        **{spec.eps_field: float(np.format_float_positional(eps, unique=True))},
        rope_parameters=rope,
        tie_word_embeddings="output.weight" not in tensor_names,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
        pad_token_id=meta.get("tokenizer.ggml.padding_token_id"),
    )
    return spec.config_class(**{**fields, **extra})


def _floats(tensor: Any) -> list[float]:
    return [float(f) for f in tensor.data]


def _hf_name(gguf_name: str, layer_names: Mapping[str, str], path: pathlib.Path) -> str:
    """The Hugging Face name of a GGUF tensor; a stacked experts tensor's has an `{expert}`
    field for each expert's index."""
    stem, _, kind = gguf_name.rpartition(".")  # kind: "weight" or "bias"
    if stem in GLOBAL_NAMES:
        return f"{GLOBAL_NAMES[stem]}.{kind}"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in layer_names:
        target = f"model.layers.{parts[1]}.{layer_names[parts[2]]}"
        # gpt-oss's sinks are a bare parameter (GGUF names every tensor `.weight`)
        return target if target.endswith(".sinks") else f"{target}.{kind}"
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in EXPERT_NAMES:
        return f"model.layers.{parts[1]}.mlp.experts.{{expert}}.{EXPERT_NAMES[parts[2]]}.{kind}"
    raise ModelNotFoundError(f"{path}: tensor {gguf_name!r} has no Hugging Face counterpart")


# ---- Config and tokenizer cache -------------------------------------------------------------


def _cache_dir_for(gguf_path: pathlib.Path) -> pathlib.Path:
    """A folder named by the GGUF stem plus a key of its size and mtime: a changed file reconverts."""
    root = pathlib.Path(os.environ.get("FORKLM_CACHE_DIR") or "~/.cache/forklm").expanduser()
    stat = gguf_path.stat()
    key = f"{_CACHE_VERSION}:{gguf_path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
    return root / f"{gguf_path.stem}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def _write_cache(model: GGUFModel, target: pathlib.Path) -> None:
    """Write to a temp folder, then rename: a crash never leaves a half-written cache behind."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    except OSError as exc:
        logger.warning("not caching the GGUF's config and tokenizer (%s)", exc)
        return
    try:
        _save_config_and_tokenizer(model, tmp)
        os.replace(tmp, target)
        logger.info("cached the GGUF's config and tokenizer in %s", target)
    except OSError as exc:
        # Another process may have renamed its copy first; either way ours is not needed.
        logger.warning("not caching the GGUF's config and tokenizer in %s (%s)", target, exc)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _cached_config(folder: pathlib.Path) -> transformers.PretrainedConfig:
    """The cached config: as transformers' base class where that stands in for the family's own
    (importing a family's config class imports transformers' model-loading stack and
    torch.distributed: ~0.9 s of every start-up), else through AutoConfig."""
    plain = folder / _PLAIN_CONFIG
    if plain.is_file():
        return _plain_config(json.loads(plain.read_text()))
    return transformers.AutoConfig.from_pretrained(folder, local_files_only=True)


@functools.cache
def _plain_config_class(model_type: str) -> type[transformers.PretrainedConfig]:
    """transformers' base config class under `model_type` (which its to_dict reports)."""
    return type(f"Plain{model_type.title()}Config", (transformers.PretrainedConfig,),
                {"model_type": model_type, "__module__": __name__})


def _plain_config(values: dict[str, Any]) -> transformers.PretrainedConfig:
    config = _plain_config_class(values["model_type"]).from_dict(values)
    if "use_cache" in values:  # the base class leaves it to generation settings
        config.use_cache = values["use_cache"]
    return config


def _plain_stand_in(config: transformers.PretrainedConfig) -> dict[str, Any] | None:
    """config's values when transformers' base config class holding them answers every attribute
    as `config` does: its class adds no properties, aliases (attribute_map) or methods beyond
    construction and validation. None otherwise (GPT-2's n_embd, Falcon's computed head_dim)."""
    base = transformers.PretrainedConfig
    for cls in type(config).__mro__[:type(config).__mro__.index(base)]:
        extra = {name for name, value in vars(cls).items()
                 if callable(value) or isinstance(value, property)} - _CONSTRUCTION_ONLY
        if extra or vars(cls).get("attribute_map"):
            return None
    values = config.to_dict()
    plain = _plain_config(values)
    names = (set(vars(config)) | set(vars(plain))) - _IGNORED_VALUES
    same = all(getattr(plain, n, None) == getattr(config, n, None) for n in names)
    return values if same else None


def _list_added_tokens(folder: pathlib.Path) -> None:
    """Copy tokenizer.json's added tokens into tokenizer_config.json as added_tokens_decoder, the
    form transformers reads them in first: without it, every load parses the whole tokenizer.json
    in Python once more for them (0.1 s of start-up for a 49k-token vocabulary)."""
    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text(encoding="utf-8"))
    if "added_tokens_decoder" in config:
        return
    added = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))["added_tokens"]
    config["added_tokens_decoder"] = {
        str(token["id"]): {k: v for k, v in token.items() if k != "id"} for token in added}
    config_file.write_text(json.dumps(config, indent=2, ensure_ascii=False), encoding="utf-8")


def _save_config_and_tokenizer(model: GGUFModel, folder: pathlib.Path) -> None:
    model.config.save_pretrained(folder)
    plain = _plain_stand_in(model.config)
    if plain is not None:
        (folder / _PLAIN_CONFIG).write_text(json.dumps(plain))
    model.tokenizer.save_pretrained(folder)
    _list_added_tokens(folder)
    transformers.GenerationConfig(
        bos_token_id=model.config.bos_token_id,
        eos_token_id=model.eos_token_ids,
        pad_token_id=model.config.pad_token_id,
    ).save_pretrained(folder)
