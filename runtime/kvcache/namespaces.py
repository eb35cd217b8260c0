"""Cache namespaces: the radix cache shares a prefix only between requests of one namespace.

A request's cache salt (vLLM's `cache_salt`; the server adds the caller's API key where it salts
by key) names its namespace. The tree itself knows nothing of them: a namespaced request's token
ids are keyed as `id + (namespace << 32)`, so sequences of different namespaces never share a
first token, hence never a path, and what one salt cached is invisible to every other, in hits,
in cached-token counts and in time to first token. Namespace 0 keys the plain ids.
"""

from __future__ import annotations

import hashlib

# Token ids are below 2**32 (every vocabulary is far smaller), so the shifted namespace and the
# id never overlap.
_ID_BITS = 32


def salt_namespace(salt: str | None) -> int:
    """The namespace of a cache salt: 0 for none, else 64 bits of its hash (never 0). Two salts
    collide with probability 2**-64."""
    if salt is None:
        return 0
    digest = hashlib.blake2b(salt.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") or 1


def request_namespace(salt: str | None, adapter_uid: int | None) -> int:
    """The namespace of a request: its salt's, and, for a LoRA adapter's request, one of that
    adapter's own (KV computed through one adapter's weights is never another's prefix; a
    reloaded adapter gets a new uid, so not even its own earlier version's)."""
    if adapter_uid is None:
        return salt_namespace(salt)
    return salt_namespace(f"{salt or ''}\x1flora:{adapter_uid}")


def namespaced(token_ids: list[int], namespace: int) -> list[int]:
    """token_ids as the radix cache keys them in `namespace` (the list itself for 0)."""
    if not namespace:
        return token_ids
    offset = namespace << _ID_BITS
    return [t + offset for t in token_ids]
