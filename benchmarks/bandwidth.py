"""The memory-bandwidth floor of single-stream decode: how many weight bytes one token reads, and
how fast this machine reads memory, measured in the same run as the decode it bounds.

At batch 1 every weight matrix is read once per token (the head included: tied to the embedding
or not, it scores the whole vocabulary), while the embedding table contributes one row. So
ms/token can be no lower than weight bytes per token / read bandwidth; issue 34 asks for at
most 1.25x that floor.

Run alone: `python -m benchmarks.bandwidth [--model FILE]` prints both figures and the floor.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from forklm.runtime.quant.linear import QuantizedLinear

READ_BYTES = 2**30  # larger than any cache, so every pass reads DRAM


def read_bandwidth_gbs(repeats: int = 7) -> float:
    """Median GB/s (10^9 bytes) of a float32 sum over a 1 GiB tensor with torch's threads: the
    read bandwidth a decode step's matmuls can at best stream weights at."""
    data = torch.ones(READ_BYTES // 4, dtype=torch.float32)
    data.sum()  # first touch: page faults are not bandwidth
    seconds = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        data.sum()
        seconds.append(time.perf_counter() - t0)
    return READ_BYTES / statistics.median(seconds) / 1e9


def weight_bytes_per_token(model: nn.Module) -> int:
    """Bytes of weights one batch-1 decode step reads: every linear (kept quantized or dense),
    the norms, and the head; the embedding table counts only where it is also the head."""
    total = 0
    embeddings = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    skip = {id(p) for m in embeddings for p in m.parameters(recurse=False)}
    for module in model.modules():
        if isinstance(module, QuantizedLinear):
            total += module.nbytes
        for param in module.parameters(recurse=False):
            if id(param) not in skip:
                total += param.numel() * param.element_size()
                skip.add(id(param))  # a tied weight counts once
    head = getattr(model, "tied_head", None)
    if isinstance(head, QuantizedLinear):
        total += head.nbytes
    elif isinstance(head, torch.Tensor):
        total += head.numel() * head.element_size()
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a GGUF file; default: the default model")
    args = parser.parse_args()
    from forklm import Engine

    options = {"model_path": args.model} if args.model else {}
    with Engine(max_total_tokens=4096, **options) as engine:
        weight = weight_bytes_per_token(engine.parts.runner.model)
    gbs = read_bandwidth_gbs()
    print(f"weights read per token {weight / 1e6:.1f} MB, read bandwidth {gbs:.1f} GB/s "
          f"({torch.get_num_threads()} threads): floor {weight / gbs / 1e6:.2f} ms/token")


if __name__ == "__main__":
    main()
