"""Real sizes from GGUF: synthetic files of real models' shapes in llama.cpp's Q4_K_M and Q5_K_M
mixes, served by forklm and by llama.cpp's llama-server on the same file, one after the other:
load time (process start to /health), peak RSS at load and after decoding, and single-stream
decode ms/token.

The weights are random (speed does not depend on their values): written as F16 with gguf-py, one
tensor at a time, then quantized by llama.cpp's own `llama-quantize`, so each file holds the type
mix a user downloads (Q4_K with Q6_K for some attn_v/ffn_down rows, and so on). The vocabulary is
the default model's, padded with plain tokens to the shape's vocab size.

Decode ms/token is measured the same way for both servers: the wall time of a request for
1 + NEW_TOKENS tokens minus that of a request for 1 token, over NEW_TOKENS (prefill and HTTP
cancel out), median of --repeats. Load times are with forklm's config/tokenizer cache warm (the
first load of a file also converts its tokenizer; printed separately).

Run: `python -m benchmarks.gguf_sizes --llama-bin /tmp/llama-server-build/bin
      [--shapes llama-3.2-1b,qwen2.5-3b] [--mixes Q4_K_M,Q5_K_M] [--workdir /tmp/forklm-gguf-sizes]`
(build llama-server and llama-quantize with benchmarks/build_llama_server.sh). Files are reused
from --workdir when present.
"""

from __future__ import annotations

import argparse
import collections
import pathlib
import statistics
import subprocess
import time
from dataclasses import dataclass

import gguf
import httpx
import numpy as np
import psutil

from benchmarks.report import machine
from benchmarks.servers import ServerProcess, forklm_server, llama_server
from forklm.runtime.models.gguf_file import GGUFFile
from forklm.runtime.models.source import default_model_gguf


@dataclass(frozen=True)
class Shape:
    """The sizes of one real checkpoint, as llama.cpp's converter writes them."""

    arch: str  # GGUF architecture
    vocab: int
    hidden: int
    ffn: int
    layers: int
    heads: int
    kv_heads: int
    rope_theta: float
    qkv_bias: bool = False  # Qwen2

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


SHAPES = {  # tied embeddings, as these checkpoints have
    "qwen2.5-0.5b": Shape("qwen2", 151936, 896, 4864, 24, 14, 2, 1e6, qkv_bias=True),
    "llama-3.2-1b": Shape("llama", 128256, 2048, 8192, 16, 32, 8, 500000.0),
    "qwen2.5-1.5b": Shape("qwen2", 151936, 1536, 8960, 28, 12, 2, 1e6, qkv_bias=True),
    "qwen2.5-3b": Shape("qwen2", 151936, 2048, 11008, 36, 16, 2, 1e6, qkv_bias=True),
}
CONTEXT = 4096  # KV tokens both servers hold (llama-server -np 1 -c 4096)
NEW_TOKENS = 64
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def _tensors(shape: Shape) -> list[tuple[str, tuple[int, ...]]]:
    """(name, numpy shape) of every tensor, in llama.cpp's names; numpy shapes are [rows, cols]."""
    h, d = shape.hidden, shape.head_dim
    q, kv = shape.heads * d, shape.kv_heads * d
    out: list[tuple[str, tuple[int, ...]]] = [("token_embd.weight", (shape.vocab, h))]
    for i in range(shape.layers):
        out += [(f"blk.{i}.attn_norm.weight", (h,)), (f"blk.{i}.attn_q.weight", (q, h)),
                (f"blk.{i}.attn_k.weight", (kv, h)), (f"blk.{i}.attn_v.weight", (kv, h)),
                (f"blk.{i}.attn_output.weight", (h, q)), (f"blk.{i}.ffn_norm.weight", (h,)),
                (f"blk.{i}.ffn_gate.weight", (shape.ffn, h)),
                (f"blk.{i}.ffn_up.weight", (shape.ffn, h)),
                (f"blk.{i}.ffn_down.weight", (h, shape.ffn))]
        if shape.qkv_bias:
            out += [(f"blk.{i}.attn_q.bias", (q,)), (f"blk.{i}.attn_k.bias", (kv,)),
                    (f"blk.{i}.attn_v.bias", (kv,))]
    return [*out, ("output_norm.weight", (h,))]


def write_f16(path: pathlib.Path, shape: Shape, seed: int = 0) -> None:
    """A GGUF of `shape` with random F16 matrices (F32 norms and biases), written one tensor at a
    time so a 3B file never sits in memory whole."""
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(path, shape.arch)
    writer.add_block_count(shape.layers)
    writer.add_context_length(32768)
    writer.add_embedding_length(shape.hidden)
    writer.add_feed_forward_length(shape.ffn)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    _add_padded_vocab(writer, shape.vocab)
    specs = _tensors(shape)
    for name, dims in specs:
        dtype = np.float16 if len(dims) == 2 else np.float32
        writer.add_tensor_info(name, dims, np.dtype(dtype), int(np.prod(dims)) * np.dtype(dtype).itemsize)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for name, dims in specs:
        if len(dims) == 1:  # norms near 1 (RMSNorm weights), biases near 0
            data = (1.0 if name.endswith("norm.weight") else 0.0) + 0.02 * rng.standard_normal(
                dims, dtype=np.float32)
        else:  # std 1/sqrt(fan_in): activations stay O(1) through the layers
            data = (rng.standard_normal(dims, dtype=np.float32) / np.sqrt(dims[1])).astype(np.float16)
        writer.write_tensor_data(np.ascontiguousarray(data))
    writer.close()


def _add_padded_vocab(writer: gguf.GGUFWriter, size: int) -> None:
    """The default model's BPE vocabulary, merges and special tokens, padded with plain tokens
    (never produced by a merge) to `size` entries."""
    fields = GGUFFile(default_model_gguf()).fields
    tokens = list(fields["tokenizer.ggml.tokens"])
    types = fields["tokenizer.ggml.token_type"].tolist()
    pad = size - len(tokens)
    writer.add_tokenizer_model(fields["tokenizer.ggml.model"])
    writer.add_tokenizer_pre(fields["tokenizer.ggml.pre"])
    writer.add_token_list(tokens + [f"<pad_{i}>" for i in range(pad)])
    writer.add_token_types(types + [int(gguf.TokenType.NORMAL)] * pad)
    writer.add_token_merges(fields["tokenizer.ggml.merges"])
    writer.add_bos_token_id(fields["tokenizer.ggml.bos_token_id"])
    writer.add_eos_token_id(fields["tokenizer.ggml.eos_token_id"])


def ensure_file(workdir: pathlib.Path, name: str, shape: Shape, mix: str,
                llama_bin: pathlib.Path) -> pathlib.Path:
    """WORKDIR/NAME-MIX.gguf, made (F16 first, then llama-quantize) unless it exists."""
    out = workdir / f"{name}-{mix}.gguf"
    if out.exists():
        return out
    f16 = workdir / f"{name}-F16.gguf"
    if not f16.exists():
        print(f"writing {f16} ...", flush=True)
        write_f16(f16.with_suffix(".part"), shape)
        f16.with_suffix(".part").rename(f16)
    print(f"llama-quantize {f16.name} -> {out.name} ...", flush=True)
    done = subprocess.run([str(llama_bin / "llama-quantize"), str(f16),
                           str(out.with_suffix(".part")), mix, "2"], capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"llama-quantize failed ({done.returncode}):\n{done.stderr[-2000:]}")
    out.with_suffix(".part").rename(out)
    return out


def type_mix(path: pathlib.Path) -> str:
    """The file's quant types by share of its bytes, e.g. 'Q4_K 71%, Q6_K 27%, F32 0%'."""
    sizes: collections.Counter[str] = collections.Counter()
    for t in gguf.GGUFReader(path).tensors:
        sizes[t.tensor_type.name] += int(t.n_bytes)
    total = sum(sizes.values())
    return ", ".join(f"{k} {100 * v / total:.0f}%" for k, v in sizes.most_common())


def _peak_rss_mb(pid: int) -> float:
    """Peak RSS (VmHWM) of the process and its children, MB."""
    proc = psutil.Process(pid)
    total = 0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            status = pathlib.Path(f"/proc/{p.pid}/status").read_text()
        except OSError:
            continue
        total += next(int(line.split()[1]) for line in status.splitlines()
                      if line.startswith("VmHWM:"))
    return total / 1024


def _request(server: ServerProcess, kind: str, num_tokens: int) -> float:
    if kind == "forklm":
        url, body = "/generate", {"text": PROMPT, "sampling_params": {
            "max_new_tokens": num_tokens, "temperature": 0, "ignore_eos": True}}
    else:
        url, body = "/completion", {"prompt": PROMPT, "n_predict": num_tokens, "temperature": 0,
                                    "ignore_eos": True, "cache_prompt": False}
    t0 = time.perf_counter()
    httpx.post(server.base_url + url, json=body, timeout=900).raise_for_status()
    return time.perf_counter() - t0


def measure(kind: str, server: ServerProcess, repeats: int) -> dict[str, float]:
    """Load time, peak RSS and decode ms/token of a started server."""
    t0 = time.perf_counter()
    with server:
        load_s = time.perf_counter() - t0
        rss_load = _peak_rss_mb(server.pid)
        _request(server, kind, 4)  # warm-up: first-use allocations and kernels
        per_token = []
        for _ in range(repeats):
            short = _request(server, kind, 1)
            full = _request(server, kind, 1 + NEW_TOKENS)
            per_token.append(1000 * (full - short) / NEW_TOKENS)
        rss_end = _peak_rss_mb(server.pid)
    return {"load_s": load_s, "rss_load_mb": rss_load, "rss_end_mb": rss_end,
            "ms_per_token": statistics.median(per_token)}


def first_load_s(path: pathlib.Path) -> float | None:
    """Seconds forklm spends converting the file's config and tokenizer on its first load (they
    are cached after, under FORKLM_CACHE_DIR), None when the cache already holds them. The
    servers' load times below are then both without that one-time step."""
    from forklm.runtime.models.gguf_loader import GGUFModel, _cache_dir_for

    if _cache_dir_for(path).is_dir():
        return None
    t0 = time.perf_counter()
    GGUFModel(path)
    return time.perf_counter() - t0


def kv_pool_mb(shape: Shape, bytes_per_value: int = 2) -> float:
    return 2 * shape.layers * shape.kv_heads * shape.head_dim * CONTEXT * bytes_per_value / 2**20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-bin", type=pathlib.Path, default=pathlib.Path("/tmp/llama-server-build/bin"),
                    help="folder with llama-server and llama-quantize")
    ap.add_argument("--shapes", default="llama-3.2-1b,qwen2.5-3b", help=f"of {', '.join(SHAPES)}")
    ap.add_argument("--mixes", default="Q4_K_M,Q5_K_M")
    ap.add_argument("--systems", default="forklm,llama-server")
    ap.add_argument("--workdir", type=pathlib.Path, default=pathlib.Path("/tmp/forklm-gguf-sizes"))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    print(f"{machine(args.threads)}, "
          f"{CONTEXT} KV tokens, decode of {NEW_TOKENS} tokens at batch 1, median of {args.repeats}")
    print("| shape | mix | file MB | types | system | load s | peak RSS at load MB | "
          "(file + KV + 300) | peak RSS after decode MB | decode ms/token |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in args.shapes.split(","):
        shape = SHAPES[name]
        for mix in args.mixes.split(","):
            path = ensure_file(args.workdir, name, shape, mix, args.llama_bin)
            file_mb = path.stat().st_size / 2**20
            budget = file_mb + kv_pool_mb(shape) + 300
            first = first_load_s(path) if "forklm" in args.systems else None
            if first is not None:
                print(f"(forklm's first load of {path.name} converted its config and tokenizer "
                      f"in {first:.1f} s, cached for the loads below)", flush=True)
            for system in args.systems.split(","):
                if system == "forklm":
                    server = forklm_server(["--model-path", str(path), "--max-total-tokens",
                                            str(CONTEXT), "--context-length", str(CONTEXT),
                                            "--max-running-requests", "1"])
                else:
                    server = llama_server(str(args.llama_bin / "llama-server"), parallel=1,
                                          num_threads=args.threads, ctx_per_slot=CONTEXT,
                                          model=str(path))
                r = measure(system, server, args.repeats)
                print(f"| {name} | {mix} | {file_mb:.0f} | {type_mix(path)} | {system} | "
                      f"{r['load_s']:.1f} | {r['rss_load_mb']:.0f} | {budget:.0f} | "
                      f"{r['rss_end_mb']:.0f} | {r['ms_per_token']:.1f} |", flush=True)


if __name__ == "__main__":
    main()
