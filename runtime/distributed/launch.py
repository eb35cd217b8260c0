"""start_tensor_parallel: rank 0's side of starting tensor parallelism. It spawns this node's
other ranks, meets every rank at the rendezvous, shares its config and loads its own shard."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from forklm.runtime import builder
from forklm.runtime.config import EngineConfig
from forklm.runtime.distributed.group import TPGroup, free_local_address, init_group, leave_group
from forklm.runtime.distributed.processes import WorkerProcesses
from forklm.runtime.distributed.runner import TensorParallelRunner
from forklm.runtime.distributed.shard import ModelShard, build_model_shard
from forklm.runtime.distributed.sharding import check_shardable
from forklm.runtime.distributed.worker import rank_device
from forklm.runtime.kv_manager import KVCacheManager
from forklm.runtime.model_loader import LoadedModel
from forklm.runtime.models import ModelSpec


@dataclass
class TensorParallel:
    """Rank 0's handle on the started group: its shard, the group, its node's worker processes."""

    shard: ModelShard
    group: TPGroup
    workers: WorkerProcesses

    def runner(self, kv: KVCacheManager, vocab_size: int) -> TensorParallelRunner:
        return TensorParallelRunner(self.shard, kv, self.group, self.workers, vocab_size)


def start_tensor_parallel(config: EngineConfig, loaded: LoadedModel,
                          spec: ModelSpec) -> TensorParallel:
    """Start the group with this process as rank 0 (node 0); returns once every rank holds its
    shard. A rank that fails while loading makes this raise, and the local workers are stopped."""
    assert config.tp_size > 1 and config.node_rank == 0
    check_shardable(spec, config.tp_size)  # before any process starts
    addr = config.dist_init_addr or free_local_address()
    workers = WorkerProcesses.spawn(config, addr, range(1, config.local_tp_size))
    try:
        group = init_group(0, config.tp_size, addr, rank_device(config, 0))
        group.share_from_first(config)
        dtype = getattr(torch, config.torch_dtype_name)
        context_len = config.context_length or loaded.config.max_position_embeddings
        shard = build_model_shard(
            config, loaded, spec, group,
            kv_capacity=lambda local: builder.kv_capacity(config, local, dtype, context_len))
    except BaseException:
        workers.stop(timeout_s=2.0)
        leave_group()
        raise
    return TensorParallel(shard, group, workers)
