"""Tensor parallelism over torch.distributed: rank 0 (the engine's process) schedules, samples and
broadcasts each step's batch; every rank runs its Megatron-style shard of the model."""

from forklm.runtime.distributed.launch import (
    TensorParallel,
    run_worker_node,
    spawn_workers,
    start_tensor_parallel,
)

__all__ = ["TensorParallel", "run_worker_node", "spawn_workers", "start_tensor_parallel"]
