"""The routing key of a request: the prompt text the cache-aware policy matches, taken from the
body of each public endpoint (the body is already parsed JSON; anything odd yields "")."""

from __future__ import annotations

import json
from typing import Any

from forklm.server.tenants import Caller

# The key is the prompt's first 32k characters (~8k tokens): enough to tell prefixes apart, and
# it bounds the tree walks the router does on its event loop whatever the prompt's size.
MAX_KEY_CHARS = 32768


def prompt_text(path: str, body: Any, key_salt: str | None = None) -> str:
    """The start of the text a replica's radix cache would see for this request ("" if none).
    A salted request (its cache_salt within its API key's salt, as the replica combines them)
    is keyed inside its salt: its prefix is cached only there, and it must not be routed by
    another salt's prompts."""
    text = _full_text(path, body)
    requested = body.get("cache_salt") if isinstance(body, dict) else None
    salt = Caller(key_salt=key_salt).cache_salt(requested if isinstance(requested, str) else None)
    if salt is not None:
        text = f"\x00salt:{salt}\x00{text}"
    return text[:MAX_KEY_CHARS]


def _full_text(path: str, body: Any) -> str:
    if not isinstance(body, dict):
        return ""
    if path == "/generate":
        return _generate_text(body)
    if path == "/v1/completions":
        return _first_text(body.get("prompt"))
    if path == "/v1/chat/completions":
        return _messages_text(body.get("messages"))
    if path == "/v1/messages":  # Anthropic's: the system prompt, then the turns
        system = body.get("system")
        head = _messages_text([{"role": "system", "content": system}]) if system else ""
        return head + _messages_text(body.get("messages"))
    if path == "/v1/responses":
        value = body.get("input")
        return value if isinstance(value, str) else _messages_text(value)
    if path == "/v1/programs/run":
        text = body.get("program_text")
        # same program, same replica: its constant prefix is cached there
        return text if isinstance(text, str) else "\x00program:" + json.dumps(body.get("program"))
    return ""


def _generate_text(body: dict[str, Any]) -> str:
    text = _first_text(body.get("text"))
    if text:
        return text
    ids = body.get("input_ids")
    if isinstance(ids, list) and ids and isinstance(ids[0], list):
        ids = ids[0]  # a batch: its first prompt decides
    return _ids_text(ids) if isinstance(ids, list) else ""


def _first_text(value: Any) -> str:
    if isinstance(value, list) and value:
        value = value[0]
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and isinstance(value[0], int):
        return _ids_text(value)  # OpenAI completions also take token ids
    return ""


def _ids_text(ids: list[Any]) -> str:
    """Token ids as text whose prefixes are the ids' prefixes (a marker keeps them apart from
    prompts given as text)."""
    return "\x00ids:" + ",".join(str(i) for i in ids[:MAX_KEY_CHARS // 2])


def _messages_text(messages: Any) -> str:
    if not isinstance(messages, list):
        return ""
    parts = []
    for message in messages:
        if not isinstance(message, dict):
            continue
        content = message.get("content")
        if isinstance(content, list):  # content parts: their text
            content = "".join(p.get("text") or "" for p in content if isinstance(p, dict))
        parts.append(f"{message.get('role')}:{content if isinstance(content, str) else ''}\n")
    return "".join(parts)
