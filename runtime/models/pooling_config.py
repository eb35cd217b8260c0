"""The embedding pooling a model's own files name: sentence-transformers' Pooling module in a
Hugging Face folder, or llama.cpp's `<arch>.pooling_type` in a GGUF. A mode forklm cannot pool
(max, weighted mean, several at once, rank) is logged and left out: the engine then pools the
last token unless the user sets EngineConfig.pooling."""

from __future__ import annotations

import json
import logging
import pathlib
from typing import Any

logger = logging.getLogger(__name__)

_POOLING_MODULE = "sentence_transformers.models.Pooling"
# sentence-transformers' Pooling config flags -> forklm's mode (None: forklm cannot pool it).
_SENTENCE_TRANSFORMERS_MODES = {
    "pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": None,
    "pooling_mode_mean_sqrt_len_tokens": None, "pooling_mode_weightedmean_tokens": None,
}
# llama.cpp's enum llama_pooling_type; 0 (none: one vector per token) names no pooling.
_GGUF_MODES = {1: "mean", 2: "cls", 3: "last"}
_GGUF_NAMES = {4: "rank"}


def folder_pooling(folder: pathlib.Path) -> str | None:
    """The mode of the Pooling module that the folder's modules.json lists, if any."""
    modules = _read_json(folder / "modules.json")
    pooling = next((m for m in modules if isinstance(m, dict)
                    and m.get("type") == _POOLING_MODULE), None) if isinstance(modules, list) else None
    if pooling is None:
        return None
    config = _read_json(folder / str(pooling.get("path", "")) / "config.json")
    config = config if isinstance(config, dict) else {}
    named = [flag for flag in _SENTENCE_TRANSFORMERS_MODES if config.get(flag)]
    if len(named) == 1 and _SENTENCE_TRANSFORMERS_MODES[named[0]] is not None:
        return _SENTENCE_TRANSFORMERS_MODES[named[0]]
    if named:
        _warn_unsupported(folder, " + ".join(named))
    return None


def gguf_pooling(path: pathlib.Path, fields: dict[str, Any], arch: str) -> str | None:
    """The mode that the GGUF's `<arch>.pooling_type` names, if any."""
    kind = fields.get(f"{arch}.pooling_type")
    if kind is None or int(kind) == 0:
        return None
    mode = _GGUF_MODES.get(int(kind))
    if mode is None:
        _warn_unsupported(path, f"{arch}.pooling_type {_GGUF_NAMES.get(int(kind), int(kind))}")
    return mode


def _warn_unsupported(source: pathlib.Path, named: str) -> None:
    logger.warning("%s names pooling %s, which forklm does not support; embeddings pool the last "
                   "token unless --pooling sets last, mean or cls", source, named)


def _read_json(path: pathlib.Path) -> Any:
    """The file's JSON; None when it is missing or unreadable (a side file must not stop a model
    from loading: the pooling then falls back, with a warning)."""
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        logger.warning("%s is not readable JSON (%s): its pooling is ignored", path, e)
        return None
