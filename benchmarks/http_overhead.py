"""Per-token cost of the HTTP server at batch 1: one `forklm serve` started once and an Engine in
this process, the same prompts (S1's: ~400 words, 64 tokens, greedy, ignore_eos) sent one at a
time, the modes interleaved round by round so a shared machine's noise hits them alike.

  python -m benchmarks.http_overhead --rounds 6 [--modes inproc,http,raw,http-old]
      [--old-governor old_cpu_threads.py] [--no-governor] [--hog N]

Modes: `inproc` streams from the Engine in this process; `http` streams /v1/completions with
httpx as the benchmark's HTTP runner does (json.loads of every event); `raw` streams the same
request over a plain socket and only counts events (what the client costs, by difference).
Per request it reports ms/token after the first, and for HTTP modes the server's threads: CPU
ms and involuntary context switches per token, and the engine's `cpu_threads` (the
ThreadGovernor's choice) after the request."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from typing import Any

import httpx

from benchmarks.runners import tpot_ms
from benchmarks.servers import forklm_server
from benchmarks.workloads import no_sharing

MAX_TOKENS = 64
# Run in the server (and this process) before forklm's engine starts: each ThreadGovernor thread
# count change is logged as a `GOVERNOR n` line; with --no-governor no governor is made.
PRELUDE = """
import sys, forklm.runtime.cpu_threads as c, forklm.runtime.engine.loop as el
use = c.ThreadGovernor._use
def logged(self, n):
    print("GOVERNOR", n, file=sys.stderr, flush=True)
    use(self, n)
c.ThreadGovernor._use = logged
if {off}:
    el.thread_governor = lambda *a, **k: None
if {old!r}:  # another version's governor: git show REV:runtime/cpu_threads.py > FILE
    import types
    old = types.ModuleType("old_cpu_threads")
    sys.modules[old.__name__] = old
    exec(open({old!r}).read(), old.__dict__)
    old.ThreadGovernor._use = logged
    el.thread_governor = old.thread_governor
"""


def thread_stats(pid: int) -> dict[int, tuple[float, int, float]]:
    """tid -> (CPU seconds, involuntary context switches, seconds runnable but waiting for a
    core) of every thread of pid; the main thread (the server's event loop) under tid -1."""
    out: dict[int, tuple[float, int, float]] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                cpu_ns, wait_ns = map(int, f.read().split()[:2])
            with open(f"/proc/{pid}/task/{tid}/status") as f:
                nv = next(int(line.split()[1]) for line in f
                          if line.startswith("nonvoluntary_ctxt_switches"))
        except (OSError, StopIteration):
            continue
        out[-1 if int(tid) == pid else int(tid)] = (cpu_ns / 1e9, nv, wait_ns / 1e9)
    return out


def diff(before: dict[int, tuple[float, int, float]], after: dict[int, tuple[float, int, float]]
         ) -> list[tuple[float, int, float]]:
    """Per-thread (CPU s, involuntary switches, wait s) during the interval: the event loop's
    first, then the others busiest first."""
    zero = (0.0, 0, 0.0)
    rows = {t: tuple(x - y for x, y in zip(a, before.get(t, zero))) for t, a in after.items()}
    loop = rows.pop(-1, zero)
    return [loop, *sorted(rows.values(), reverse=True)]  # type: ignore[list-item]


async def http_request(client: httpx.AsyncClient, url: str, prompt: str) -> tuple[float, float,
                                                                                 int, str]:
    body = {"model": "default", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    t0, first, pieces, n = time.perf_counter(), None, [], 0
    async with client.stream("POST", url + "/v1/completions", json=body) as resp:
        async for line in resp.aiter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            text = "".join(c.get("text") or "" for c in chunk.get("choices") or [])
            if text:
                first = first or time.perf_counter()
                pieces.append(text)
            if chunk.get("usage"):
                n = chunk["usage"]["completion_tokens"]
    end = time.perf_counter()
    return end - t0, (first or end) - t0, n, "".join(pieces)


def raw_request(port: int, prompt: str) -> tuple[float, float, int, str]:
    """The same request over a socket; counts `data:` events, parses nothing but the last."""
    body = json.dumps({"model": "default", "prompt": prompt, "max_tokens": MAX_TOKENS,
                       "temperature": 0.0, "stream": True, "ignore_eos": True}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
            f"application/json\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n")
    t0, first, events, data = time.perf_counter(), None, 0, b""
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(head.encode() + body)
        while True:
            buf = s.recv(65536)
            if not buf:
                break
            k = buf.count(b"data: {")
            if k:
                first = first or time.perf_counter()
                events += k
            data += buf
    end = time.perf_counter()
    return end - t0, (first or end) - t0, events, ""


def inproc_request(engine: Any, prompt: str) -> tuple[float, float, int, str]:
    async def go() -> tuple[float, float, int, str]:
        params = {"temperature": 0, "max_new_tokens": MAX_TOKENS, "ignore_eos": True}
        t0, first, n, pieces = time.perf_counter(), None, 0, []
        async for chunk in await engine.async_generate(prompt, params, stream=True):
            first = first or time.perf_counter()
            pieces.append(chunk["text"])
            n += len(chunk["output_ids"])
        end = time.perf_counter()
        return end - t0, (first or end) - t0, n, "".join(pieces)

    return asyncio.run(go())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--modes", default="inproc,http,raw")
    ap.add_argument("--server-env", action="append", default=[], help="K=V for the server")
    ap.add_argument("--server-flags", default="", help="extra `forklm serve` flags")
    ap.add_argument("--no-governor", action="store_true", help="no ThreadGovernor anywhere")
    ap.add_argument("--old-governor", default="", help="a cpu_threads.py whose governor the "
                    "`-old` modes' server runs (http-old, raw-old)")
    ap.add_argument("--hog", type=int, default=0, help="busy-loop processes beside the run")
    args = ap.parse_args()
    modes = args.modes.split(",")
    prompts = [r.prompt for r in no_sharing(args.rounds * len(modes) + 1).requests]
    prelude = PRELUDE.format(off=args.no_governor, old="")
    server = make_server(args, prelude)
    old: Any = (make_server(args, PRELUDE.format(off=False, old=args.old_governor))
                if args.old_governor else None)
    engine: Any = None
    if "inproc" in modes:
        exec(prelude, {})
        from forklm import Engine

        engine = Engine()
    results: dict[str, list[float]] = {m: [] for m in modes}
    texts: dict[str, dict[int, str]] = {m: {} for m in modes}
    wait_pct: dict[str, list[float]] = {m: [] for m in modes}
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
            for _ in range(args.hog)]
    with server, old or contextlib.nullcontext():

        async def http_one(url: str, prompt: str) -> tuple[float, float, int, str]:
            async with httpx.AsyncClient(timeout=600) as client:
                return await http_request(client, url, prompt)

        for mode in modes:  # warm up each path once (first-request compiles, caches)
            run_one(mode, engine, old if mode.endswith("-old") else server, http_one,
                    prompts[-1])
        for r in range(args.rounds):
            order = modes[r % len(modes):] + modes[:r % len(modes)]
            for mode in order:
                prompt = prompts[r]
                target = old if mode.endswith("-old") else server
                pid = os.getpid() if mode == "inproc" else target.pid
                before, cpu0 = thread_stats(pid), time.process_time()
                lat, ttft, n, text = run_one(mode, engine, target, http_one, prompt)
                after, client_s = thread_stats(pid), time.process_time() - cpu0
                eng = diff(before, after)[1]  # the engine thread: the busiest but the loop
                wait_pct[mode].append(100 * eng[2] / lat)
                tpot = tpot_ms(lat, ttft, n) or float("nan")
                results[mode].append(tpot)
                texts[mode][r] = text
                line = (f"round {r} {mode:7s} {tpot:6.2f} ms/token ({n} tokens) engine thread "
                        f"waits {100 * eng[2] / lat:4.1f}% invol {eng[1] / lat:5.0f}/s")
                if mode != "inproc":
                    info = httpx.get(target.base_url + "/get_server_info", timeout=30).json()
                    threads = info["internal_states"][0].get("cpu_threads")
                    top = diff(before, after)[:4]
                    line += (f"  server cpu ms/tok loop,rest "
                             f"{[round(1000 * t[0] / n, 2) for t in top]} "
                             f"invol/tok {[round(t[1] / n, 2) for t in top]} "
                             f"client cpu {1000 * client_s / n:.2f} ms/tok "
                             f"cpu_threads={threads} governor changes "
                             f"{target.log_tail(10**7).count('GOVERNOR')}")
                else:
                    line += f"  cpu_threads={engine.stats().get('cpu_threads')}"
                print(line, flush=True)
    for mode in modes:
        print(f"{mode:7s} median {statistics.median(results[mode]):6.2f} ms/token  "
              f"all {[round(x, 2) for x in results[mode]]}  engine thread waits (median) "
              f"{statistics.median(wait_pct[mode]):.1f}%")
    for mode in modes:
        if mode.startswith("http") and "inproc" in texts:
            same = all(texts["inproc"][r] == texts[mode][r] for r in texts[mode])
            print(f"{mode} text == inproc text:", same)
    print("load average:", os.getloadavg())
    if engine is not None:
        engine.shutdown()
    for hog in hogs:
        hog.kill()


def make_server(args: argparse.Namespace, prelude: str) -> Any:
    server = forklm_server(args.server_flags.split() or None)
    server.env.update(dict(kv.split("=", 1) for kv in args.server_env))
    i = server.command.index("-m")  # python -m forklm serve ... -> python -c prelude+run ...
    server.command[i:i + 2] = ["-c", prelude + "\nimport runpy; runpy.run_module('forklm', "
                               "run_name='__main__', alter_sys=True)"]
    return server


def run_one(mode: str, engine: Any, server: Any, http_one: Any, prompt: str
            ) -> tuple[float, float, int, str]:
    kind = mode.removesuffix("-old")
    if kind == "inproc":
        return inproc_request(engine, prompt)
    if kind == "http":
        return asyncio.run(http_one(server.base_url, prompt))
    if kind == "raw":
        return raw_request(server.port, prompt)
    raise ValueError(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main()
