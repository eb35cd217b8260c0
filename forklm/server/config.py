"""ServerConfig: the HTTP server's knobs (the tier above EngineConfig); CLI flags come from it."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from forklm.frontend_dsl.ir import ProgramLimits
from forklm.parsers.reasoning import REASONING_PARSERS
from forklm.parsers.tool_calls import TOOL_CALL_PARSERS
from forklm.runtime.config import check_field as _check
from forklm.runtime.config import config_from_kwargs
from forklm.server.chat_template import is_template_text
from forklm.server.tenants import load_api_keys

# --load-balance-method (SGLang's names): forklm/router/policies.py implements each one.
LOAD_BALANCE_METHODS = ("round_robin", "shortest_queue", "cache_aware")
_PROGRAM_LIMITS = ProgramLimits()  # the defaults of the max_program_* fields below


@dataclass(frozen=True)
class ServerConfig:
    # Loopback by default: exposing a model to the network is a decision, not a default.
    host: str = "127.0.0.1"
    port: int = 30000
    # When set, every endpoint but /health needs `Authorization: Bearer <api_key>`.
    api_key: str | None = None
    # Named keys for a shared server: a JSON file {"keys": [{"name", "key", and optionally
    # "cache_salt", "max_running_requests", "max_queued_requests"}]}, each accepted like
    # --api-key (which may be given too, named "default"); the name shows in metrics and logs.
    api_keys_file: str | None = None
    # Every key without a cache_salt of its own is salted by its name: keys never share cached
    # prefixes, so none learns from cache hits or timing what another sent.
    cache_salt_by_key: bool = False
    # Each key's share of the engine, in engine requests (prompts x n): at most this many run at
    # once (None: no bound beyond the server's own), and at most max_queued_requests_per_key
    # more wait (then a 429; None: max_queued_requests).
    max_running_requests_per_key: int | None = None
    max_queued_requests_per_key: int | None = None
    # The name /v1/models reports and requests must use; None = the engine's model_path.
    served_model_name: str | None = None
    # A Jinja chat template (a file, or the template itself) used instead of the tokenizer's.
    chat_template: str | None = None
    # Control tokens typed into chat messages ("<|im_end|>") are encoded as plain text, so a user
    # cannot forge a turn; True restores the old behaviour (they become real control tokens).
    allow_special_tokens_in_content: bool = False
    # A vision-language model's remote images (image_url parts, image_data) are fetched only
    # from URLs starting with one of these ("https://images.example.com/"); none by default: a
    # server must not be a proxy to the network. Data URLs and base64 always work.
    allowed_image_url_prefixes: tuple[str, ...] = ()
    # Requests admitted beyond the engine's max_running_requests before new ones get a 503.
    max_queued_requests: int = 256
    # 8 MiB is ~1M tokens of text, far beyond any context; larger bodies are an error or abuse.
    max_request_body_bytes: int = 8 * 1024 * 1024
    # The Retry-After seconds a 503 (queue full) suggests.
    retry_after_s: int = 1
    # Limits on one POST /v1/programs/run request: `program_limits` (ProgramLimits' fields).
    max_program_nodes: int = _PROGRAM_LIMITS.max_nodes
    max_fork_size: int = _PROGRAM_LIMITS.max_fork_size
    max_repeat: int = _PROGRAM_LIMITS.max_repeat
    max_program_tokens: int = _PROGRAM_LIMITS.max_total_tokens
    # The model's tool-call format (hermes, llama3, mistral, json); None = detected from the chat
    # template, else the generic JSON tool prompt.
    tool_call_parser: str | None = None
    # Splits <think>...</think> into reasoning_content (qwen3, deepseek-r1); None = no split.
    reasoning_parser: str | None = None
    # Seconds SIGTERM waits for in-flight requests before aborting them.
    graceful_shutdown_s: float = 30.0
    log_level: str = "warning"
    # Data parallelism (SGLang's --dp-size): N engine replicas, each a `forklm serve` process,
    # behind this server acting as a router (forklm/router/) with this policy.
    dp_size: int = 1
    load_balance_method: str = "cache_aware"
    # Fleet faults, --dp-size and --ray alike (sgl-router's flag names). A request whose replica
    # fails before the client got a byte is resent to another replica, at most this many times
    # (nothing was returned, so resending repeats no answer).
    retry_max_retries: int = 3
    disable_retries: bool = False
    # Each replica's /health is probed every interval; one that gives no answer within the
    # timeout threshold times in a row is stuck: it is killed and restarted like a dead one.
    health_check_timeout_secs: float = 5.0
    health_check_interval_secs: float = 1.0
    health_failure_threshold: int = 3

    def __post_init__(self) -> None:
        _check(1 <= self.port <= 65535, "port", self.port, "must be in [1, 65535]")
        _check(self.api_key is None or self.api_key != "", "api_key", self.api_key,
               "must be non-empty when given")
        _check(self.chat_template is None or is_template_text(self.chat_template)
               or os.path.isfile(self.chat_template), "chat_template", self.chat_template,
               "must be a Jinja template or the path of a file holding one")
        if self.api_keys_file is not None:
            load_api_keys(self.api_keys_file)  # raises naming what is wrong with the file
        _check(self.max_running_requests_per_key is None or self.max_running_requests_per_key
               >= 1, "max_running_requests_per_key", self.max_running_requests_per_key,
               "must be >= 1")
        _check(self.max_queued_requests_per_key is None or self.max_queued_requests_per_key
               >= 0, "max_queued_requests_per_key", self.max_queued_requests_per_key,
               "must be >= 0")
        for name in ("max_queued_requests", "retry_after_s"):
            _check(getattr(self, name) >= 0, name, getattr(self, name), "must be >= 0")
        for name in ("max_request_body_bytes", "max_program_nodes", "max_fork_size",
                     "max_repeat", "max_program_tokens"):
            _check(getattr(self, name) >= 1, name, getattr(self, name), "must be >= 1")
        for name, known in (("tool_call_parser", TOOL_CALL_PARSERS),
                            ("reasoning_parser", REASONING_PARSERS)):
            value = getattr(self, name)
            _check(value is None or value in known, name, value,
                   "expected one of " + ", ".join(known))
        _check(self.graceful_shutdown_s >= 0, "graceful_shutdown_s", self.graceful_shutdown_s,
               "must be >= 0")
        _check(self.dp_size >= 1, "dp_size", self.dp_size, "must be >= 1")
        _check(self.load_balance_method in LOAD_BALANCE_METHODS, "load_balance_method",
               self.load_balance_method, "expected one of " + ", ".join(LOAD_BALANCE_METHODS))
        _check(self.retry_max_retries >= 0, "retry_max_retries", self.retry_max_retries,
               "must be >= 0")
        for name in ("health_check_timeout_secs", "health_check_interval_secs"):
            _check(getattr(self, name) > 0, name, getattr(self, name), "must be > 0")
        _check(self.health_failure_threshold >= 1, "health_failure_threshold",
               self.health_failure_threshold, "must be >= 1")
        _check(self.log_level in ("critical", "error", "warning", "info", "debug", "trace"),
               "log_level", self.log_level, "expected critical, error, warning, info or debug")

    @property
    def program_limits(self) -> ProgramLimits:
        return ProgramLimits(max_nodes=self.max_program_nodes, max_fork_size=self.max_fork_size,
                             max_repeat=self.max_repeat, max_total_tokens=self.max_program_tokens)

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> ServerConfig:
        """Build from keyword arguments, rejecting unknown names with the list of known ones."""
        return config_from_kwargs(cls, "server", kwargs)
