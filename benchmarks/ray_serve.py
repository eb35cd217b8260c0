"""forklm on Ray Serve (forklm/ray_serve/): W1 and W3 through the Ray Serve ingress with one engine
replica, then two under each load-balance method, on a local Ray instance started here.

  python -m benchmarks.ray_serve [--w1-requests 16] [--w3-conversations 4] [--w3-turns 3]
      [--new-tokens 16] [--num-cpus 2]

Each configuration is a fresh deployment (cold caches). Reports throughput, the prompt-token cache
hit rate the replicas report in their streamed usage (cached / sent), and how the prompt tokens
split between the replicas (from each replica's engine stats).
"""

from __future__ import annotations

import argparse

import httpx

from benchmarks.dp_routing import policy_row, print_policy_table, workloads
from benchmarks.http_runner import HTTPRunner
from benchmarks.tensor_parallel import cpu_name
from forklm.runtime.child_process import free_port

CONFIGS = [(1, "cache_aware"), (2, "round_robin"), (2, "shortest_queue"), (2, "cache_aware")]
APP = "forklm_bench"


def prompt_tokens_per_replica(base_url: str) -> list[int]:
    info = httpx.get(base_url + "/get_server_info", timeout=60).json()
    return sorted((r["internal_state"] or {}).get("prompt_tokens", 0) for r in info["replicas"])


def run_config(base_url: str, dp_size: int, method: str, args: argparse.Namespace) -> list[dict]:
    from ray import serve

    from forklm.ray_serve.app import build_application
    from forklm.server.config import ServerConfig

    engine = {"dtype": args.dtype, "max_total_tokens": args.max_total_tokens, "num_threads": 1}
    serve.run(build_application(engine, ServerConfig(dp_size=dp_size,
                                                     load_balance_method=method)),
              name=APP, route_prefix="/")
    rows = []
    try:
        for wl in workloads(args):
            before = prompt_tokens_per_replica(base_url)
            m = HTTPRunner(base_url, system=f"ray dp={dp_size} {method}").run(wl)
            rows.append(policy_row(m, before, prompt_tokens_per_replica(base_url)))
    finally:
        serve.delete(APP)
    return rows


def main() -> None:
    import ray
    from ray import serve

    p = argparse.ArgumentParser()
    p.add_argument("--w1-requests", type=int, default=16)
    p.add_argument("--w3-conversations", type=int, default=4)
    p.add_argument("--w3-turns", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--max-total-tokens", type=int, default=8192)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--num-cpus", type=int, default=2, help="Ray's CPUs (one per replica)")
    args = p.parse_args()
    print(f"{cpu_name()}; Ray Serve, one CPU per replica; {vars(args)}")
    port = free_port()
    ray.init(num_cpus=args.num_cpus, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        base = f"http://127.0.0.1:{port}"
        rows = [row for dp, method in CONFIGS for row in run_config(base, dp, method, args)]
    finally:
        serve.shutdown()
        ray.shutdown()
    print_policy_table(rows, "prompt tokens per replica")


if __name__ == "__main__":
    main()
