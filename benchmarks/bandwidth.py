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
import ctypes
import functools
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from forklm.kernels.cpu.native_build import compile_library
from forklm.runtime.quant.linear import QuantizedLinear

READ_BYTES = 2**30  # larger than any cache, so every pass reads DRAM
PROBE_SOURCE = Path(__file__).with_name("read_bandwidth.c")
PROBE_STREAMS = (1, 2, 3, 4)


def read_bandwidth_gbs(repeats: int = 7) -> float:
    """The fastest this machine reads memory with torch's threads, in GB/s (10^9 bytes): the best
    median of a float32 sum over a 1 GiB tensor and of the C probe reading it as 1-4 streams a
    thread (read_bandwidth.c; skipped without a C compiler). A torch sum reads one stream a
    thread, which on these VMs leaves ~10-25% of the bandwidth unused (benchmarks/NOTES.md,
    session 29): a floor from it alone would be too lenient."""
    return max(read_rates_gbs(repeats).values())


def read_rates_gbs(repeats: int = 7) -> dict[str, float]:
    """Median GB/s of each way read_bandwidth_gbs reads the 1 GiB: "torch sum", "C 1 streams",
    ... "C 4 streams" (the probe's, where it builds)."""
    data = torch.ones(READ_BYTES // 4, dtype=torch.float32)
    readers: dict[str, Callable[[], object]] = {"torch sum": data.sum}
    probe = _read_probe()
    if probe is not None:
        for streams in PROBE_STREAMS:
            readers[f"C {streams} streams"] = functools.partial(
                probe, data.data_ptr(), READ_BYTES // 8, streams, torch.get_num_threads())
    rates = {}
    for name, read in readers.items():
        read()  # first touch: page faults are not bandwidth
        seconds = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            read()
            seconds.append(time.perf_counter() - t0)
        rates[name] = READ_BYTES / statistics.median(seconds) / 1e9
    return rates


@functools.cache
def _read_probe() -> Callable[[int, int, int, int], int] | None:
    """read_bandwidth.c's read_streams(address, words, streams, threads), built for this CPU once per
    process; None without a C compiler or where it fails to build."""
    cc = os.environ.get("CC", "cc")
    if shutil.which(cc) is None:
        return None
    with tempfile.TemporaryDirectory(prefix="forklm-read-probe-") as folder:
        target = Path(folder, "read_bandwidth.so")  # loaded before the folder goes
        try:
            compile_library(cc, PROBE_SOURCE, ["-O3", "-march=native", "-fopenmp", "-shared",
                                               "-fPIC", "-std=gnu11"], target)
            read = ctypes.CDLL(str(target)).read_streams
        except (RuntimeError, OSError):
            return None
    read.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int]
    read.restype = ctypes.c_uint64
    return read


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
    rates = read_rates_gbs()
    gbs = max(rates.values())
    print(", ".join(f"{name} {rate:.1f} GB/s" for name, rate in rates.items()))
    print(f"weights read per token {weight / 1e6:.1f} MB, read bandwidth {gbs:.1f} GB/s "
          f"({torch.get_num_threads()} threads): floor {weight / gbs / 1e6:.2f} ms/token")


if __name__ == "__main__":
    main()
