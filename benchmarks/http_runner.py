"""Measure any OpenAI-compatible completions endpoint with the workloads and metrics of the other
runners: streaming `/v1/completions` requests (greedy, `max_tokens`, `ignore_eos` as an extra body
field), the workload's number in flight, W3 turns in order per conversation."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from benchmarks.runners import Metrics, _metrics, drive, tpot_ms
from benchmarks.workloads import Request, Workload


@dataclass
class Usage:
    """What one streamed completion reported: text, token counts, and the prompt tokens the
    server says it served from its cache (None when it does not say)."""

    text: str = ""
    completion_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int | None = None
    num_chunks: int = 0
    saw_usage: bool = False


# Sends of one request that the server closed unanswered before the run gives up on it
UNANSWERED_ATTEMPTS = 4


@dataclass
class HTTPRunner:
    """OpenAI-compatible server at base_url (".../v1" or the server root). server_pid, when
    given, is sampled for peak RSS (the server's, not this client's)."""

    base_url: str
    system: str = "http"
    model: str | None = None  # None: the first model the server lists at /v1/models
    server_pid: int | None = None
    supports_json_schema: bool = True
    timeout_s: float = 1800.0
    # For servers without `ignore_eos`: EOS token ids biased by -100 when a request ignores EOS.
    eos_bias_ids: tuple[int, ...] = ()
    # Counts a prompt's tokens when the server reports no usage while streaming (llama-cpp-python)
    count_tokens: Callable[[str], int] | None = None
    # SGLang and forklm take `json_schema` as a JSON string, llama-server as an object.
    json_schema_as_string: bool = True
    extra_body: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        base = self.base_url.rstrip("/")
        self.v1_url = base if base.endswith("/v1") else base + "/v1"
        self.completions_url = self.v1_url + "/completions"

    def served_model(self) -> str:
        if self.model is None:
            models = httpx.get(self.v1_url + "/models", timeout=30).json().get("data") or []
            self.model = models[0]["id"] if models else "default"
        return self.model

    def supports(self, wl: Workload) -> bool:
        return self.supports_json_schema or all(r.json_schema is None for r in wl.requests)

    def run(self, wl: Workload) -> Metrics:
        rss = RSSSampler(self.server_pid)
        t0 = time.perf_counter()
        latencies, ttfts, usages = asyncio.run(rss.around(self._run_all(wl)))
        wall = time.perf_counter() - t0
        tpots = [tpot_ms(lat, ttft, u.completion_tokens)
                 for lat, ttft, u in zip(latencies, ttfts, usages)]
        out_tokens = sum(u.completion_tokens for u in usages)
        sent = sum(u.prompt_tokens for u in usages)
        reported = [u.cached_tokens for u in usages if u.cached_tokens is not None]
        # Without a cache report every prompt token counts as computed (the conservative reading).
        computed = sent - sum(reported) if reported else sent
        return _metrics(self.system, wl, wall, out_tokens, latencies, ttfts, sent, computed,
                        peak_rss_mb=rss.peak_mb if self.server_pid else float("nan"),
                        tpots_ms=[t for t in tpots if t is not None])

    async def _run_all(self, wl: Workload) -> tuple[list[float], list[float], list[Usage]]:
        gate = asyncio.Semaphore(wl.max_in_flight)
        latencies: list[float] = []
        ttfts: list[float] = []
        usages: list[Usage] = []
        limits = httpx.Limits(max_connections=wl.max_in_flight + 4)
        async with httpx.AsyncClient(timeout=self.timeout_s, limits=limits) as client:

            async def one(prompt: str, req: Request) -> str:
                async with gate:
                    t0 = time.perf_counter()
                    usage, first = await self.complete(client, prompt, req)
                    latencies.append(time.perf_counter() - t0)
                    ttfts.append((first or time.perf_counter()) - t0)
                    if not usage.saw_usage and self.count_tokens is not None:
                        usage.prompt_tokens = self.count_tokens(prompt)
                    usages.append(usage)
                    return usage.text

            await drive(wl, one)
        return latencies, ttfts, usages

    def body(self, prompt: str, req: Request) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.served_model(), "prompt": prompt, "max_tokens": req.max_new_tokens,
            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True},
            "ignore_eos": req.ignore_eos, **self.extra_body,
        }
        if req.ignore_eos and self.eos_bias_ids:
            body["logit_bias"] = {str(i): -100.0 for i in self.eos_bias_ids}
        if req.json_schema is not None:
            body["json_schema"] = (json.dumps(req.json_schema) if self.json_schema_as_string
                                   else req.json_schema)  # SGLang's completions extension
        return body

    async def complete(self, client: httpx.AsyncClient, prompt: str,
                       req: Request) -> tuple[Usage, float | None]:
        """One streamed completion -> (usage, time of the first text chunk or None)."""
        for attempt in range(1, UNANSWERED_ATTEMPTS + 1):
            try:
                return await self._complete_once(client, prompt, req)
            except httpx.RemoteProtocolError as e:
                if "without sending a response" not in str(e) or attempt == UNANSWERED_ATTEMPTS:
                    raise
                # The server closed a pooled keep-alive connection as the request went out (seen
                # with llama-server, the next pooled one may be as stale): it was never
                # answered, so sending it again is safe.
                logging.warning("%s: %s; sending the request again", self.completions_url, e)
        raise AssertionError("unreachable")

    async def _complete_once(self, client: httpx.AsyncClient, prompt: str,
                             req: Request) -> tuple[Usage, float | None]:
        usage, first = Usage(), None
        pieces: list[str] = []
        async with client.stream("POST", self.completions_url, json=self.body(prompt, req)) as resp:
            if resp.status_code != 200:
                detail = (await resp.aread()).decode(errors="replace")[:500]
                raise RuntimeError(f"{self.completions_url} answered {resp.status_code}: {detail}")
            async for line in resp.aiter_lines():
                chunk = _sse_data(line)
                if chunk is None:
                    continue
                text = "".join(c.get("text") or "" for c in chunk.get("choices") or [])
                if text:
                    first = first or time.perf_counter()
                    pieces.append(text)
                    usage.num_chunks += 1
                _read_usage(chunk, usage)
        usage.text = "".join(pieces)
        if not usage.saw_usage:  # servers that send no usage when streaming: one chunk per token
            usage.completion_tokens = usage.num_chunks
        return usage, first


def _sse_data(line: str) -> dict[str, Any] | None:
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    if not data or data == "[DONE]":
        return None
    return json.loads(data)


def _read_usage(chunk: dict[str, Any], usage: Usage) -> None:
    """Token counts from `usage` (OpenAI), and cached prompt tokens from
    `usage.prompt_tokens_details.cached_tokens`, llama.cpp's `timings.cache_n`, or `tokens_cached`."""
    u = chunk.get("usage")
    if u:
        usage.saw_usage = True
        usage.completion_tokens = int(u.get("completion_tokens") or 0)
        usage.prompt_tokens = int(u.get("prompt_tokens") or 0)
        details = u.get("prompt_tokens_details") or {}
        if details.get("cached_tokens") is not None:
            usage.cached_tokens = int(details["cached_tokens"])
    timings = chunk.get("timings") or {}
    if timings.get("cache_n") is not None:
        usage.cached_tokens = int(timings["cache_n"])
    elif chunk.get("tokens_cached") is not None:
        usage.cached_tokens = int(chunk["tokens_cached"])


class RSSSampler:
    """Peak resident memory of a process (and its children) sampled every 0.2 s while a
    coroutine runs; falls back to the kernel's high-water mark (VmHWM) when it is higher."""

    def __init__(self, pid: int | None):
        self.pid, self.peak_mb = pid, 0.0

    async def around(self, coro: Any) -> Any:
        if self.pid is None:
            return await coro
        task = asyncio.ensure_future(coro)
        while not task.done():
            self._sample()
            await asyncio.wait([task], timeout=0.2)
        self._sample()
        return task.result()

    def _sample(self) -> None:
        import psutil

        try:
            proc = psutil.Process(self.pid)
            rss = proc.memory_info().rss + sum(c.memory_info().rss
                                               for c in proc.children(recursive=True))
        except psutil.Error:
            return
        self.peak_mb = max(self.peak_mb, rss / 2**20, _vm_hwm_mb(self.pid))


def _vm_hwm_mb(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0
