"""K-quant (and legacy Q4_0/Q5_0/Q8_0) matrices of a 1B model's shapes, several ways,
interleaved in one process (medians): `per-16` kernels/cpu/kquant_vnni.c's per-16 kernel on the
compact records (quant/kquant.py's KQuantMatrix, x in int8 steps per 16 k), `decode` the decode
kernel (KQuantMatrix.native(): the fine product for the K-quants, x per 256 k in power-of-two
steps per 32; the per-16 kernel for the legacy types), `many-row` its many-row product on the
same records (x per 256 k, or per 32 for the legacy types), `AMX` the
same records on AMX tiles (bf16 weights a tile at a time, x as it is; where the CPU runs them), `int4` the
Int4Matrix path that held K-quants before (torch's int4 packing), `dense` a packed bf16 copy
(oneDNN; what small models attach for larger calls) and `dequantize + GEMM` the records
dequantized to bf16 for the call, then torch's GEMM. Also the bytes each holds. Weights are
real K-quant blocks (gguf-py's Q6_K quantizer is absent, so random blocks with realistic fp16
steps, tests/test_quant.make_weight).

    PYTHONPATH=. .venv/bin/python -m benchmarks.kquant_matmul [--rows 1 8 16 64 256] \
        [--types Q4_K Q6_K Q8_0] [--shapes 2048x2048 8192x2048 2048x8192 4864x896]
"""

from __future__ import annotations

import argparse
import functools

import torch
from gguf import GGMLQuantizationType

from benchmarks.int4_gemv import medians
from benchmarks.report import machine
from forklm.kernels.cpu import bindings as native_kernels
from forklm.runtime.models.onednn_linear import OneDNNLinear
from forklm.runtime.quant.kquant import KQuantMatrix, kquant_available
from forklm.runtime.quant.linear import QuantizedLinear, use_int8_activations


def _dequantized_product(matrix: KQuantMatrix, wt: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return x @ matrix.dense_t(wt)


def main() -> None:
    from tests.test_quant import make_weight

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 32, 64, 128, 256])
    parser.add_argument("--types", nargs="+", default=["Q4_K", "Q5_K", "Q6_K"])
    parser.add_argument("--shapes", nargs="+", default=["8192x2048", "2048x8192"],
                        help="out x in")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    assert kquant_available(), "the K-quant kernel needs AVX512-VNNI/BW/BF16 and a C compiler"
    print(f"# {machine()}")
    print("| type | out x in | rows | per-16 us | decode us | many-row us | int4 us | dense us | "
          "dequantize + GEMM us (dequantize alone) | AMX us | decode / per-16 | many-row / per-16 "
          "| many-row / dense | many-row / dequantize + GEMM | AMX / many-row | AMX / dense |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for type_name in args.types:
        ggml_type = GGMLQuantizationType[type_name]
        for shape in args.shapes:
            out_features, in_features = (int(n) for n in shape.split("x"))
            weight = make_weight(ggml_type, out_features, in_features, seed=1)
            records = QuantizedLinear.from_gguf([weight], None, torch.bfloat16,
                                                kquant_records=True)
            kq = records.matrices[0]
            assert isinstance(kq, KQuantMatrix)
            int4 = QuantizedLinear.from_gguf([weight], None, torch.bfloat16)
            use_int8_activations(int4, max_bytes=2**40)
            dense = OneDNNLinear(records.dequantize().bfloat16(), None)
            wt = torch.empty(in_features, out_features, dtype=torch.bfloat16)
            kq_per16 = native_kernels.kquant_matmul(int(ggml_type), kq.records, kq.padded_rows,
                                                    out_features, in_features)
            kq_decode = kq.native()  # the decode kernel for every row count
            kq_gemm = kq.gemm()  # the many-row product for every row count
            kq_amx = kq.amx_gemm()  # None where AMX does not run
            print(f"<!-- {type_name} {shape}: records {records.nbytes / 1e6:.1f} MB, int4 "
                  f"{int4.nbytes / 1e6:.1f} MB, file {weight.nbytes / 1e6:.1f} MB -->")
            for rows in args.rows:
                x = torch.randn(rows, in_features).bfloat16()
                calls = max(1, 64 // rows)
                amx = {} if kq_amx is None else {"amx": functools.partial(kq_amx, x)}
                with torch.inference_mode():
                    t = medians({**amx, "per16": functools.partial(kq_per16, x),
                                 "decode": functools.partial(kq_decode, x),
                                 "gemm": functools.partial(kq_gemm, x),
                                 "int4": functools.partial(int4, x),
                                 "dense": functools.partial(dense, x),
                                 "dequant": functools.partial(_dequantized_product, kq, wt, x),
                                 "dequant only": functools.partial(kq.dense_t, wt)},
                                calls, args.rounds)
                amx_cols = (("-", "-", "-") if kq_amx is None else
                            (f"{t['amx']:.0f}", f"{t['amx'] / t['gemm']:.2f}",
                             f"{t['amx'] / t['dense']:.2f}"))
                print(f"| {type_name} | {shape} | {rows} | {t['per16']:.0f} | {t['decode']:.0f} "
                      f"| {t['gemm']:.0f} | {t['int4']:.0f} | {t['dense']:.0f} | {t['dequant']:.0f} "
                      f"({t['dequant only']:.0f}) | {amx_cols[0]} | {t['decode'] / t['per16']:.2f} "
                      f"| {t['gemm'] / t['per16']:.2f} | "
                      f"{t['gemm'] / t['dense']:.2f} | {t['gemm'] / t['dequant']:.2f} | "
                      f"{amx_cols[1]} | {amx_cols[2]} |",
                      flush=True)


if __name__ == "__main__":
    main()
