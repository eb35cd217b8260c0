"""`python -m forklm.sim`: replay a synthetic agent trace on N simulated replicas under each
routing policy and print the table. The fleet mix with W1/W3-like traffic is
benchmarks/sim_fleet.py; fitting a cost model is benchmarks/sim_validate.py."""

from __future__ import annotations

import argparse
import time

from forklm.router.policies import POLICIES
from forklm.runtime.config import EngineConfig
from forklm.sim.cost_model import CostModel
from forklm.sim.report import HEADER, table_row
from forklm.sim.simulator import ModelFacts, SimConfig, Simulation
from forklm.sim.traces import AgentTraceConfig, agent_trace


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m forklm.sim", description=__doc__)
    p.add_argument("--replicas", default="1,4", help="comma-separated replica counts")
    p.add_argument("--policies", default=",".join(POLICIES))
    cost = p.add_mutually_exclusive_group(required=True)
    cost.add_argument("--cost-file", help="a cost model JSON (benchmarks/sim_cost_cpu.json)")
    cost.add_argument("--cost", help='coefficients in seconds, "decode_base_s=0.01,..."')
    p.add_argument("--sessions-per-replica", type=int, default=8)
    p.add_argument("--rate-per-replica", type=float, default=0.1, help="sessions/s per replica")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--max-total-tokens", type=int, default=16384, help="KV slots per replica")
    p.add_argument("--step-jitter", type=float, default=0.05,
                   help="relative noise on step times (SimConfig.step_jitter)")
    p.add_argument("--model", default="SmolLM2-135M-Instruct", help="whose tokenizer")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    try:
        args.replicas = [int(n) for n in args.replicas.split(",")]
    except ValueError:
        p.error(f"--replicas {args.replicas!r}: expected comma-separated integers")
    if any(n < 1 for n in args.replicas):
        p.error(f"--replicas {args.replicas}: each count must be >= 1")
    args.policies = args.policies.split(",")
    for name in args.policies:
        if name not in POLICIES:
            p.error(f"--policies: {name!r}: expected among {', '.join(POLICIES)}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        cost = CostModel.from_spec(args.cost) if args.cost else CostModel.from_json(args.cost_file)
    except ValueError as e:  # a bad file or coefficient: the message names it
        raise SystemExit(f"python -m forklm.sim: error: {e}") from None
    model = ModelFacts.load(args.model)
    engine = EngineConfig(max_total_tokens=args.max_total_tokens)
    print(f"cost model: {cost}")
    print(HEADER)
    for n in args.replicas:
        trace = agent_trace(AgentTraceConfig(
            num_sessions=args.sessions_per_replica * n, sessions_per_s=args.rate_per_replica * n,
            num_system_prompts=max(2, n // 2), max_new_tokens=args.max_new_tokens,
            seed=args.seed), name=f"agent x{n}")
        for policy in args.policies:
            t0 = time.perf_counter()
            config = SimConfig(n, policy, engine, step_jitter=args.step_jitter)
            summary = Simulation(config, cost, model).run(trace).summary()
            print(f"{table_row(summary)}  ({time.perf_counter() - t0:.1f} s)", flush=True)


if __name__ == "__main__":
    main()
