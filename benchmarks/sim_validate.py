"""Validate the simulator (forklm/sim) against the real server, in one run so that the machine's
load hits both alike: fit the forward's shape from isolated forwards timed here, measure W1-W3 on
`forklm serve` at dp_size 1 and 2 (benchmarks/dp_routing.py's servers and HTTP runner), each
workload right after two short calibration runs on the same server that give the forward's level
and the engine's time outside the forward, simulate the same, and compare.

  python -m benchmarks.sim_validate [--w1-requests 24] [--w2-requests 16] [--w3-conversations 8]
      [--w3-turns 3] [--new-tokens 32] [--configs dp1,dp2:cache_aware,dp2:round_robin]
      [--cost-out benchmarks/sim_cost_cpu.json]

Prints the fitted coefficients and a table of simulated vs measured throughput (output tok/s) and
cache hit rate (prompt tokens served from the cache / sent), with the error of each. A second
simulated throughput takes the forward's level from the workload's own run (the server's
measured forward seconds): it checks the simulator's structure (scheduling, batching, steps,
overhead) apart from how much the machine's speed drifted since the calibration.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import time
from collections import defaultdict

import httpx

from benchmarks.http_runner import HTTPRunner
from benchmarks.runners import Metrics
from benchmarks.servers import forklm_server
from benchmarks.tensor_parallel import cpu_name
from benchmarks.workloads import Workload, multi_turn, no_sharing, shared_prefix
from forklm.runtime.config import EngineConfig, cpu_flags
from forklm.sim.cost_model import CostModel, fit_forward, fit_overhead
from forklm.sim.profile import OverheadSample, ProfileConfig, overhead_between, profile_forward
from forklm.sim.simulator import ModelFacts, SimConfig, Simulation
from forklm.sim.traces import Session, Trace, Turn

# Relative noise on simulated step times (see SimConfig.step_jitter); the fit's residuals on this
# shared machine are larger still.
STEP_JITTER = 0.05


@dataclasses.dataclass(frozen=True)
class Setup:
    dp_size: int
    policy: str  # the router's load-balance method ("-" at dp_size 1)

    @classmethod
    def parse(cls, text: str) -> Setup:
        dp, _, policy = text.partition(":")
        if not dp.startswith("dp") or not dp[2:].isdigit():
            raise SystemExit(f"--configs: {text!r}: expected dpN or dpN:policy")
        return cls(int(dp[2:]), policy or ("-" if dp == "dp1" else "round_robin"))

    @property
    def name(self) -> str:
        return f"dp={self.dp_size} {self.policy}"

    @property
    def threads(self) -> int:
        """torch threads per replica, as the router shares the cores (replicas.replica_threads)."""
        import os

        return max(1, len(os.sched_getaffinity(0)) // self.dp_size)


def workload_trace(wl: Workload) -> Trace:
    """A benchmark workload as a simulator trace: everything sent at 0 behind its in-flight gate;
    a multi-turn workload's conversations as sessions (next turn right after the answer)."""
    if not wl.multi_turn:
        sessions = [Session(0.0, (Turn(r.prompt, r.max_new_tokens),)) for r in wl.requests]
    else:
        convs: dict[int, list[Turn]] = defaultdict(list)
        for r in sorted(wl.requests, key=lambda r: (r.conversation or 0, r.turn)):
            convs[r.conversation or 0].append(Turn(r.prompt, r.max_new_tokens))
        sessions = [Session(0.0, tuple(turns)) for turns in convs.values()]
    return Trace(wl.name.split()[0], tuple(sessions), max_in_flight=wl.max_in_flight)


def workloads(args: argparse.Namespace) -> list[Workload]:
    wls = [shared_prefix(num_requests=args.w1_requests), no_sharing(num_requests=args.w2_requests),
           multi_turn(num_conversations=args.w3_conversations, num_turns=args.w3_turns)]
    for wl in wls:
        for req in wl.requests:
            req.max_new_tokens = args.new_tokens
    return wls


def calibration_workloads(new_tokens: int) -> list[Workload]:
    """Distinct prompts (seeds no benchmark workload uses) at batch 1 and batch 6: two short runs
    that give the forward's level on the machine as loaded now, and separate the engine's
    per-step cost outside the forward from its per-request cost."""
    alone, batched = no_sharing(num_requests=2, seed=11), no_sharing(num_requests=6, seed=12)
    alone.max_in_flight, batched.max_in_flight = 1, 6
    for wl in (alone, batched):
        for req in wl.requests:
            req.prompt = " ".join(req.prompt.split()[:120])
            req.max_new_tokens = new_tokens
    return [alone, batched]


def engine_stats(base_url: str) -> list[dict]:
    return httpx.get(base_url + "/get_server_info", timeout=30).json()["internal_states"]


def flush(base_url: str) -> None:
    httpx.post(base_url + "/flush_cache", timeout=30).raise_for_status()


@dataclasses.dataclass
class Measured:
    workload: Workload
    calibration: list[OverheadSample]  # the runs just before it
    metrics: Metrics
    own: OverheadSample  # the engine's counters over the workload's own run


def measure(config: Setup, args: argparse.Namespace) -> list[Measured]:
    """Each workload on a fresh cache, right after its own calibration runs (the machine's load
    drifts over minutes, so each workload gets the machine's speed of its moment)."""
    flags = ["--dtype", args.dtype, "--max-total-tokens", str(args.max_total_tokens),
             "--dp-size", str(config.dp_size)]
    if config.dp_size > 1:
        flags += ["--load-balance-method", config.policy]
    out = []
    with forklm_server(flags) as server:
        runner = HTTPRunner(server.base_url, system=config.name, server_pid=server.pid)

        def timed(wl: Workload) -> tuple[OverheadSample, Metrics]:
            before = engine_stats(server.base_url)
            metrics = runner.run(wl)
            sample = overhead_between(before, engine_stats(server.base_url))
            flush(server.base_url)
            return sample, metrics

        for wl in workloads(args):
            calibration = [timed(c)[0] for c in calibration_workloads(args.new_tokens)]
            own, metrics = timed(wl)
            out.append(Measured(wl, calibration, metrics, own))
    return out


def sim_config(config: Setup, args: argparse.Namespace) -> SimConfig:
    engine = EngineConfig(max_total_tokens=args.max_total_tokens)
    policy = config.policy if config.dp_size > 1 else "round_robin"
    return SimConfig(config.dp_size, policy, engine, step_jitter=STEP_JITTER)


def simulated_forward_s(config: Setup, cost: CostModel, wl: Workload, model: ModelFacts,
                        args: argparse.Namespace) -> float:
    sim = Simulation(sim_config(config, args), cost, model)
    sim.run(workload_trace(wl))
    return sum(r.stats.forward_s for r in sim.replicas)


def live_cost(config: Setup, forward: CostModel, samples: list[OverheadSample],
              model: ModelFacts, args: argparse.Namespace) -> tuple[CostModel, float]:
    """The server's cost model: the isolated forwards' shape scaled to the forward time the
    server measured on the calibration runs (the machine as loaded then), plus the overhead
    fitted from them. Returns (it, the scale)."""
    predicted = sum(simulated_forward_s(config, forward, wl, model, args)
                    for wl in calibration_workloads(args.new_tokens))
    scale = sum(s.forward_s for s in samples) / predicted
    o0, o1 = fit_overhead([(s.steps, s.request_steps, s.overhead_s) for s in samples])
    cost = dataclasses.replace(
        forward.scaled_forward(scale).with_overhead(o0, o1),
        description=f"{forward.description}, forward x{scale:.2f} and overhead from {config.name}")
    return cost, scale


def fit_costs(threads: list[int], args: argparse.Namespace) -> dict[int, CostModel]:
    costs = {}
    for n in sorted(set(threads)):
        t0 = time.perf_counter()
        steps = profile_forward(ProfileConfig(dtype=args.dtype, num_threads=n,
                                              repeats=args.profile_repeats))
        costs[n] = fit_forward(steps, f"{cpu_name()}, dtype {args.dtype}, {n} thread(s)")
        print(f"forward fit, {n} thread(s), {time.perf_counter() - t0:.0f} s: {costs[n]}")
        gc.collect()
    return costs


def err(sim: float, real: float) -> str:
    return f"{(sim - real) / real:+.0%}" if real else "n/a"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--w1-requests", type=int, default=24)
    p.add_argument("--w2-requests", type=int, default=16)
    p.add_argument("--w3-conversations", type=int, default=8)
    p.add_argument("--w3-turns", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--max-total-tokens", type=int, default=16384)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--configs", default="dp1,dp2:cache_aware,dp2:round_robin")
    p.add_argument("--profile-repeats", type=int, default=3)
    p.add_argument("--forward-from", help="take the forward coefficients from this cost JSON "
                   "instead of profiling (for a quick run of this script)")
    p.add_argument("--cost-out", default="benchmarks/sim_cost_cpu.json",
                   help="where the dp=1 cost model (its first workload's) is saved")
    args = p.parse_args()
    configs = [Setup.parse(c) for c in args.configs.split(",")]
    isa = "AVX-512-bf16" if "avx512_bf16" in cpu_flags() else "AVX2"
    print(f"{cpu_name()} ({isa}); {vars(args)}")
    t0 = time.perf_counter()
    if args.forward_from:  # a quick check of this script: no profiling
        given = CostModel.from_json(args.forward_from).with_overhead(0.0, 0.0)
        forward = {c.threads: given for c in configs}
    else:
        forward = fit_costs([c.threads for c in configs], args)
    model = ModelFacts.load()
    rows, saved = [], False
    for config in configs:
        for m in measure(config, args):
            name = workload_trace(m.workload).name
            cost, scale = live_cost(config, forward[config.threads], m.calibration, model, args)
            if config.dp_size == 1 and not saved:
                cost.to_json(args.cost_out)
                saved = True
            sim = Simulation(sim_config(config, args), cost, model).run(
                workload_trace(m.workload)).summary()
            # The structure check: the forward's level taken from the workload's own run.
            own_scale = m.own.forward_s / simulated_forward_s(config, forward[config.threads],
                                                              m.workload, model, args)
            own = Simulation(sim_config(config, args), cost.scaled_forward(own_scale / scale),
                             model).run(workload_trace(m.workload)).summary()
            print(f"{name} {config.name}: forward x{scale:.2f} (calibration) / x{own_scale:.2f} "
                  f"(own run) of the isolated profile; overhead {1000 * cost.overhead_s:.2f} "
                  f"ms/step + {1000 * cost.overhead_per_req_s:.3f} ms/request", flush=True)
            real = m.metrics
            hit = 1 - real.prompt_tokens_computed / max(real.prompt_tokens_sent, 1)
            rows.append((name, config.name, real.output_tokens_per_s, sim.output_tokens_per_s,
                         own.output_tokens_per_s, hit, sim.cache_hit_rate, real.median_ttft_s,
                         sim.ttft_s[0]))
    print(f"total {time.perf_counter() - t0:.0f} s")
    print("| workload | config | tok/s measured | simulated | error | simulated, own forward "
          "level | error | hit measured | simulated | error | TTFT p50 s measured / simulated |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for w, c, mt, st, ot, mh, sh, mf, sf in sorted(rows, key=lambda r: r[0]):
        hit_err = err(sh, mh) if mh > 0.005 else f"{100 * (sh - mh):+.1f} pt"
        print(f"| {w} | {c} | {mt:.1f} | {st:.1f} | {err(st, mt)} | {ot:.1f} | {err(ot, mt)} "
              f"| {mh:.1%} | {sh:.1%} | {hit_err} | {mf:.2f} / {sf:.2f} |")


if __name__ == "__main__":
    main()
