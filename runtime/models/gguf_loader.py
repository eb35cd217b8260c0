"""GGUF files: config, tokenizer and weights under Hugging Face names.

Weights stream one tensor at a time from the memory-mapped file, either dequantized (float32) or,
for the block formats forklm multiplies with directly, as quantized parts (runtime/quant/).
Building the tokenizer from a GGUF vocabulary takes seconds, so the config and tokenizer are
cached once as a small Hugging Face folder (no weights) under ~/.cache/forklm.
"""

from __future__ import annotations

import hashlib
import logging
import os
import pathlib
import shutil
import tempfile
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
import transformers

from forklm.runtime.errors import ModelNotFoundError, UnsupportedModelError

logger = logging.getLogger(__name__)

# Bump when the cached files change meaning, so caches written by an older loader are not reused.
_CACHE_VERSION = 2

# GGUF architecture -> (config class, whether llama.cpp permuted the Q/K rows for its RoPE).
_GGUF_ARCHS = {
    "llama": (transformers.LlamaConfig, True),
    "qwen2": (transformers.Qwen2Config, False),
    "qwen3": (transformers.Qwen3Config, False),
}
_ROPE_FREQS = "rope_freqs.weight"
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
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}


class GGUFModel:
    """One GGUF file: `config`, `tokenizer`, `eos_token_ids`, and `weights()` streamed."""

    def __init__(self, path: pathlib.Path):
        import gguf  # only GGUF loading needs it

        self.path = path
        self.tokenizer: transformers.PreTrainedTokenizerBase
        self.reader = gguf.GGUFReader(path)
        arch = self.reader.fields["general.architecture"].contents()
        if arch not in _GGUF_ARCHS:
            raise UnsupportedModelError(
                f"{path}: GGUF architecture {arch!r} is not supported; expected one of "
                f"{sorted(_GGUF_ARCHS)}")
        self.arch = arch
        cached = _cache_dir_for(path)
        if cached.is_dir():
            logger.info("config and tokenizer of %s from cache %s", path.name, cached)
            self.config = transformers.AutoConfig.from_pretrained(cached, local_files_only=True)
            self.tokenizer = transformers.AutoTokenizer.from_pretrained(cached, local_files_only=True)
            generation = transformers.GenerationConfig.from_pretrained(cached)
            eos = generation.eos_token_id
            self.eos_token_ids = [eos] if isinstance(eos, int) else list(eos or [])
            return
        meta = {k: f.contents() for k, f in self.reader.fields.items() if k not in _TOKENIZER_ARRAYS}
        meta.setdefault(f"{arch}.vocab_size", len(self.reader.fields["tokenizer.ggml.tokens"].data))
        self.config = _gguf_config(meta, arch, {t.name for t in self.reader.tensors})
        factors = next((t for t in self.reader.tensors if t.name == _ROPE_FREQS), None)
        if factors is not None:  # llama.cpp's form of Llama 3 rope scaling: inv_freq / factors
            self.config.rope_parameters["freq_factors"] = [float(f) for f in factors.data]
        self.tokenizer = _gguf_tokenizer(path, meta)
        eos_keys = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")
        self.eos_token_ids = list(dict.fromkeys(meta[k] for k in eos_keys if k in meta))
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
        dequantized = set()
        for tensor in self.reader.tensors:
            if tensor.name == _ROPE_FREQS:
                continue  # in the config's rope parameters, not a weight
            name = _hf_name(tensor.name, self.path)
            shape = tuple(int(n) for n in tensor.shape.tolist()[::-1])  # GGUF lists dims fastest-first
            rows = self._qk_row_order(name, shape[0])
            if supported is not None and len(shape) == 2 and supported(tensor.tensor_type):
                data = tensor.data if rows is None else tensor.data[rows.numpy()]
                yield name, GGUFWeight(np.asarray(data), tensor.tensor_type, (shape[0], shape[1]))
                continue
            if keep_quantized and len(shape) == 2:
                dequantized.add(tensor.tensor_type.name)
            array = dequantize(tensor.data, tensor.tensor_type).reshape(shape)
            weight = torch.from_numpy(np.require(array, np.float32, ["C", "W"]))
            yield name, weight if rows is None else weight[rows]
        if dequantized:
            logger.info("%s: %s tensors have no quantized kernel here; dequantized at load",
                        self.path.name, ", ".join(sorted(dequantized)))

    def _qk_row_order(self, name: str, rows: int) -> torch.Tensor | None:
        """Row order that undoes llama.cpp's RoPE permutation of q/k (None: rows are as HF's)."""
        if not _GGUF_ARCHS[self.arch][1] or not (".q_proj." in name or ".k_proj." in name):
            return None
        heads = (self.config.num_attention_heads if ".q_proj." in name
                 else self.config.num_key_value_heads)
        # llama.cpp interleaves each head's two rotary halves: [heads, half, 2] -> [heads, 2, half]
        return torch.arange(rows).reshape(heads, rows // heads // 2, 2).transpose(1, 2).reshape(-1)


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
    if arch in ("llama", "qwen3"):
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


def _gguf_tokenizer(path: pathlib.Path, meta: dict) -> transformers.PreTrainedTokenizerBase:
    # transformers rebuilds the tokenizer from the GGUF vocabulary, merges and pre-tokenizer name.
    tokenizer = transformers.AutoTokenizer.from_pretrained(
        path.parent, gguf_file=path.name, local_files_only=True
    )
    if meta.get("tokenizer.chat_template"):
        tokenizer.chat_template = meta["tokenizer.chat_template"]
    return tokenizer


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


def _save_config_and_tokenizer(model: GGUFModel, folder: pathlib.Path) -> None:
    model.config.save_pretrained(folder)
    model.tokenizer.save_pretrained(folder)
    transformers.GenerationConfig(
        bos_token_id=model.config.bos_token_id,
        eos_token_id=model.eos_token_ids,
        pad_token_id=model.config.pad_token_id,
    ).save_pretrained(folder)
