"""start_tensor_parallel: rank 0's side of starting tensor parallelism. It spawns this node's
other ranks, meets every rank at the rendezvous, shares its config and loads its own shard."""

from __future__ import annotations

import signal
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

from forklm.runtime.distributed.group import TPGroup, free_local_address, init_group, leave_group
from forklm.runtime.distributed.processes import STOP_TIMEOUT_S, WorkerProcesses
from forklm.runtime.distributed.runner import TensorParallelRunner
from forklm.runtime.distributed.shard import ModelShard, connect_shard, load_shard
from forklm.runtime.distributed.sharding import check_shardable
from forklm.runtime.distributed.worker import rank_device, run_worker
from forklm.runtime.forward import model_parts

if TYPE_CHECKING:
    from forklm.runtime.config import EngineConfig
    from forklm.runtime.kvcache.manager import KVCacheManager
    from forklm.runtime.models import ModelSpec
    from forklm.runtime.models.loader import LoadedModel


@dataclass
class TensorParallel:
    """Rank 0's handle on the started group: its shard, the group, its node's worker processes."""

    shard: ModelShard
    group: TPGroup
    workers: WorkerProcesses

    def runner(self, kv: KVCacheManager, vocab_size: int) -> TensorParallelRunner:
        return TensorParallelRunner(self.shard, kv, self.group, self.workers, vocab_size)


def spawn_workers(config: EngineConfig) -> WorkerProcesses:
    """Start this node's ranks 1 .. local_tp_size - 1 (node 0), meeting at dist_init_addr or a
    free local port; they load their shards while rank 0 loads its own."""
    assert config.tp_size > 1 and config.node_rank == 0
    addr = config.dist_init_addr or free_local_address()
    return WorkerProcesses.spawn(config, addr, range(1, config.local_tp_size))


def start_tensor_parallel(config: EngineConfig, loaded: LoadedModel, spec: ModelSpec,
                          workers: WorkerProcesses) -> TensorParallel:
    """Join the group as rank 0 with `workers` started; returns once every rank holds its shard.
    A rank that fails while loading makes this raise (the caller stops the workers)."""
    check_shardable(spec, config.tp_size)  # before this rank loads anything
    try:
        device = rank_device(config, 0)
        own = load_shard(config, loaded, spec, 0, config.tp_size)
        group = init_group(0, config.tp_size, workers.init_addr, device)
        group.share_from_first(config)
        context_len = config.context_length or loaded.config.max_position_embeddings
        shard = connect_shard(
            config, own, group,
            kv_capacity=lambda local: model_parts.kv_capacity(config, local, context_len))
    except BaseException:
        leave_group()
        raise
    return TensorParallel(shard, group, workers)


def run_worker_node(config: EngineConfig) -> int:
    """`forklm serve --node-rank N` (N > 0): run this node's ranks, the first in this process,
    until node 0 shuts down. SIGTERM stops them all."""
    assert config.node_rank > 0 and config.dist_init_addr is not None
    first = config.node_rank * config.local_tp_size
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that `finally` stops the rest
    workers = WorkerProcesses.spawn(config, config.dist_init_addr,
                                    range(first + 1, first + config.local_tp_size))
    code = 1
    try:
        code = run_worker(first, config, config.dist_init_addr)
        return code
    finally:  # told to stop, the others exit as this one did; else they are stopped at once
        workers.stop(timeout_s=STOP_TIMEOUT_S if code == 0 else 1.0)
