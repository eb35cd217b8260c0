"""The tokenizer a GGUF's metadata describes, read the way llama.cpp (the format's owner) reads it:
transformers' own GGUF conversion, corrected where transformers reads the metadata otherwise."""

from __future__ import annotations

import pathlib
from typing import Any

import numpy as np
import transformers
from tokenizers import Regex, decoders, normalizers, pre_tokenizers

# The vocabulary's metadata arrays: large, and read by transformers itself, so never in `meta`.
TOKENIZER_ARRAYS = {f"tokenizer.ggml.{k}" for k in ("tokens", "token_type", "scores", "merges")}
_SPACE = "\u2581"  # sentencepiece's visible space
# `tokenizer.ggml.pre` names llama.cpp splits as: every digit alone, then GPT-2's split
# (transformers applies GPT-2's split alone, so " 123" stays one piece). SmolLM2 is one.
_DIGITS_THEN_GPT2 = frozenset({"smollm", "starcoder", "refact", "command-r", "codeshell",
                               "exaone", "minerva-7b", "mellum2"})
# ... names llama.cpp splits by a regex of their own, as their tokenizer.json does before its
# byte-level step (transformers applies GPT-2's split instead). BLOOM's keeps each run of
# anything but whitespace and a few punctuation marks whole, with one space in front.
_OWN_SPLITS = {"bloom": r" ?[^(\s|.,!?…。，、।۔،)]+"}
# ... names whose vocabulary is looked up whole before any merge (tokenizers' ignore_merges).
_WHOLE_WORDS_FIRST = frozenset({"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1",
                                "pixtral", "midm-2.0", "lfm2", "jina-v5-nano", "tekken",
                                "youtu", "glm4", "glm5", "minicpm5"})
# ... byte-level names llama.cpp adds a BOS to when the file has no add_bos_token.
_BOS_BY_DEFAULT = frozenset({"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral",
                             "midm-2.0", "lfm2", "jina-v5-nano", "tekken", "chameleon"})


def gguf_tokenizer(path: pathlib.Path, meta: dict[str, Any]) -> transformers.PreTrainedTokenizerBase:
    """The tokenizer of the GGUF at `path`, whose metadata (without the vocabulary arrays) is
    `meta`: vocabulary and merges as transformers converts them; sentencepiece spaces, byte-level
    splits, BOS/EOS and the chat template as llama.cpp reads the metadata."""
    model, pre = meta.get("tokenizer.ggml.model"), meta.get("tokenizer.ggml.pre")
    add_bos = meta.get("tokenizer.ggml.add_bos_token",
                       model == "llama" or (model == "gpt2" and pre in _BOS_BY_DEFAULT))
    tokenizer = _tokenizer_class(meta).from_pretrained(
        path.parent, gguf_file=path.name, local_files_only=True, add_bos_token=bool(add_bos),
        add_eos_token=bool(meta.get("tokenizer.ggml.add_eos_token", False)))
    if model == "llama":
        _sentencepiece_spaces(tokenizer.backend_tokenizer,
                              bool(meta.get("tokenizer.ggml.add_space_prefix", True)))
    elif model == "gpt2":
        _byte_level_split(tokenizer.backend_tokenizer, pre)
    if meta.get("tokenizer.chat_template"):
        tokenizer.chat_template = meta["tokenizer.chat_template"]
    return tokenizer


def _tokenizer_class(meta: dict[str, Any]) -> type[transformers.PreTrainedTokenizerBase]:
    """The class AutoTokenizer picks for this file: the one registered for the model type
    transformers' GGUF reader gives it, else the tokenizers backend (which builds the same
    tokenizer from the tokenizer.* keys alone). Picked here because AutoTokenizer gets that type
    by parsing every metadata field with gguf-py's reader, vocabulary included: 3-4 s for a
    49k-token vocabulary on a first load. Architectures transformers has no GGUF config mapping
    for (SmolLM3, Granite, OLMo 2) or reads wrongly (Gemma 4's per-layer MLP widths) take the
    backend, as AutoTokenizer would refuse them."""
    from transformers.models.auto.tokenization_auto import (
        TOKENIZER_MAPPING_NAMES,
        tokenizer_class_from_name,
    )

    name = TOKENIZER_MAPPING_NAMES.get(_transformers_model_type(meta) or "")
    picked = tokenizer_class_from_name(name) if name else None
    if picked is None or picked.__name__ == "MistralCommonBackend":  # needs Mistral's own files
        return transformers.TokenizersBackend
    return picked


def _transformers_model_type(meta: dict[str, Any]) -> str | None:
    """The model_type transformers' GGUF config reader (load_gguf_checkpoint) gives a file of
    these metadata; None for architectures it does not read."""
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    arch, name = meta.get("general.architecture"), meta.get("general.name")
    if arch not in GGUF_SUPPORTED_ARCHITECTURES or arch == "gemma4":
        return None
    if arch == "llama" and name == "mistral":  # it tests the name list for the exact string
        return "mistral"
    if arch in ("t5", "t5encoder"):
        return "umt5" if "umt5" in str(name or "").lower() else "t5"
    return "gemma3_text" if arch == "gemma3" else str(arch)


def tokenizer_of_gguf(path: pathlib.Path) -> transformers.PreTrainedTokenizerBase:
    """gguf_tokenizer of a GGUF file alone (`tokenizer_path`): only its tokenizer metadata is
    read, so any architecture's file will do."""
    from forklm.runtime.models.gguf_file import GGUFFile

    fields = GGUFFile(path).fields
    return gguf_tokenizer(path, {name: value.tolist() if isinstance(value, np.ndarray) else value
                                 for name, value in fields.items()
                                 if (name.startswith("tokenizer.")
                                     or name in ("general.architecture", "general.name"))
                                 and name not in TOKENIZER_ARRAYS})


def _sentencepiece_spaces(backend: Any, add_space_prefix: bool) -> None:
    """Spaces as llama.cpp's sentencepiece tokenizer writes them: each run of text (the whole
    text, and each piece after a control token) gets one "▁" in front when the file says
    add_space_prefix (its default), every space becomes "▁", and nothing else splits the text.
    transformers' Metaspace adds no "▁" to text that starts with a space ("  hi" -> "▁▁hi",
    llama.cpp "▁▁▁hi") nor after a control token, and its Gemma tokenizer never adds one."""
    spaces = normalizers.Replace(" ", _SPACE)
    backend.normalizer = (normalizers.Sequence([normalizers.Prepend(_SPACE), spaces])
                          if add_space_prefix else spaces)
    backend.pre_tokenizer = None
    steps = [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    backend.decoder = decoders.Sequence(
        steps + ([decoders.Strip(" ", 1, 0)] if add_space_prefix else []))


def _byte_level_split(backend: Any, pre: str | None) -> None:
    if pre in _DIGITS_THEN_GPT2:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(r"\p{N}"), "isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])  # GPT-2's split
    if pre in _OWN_SPLITS:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_OWN_SPLITS[pre]), "isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    if pre in _WHOLE_WORDS_FIRST:
        backend.model.ignore_merges = True


def load_saved_tokenizer(folder: pathlib.Path) -> transformers.PreTrainedTokenizerBase:
    """The tokenizer gguf_tokenizer made, from its save_pretrained folder, unchanged: loaded as a
    plain tokenizers backend, since AutoTokenizer would pick the model type's class, which
    rebuilds parts in its __init__ (Qwen2Tokenizer adds an NFC normalizer llama.cpp does not
    apply). BOS/EOS travel in tokenizer.json's post-processor (transformers saves no
    add_bos_token flag beside it)."""
    return transformers.PreTrainedTokenizerFast.from_pretrained(folder, local_files_only=True)
