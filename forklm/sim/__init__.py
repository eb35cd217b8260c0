"""A fleet simulator made of the real parts: the engine's scheduler, radix cache and KV pool per
replica and the router's policies, with a fitted cost model in place of the model forward, on a
virtual clock. `python -m forklm.sim --help`; benchmarks/sim_validate.py checks it against the
real server, benchmarks/sim_fleet.py asks it fleet-scale routing questions."""

from forklm.sim.cost_model import CostModel, StepShape, fit_forward, fit_overhead
from forklm.sim.report import SimResult, Summary
from forklm.sim.simulator import ModelFacts, SimConfig, Simulation
from forklm.sim.traces import AgentTraceConfig, Session, Trace, Turn, agent_trace

__all__ = ["AgentTraceConfig", "CostModel", "ModelFacts", "Session", "SimConfig", "SimResult",
           "Simulation", "StepShape", "Summary", "Trace", "Turn", "agent_trace", "fit_forward",
           "fit_overhead"]
