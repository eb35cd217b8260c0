"""Validation of SamplingParams' SGLang/OpenAI extras: logit_bias, structural_tag, custom_params and
stream_interval (each normalized once, when a SamplingParams is created)."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from itertools import accumulate
from typing import Any

from forklm.runtime.errors import InvalidArgumentError

# OpenAI's range: -100 bans a token, +100 makes it (nearly) the only choice.
MAX_ABS_LOGIT_BIAS = 100.0
# Entries of one logit_bias; each costs one scatter in every step of the request.
MAX_LOGIT_BIAS_ENTRIES = 4096
# A structural tag's structures and triggers (each structure compiles one JSON schema).
MAX_STRUCTURES = 64
# A constraint's text (regex, schema JSON, EBNF, choices JSON, structural tag JSON). Real schemas
# are 1-50 KB; compile time grows faster than the size, and the time budget
# (EngineConfig.grammar_compile_timeout_s) stops the rest.
MAX_GRAMMAR_CHARS = 256 * 1024
# Nesting of objects and arrays in a schema or structural tag: xgrammar converts schemas
# recursively in C++ (each schema level is 2-3 JSON levels: the object, "properties", the key).
MAX_GRAMMAR_DEPTH = 64
# A JSON string; an unterminated one runs to the end (an optional close never fails, so no
# backtracking: linear time on any text).
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"?', re.DOTALL)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_DEPTH_STEP = {"[": 1, "{": 1, "]": -1, "}": -1}


def str_list(value: object, field: str, max_items: int | None = None,
             noun: str = "strings") -> list[str] | None:
    """A str or a list of str (stop, stop_regex) as a list of at most `max_items`; None stays
    None."""
    if value is None:
        return None
    items = [value] if isinstance(value, str) else value
    if not (isinstance(items, (list, tuple)) and all(isinstance(s, str) for s in items)):
        raise InvalidArgumentError(field, value, "must be a str or a list of str")
    if max_items is not None and len(items) > max_items:
        raise InvalidArgumentError(field, f"<{len(items)} {noun}>", f"at most {max_items} {noun}")
    return list(items)


def normalize_logit_bias(bias: object) -> dict[int, float] | None:
    """{token id: bias} with int keys (JSON objects give "123"), biases finite in [-100, 100]."""
    if bias is None:
        return None
    if not isinstance(bias, Mapping):
        raise InvalidArgumentError("logit_bias", bias, "must be an object of token id -> bias")
    if len(bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise InvalidArgumentError("logit_bias", f"<{len(bias)} entries>",
                                   f"at most {MAX_LOGIT_BIAS_ENTRIES} entries")
    out: dict[int, float] = {}
    for key, value in bias.items():
        token_id = _token_id(key)
        if token_id is None:
            raise InvalidArgumentError("logit_bias", key, "keys must be token ids (ints >= 0)")
        if not (is_number(value) and abs(value) <= MAX_ABS_LOGIT_BIAS):
            raise InvalidArgumentError("logit_bias", {key: value},
                                       "biases must be numbers in [-100, 100]")
        out[token_id] = float(value)
    return out or None


def _token_id(key: object) -> int | None:
    if isinstance(key, bool):
        return None
    if isinstance(key, int):
        return key if key >= 0 else None
    if isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 12:
        return int(key)
    return None


def is_number(v: object) -> bool:
    """A finite int or float (not a bool); an int too large for a float is not one."""
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        return False
    try:
        return math.isfinite(v)
    except OverflowError:  # an int beyond float's range (10**400)
        return False


def normalize_structural_tag(tag: object) -> str | None:
    """The tag as JSON text, checked to be SGLang's shape (structures + triggers) or xgrammar's
    (format); whether its schemas compile is xgrammar's to say (GrammarBackend)."""
    if tag is None:
        return None
    text = tag if isinstance(tag, str) else _dumps(tag)
    try:
        obj = json.loads(text)
    except (ValueError, RecursionError) as e:  # RecursionError: nested beyond Python's stack
        raise InvalidArgumentError("structural_tag", shorten(text), f"not valid JSON: {e}") from e
    if not isinstance(obj, dict) or obj.get("type", "structural_tag") != "structural_tag":
        raise InvalidArgumentError("structural_tag", shorten(text),
                                   'must be an object with "type": "structural_tag"')
    if "format" in obj:
        return text
    structures, triggers = obj.get("structures"), obj.get("triggers")
    ok = (isinstance(structures, list) and 0 < len(structures) <= MAX_STRUCTURES
          and all(_is_structure(s) for s in structures)
          and isinstance(triggers, list) and 0 < len(triggers) <= MAX_STRUCTURES
          and all(isinstance(t, str) and t for t in triggers))
    if not ok or not isinstance(structures, list) or not isinstance(triggers, list):
        raise InvalidArgumentError(
            "structural_tag", shorten(text),
            f'needs "structures" (1..{MAX_STRUCTURES} of {{"begin": str, "schema": object, '
            f'"end": str}}) and "triggers" (1..{MAX_STRUCTURES} non-empty str), or "format"')
    for s in structures:
        if not any(s["begin"].startswith(t) for t in triggers):
            raise InvalidArgumentError("structural_tag", s["begin"],
                                       "every structure's begin must start with a trigger")
    return text


def _is_structure(s: object) -> bool:
    return (isinstance(s, dict) and isinstance(s.get("begin"), str) and s["begin"] != ""
            and isinstance(s.get("end"), str)
            and isinstance(s.get("schema", {}), (dict, bool)))


def _dumps(value: object) -> str:
    try:
        return json.dumps(value)
    except (TypeError, ValueError, RecursionError) as e:  # RecursionError: nested too deep
        raise InvalidArgumentError("structural_tag", "<object>",
                                   f"not JSON-serializable: {e!r}") from e


def shorten(text: str) -> str:
    """text as an error message shows it: at most 80 characters (a client may send megabytes)."""
    return text if len(text) <= 80 else text[:77] + "..."


def check_extras(custom_params: Any, stream_interval: Any) -> None:
    if custom_params is not None and not isinstance(custom_params, Mapping):
        raise InvalidArgumentError("custom_params", custom_params, "must be an object or null")
    if stream_interval is not None and (isinstance(stream_interval, bool)
                                        or not isinstance(stream_interval, int)
                                        or stream_interval < 1):
        raise InvalidArgumentError("stream_interval", stream_interval,
                                   "must be null or an int >= 1")


def check_grammar_size(kind: str, text: str) -> None:
    """A constraint's text within MAX_GRAMMAR_CHARS and, for JSON kinds, MAX_GRAMMAR_DEPTH
    (measured on the text, without parsing it)."""
    if len(text) > MAX_GRAMMAR_CHARS:
        raise InvalidArgumentError(kind, shorten(text),
                                   f"over the limit of {MAX_GRAMMAR_CHARS} characters")
    if kind in ("json_schema", "structural_tag"):
        brackets = _NOT_BRACKET.sub("", _STRING.sub("", text))
        depth = max(accumulate(_DEPTH_STEP[c] for c in brackets), default=0)
        if depth > MAX_GRAMMAR_DEPTH:
            raise InvalidArgumentError(kind, shorten(text), f"nested {depth} deep; at most "
                                       f"{MAX_GRAMMAR_DEPTH} levels of objects and arrays")
