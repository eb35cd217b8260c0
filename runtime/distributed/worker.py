"""A worker rank: joins the group, loads its shard, then runs the model on every batch rank 0
broadcasts until told to stop. It schedules nothing and samples nothing."""

from __future__ import annotations

import logging
import signal
import sys
from typing import TYPE_CHECKING

import torch

from forklm.runtime.distributed.group import TPGroup, init_group, leave_group
from forklm.runtime.distributed.shard import ModelShard, connect_shard, load_shard
from forklm.runtime.distributed.step_channel import Command, receive_step

if TYPE_CHECKING:
    from forklm.runtime.config import EngineConfig

logger = logging.getLogger(__name__)


def main(rank: int, config: EngineConfig, init_addr: str) -> None:
    """A spawned worker process's entry point."""
    logging.basicConfig(level=logging.WARNING,
                        format=f"%(levelname)s tp{rank} %(name)s: %(message)s")
    # Ctrl-C reaches the whole process group: rank 0 decides when its workers stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sys.exit(run_worker(rank, config, init_addr))


def run_worker(rank: int, config: EngineConfig, init_addr: str) -> int:
    """Serve as `rank` until rank 0 says stop (0) or the group breaks (1)."""
    from forklm.runtime.models import spec_from_config
    from forklm.runtime.models.loader import load_model

    device = rank_device(config, rank)
    if config.threads_per_rank:
        torch.set_num_threads(config.threads_per_rank)
    group = init_group(rank, config.tp_size, init_addr, device)
    try:
        config = group.share_from_first(None)  # rank 0's settings, whatever this node was given
        loaded = load_model(config.model_path, config.revision, config.tokenizer_path)
        own = load_shard(config, loaded, spec_from_config(loaded.config), rank, config.tp_size)
        shard = connect_shard(config, own, group, None)
        serve_steps(shard, group)
        return 0
    except Exception:
        logger.exception("tensor-parallel rank %d stopped", rank)
        return 1
    finally:
        leave_group()


def serve_steps(shard: ModelShard, group: TPGroup) -> None:
    """The worker loop: one command from rank 0 at a time."""
    while True:
        command, batch = receive_step(group)
        if command == Command.SHUTDOWN:
            return
        if command == Command.PING:
            group.ping()
            continue
        assert batch is not None
        logits = shard.model(batch.to(group.device), shard.attn)  # [rows, vocab / tp_size]
        group.gather_to_first(logits)


def rank_device(config: EngineConfig, rank: int) -> str:
    """The device `rank` runs on: the CPU, or its node's GPU number rank % local_tp_size."""
    if config.device == "cpu":
        return "cpu"
    local = rank % config.local_tp_size
    torch.cuda.set_device(local)
    return f"cuda:{local}"
