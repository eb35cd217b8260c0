"""Soak/fault run for issue 16 (no cheap request may stall, starve or poison the server): ordinary
greedy chat and /generate requests alone, then the same traffic with the issue's hostile requests
mixed in (each sent a bounded number of times, with timeouts, loopback only). Reports the ordinary
requests' p50/p99 latency and correctness per phase, 5xx answers, hostile requests that hung,
admission slots and KV still held after the traffic, and the server's RSS growth.

    python -m benchmarks.hostile_soak [--duration 60] [--base-url URL --server-pid PID]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

import httpx

from benchmarks.hostile_requests import HostileRequest, hostile_requests

ORDINARY_PROMPTS = ["The capital of France is", "Name three colors:", "def add(a, b):",
                    "Once upon a time,"]


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100) by linear interpolation between closest ranks; nan if empty."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


@dataclass
class PhaseStats:
    """The ordinary requests of one phase: seconds per answered request, wrong outputs (text
    other than the first seen for the same endpoint and prompt) and failures by kind."""

    name: str
    latencies: list[float] = field(default_factory=list)
    mismatches: int = 0
    failures: dict[str, int] = field(default_factory=dict)

    def fail(self, kind: str) -> None:
        self.failures[kind] = self.failures.get(kind, 0) + 1


@dataclass
class HostileOutcome:
    """Answers to one hostile request: status codes (or 'timeout', 'abandoned', an error name)
    and the slowest answer's seconds."""

    request: HostileRequest
    answers: list[str] = field(default_factory=list)
    max_s: float = 0.0

    @property
    def hung(self) -> int:
        return self.answers.count("timeout")


@dataclass
class Soak:
    """Ordinary and hostile traffic against base_url; outputs are compared across both phases."""

    base_url: str
    concurrency: int = 3
    max_tokens: int = 8
    ordinary_timeout_s: float = 60.0
    hostile_timeout_s: float = 30.0
    rounds: int = 4
    model: str = "default"
    reference: dict[tuple[str, str], str] = field(default_factory=dict)
    status_5xx: int = 0

    async def ordinary_once(self, client: httpx.AsyncClient, i: int, stats: PhaseStats) -> None:
        prompt = ORDINARY_PROMPTS[i % len(ORDINARY_PROMPTS)]
        chat = (i // len(ORDINARY_PROMPTS)) % 2 == 0
        path, body = (("/v1/chat/completions", {
            "model": self.model, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": self.max_tokens, "temperature": 0}) if chat else ("/generate", {
                "text": prompt, "sampling_params": {"max_new_tokens": self.max_tokens,
                                                    "temperature": 0}}))
        start = time.perf_counter()
        try:
            reply = await client.post(path, json=body, timeout=self.ordinary_timeout_s)
        except httpx.TimeoutException:
            stats.fail("timeout")
            return
        except httpx.HTTPError as e:
            stats.fail(type(e).__name__)
            await asyncio.sleep(0.5)  # a refused connection: do not spin
            return
        seconds = time.perf_counter() - start
        self.status_5xx += reply.status_code >= 500
        if reply.status_code != 200:
            stats.fail(str(reply.status_code))
            return
        data = reply.json()
        text = data["choices"][0]["message"]["content"] if chat else data["text"]
        stats.latencies.append(seconds)
        stats.mismatches += self.reference.setdefault((path, prompt), text) != text

    async def ordinary(self, client: httpx.AsyncClient, stats: PhaseStats, end: float) -> None:
        async def worker(w: int) -> None:
            i = w
            while time.monotonic() < end:
                await self.ordinary_once(client, i, stats)
                i += self.concurrency

        await asyncio.gather(*(worker(w) for w in range(self.concurrency)))

    async def hostile_once(self, client: httpx.AsyncClient, outcome: HostileOutcome) -> None:
        req = outcome.request
        timeout = req.abandon_s or self.hostile_timeout_s
        start = time.perf_counter()
        try:
            answer = await self._send(client, req, timeout)
        except httpx.TimeoutException:
            answer = "abandoned" if req.abandon_s else "timeout"
        except httpx.HTTPError as e:
            answer = type(e).__name__
        outcome.max_s = max(outcome.max_s, time.perf_counter() - start)
        outcome.answers.append(answer)

    async def _send(self, client: httpx.AsyncClient, req: HostileRequest, timeout: float) -> str:
        kwargs: dict[str, Any] = {"timeout": timeout, "headers": req.headers}
        if req.raw is not None:
            kwargs["content"] = req.raw
            kwargs["headers"] = {"content-type": "application/json", **req.headers}
        elif req.body is not None:
            kwargs["json"] = req.body
        async with client.stream(req.method, req.path, **kwargs) as reply:
            self.status_5xx += reply.status_code >= 500
            if req.disconnect and reply.status_code == 200:
                async for line in reply.aiter_lines():
                    if line:
                        return "200-left"  # leave mid-stream: closing drops the connection
            content = await reply.aread()
        if reply.status_code == 200 and req.path == "/v1/programs/run" and not req.disconnect:
            try:
                results = json.loads(content).get("results") or []
            except (ValueError, AttributeError):
                return "200 not JSON"
            if any(isinstance(item, dict) and item.get("error") for item in results):
                return "200 item error"  # a program refused while running answers 200
        return str(reply.status_code)

    async def hostile(self, client: httpx.AsyncClient, outcomes: list[HostileOutcome],
                      end: float) -> None:
        """`rounds` rounds spread over the phase (round r starts r/rounds of the way in, or when
        the one before ends); in each, every hostile request is sent `times` times, two at a
        time. Nothing starts after `end`."""
        gate = asyncio.Semaphore(2)
        start = time.monotonic()

        async def one(outcome: HostileOutcome) -> None:
            async with gate:
                if time.monotonic() < end:
                    await self.hostile_once(client, outcome)

        for r in range(self.rounds):
            await asyncio.sleep(max(0.0, start + r * (end - start) / self.rounds
                                    - time.monotonic()))
            await asyncio.gather(*(one(o) for o in outcomes for _ in range(o.request.times)))

    async def phase(self, name: str, duration_s: float,
                    outcomes: list[HostileOutcome] | None) -> PhaseStats:
        stats = PhaseStats(name)
        end = time.monotonic() + duration_s
        limits = httpx.Limits(max_connections=self.concurrency + 8)
        async with httpx.AsyncClient(base_url=self.base_url, limits=limits) as client:
            tasks = [self.ordinary(client, stats, end)]
            if outcomes is not None:
                tasks.append(self.hostile(client, outcomes, end))
            await asyncio.gather(*tasks)
        return stats


def server_state(base_url: str, settle_s: float = 30.0) -> dict[str, Any]:
    """Admission and engine counters once idle: polled until nothing is admitted or running, or
    settle_s passes (what is still held then is leaked)."""
    deadline = time.monotonic() + settle_s
    while True:
        try:
            info = httpx.get(base_url + "/get_server_info", timeout=30).json()
            state = info["internal_states"][0]
        except (httpx.HTTPError, ValueError, KeyError) as e:
            return {"error": repr(e)}
        idle = not state.get("admitted_requests") and not state.get("running")
        if idle or time.monotonic() > deadline:
            return state
        time.sleep(0.5)


def rss_mb(pid: int | None) -> float:
    if pid is None:
        return float("nan")
    import psutil

    try:
        proc = psutil.Process(pid)
        return (proc.memory_info().rss + sum(c.memory_info().rss
                                             for c in proc.children(recursive=True))) / 2**20
    except psutil.Error:
        return float("nan")


def phase_table(phases: list[PhaseStats]) -> str:
    rows = ["| phase | ordinary answered | p50 s | p99 s | max s | wrong outputs | failed |",
            "| --- | --- | --- | --- | --- | --- | --- |"]
    for p in phases:
        failed = ", ".join(f"{k}: {v}" for k, v in sorted(p.failures.items())) or "0"
        rows.append(f"| {p.name} | {len(p.latencies)} | {percentile(p.latencies, 50):.2f} | "
                    f"{percentile(p.latencies, 99):.2f} | {max(p.latencies, default=0):.2f} | "
                    f"{p.mismatches} | {failed} |")
    return "\n".join(rows)


def hostile_table(outcomes: list[HostileOutcome]) -> str:
    rows = ["| hostile request | answers | slowest s | hung |", "| --- | --- | --- | --- |"]
    for o in outcomes:
        counts: dict[str, int] = {}
        for a in o.answers:
            counts[a] = counts.get(a, 0) + 1
        answers = ", ".join(f"{k} x{v}" for k, v in counts.items()) or "not sent"
        name = o.request.name.replace("|", "\\|")
        rows.append(f"| {name} | {answers} | {o.max_s:.2f} | {o.hung} |")
    return "\n".join(rows)


def summary_table(soak: Soak, outcomes: list[HostileOutcome], state: dict[str, Any],
                  rss: list[float]) -> str:
    keys = ("admitted_requests", "running", "waiting", "kv_used")
    held = ", ".join(f"{k} {state.get(k, '?')}" for k in keys) if "error" not in state \
        else state["error"]
    return "\n".join([
        "| measure | value |", "| --- | --- |",
        f"| 5xx answers (any request) | {soak.status_5xx} |",
        f"| hostile requests past their {soak.hostile_timeout_s:.0f} s timeout | "
        f"{sum(o.hung for o in outcomes)} |",
        f"| after the traffic (30 s to settle) | {held} |",
        f"| server RSS MB: start / after ordinary / after hostile | "
        f"{rss[0]:.0f} / {rss[1]:.0f} / {rss[2]:.0f} (growth {rss[2] - rss[0]:+.0f}) |"])


def run(base_url: str, server_pid: int | None, duration_s: float, concurrency: int,
        rounds: int) -> str:
    host = urlparse(base_url).hostname
    assert host in ("127.0.0.1", "localhost", "::1"), f"loopback only, not {host!r}"
    models = httpx.get(base_url + "/v1/models", timeout=30).json().get("data") or []
    soak = Soak(base_url, concurrency=concurrency, rounds=rounds,
                model=models[0]["id"] if models else "default")
    outcomes = [HostileOutcome(r) for r in hostile_requests()]
    rss = [rss_mb(server_pid)]
    quiet = asyncio.run(soak.phase("ordinary alone", duration_s, None))
    rss.append(rss_mb(server_pid))
    mixed = asyncio.run(soak.phase("ordinary + hostile", duration_s, outcomes))
    state = server_state(base_url)
    rss.append(rss_mb(server_pid))
    return "\n\n".join([phase_table([quiet, mixed]), summary_table(soak, outcomes, state, rss),
                        hostile_table(outcomes)])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration", type=float, default=60.0, help="seconds per phase")
    ap.add_argument("--concurrency", type=int, default=3, help="ordinary requests in flight")
    ap.add_argument("--rounds", type=int, default=4,
                    help="rounds of hostile requests spread over the second phase")
    ap.add_argument("--base-url", help="a running server on loopback (default: start one)")
    ap.add_argument("--server-pid", type=int, help="its pid, for RSS (with --base-url)")
    args = ap.parse_args()
    if args.base_url:
        print(run(args.base_url.rstrip("/"), args.server_pid, args.duration, args.concurrency,
                  args.rounds))
        return
    from benchmarks.servers import forklm_server

    with forklm_server() as server:
        print(run(server.base_url, server.pid, args.duration, args.concurrency,
                  args.rounds))


if __name__ == "__main__":
    main()
