"""Benchmark runners, all reporting the same metrics: the in-process forklm Engine, and Hugging Face
transformers baselines (one request at a time, and static padded batches: the naive batching
continuous batching replaces)."""

from __future__ import annotations

import asyncio
import resource
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

from benchmarks.workloads import Request, Workload


@dataclass
class Metrics:
    system: str
    workload: str
    wall_s: float
    output_tokens_per_s: float
    requests_per_s: float
    median_latency_s: float
    p99_latency_s: float
    median_ttft_s: float
    prompt_tokens_sent: int
    prompt_tokens_computed: int
    peak_rss_mb: float
    # Median over requests of (latency - TTFT) / (output tokens - 1): decode time per token after
    # the first; nan where a runner cannot see the first token (transformers' generate).
    median_tpot_ms: float = float("nan")

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _metrics(system: str, wl: Workload, wall: float, out_tokens: int, latencies: list[float],
             ttfts: list[float], sent: int, computed: int,
             peak_rss_mb: float | None = None, tpots_ms: list[float] | None = None) -> Metrics:
    """Peak RSS is this process's unless the caller measured a server's (peak_rss_mb)."""
    lat = sorted(latencies)
    if peak_rss_mb is None:
        peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return Metrics(
        system=system, workload=wl.name, wall_s=wall, output_tokens_per_s=out_tokens / wall,
        requests_per_s=len(lat) / wall, median_latency_s=statistics.median(lat),
        p99_latency_s=lat[min(len(lat) - 1, int(0.99 * len(lat)))],
        median_ttft_s=statistics.median(ttfts) if ttfts else float("nan"),
        prompt_tokens_sent=sent, prompt_tokens_computed=computed,
        peak_rss_mb=peak_rss_mb,
        median_tpot_ms=statistics.median(tpots_ms) if tpots_ms else float("nan"),
    )


def tpot_ms(latency_s: float, ttft_s: float, num_tokens: int) -> float | None:
    """Time per output token after the first, in ms; None for a request of fewer than 2 tokens."""
    return 1000 * (latency_s - ttft_s) / (num_tokens - 1) if num_tokens >= 2 else None


class EngineRunner:
    """forklm's Engine in this process; max_in_flight requests at a time, streaming for TTFT."""

    def __init__(self, engine: Any, system: str = "forklm"):
        self.engine, self.system = engine, system
        self.warm = False

    @staticmethod
    def supports(wl: Workload) -> bool:
        return True

    def run(self, wl: Workload) -> Metrics:
        if not self.warm:
            self._wait_for_idle_work()
        self.engine.flush_cache()
        before = self.engine.stats()
        t0 = time.perf_counter()
        latencies, ttfts, tpots, out_tokens = asyncio.run(self._run_all(wl))
        wall = time.perf_counter() - t0
        after = self.engine.stats()
        sent = after["prompt_tokens"] - before["prompt_tokens"]
        cached = after["cache_hit_tokens"] - before["cache_hit_tokens"]
        return _metrics(self.system, wl, wall, out_tokens, latencies, ttfts, sent, sent - cached,
                        tpots_ms=tpots)

    def _wait_for_idle_work(self, timeout_s: float = 300.0) -> None:
        """Measure the engine as a server runs after its start: once the work it leaves to idle
        time is done (the weights moved into huge pages: ~6% of a 1B's decode step)."""
        t0 = time.monotonic()
        while self.engine.stats()["idle_work_left"] and time.monotonic() - t0 < timeout_s:
            time.sleep(0.1)
        left = self.engine.stats()["idle_work_left"]
        print(f"  {self.system}: waited {time.monotonic() - t0:.1f} s for its idle work"
              + (f" ({left} left)" if left else ""), flush=True)
        self.warm = True

    async def _run_all(self, wl: Workload) -> tuple[list[float], list[float], list[float], int]:
        gate = asyncio.Semaphore(wl.max_in_flight)
        latencies: list[float] = []
        ttfts: list[float] = []
        tpots: list[float] = []
        tokens = [0]

        async def one(prompt: str, req: Request) -> str:
            async with gate:
                t0 = time.perf_counter()
                params: dict[str, Any] = {"temperature": 0, "max_new_tokens": req.max_new_tokens,
                                          "ignore_eos": req.ignore_eos}
                if req.json_schema is not None:
                    params["json_schema"] = req.json_schema
                text, first, num_tokens = [], None, 0
                async for chunk in await self.engine.async_generate(prompt, params, stream=True):
                    first = first or time.perf_counter()
                    text.append(chunk["text"])
                    num_tokens += len(chunk["output_ids"])
                latencies.append(time.perf_counter() - t0)
                ttfts.append((first or time.perf_counter()) - t0)
                tokens[0] += num_tokens
                tpot = tpot_ms(latencies[-1], ttfts[-1], num_tokens)
                if tpot is not None:
                    tpots.append(tpot)
                return "".join(text)

        await drive(wl, one)
        return latencies, ttfts, tpots, tokens[0]


def _conversations(wl: Workload) -> dict[int, list[Request]]:
    convs: dict[int, list[Request]] = {}
    for r in sorted(wl.requests, key=lambda r: (r.conversation, r.turn)):
        convs.setdefault(r.conversation or 0, []).append(r)
    return convs


async def drive(wl: Workload, one: Any) -> None:
    """Send a workload's requests through `one(prompt, req) -> answer text`: all requests at once
    (the caller's gate bounds how many are in flight), or for multi-turn workloads each
    conversation's turns in order (turn k's prompt = turn k-1's prompt + answer + question)."""
    if not wl.multi_turn:
        await asyncio.gather(*(one(r.prompt, r) for r in wl.requests))
        return

    async def conversation(turns: list[Request]) -> None:
        history = ""
        for req in turns:
            prompt = history + req.prompt
            history = prompt + await one(prompt, req) + "\n"

    await asyncio.gather(*(conversation(turns) for turns in _conversations(wl).values()))


class HFRunner:
    """transformers generate on the same weights: batch_size 1 (one at a time) or static padded
    batches (left padding; every request in a batch waits for the longest)."""

    def __init__(self, model: Any, tokenizer: Any, batch_size: int):
        self.model, self.tokenizer, self.batch_size = model, tokenizer, batch_size
        self.system = f"transformers batch {batch_size}"

    @staticmethod
    def supports(wl: Workload) -> bool:
        return all(r.json_schema is None for r in wl.requests)  # no constrained decoding here

    def run(self, wl: Workload) -> Metrics:
        import torch

        tok = self.tokenizer
        tok.padding_side = "left"
        latencies: list[float] = []
        out_tokens = sent = 0
        t0 = time.perf_counter()
        history = {c: "" for c in _conversations(wl)}
        batches = _batches(wl, self.batch_size)
        for batch in batches:
            prompts = [history[r.conversation] + r.prompt if wl.multi_turn else r.prompt
                       for r in batch]
            enc = tok(prompts, return_tensors="pt", padding=True)
            sent += int(enc["attention_mask"].sum())
            start = time.perf_counter()
            with torch.inference_mode():
                out = self.model.generate(**enc, do_sample=False,
                                          max_new_tokens=batch[0].max_new_tokens,
                                          min_new_tokens=batch[0].max_new_tokens
                                          if batch[0].ignore_eos else None,
                                          pad_token_id=tok.pad_token_id)
            new = out[:, enc["input_ids"].shape[1]:]
            out_tokens += new.numel()
            latencies += [time.perf_counter() - start] * len(batch)
            if wl.multi_turn:
                for r, p, ids in zip(batch, prompts, new):
                    history[r.conversation] = p + tok.decode(ids, skip_special_tokens=True) + "\n"
        wall = time.perf_counter() - t0
        return _metrics(self.system, wl, wall, out_tokens, latencies, [], sent, sent)


def _batches(wl: Workload, size: int) -> list[list[Request]]:
    """Static batches in submission order; for multi-turn, turn by turn (a turn's batch starts
    only after every conversation's previous turn is answered)."""
    groups: dict[int, list[Request]] = {}
    for r in wl.requests:
        groups.setdefault(r.turn if wl.multi_turn else 0, []).append(r)
    return [g[i : i + size] for _, g in sorted(groups.items()) for i in range(0, len(g), size)]
