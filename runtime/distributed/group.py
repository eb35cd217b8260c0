"""The tensor-parallel process group: torch.distributed's TCP rendezvous, then two groups over the
same ranks: `control` (gloo, CPU tensors) carries each step's batch from rank 0, `compute` (gloo on
the CPU, NCCL on GPUs) the model's all-reduces and the logits gather."""

from __future__ import annotations

import datetime
import logging
import socket
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

# Waiting for every node to join: a second machine may be started by hand, after the first.
RENDEZVOUS_TIMEOUT_S = 600.0
# A worker waits on the control group between steps; rank 0 pings it every few seconds while
# idle (runner.py), so this only bounds a rank 0 that hangs without closing its sockets.
CONTROL_TIMEOUT_S = 3600.0
# One collective inside a forward: ranks meet once per layer, so a rank that has not arrived
# after a minute is hung (a dead one is noticed at once: its sockets close).
COLLECTIVE_TIMEOUT_S = 60.0


@dataclass
class TPGroup:
    """This process's rank in the tensor-parallel group and the collectives the model runs."""

    rank: int
    size: int
    device: torch.device
    control: Any  # ProcessGroup (gloo)
    compute: Any  # ProcessGroup (gloo or NCCL)
    # Seconds spent in the forward's collectives, waiting for slower ranks included (rank 0's
    # figure is what benchmarks/tensor_parallel.py reports as the all-reduce share of a step).
    comm_s: float = 0.0

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks, in place; returns x."""
        t0 = time.perf_counter()
        dist.all_reduce(x, group=self.compute)
        self.comm_s += time.perf_counter() - t0
        return x

    def gather_to_first(self, x: torch.Tensor) -> torch.Tensor | None:
        """Rank 0: every rank's x concatenated along the last axis (rank order); others: None."""
        t0 = time.perf_counter()
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.is_first else None
        dist.gather(x, parts, dst=0, group=self.compute)
        self.comm_s += time.perf_counter() - t0
        return torch.cat(parts, dim=-1) if parts is not None else None

    def share_from_first(self, value: Any) -> Any:
        """Rank 0's `value` (any picklable object) on every rank."""
        box = [value if self.is_first else None]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    def gather_objects(self, value: Any) -> list[Any] | None:
        """Rank 0: every rank's `value`, in rank order; others: None."""
        out: list[Any] | None = [None] * self.size if self.is_first else None
        dist.gather_object(value, out, dst=0, group=self.control)
        return out

    def ping(self) -> None:
        """A no-op collective every rank joins: it fails when one has gone."""
        dist.all_reduce(torch.zeros(1, device=self.device), group=self.compute)


def init_group(rank: int, size: int, init_addr: str, device: str) -> TPGroup:
    """Join the group of `size` ranks meeting at init_addr ("host:port" or "tcp://host:port"),
    as `rank`; on CUDA each rank takes its node's GPU local_rank (set by the caller's device)."""
    backend = "nccl" if device.startswith("cuda") else "gloo"
    url = init_addr if init_addr.startswith("tcp://") else f"tcp://{init_addr}"
    if dist.is_initialized():
        raise RuntimeError("a tensor-parallel engine already runs in this process (torch."
                           "distributed has one default group per process); shut it down first")
    dist.init_process_group(backend, init_method=url, rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=RENDEZVOUS_TIMEOUT_S))
    control = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=CONTROL_TIMEOUT_S))
    compute = dist.new_group(backend=backend,
                             timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    logger.info("tensor-parallel rank %d of %d joined at %s (%s)", rank, size, url, backend)
    return TPGroup(rank, size, torch.device(device), control, compute)


def leave_group() -> None:
    """Destroy this process's groups (never raises: the peers may be gone)."""
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # a broken group is torn down all the same
            logger.debug("destroy_process_group failed", exc_info=True)


def free_local_address() -> str:
    """127.0.0.1:<a port free now> for a one-machine rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"
