"""Tenants of a shared server: API keys with names (a keys file), who a request comes from, the
cache salt that keeps one tenant's prefixes from another, and each key's share of the engine.

A key's requests run at most `max_running_requests` (engine requests: prompts x n) at once; more
wait here, in arrival order, at most `max_queued_requests` of them, and beyond that get a 429.
The engine's scheduler also interleaves waiting requests by key (EngineRequest.tenant), so one
key's flood delays another key's request by a few steps, not by the flood's length.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from forklm.runtime.errors import InvalidArgumentError
from forklm.server.errors import ApiError

if TYPE_CHECKING:
    from forklm.server.config import ServerConfig

logger = logging.getLogger(__name__)

# The name of --api-key's key, and of every caller when the server has no keys at all.
SINGLE_KEY_NAME = "default"
ANONYMOUS = ""
# A key's salt and a request's cache_salt are joined by a character no salt is expected to hold,
# so ("a", "b|c") and ("a|b", "c") stay apart.
_SALT_JOIN = "\x1f"


class ApiKeyEntry(BaseModel):
    """One key of --api-keys-file."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.@:-]+$")
    key: str = Field(min_length=1, max_length=512)
    # Its requests share cached prefixes only among themselves (and --cache-salt-by-key gives
    # every key without one its name as the salt).
    cache_salt: str | None = Field(default=None, min_length=1, max_length=1024)
    # Its share of the engine; None: the server's --max-running-requests-per-key and
    # --max-queued-requests-per-key.
    max_running_requests: int | None = Field(default=None, ge=1)
    max_queued_requests: int | None = Field(default=None, ge=0)


class _KeysFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    keys: list[ApiKeyEntry] = Field(min_length=1, max_length=10_000)

    @model_validator(mode="after")
    def _distinct(self) -> _KeysFile:
        for attr in ("name", "key"):
            values = [getattr(k, attr) for k in self.keys]
            if len(set(values)) != len(values):
                raise ValueError(f"two keys share a {attr}" + (
                    f": {next(v for v in values if values.count(v) > 1)!r}" if attr == "name"
                    else ""))
        return self


def load_api_keys(path: str) -> list[ApiKeyEntry]:
    """The keys of a JSON file: {"keys": [{"name": ..., "key": ..., ...}]} or the bare list.
    Raises InvalidArgumentError naming the file and what is wrong in it."""
    try:
        with open(path, encoding="utf-8") as f:
            data: Any = json.load(f)
    except (OSError, ValueError) as e:
        raise InvalidArgumentError("api_keys_file", path, f"cannot be read as JSON: {e}") from e
    if isinstance(data, list):
        data = {"keys": data}
    try:
        return _KeysFile.model_validate(data).keys
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise InvalidArgumentError("api_keys_file", path, f"{where}: {first['msg']}") from e


@dataclass(frozen=True)
class Caller:
    """Who sent a request: a key's name (ANONYMOUS without keys) and that key's cache salt."""

    name: str = ANONYMOUS
    key_salt: str | None = None

    def session_id(self, sid: str) -> str:
        """The engine's id of this caller's session `sid`: each key's sessions apart, so no key
        can pin into, or close, another key's session."""
        return sid if not self.name else f"{self.name}{_SALT_JOIN}{sid}"

    def cache_salt(self, requested: str | None) -> str | None:
        """The salt the engine uses: the request's own within the key's, so two keys never share
        a prefix even when their requests name the same salt."""
        if self.key_salt is None:
            return requested
        return self.key_salt + _SALT_JOIN + (requested or "")


def caller_of(request: Any) -> Caller:
    """Who sent an HTTP `request` (the GuardMiddleware put it in the request's state)."""
    return getattr(request.state, "caller", None) or Caller()


@dataclass
class TenantGate:
    """One key's share of the engine (see the module docstring). Counts engine requests."""

    name: str
    max_running: int | None
    max_queued: int | None
    retry_after_s: int = 1
    running: int = 0
    queued: int = 0
    _waiters: deque[tuple[int, asyncio.Future[None]]] = field(default_factory=deque)

    async def acquire(self, num: int) -> None:
        """Take `num` places, waiting in line while the key's running share is used up; a 429
        when the line is full, a 400 when `num` exceeds the share itself."""
        if self.max_running is None:
            self.running += num
            return
        if num > self.max_running:
            raise ApiError(400, f"the call makes {num} engine requests (prompts x n), more than "
                           f"API key {self.name!r} may run at once ({self.max_running})")
        if not self._waiters and self.running + num <= self.max_running:
            self.running += num
            return
        if self.max_queued is not None and self.queued + num > self.max_queued:
            logger.warning("API key %r over its limits: %d running, %d queued", self.name,
                           self.running, self.queued)
            raise ApiError(429, f"too many requests for API key {self.name!r}: {self.running} "
                           f"running (limit {self.max_running}), {self.queued} queued (limit "
                           f"{self.max_queued})", headers={"Retry-After": str(self.retry_after_s)})
        waiter = (num, asyncio.get_running_loop().create_future())
        self._waiters.append(waiter)
        self.queued += num
        try:
            await waiter[1]
        except asyncio.CancelledError:
            if waiter in self._waiters:  # still in line: leave it
                self._waiters.remove(waiter)
                self.queued -= num
            elif waiter[1].done() and not waiter[1].cancelled():  # granted as it was cancelled
                self.release(num)
            raise

    def release(self, num: int) -> None:
        self.running -= num
        assert self.running >= 0, (self.name, self.running)
        while self._waiters and self.running + self._waiters[0][0] <= (self.max_running or 0):
            num_next, future = self._waiters.popleft()
            self.queued -= num_next
            if not future.done():
                self.running += num_next
                future.set_result(None)


class Tenants:
    """The server's keys and their gates. `authenticate` maps an Authorization token to a Caller
    (None: no such key); without any key every request is the ANONYMOUS caller."""

    def __init__(self, api_key: str | None, entries: list[ApiKeyEntry],
                 salt_by_key: bool, max_running: int | None, max_queued: int | None,
                 retry_after_s: int):
        if api_key is not None:
            if any(e.name == SINGLE_KEY_NAME for e in entries):
                raise InvalidArgumentError("api_keys_file", SINGLE_KEY_NAME, "the name of "
                                           "--api-key's key: give that key another name")
            entries = [ApiKeyEntry(name=SINGLE_KEY_NAME, key=api_key), *entries]
        self.entries = entries
        self._keys = [(e.key.encode(), e) for e in entries]
        self.callers = {e.name: Caller(e.name, e.cache_salt or (e.name if salt_by_key else None))
                        for e in entries}
        self.gates = {e.name: TenantGate(
            e.name, e.max_running_requests or max_running,
            e.max_queued_requests if e.max_queued_requests is not None else max_queued,
            retry_after_s) for e in entries}
        self.gates[ANONYMOUS] = TenantGate(ANONYMOUS, max_running, max_queued, retry_after_s)

    @classmethod
    def of(cls, config: ServerConfig) -> Tenants:
        """The server's API keys (--api-key and --api-keys-file) and each key's share."""
        entries = load_api_keys(config.api_keys_file) if config.api_keys_file else []
        # a key's line is bounded even when only its running share is given: by the server's
        # queue
        queued = config.max_queued_requests_per_key
        return cls(config.api_key, entries, config.cache_salt_by_key,
                   config.max_running_requests_per_key,
                   config.max_queued_requests if queued is None else queued,
                   config.retry_after_s)

    @property
    def needs_key(self) -> bool:
        return bool(self._keys)

    def authenticate(self, token: bytes) -> Caller | None:
        """The caller whose key `token` is; every key is compared (in constant time each), so
        the answer's timing does not say which key came close."""
        found = None
        for key, entry in self._keys:
            if hmac.compare_digest(token, key):
                found = entry
        return None if found is None else self.callers[found.name]

    def gate_of(self, tenant: str) -> TenantGate:
        """The gate of a key's name (the anonymous one for a name the server does not know)."""
        return self.gates.get(tenant) or self.gates[ANONYMOUS]
