"""Start-up (issue 39): launch -> ready and launch -> first token for `forklm serve` and
llama.cpp's `llama-server` on the same GGUF, runs alternating between them.

- ready: from starting the process (benchmarks/servers.py's ServerProcess, with the servers'
  usual flags) to the first `GET /health` that answers 200 (polled every 10 ms);
- first token: from starting the process to the first streamed token of a completion sent the
  moment it is ready (what a harness that starts a server per task feels);
- first / later TTFT: the first request's time to first token against the median of the next
  ones (the first request must not pay for warm-up).

Also `Engine()` in process (the engine alone, after its imports) and, with `--importtime`, the
slowest imports of `forklm serve`'s start-up path (`python -X importtime`).

Run: `python -m benchmarks.startup [--model FILE] [--runs 5] [--llama-server PATH] [--importtime]`.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field

import httpx

from benchmarks.report import machine
from benchmarks.servers import ServerProcess, default_gguf, forklm_server, llama_server

POLL_S = 0.01  # between health checks
PROMPT = "Once upon a time, in a small village by the sea,"
LATER_REQUESTS = 5
WARM_UP_LINGER_S = 10.0  # the unmeasured first start's idle time, for its caches


@dataclass
class StartupRun:
    ready_s: float
    first_token_s: float
    first_ttft_s: float
    later_ttft_s: float


@dataclass
class SystemRuns:
    name: str
    runs: list[StartupRun] = field(default_factory=list)

    def median(self, attr: str) -> float:
        return statistics.median(getattr(r, attr) for r in self.runs)


def _ttft(base_url: str, model: str) -> float:
    """Seconds to the first streamed token of one completion."""
    body = {"model": model,  "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "stream": True}
    t0 = time.perf_counter()
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=120) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            # the first chunk with a token, decoded or not
            if (line.startswith("data: ") and line != "data: [DONE]"
                    and json.loads(line[6:]).get("choices")):
                return time.perf_counter() - t0
    raise RuntimeError(f"{base_url}: no token streamed")


def launch_once(server: ServerProcess, linger_s: float = 0.0) -> StartupRun:
    """Start `server`, time it to ready and to its first token, stop it (after `linger_s` more
    seconds: an engine's idle work writes the K-quant records cache)."""
    server.poll_s = POLL_S
    t0 = time.perf_counter()
    with server:  # returns once /health answers 200
        ready = time.perf_counter() - t0
        model = httpx.get(server.base_url + "/v1/models").json()["data"][0]["id"]
        first_ttft = _ttft(server.base_url, model)
        first_token = time.perf_counter() - t0
        later = statistics.median(_ttft(server.base_url, model) for _ in range(LATER_REQUESTS))
        time.sleep(linger_s)
    return StartupRun(ready, first_token, first_ttft, later)


def engine_in_process(model: str) -> float:
    """Seconds of `Engine(model_path=model)` in a fresh process, after its imports."""
    code = ("import time; from forklm import Engine; t = time.perf_counter(); "
            f"e = Engine(model_path={model!r}); print(time.perf_counter() - t); e.shutdown()")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def slowest_imports(top: int = 12) -> list[tuple[float, str]]:
    """(cumulative seconds, module) of the slowest imports of the server's start-up path."""
    code = "import forklm.cli, forklm.server.app"
    out = subprocess.run([sys.executable, "-X", "importtime", "-c", code], capture_output=True,
                         text=True, check=True)
    rows = []
    for line in out.stderr.splitlines():
        parts = line.removeprefix("import time:").split("|")
        if len(parts) == 3 and parts[1].strip().isdigit():
            rows.append((int(parts[1]) / 1e6, parts[2].rstrip()))
    return sorted(rows, reverse=True)[:top]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(default_gguf()), help="GGUF file (default model)")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--llama-server", default="/tmp/llama-server-build/bin/llama-server")
    ap.add_argument("--importtime", action="store_true")
    args = ap.parse_args()
    systems = {"forklm serve": lambda: forklm_server(["--model-path", args.model])}
    if pathlib.Path(args.llama_server).exists():
        systems["llama-server -np 8"] = lambda: llama_server(args.llama_server, 8,
                                                             model=args.model)
    else:
        print(f"(no llama-server at {args.llama_server}: forklm only)")
    results = {name: SystemRuns(name) for name in systems}
    # unmeasured: fills the caches (config and tokenizer, kernels, K-quant records, page cache)
    launch_once(systems["forklm serve"](), linger_s=WARM_UP_LINGER_S)
    for _ in range(args.runs):
        for name, server in systems.items():
            results[name].runs.append(launch_once(server()))
    engine_s = [engine_in_process(args.model) for _ in range(3)]
    print(f"# start-up, {pathlib.Path(args.model).name}; {machine()}; medians of {args.runs} "
          "alternating runs, warm caches\n")
    print("| system | launch -> /health 200 (s) | launch -> first token (s) | first TTFT (ms) "
          "| later TTFT (ms) |")
    print("|---|---|---|---|---|")
    for runs in results.values():
        print(f"| {runs.name} | {runs.median('ready_s'):.2f} | {runs.median('first_token_s'):.2f} "
              f"| {1000 * runs.median('first_ttft_s'):.0f} "
              f"| {1000 * runs.median('later_ttft_s'):.0f} |")
    print(f"\nEngine() in process, after its imports: {statistics.median(engine_s):.2f} s "
          f"(runs: {', '.join(f'{s:.2f}' for s in engine_s)})")
    if args.importtime:
        print("\nslowest imports of `forklm serve` (cumulative s):")
        for seconds, module in slowest_imports():
            print(f"  {seconds:6.3f}  {module}")


if __name__ == "__main__":
    main()
