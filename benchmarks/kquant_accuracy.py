"""How near each K-quant product's int8 steps for x keep a model to its float32 weights: the prompt
logprobs of README tokens through a K-quant GGUF, one engine per product with that product taking
every call of the K-quant matrices (decode and prefill alike), against the same file dequantized to
float32. Products (kernels/cpu/kquant_vnni.c): `per-16` (x in steps per 16 k), `fine` (the decode
kernel: per 256 k with a power-of-two step per 32), `per-256` (the many-row product, llama.cpp's
Q8_K); the legacy types' matrices keep the per-16 kernel throughout, so only the K-quants differ.

The default model (no flag) is the default GGUF requantized to Q4_K_M by the peer's
`llama-quantize` (build it with benchmarks/build_llama_server.sh): its 576-wide rows fall back to
Q5_0/Q8_0, so its K-quants are the ffn_down matrices, whose input carries the outlier channels.

    python -m benchmarks.kquant_accuracy [--model K_QUANT.gguf] [--tokens 4000]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import pathlib
import subprocess
from collections.abc import Iterator

import torch

from benchmarks.report import machine
from benchmarks.servers import default_gguf
from forklm.kernels.cpu import bindings as native_kernels
from forklm.runtime.quant import kquant

PRODUCTS = ("per-16", "fine", "per-256")
# the C entry that takes every K-quant call (per-256: the many-row product for every row count)
_ENTRIES = {"per-16": "kquant_matmul", "fine": "kquant_gemm_fine"}


@contextlib.contextmanager
def every_call_by(product: str) -> Iterator[None]:
    """Engines made inside send every K-quant matmul to `product` (module state, restored after)."""
    saved = kquant.GEMM_MIN_ROWS, kquant.AMX_MIN_ROWS, kquant.KQuantMatrix.native
    kquant.AMX_MIN_ROWS = 2**62
    if product == "per-256":
        kquant.GEMM_MIN_ROWS = 1
    else:
        kquant.GEMM_MIN_ROWS = 2**62

        def native(self: kquant.KQuantMatrix):
            entry = _ENTRIES[product] if self.ggml_type in kquant._K_TYPES else "kquant_matmul"
            return self._bound("_native", functools.partial(native_kernels.kquant_matmul,
                                                            entry=entry))
        kquant.KQuantMatrix.native = native  # type: ignore[method-assign]
    try:
        yield
    finally:
        kquant.GEMM_MIN_ROWS, kquant.AMX_MIN_ROWS, kquant.KQuantMatrix.native = saved


def scored(engine, ids: list[int], chunk: int = 1000) -> tuple[torch.Tensor, list[int]]:
    """Each token's logprob and the top-1 token before it, over `ids` in prompts of `chunk`; the
    engine is shut down after."""
    logprobs: list[float] = []
    tops: list[int] = []
    try:
        for start in range(0, len(ids), chunk):
            res = engine.generate(input_ids=ids[start:start + chunk],
                                  sampling_params={"max_new_tokens": 0}, return_logprob=True,
                                  logprob_start_len=0, top_logprobs_num=1)
            info = res["meta_info"]
            logprobs += [lp for lp, _, _ in info["input_token_logprobs"][1:]]
            tops += [top[0][1] for top in info["input_top_logprobs"][1:]]
    finally:
        engine.shutdown()
    return torch.tensor(logprobs, dtype=torch.float64), tops


def requantized_default(llama_bin: pathlib.Path, workdir: pathlib.Path) -> pathlib.Path:
    """The default GGUF requantized to Q4_K_M (made once, then reused)."""
    out = workdir / "default-Q4_K_M.gguf"
    if not out.exists():
        workdir.mkdir(parents=True, exist_ok=True)
        done = subprocess.run([str(llama_bin / "llama-quantize"), "--allow-requantize",
                               str(default_gguf()), str(out), "Q4_K_M", "2"],
                              capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"llama-quantize failed ({done.returncode}):\n"
                               f"{done.stderr[-2000:]}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="a GGUF with K-quant matrices (default: the default model "
                                    "requantized to Q4_K_M)")
    ap.add_argument("--tokens", type=int, default=4000, help="README tokens scored")
    ap.add_argument("--llama-bin", type=pathlib.Path,
                    default=pathlib.Path("/tmp/llama-server-build/bin"),
                    help="folder with llama-quantize")
    ap.add_argument("--workdir", type=pathlib.Path, default=pathlib.Path("/tmp/forklm-gguf-sizes"))
    args = ap.parse_args()
    assert kquant.kquant_available(), "the K-quant kernels need AVX512-VNNI/BW/BF16"
    model = args.model or str(requantized_default(args.llama_bin, args.workdir))
    from forklm import Engine

    reference = Engine(model_path=model, dtype="float32", quantization="none",
                       max_total_tokens=4096)
    readme = (pathlib.Path(__file__).resolve().parents[1] / "README.md").read_text()
    ids = reference.parts.tokenizer.encode(readme, add_special_tokens=False)[:args.tokens]
    exact, exact_tops = scored(reference, ids)
    print(f"# {machine()}; {model}; {len(exact)} tokens scored against the float32 dequantized "
          "model\n")
    print("| product | mean abs logprob difference | mean change | top-1 agreement |")
    print("|---|---|---|---|")
    for product in PRODUCTS:
        with every_call_by(product):
            logprobs, tops = scored(Engine(model_path=model, dtype="bfloat16",
                                           quantization="gguf", max_total_tokens=4096), ids)
        diff = logprobs - exact
        agree = sum(a == b for a, b in zip(tops, exact_tops)) / len(tops)
        print(f"| {product} | {diff.abs().mean():.4f} | {diff.mean():+.4f} | {agree:.1%} |",
              flush=True)


if __name__ == "__main__":
    main()
