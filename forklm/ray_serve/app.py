"""The Ray Serve application: an ingress deployment in front of an engine deployment whose
replicas are routed by PolicyRequestRouter. Built from the same configs as `forklm serve`."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Any

from forklm.runtime.config import EngineConfig
from forklm.runtime.config import check_field as _check
from forklm.server.config import ServerConfig

ENGINE_DEPLOYMENT = "forklm_engine"
INGRESS_DEPLOYMENT = "forklm_ingress"
# By name, so building the application does not import it (only the ingress process does).
ROUTER_CLASS = "forklm.ray_serve.request_router.PolicyRequestRouter"


@dataclass(frozen=True)
class ReplicaPlan:
    """What Ray reserves per engine replica, derived from the engine and server configs."""

    num_replicas: int = 1  # --dp-size
    load_balance_method: str = "cache_aware"
    num_cpus: float = 1.0  # Ray's CPUs per replica, = its torch threads
    num_gpus: float = 0.0
    # Requests Ray Serve lets a replica hold; beyond it the router spills to another replica.
    # The engine batches them (Ray's default of 5 would cap batches at 5).
    max_ongoing_requests: int = 320
    # Ray Serve restarts a replica whose check_health fails (or exceeds the timeout) on
    # consecutive periodic checks: a dead or stuck replica is replaced, as by the --dp-size router.
    health_check_period_s: float = 1.0
    health_check_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        _check(self.num_replicas >= 1, "dp_size", self.num_replicas, "must be >= 1")
        _check(self.num_cpus > 0, "num_threads", self.num_cpus, "must be > 0")
        _check(self.max_ongoing_requests >= 1, "max_queued_requests",
               self.max_ongoing_requests, "must leave room for a request")

    @classmethod
    def of(cls, engine: EngineConfig, server: ServerConfig) -> ReplicaPlan:
        return cls(num_replicas=server.dp_size, load_balance_method=server.load_balance_method,
                   num_cpus=float(engine.num_threads or 1),
                   num_gpus=1.0 if engine.device.startswith("cuda") else 0.0,
                   max_ongoing_requests=engine.max_running_requests + server.max_queued_requests,
                   health_check_period_s=server.health_check_interval_secs,
                   health_check_timeout_s=server.health_check_timeout_secs)


def build_application(engine_kwargs: dict[str, Any], server_config: ServerConfig) -> Any:
    """The Application for serve.run: `dp_size` engine replicas, each with the engine flags
    given (torch threads = its Ray CPUs) and the server's config as a single server."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from forklm.ray_serve.ingress import Ingress
    from forklm.ray_serve.replica import EngineReplica

    engine_config = EngineConfig.from_kwargs(**engine_kwargs)
    plan = ReplicaPlan.of(engine_config, server_config)
    replica_kwargs = {**engine_kwargs, "num_threads": int(plan.num_cpus)}
    router_config = RequestRouterConfig(
        request_router_class=ROUTER_CLASS,  # type: ignore[arg-type]  # Ray's typing says dict
        request_router_kwargs={"load_balance_method": plan.load_balance_method,
                               "num_replicas": plan.num_replicas})
    engine = serve.deployment(
        name=ENGINE_DEPLOYMENT, num_replicas=plan.num_replicas,
        max_ongoing_requests=plan.max_ongoing_requests,
        ray_actor_options={"num_cpus": plan.num_cpus, "num_gpus": plan.num_gpus},
        health_check_period_s=plan.health_check_period_s,
        health_check_timeout_s=plan.health_check_timeout_s,
        request_router_config=router_config)(EngineReplica)
    # The ingress only parses and relays: no CPU reserved, so the replicas get them all.
    ingress = serve.deployment(
        name=INGRESS_DEPLOYMENT, ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=plan.num_replicas * plan.max_ongoing_requests)(Ingress)
    single = dataclasses.replace(server_config, dp_size=1)
    return ingress.bind(engine.bind(replica_kwargs, single), server_config, plan.num_replicas)


def application_from_flags(args: dict[str, Any]) -> Any:
    """build_application from `forklm serve` flags given as {name: value} (Ray Serve's
    application-builder arguments: dp-size=2 or dp_size: 2; true/false for switches)."""
    from forklm.server.flags import add_serve_flags, dataclass_kwargs, engine_kwargs

    parser = argparse.ArgumentParser(prog="forklm serve")
    add_serve_flags(parser)
    argv = []
    for name, value in args.items():
        flag = "--" + str(name).replace("_", "-")
        text = str(value).lower()
        if isinstance(value, (list, tuple)):  # a list flag: lora_paths: [a=/x, b=/y]
            argv += [flag, *map(str, value)] if value else []
        elif text in ("true", "false"):
            argv.append(flag if text == "true" else "--no-" + flag[2:])
        else:
            argv += [flag, str(value)]
    try:
        parsed = parser.parse_args(argv)
    except SystemExit as e:  # argparse printed why; a builder raises instead of exiting
        raise ValueError(f"forklm.ray_serve: invalid arguments {args!r}") from e
    server = ServerConfig.from_kwargs(**dataclass_kwargs(parsed, ServerConfig))
    return build_application(engine_kwargs(parsed), server)
