"""What rank 0 tells the workers each step, over the control group: a fixed-size header (the
command and the batch's shapes), then the ForwardBatch's integer tensors packed into one."""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from forklm.runtime.forward.batch import ForwardBatch

if TYPE_CHECKING:
    from forklm.runtime.distributed.group import TPGroup


class Command(enum.IntEnum):
    FORWARD = 1  # a ForwardBatch follows; every rank runs the model on it
    PING = 2  # every rank joins one tiny all-reduce (liveness while rank 0 is idle)
    SHUTDOWN = 3  # workers leave their loop and exit


# header: command, tokens, batch, slot-table columns, max q len, logits rows, is_decode
_HEADER_LEN = 7


def send_step(group: TPGroup, command: Command, batch: ForwardBatch | None = None) -> None:
    """Rank 0: broadcast `command` (and for FORWARD, `batch`, its tensors on the CPU)."""
    header = torch.zeros(_HEADER_LEN, dtype=torch.int64)
    header[0] = int(command)
    if batch is not None:
        header[1:] = torch.tensor([batch.num_tokens, batch.batch_size, batch.slot_table.shape[1],
                                   batch.max_q_len, batch.logits_indices.numel(),
                                   int(batch.is_decode)])
    dist.broadcast(header, src=0, group=group.control)
    if batch is not None:
        payload = torch.cat([batch.input_ids, batch.positions, batch.out_slots, batch.q_lens,
                             batch.kv_lens, batch.slot_table.reshape(-1),
                             batch.q_index.reshape(-1), batch.logits_indices])
        dist.broadcast(payload, src=0, group=group.control)


def receive_step(group: TPGroup) -> tuple[Command, ForwardBatch | None]:
    """Workers: wait for rank 0's next command (and its batch, on the CPU)."""
    header = torch.zeros(_HEADER_LEN, dtype=torch.int64)
    dist.broadcast(header, src=0, group=group.control)
    command, tokens, size, slot_cols, max_q, num_logits, is_decode = header.tolist()
    if command != Command.FORWARD:
        return Command(command), None
    sizes = [tokens, tokens, tokens, size, size, size * slot_cols, size * max_q, num_logits]
    payload = torch.empty(sum(sizes), dtype=torch.int64)
    dist.broadcast(payload, src=0, group=group.control)
    ids, pos, slots, q_lens, kv_lens, table, q_index, logits = payload.split(sizes)
    return Command.FORWARD, ForwardBatch(
        input_ids=ids, positions=pos, out_slots=slots, q_lens=q_lens, kv_lens=kv_lens,
        slot_table=table.view(size, slot_cols), q_index=q_index.view(size, max_q),
        logits_indices=logits, max_q_len=max_q, is_decode=bool(is_decode))
