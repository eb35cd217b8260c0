"""Data-parallel routing: `forklm serve --dp-size 2` under each load-balance method vs one replica,
on W1 (shared prefix) and W3 (multi-turn), through the HTTP runner (streaming /v1/completions).

  python -m benchmarks.dp_routing [--w1-requests 32] [--w3-conversations 8] [--w3-turns 3]
      [--new-tokens 16] [--dtype float32]

Each configuration is a fresh server (cold caches). Reports throughput, the prompt-token cache
hit rate the server reports (cached / sent), and for dp_size=2 how the router spread requests.
The goal (issue 19): cache_aware keeps >= 90% of the single-replica hit rate.
"""

from __future__ import annotations

import argparse

import httpx

from benchmarks.http_runner import HTTPRunner
from benchmarks.runners import Metrics
from benchmarks.servers import forklm_server
from benchmarks.tensor_parallel import cpu_name
from benchmarks.workloads import Workload, multi_turn, shared_prefix
from forklm.runtime.config import cpu_flags

CONFIGS = [(1, None), (2, "round_robin"), (2, "shortest_queue"), (2, "cache_aware")]


def workloads(args: argparse.Namespace) -> list[Workload]:
    w1 = shared_prefix(num_requests=args.w1_requests)
    w3 = multi_turn(num_conversations=args.w3_conversations, num_turns=args.w3_turns)
    for wl in (w1, w3):
        for req in wl.requests:
            req.max_new_tokens = args.new_tokens
    return [w1, w3]


def routed(base_url: str) -> list[int]:
    info = httpx.get(base_url + "/get_server_info", timeout=30).json()
    return [r["routed"] for r in info.get("replicas", [])]


def run_config(dp_size: int, method: str | None, args: argparse.Namespace) -> list[dict]:
    flags = ["--dtype", args.dtype, "--max-total-tokens", str(args.max_total_tokens),
             "--dp-size", str(dp_size)]
    if method:
        flags += ["--load-balance-method", method]
    rows = []
    with forklm_server(flags) as server:
        for wl in workloads(args):
            before = routed(server.base_url)
            m = HTTPRunner(server.base_url, system=f"dp={dp_size} {method or '-'}",
                           server_pid=server.pid).run(wl)
            rows.append(policy_row(m, before, routed(server.base_url)))
    return rows


def policy_row(m: Metrics, before: list[int], after: list[int]) -> dict:
    """One table row: throughput, TTFT, the prompt-token cache hit rate, and how a per-replica
    counter grew during the run (its spread over the replicas)."""
    return {"config": m.system, "workload": m.workload.split()[0],
            "tok_s": m.output_tokens_per_s, "median_ttft_s": m.median_ttft_s,
            "hit": 1 - m.prompt_tokens_computed / max(m.prompt_tokens_sent, 1),
            "spread": "/".join(str(a - b) for a, b in zip(after, before)) or "-"}


def print_policy_table(rows: list[dict], spread_header: str) -> None:
    """The rows by workload, each hit rate also as a share of its workload's dp=1 row."""
    reference = {r["workload"]: r["hit"] for r in rows if "dp=1" in r["config"].split()}
    print("| workload | config | output tok/s | median TTFT s | cache hit rate | vs dp=1 hit "
          f"| {spread_header} |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in sorted(rows, key=lambda r: r["workload"]):
        share = r["hit"] / reference[r["workload"]] if reference[r["workload"]] else float("nan")
        print(f"| {r['workload']} | {r['config']} | {r['tok_s']:.1f} | {r['median_ttft_s']:.2f} "
              f"| {r['hit']:.1%} | {share:.0%} | {r['spread']} |")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--w1-requests", type=int, default=32)
    p.add_argument("--w3-conversations", type=int, default=8)
    p.add_argument("--w3-turns", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--max-total-tokens", type=int, default=16384)
    p.add_argument("--dtype", default="float32")
    args = p.parse_args()
    isa = "AVX-512-bf16" if "avx512_bf16" in cpu_flags() else "AVX2"
    print(f"{cpu_name()} ({isa}); {vars(args)}")
    print_policy_table([row for dp, method in CONFIGS for row in run_config(dp, method, args)],
                       "requests per replica")


if __name__ == "__main__":
    main()
