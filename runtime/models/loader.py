"""Load a model's config, tokenizer and weights from a Hugging Face folder, a GGUF file or a Hub id.

Weights are never loaded as a whole: `LoadedModel.weights()` streams (name, tensor) pairs from
memory-mapped files, so the model can convert and place them one by one (models/weights.py).
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import transformers
from safetensors import safe_open

from forklm.runtime.errors import ModelNotFoundError
from forklm.runtime.models.checkpoint_layouts import forklm_layout
from forklm.runtime.models.pooling_config import folder_pooling, gguf_pooling
from forklm.runtime.models.source import resolve_model_source, resolve_tokenizer_source

if TYPE_CHECKING:
    from forklm.runtime.quant.records_cache import RecordsCache


@dataclass
class LoadedModel:
    """Config, tokenizer and a weight stream, HF-named in Llama's layout (checkpoint_layouts.py
    rewrites the others, GPT-2's). `weights(keep_quantized)` yields each
    tensor once, as float32/bf16 tensors (HF folders keep their stored dtype) or, for a GGUF with
    keep_quantized, quantized parts for the formats runtime/quant/ multiplies with."""

    config: transformers.PretrainedConfig
    tokenizer: transformers.PreTrainedTokenizerBase
    source: str  # the GGUF file or the folder the weights come from
    eos_token_ids: list[int]
    weights: Callable[..., Iterator[tuple[str, Any]]]
    is_gguf: bool = False
    pooling: str | None = None  # the embedding pooling the model's files name (pooling_config.py)
    # A vision-language checkpoint whose images forklm reads (runtime/multimodal/): its outer
    # config (the text model's is `config`) and its weight files; None for a text model.
    vision_config: transformers.PretrainedConfig | None = None
    shards: list[pathlib.Path] | None = None
    # a GGUF's repacked weights cached on disk (runtime/quant/records_cache.py): an engine
    # writes what its load built there in its idle time
    records_cache: RecordsCache | None = None

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Every weight as a float32 tensor in one dict (tests and references, not the engine)."""
        return {name: tensor.float() for name, tensor in self.weights()}


def load_model(model_path: str, revision: str | None = None,
               tokenizer_path: str | None = None) -> LoadedModel:
    """Load `model_path` (a path, the default model's name or a Hub id: model_source.py);
    `tokenizer_path` overrides the tokenizer."""
    path = resolve_model_source(model_path, revision)
    if path.is_dir():
        loaded = _load_hf_dir(path)
        loaded.pooling = folder_pooling(path)
    else:
        from forklm.runtime.models.gguf_loader import GGUFModel

        gguf = GGUFModel(path)
        loaded = LoadedModel(gguf.config, gguf.tokenizer, str(path), gguf.eos_token_ids,
                             gguf.weights, is_gguf=True,
                             pooling=gguf_pooling(path, gguf.file.fields, gguf.arch),
                             records_cache=gguf.records_cache)
    if tokenizer_path is not None:
        folder = resolve_tokenizer_source(tokenizer_path)
        if folder.is_dir():
            loaded.tokenizer = transformers.AutoTokenizer.from_pretrained(
                folder, local_files_only=True)
        else:
            from forklm.runtime.models.gguf_tokenizer import tokenizer_of_gguf

            loaded.tokenizer = tokenizer_of_gguf(folder)
    return loaded


# ---- Hugging Face folders -------------------------------------------------------------------


# Multimodal checkpoints whose language model forklm serves alone (text in, text out): their
# config's text_config, and their weights under the language model's prefix (the Hub's names and
# transformers 5's); the vision tower and projector are not loaded here.
_TEXT_OF_MULTIMODAL = frozenset({"gemma3", "gemma4", "qwen2_5_vl", "qwen3_vl"})
# Vision-language checkpoints whose images forklm also reads: the language model as above, the
# vision tower and projector by runtime/multimodal/ from the same files. Where the checkpoint
# has no image processor's config (a Gemma 3 saved without one), its text is served alone.
VISION_LANGUAGE = frozenset({"idefics3", "smolvlm", "gemma3", "qwen2_5_vl", "qwen3_vl"})
_PROCESSOR_CONFIGS = ("preprocessor_config.json", "processor_config.json")
ALIBI_CONTEXT = 2048  # BLOOM's training sequence length
_LANGUAGE_MODEL_PREFIXES = (("language_model.model.", "model."), ("model.language_model.", "model."),
                            ("language_model.lm_head.", "lm_head."),
                            ("model.text_model.", "model."))  # Idefics3's, SmolVLM's
# Checkpoints whose language model sits at the top ("model.layers..." beside "visual.": the Hub's
# Qwen2.5-VL files): any other "model." name is the language model's, as named.
_LANGUAGE_MODEL_AT_TOP = {"qwen2_5_vl": ("model.visual.",)}


def _load_hf_dir(folder: pathlib.Path) -> LoadedModel:
    outer = transformers.AutoConfig.from_pretrained(folder, local_files_only=True)
    vision = outer.model_type in VISION_LANGUAGE and any(
        (folder / name).is_file() for name in _PROCESSOR_CONFIGS)
    multimodal = vision or outer.model_type in _TEXT_OF_MULTIMODAL
    config = outer.get_text_config() if multimodal else outer
    if multimodal:  # the multimodal model ties (or not) its language model's head
        config.tie_word_embeddings = bool(getattr(outer, "tie_word_embeddings", False))
    if getattr(config, "max_position_embeddings", None) is None:
        # ALiBi models have no position table: MPT states its training length as max_seq_len,
        # BLOOM not at all (2048). The engine's context_length may go past it.
        config.max_position_embeddings = (getattr(config, "max_seq_len", None)
                                          or getattr(config, "seq_length", None) or ALIBI_CONTEXT)
    shards = _safetensors_files(folder)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)
    eos_ids = _eos_ids_from(_read_json(folder / "generation_config.json"), config, tokenizer)
    tied = bool(getattr(config, "tie_word_embeddings", False))

    def weights(keep_quantized: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        return forklm_layout(config, checkpoint_tensors())

    def checkpoint_tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for shard in shards:
            with safe_open(shard, framework="pt") as f:
                names = f.keys()  # a safe_open handle is not iterable itself
                for name in names:
                    hf_name = (language_model_name(name, outer.model_type) if multimodal
                               else name)
                    if hf_name is None or (tied and hf_name == "lm_head.weight"):
                        continue  # tied models carry no lm_head, whatever the source
                    yield hf_name, f.get_tensor(name)

    return LoadedModel(config, tokenizer, str(folder), eos_ids, weights,
                       vision_config=outer if vision else None, shards=shards if vision else None)


def language_model_name(name: str, model_type: str | None = None) -> str | None:
    """A multimodal checkpoint's tensor under its language model's own name (None: another
    tower's)."""
    for prefix, replacement in _LANGUAGE_MODEL_PREFIXES:
        if name.startswith(prefix):
            return replacement + name[len(prefix):]
    if name == "lm_head.weight":
        return name
    towers = _LANGUAGE_MODEL_AT_TOP.get(model_type or "")
    if towers is not None and name.startswith("model.") and not name.startswith(towers):
        return name
    return None


def _safetensors_files(folder: pathlib.Path) -> list[pathlib.Path]:
    index = _read_json(folder / "model.safetensors.index.json")
    files = sorted(set(index["weight_map"].values())) if index else None
    paths = [folder / f for f in files] if files else sorted(folder.glob("*.safetensors"))
    if not paths:
        raise ModelNotFoundError(f"{folder}: no *.safetensors weights (other formats unsupported)")
    return paths


def _read_json(path: pathlib.Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def _eos_ids_from(generation: dict | None, config, tokenizer) -> list[int]:
    """The first source that names EOS wins: generation_config.json, then config, then tokenizer."""
    sources = ((generation or {}).get("eos_token_id"), getattr(config, "eos_token_id", None),
               tokenizer.eos_token_id)
    for ids in sources:
        if ids is not None:
            ids = [ids] if isinstance(ids, int) else list(ids)
            return list(dict.fromkeys(int(i) for i in ids))
    return []


