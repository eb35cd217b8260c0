"""Fleet-scale routing by simulation (forklm/sim): cache_aware vs round_robin vs shortest_queue at
8, 32 and 128 replicas, on open-loop traffic that grows with the fleet: agent sessions (Poisson
arrivals, tool round trips, growing context), W1-like few-shot requests and W3-like multi-turn
chats, the number of distinct prefixes (agent definitions, few-shot prompts) scaling too.

  python -m benchmarks.sim_fleet [--replicas 8,32,128] [--cost-file benchmarks/sim_cost_cpu.json
      | --cost "decode_base_s=0.008,..."] [--seconds 60] [--load 1.0]

Each replica is the real scheduler and radix cache with the cost model's step time (fitted on this
machine by benchmarks/sim_validate.py unless --cost gives a GPU's); the router is the real policy.
"""

from __future__ import annotations

import argparse
import random
import time

from benchmarks.workloads import multi_turn, shared_prefix
from forklm.router.policies import POLICIES
from forklm.runtime.config import EngineConfig
from forklm.sim.cost_model import CostModel
from forklm.sim.report import HEADER, table_row
from forklm.sim.simulator import ModelFacts, SimConfig, Simulation
from forklm.sim.traces import AgentTraceConfig, Session, Trace, Turn, agent_trace

# Per replica and second of arrivals, at --load 1 (about half of a CPU replica's capacity under
# the fitted CPU cost model when its cache hits; misses push it towards saturation).
W1_REQUESTS_PER_S = 0.4
AGENT_SESSIONS_PER_S = 0.05
W3_CONVERSATIONS_PER_S = 0.05


def fleet_trace(num_replicas: int, seconds: float, load: float, seed: int = 0) -> Trace:
    rng = random.Random(seed)
    rate = load * num_replicas
    families = max(2, num_replicas // 4)  # distinct prefixes grow with the fleet
    sessions: list[Session] = []
    # W1-like: each request one of `families` few-shot prefixes and its own question.
    prefix_sets = [shared_prefix(num_requests=64, seed=100 + f).requests for f in range(families)]
    for t in _poisson(rng, W1_REQUESTS_PER_S * rate, seconds):
        req = rng.choice(rng.choice(prefix_sets))
        sessions.append(Session(t, (Turn(req.prompt, 32),)))
    # W3-like: 4-turn chats, the user thinking 1-4 s between an answer and the next question.
    for i, t in enumerate(_poisson(rng, W3_CONVERSATIONS_PER_S * rate, seconds)):
        questions = multi_turn(num_conversations=1, num_turns=4, seed=1000 + i).requests
        turns = [Turn(q.prompt, 32, delay_s=rng.uniform(1, 4)) for q in questions]
        sessions.append(Session(t, tuple(turns)))
    agents = agent_trace(AgentTraceConfig(
        num_sessions=max(1, round(AGENT_SESSIONS_PER_S * rate * seconds)),
        sessions_per_s=AGENT_SESSIONS_PER_S * rate, num_system_prompts=families, seed=seed))
    sessions += agents.sessions
    sessions.sort(key=lambda s: s.start_s)
    return Trace(f"mix x{num_replicas}", tuple(sessions))


def _poisson(rng: random.Random, rate: float, seconds: float) -> list[float]:
    times, t = [], rng.expovariate(rate)
    while t < seconds:
        times.append(t)
        t += rng.expovariate(rate)
    return times


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--replicas", default="8,32,128")
    p.add_argument("--policies", default="round_robin,shortest_queue,cache_aware")
    p.add_argument("--cost-file", default="benchmarks/sim_cost_cpu.json")
    p.add_argument("--cost", help='coefficients "name=seconds,..." (overrides --cost-file)')
    p.add_argument("--seconds", type=float, default=60.0, help="arrivals over this long")
    p.add_argument("--load", type=float, default=1.0, help="arrival rate multiplier")
    p.add_argument("--max-total-tokens", type=int, default=16384, help="KV slots per replica")
    p.add_argument("--step-jitter", type=float, default=0.05,
                   help="relative noise on step times (SimConfig.step_jitter)")
    args = p.parse_args()
    replicas = [int(n) for n in args.replicas.split(",")]
    policies = args.policies.split(",")
    for name in policies:
        if name not in POLICIES:
            raise SystemExit(f"--policies: {name!r}: expected among {', '.join(POLICIES)}")
    cost = CostModel.from_spec(args.cost) if args.cost else CostModel.from_json(args.cost_file)
    print(f"cost model: {cost}\n{vars(args)}")
    model = ModelFacts.load()
    engine = EngineConfig(max_total_tokens=args.max_total_tokens)
    title, rule = HEADER.split("\n")
    print(f"{title} sim wall s |\n{rule} --- |")
    for n in replicas:
        trace = fleet_trace(n, args.seconds, args.load)
        for policy in policies:
            t0 = time.perf_counter()
            config = SimConfig(n, policy, engine, step_jitter=args.step_jitter)
            result = Simulation(config, cost, model).run(trace)
            print(f"{table_row(result.summary())} {time.perf_counter() - t0:.0f} |", flush=True)


if __name__ == "__main__":
    main()
