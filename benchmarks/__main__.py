"""Run benchmark workloads on several systems side by side in one process and report medians.

  python -m benchmarks --scale full --repeats 3          # the full suite (see RESULTS.md)
  python -m benchmarks --workloads W1,W2 --systems forklm,forklm-nocache,hf8 --scale 0.25
  python -m benchmarks --systems http --base-url http://127.0.0.1:30000 --workloads W1
  python -m benchmarks --workloads W1,W2,W3,S1 --systems forklm-http,llama-server-np16  # issue 15

Systems: forklm, forklm-nocache, forklm-fcfs, forklm-ngram (NGRAM speculative decoding), forklm-int4
(quantization="gguf": no dense copy), forklm-dense (quantization="none": weights in the run dtype),
forklm-deterministic (enable_deterministic_inference), forklm-compile (enable_torch_compile)
(in-process Engine and its ablations), hf1, hf8
(transformers one at a time / static batches of 8), http (any OpenAI-compatible server at
--base-url), forklm-http (starts `forklm serve`), llama-server-np8 and llama-server-np16
(llama.cpp's C++ server with 8 / 16 parallel slots on the same GGUF; build it with
benchmarks/build_llama_server.sh, or pass --llama-server PATH), llamacpp (llama-cpp-python's
server, one request at a time, with --llamacpp-python). Workload S1 is W2's prompts one at a time,
for ms/token and TTFT at batch 1. Repeats are interleaved across systems (repeat 1 of every system,
then repeat 2, ...) so that a busy machine slows all of them alike. Writes a markdown report, the
raw runs as JSON and a PNG plot to benchmarks/results/<stamp>.*
"""

from __future__ import annotations

import argparse
import contextlib
import json
import pathlib
import time
from typing import Any

from benchmarks import report
from benchmarks.runners import EngineRunner, HFRunner, Metrics
from benchmarks.workloads import WORKLOADS, Workload
from forklm.runtime.cpu_threads import release_openmp_threads
from forklm.runtime.process_heap import tune_heap

ENGINE_SYSTEMS: dict[str, dict[str, Any]] = {  # name -> Engine options (the ablations)
    "forklm": {},
    "forklm-nocache": {"disable_radix_cache": True},
    "forklm-fcfs": {"schedule_policy": "fcfs"},
    "forklm-ngram": {"speculative_algorithm": "NGRAM"},
    "forklm-int4": {"quantization": "gguf"},  # only the int4 blocks, no dense bf16 copy
    # Weights in the run dtype (no int4 blocks, no float16 weights on an AVX2 CPU)
    "forklm-dense": {"quantization": "none"},
    # Batch-invariant matmuls and attention: what determinism costs
    "forklm-deterministic": {"enable_deterministic_inference": True},
    # Each layer's dense steps compiled by inductor (runtime/forward/torch_compile.py)
    "forklm-compile": {"enable_torch_compile": True},
    # Decode steps back to back before the scheduler looks again (SGLang's flag)
    "forklm-cds4": {"num_continuous_decode_steps": 4},
    "forklm-cds8": {"num_continuous_decode_steps": 8},
}
LLAMA_SERVER_SLOTS = {"llama-server-np8": 8, "llama-server-np16": 16}
HTTP_SYSTEMS = ("http", "forklm-http", "llamacpp", *LLAMA_SERVER_SLOTS)
# Servers this benchmark starts, started afresh for every repeat (`http` is someone else's)
RESTARTED_EACH_REPEAT = ("forklm-http", "llamacpp", *LLAMA_SERVER_SLOTS)
SYSTEMS = (*ENGINE_SYSTEMS, "hf1", "hf8", *HTTP_SYSTEMS)
PROGRAM_WORKLOADS = ("W5-select", "W5-fork")
RESULTS = pathlib.Path(__file__).parent / "results"
FULL_WORKLOADS = "S1,W1,W1-64,W2,W3,W4,W4-free,W5-select,W5-fork"
FULL_SYSTEMS = "forklm,forklm-nocache,forklm-fcfs,forklm-http,hf8,llama-server-np8,llama-server-np16"


def _engine_options(args: argparse.Namespace) -> dict[str, Any]:
    opts: dict[str, Any] = {"dtype": args.dtype, "max_total_tokens": args.max_total_tokens,
                            "kv_cache_dtype": args.kv_cache_dtype}
    if args.model:
        opts["model_path"] = args.model
    if args.num_threads:
        opts["num_threads"] = args.num_threads
    return opts


def _make_runner(system: str, args: argparse.Namespace, stack: contextlib.ExitStack) -> Any:
    if system in ENGINE_SYSTEMS:
        from forklm import Engine

        engine = stack.enter_context(Engine(**_engine_options(args), **ENGINE_SYSTEMS[system]))
        return EngineRunner(engine, system)
    if system in ("hf1", "hf8"):
        return _hf_runner(system, args)
    if system in HTTP_SYSTEMS:
        return _http_runner(system, args, stack)
    raise SystemExit(f"unknown system {system!r}; known: {', '.join(SYSTEMS)}")


def _hf_runner(system: str, args: argparse.Namespace) -> HFRunner:
    if args.model:
        raise SystemExit(f"--systems {system} runs the default model only, not --model")
    import torch
    import transformers

    from forklm.runtime.config import resolved_dtype_name
    from forklm.runtime.models.loader import load_model

    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    loaded = load_model("SmolLM2-135M-Instruct")
    model = transformers.LlamaForCausalLM(loaded.config)
    model.load_state_dict(loaded.state_dict(), strict=False)
    model.tie_weights()
    dtype = getattr(torch, resolved_dtype_name(args.dtype))
    return HFRunner(model.to(dtype).eval(), loaded.tokenizer, 1 if system == "hf1" else 8)


def _http_runner(system: str, args: argparse.Namespace, stack: contextlib.ExitStack) -> Any:
    from benchmarks.http_runner import HTTPRunner
    from benchmarks.servers import forklm_server, llamacpp_server

    if system in LLAMA_SERVER_SLOTS:
        return _llama_server_runner(system, args, stack)
    if system == "http":
        if not args.base_url:
            raise SystemExit("--systems http needs --base-url URL")
        return HTTPRunner(args.base_url, "http", server_pid=args.server_pid)
    if system == "llamacpp":
        server = stack.enter_context(llamacpp_server(args.llamacpp_python,
                                                     num_threads=args.num_threads or 2))
        # llama-cpp-python has no ignore_eos: a -100 bias on the EOS id keeps it generating
        # max_tokens like the others; it runs no JSON schema constraint on completions.
        # It reports no usage when streaming: prompts are counted with the same GGUF's tokenizer,
        # and its prefix reuse is not reported, so every prompt token counts as computed.
        return HTTPRunner(server.base_url, "llamacpp", server_pid=server.pid,
                          supports_json_schema=False, eos_bias_ids=(2,),
                          count_tokens=_gguf_token_counter(args.model))
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in _engine_options(args).items()]
    server = stack.enter_context(forklm_server(flags))
    return HTTPRunner(server.base_url, "forklm-http", server_pid=server.pid)


def _llama_server_runner(system: str, args: argparse.Namespace,
                         stack: contextlib.ExitStack) -> Any:
    from benchmarks.http_runner import HTTPRunner
    from benchmarks.servers import llama_server

    if not pathlib.Path(args.llama_server).exists():
        raise SystemExit(f"--llama-server {args.llama_server} does not exist; build it with "
                         "benchmarks/build_llama_server.sh [DEST] (about 10 minutes)")
    server = stack.enter_context(llama_server(args.llama_server, LLAMA_SERVER_SLOTS[system],
                                              num_threads=args.num_threads or 2,
                                              model=args.model))
    # It takes ignore_eos, streams usage (with prompt_tokens_details.cached_tokens) and
    # timings.cache_n in the last chunk, and constrains /v1/completions by a json_schema object.
    return HTTPRunner(server.base_url, system, server_pid=server.pid,
                      json_schema_as_string=False)


def _gguf_token_counter(model: str | None) -> Any:
    from forklm.runtime.models.loader import load_model

    tokenizer = load_model(model or "SmolLM2-135M-Instruct").tokenizer
    return lambda text: len(tokenizer.encode(text))


def _workload(name: str, scale: float, max_in_flight: int | None) -> Workload:
    if name not in WORKLOADS:
        raise SystemExit(f"unknown workload {name!r}; known: "
                         f"{', '.join([*WORKLOADS, *PROGRAM_WORKLOADS])}")
    wl = WORKLOADS[name]()
    if wl.multi_turn:  # scale conversations, keeping every turn of each
        keep = max(1, int(len({r.conversation for r in wl.requests}) * scale))
        wl.requests = [r for r in wl.requests if (r.conversation or 0) < keep]
    else:
        wl.requests = wl.requests[: max(1, int(len(wl.requests) * scale))]
    wl.max_in_flight = max_in_flight or wl.max_in_flight
    return wl


def _run_once(system: str, runner: Any, names: list[str], args: argparse.Namespace,
              runs: report.Runs) -> None:
    for name in names:
        if name in PROGRAM_WORKLOADS:
            if system in ENGINE_SYSTEMS:
                _run_programs(system, runner, name, args.scale, runs)
            continue
        wl = _workload(name, args.scale, args.max_in_flight)
        if runner.supports(wl):
            floored = system == "forklm" and name == "S1"
            if floored:
                _read_bandwidth_now()
            m = runner.run(wl)
            if floored:
                _read_bandwidth_now()
            runs.setdefault((wl.name, system), []).append(m)
            print(f"  {system:15s} {wl.name:32s} {m.output_tokens_per_s:8.1f} tok/s "
                  f"{m.wall_s:7.1f} s", flush=True)


def _run_programs(system: str, runner: EngineRunner, name: str, scale: float,
                  runs: report.Runs) -> None:
    from benchmarks.programs import PROGRAM_WORKLOADS as PW
    from benchmarks.programs import ProgramRunner

    pw = PW[name]()
    pw.items = pw.items[: max(1, int(len(pw.items) * scale))]
    prog_runner = ProgramRunner(runner.engine, system)
    for batched in (True, False):
        m = prog_runner.run(pw, batched)
        runs.setdefault((m.workload, system), []).append(m)
        print(f"  {system:15s} {m.workload:32s} {m.requests_per_s:8.2f} programs/s", flush=True)


def _kv_memory(runners: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    from benchmarks.kv_memory import measure_kv_memory

    extra: dict[str, Any] = {}
    for system in ("forklm", "forklm-nocache"):
        if system in runners:
            wl = _workload("W2", min(args.scale, 0.5), None)
            kv = measure_kv_memory(runners[system].engine, wl)
            extra[f"KV bytes reserved / needed, W2, {system} (max of {kv.samples} samples)"] = (
                kv.max_ratio, 1.02)
    if "forklm" in runners:
        from benchmarks.engine_speed import decode_step_split

        forward, overhead = decode_step_split(runners["forklm"].engine)
        extra[f"outside the forward / decode step, batch 16 ({overhead:.1f} of "
              f"{forward + overhead:.1f} ms)"] = (overhead / (forward + overhead), 0.10)
    return extra


def _parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", default="W1,W2,W3")
    p.add_argument("--systems", default="forklm,forklm-nocache,hf8")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--scale", default="1.0",
                   help="fraction of each workload's requests, or 'full' (= the full suite's "
                        f"workloads {FULL_WORKLOADS} and systems {FULL_SYSTEMS}, scale 1)")
    p.add_argument("--dtype", default="auto",
                   help="dtype of every in-process system (forklm and transformers alike); auto = "
                        "bfloat16 where the CPU has native bf16, else float32")
    p.add_argument("--model", default=None,
                   help="a GGUF file (or any model forklm loads) for the engine, forklm-http and "
                        "llama-server systems, e.g. a synthetic file of benchmarks.gguf_sizes; "
                        "default: the default model")
    p.add_argument("--max-total-tokens", type=int, default=65536)
    p.add_argument("--kv-cache-dtype", default="auto",
                   help="the in-process engines' KV pool: auto, fp8_e5m2, fp8_e4m3 or int8")
    p.add_argument("--num-threads", type=int, default=None,
                   help="threads for every system (engine, transformers, llama.cpp; default 2 "
                        "for llama.cpp and torch's default elsewhere)")
    p.add_argument("--max-in-flight", type=int, default=None,
                   help="override the workloads' requests in flight (16 in workloads.md)")
    p.add_argument("--base-url", default=None, help="server for --systems http")
    p.add_argument("--server-pid", type=int, default=None, help="its pid, for peak RSS")
    p.add_argument("--llamacpp-python", default="/tmp/llamacpp-venv/bin/python")
    p.add_argument("--llama-server", default="/tmp/llama-server-build/bin/llama-server",
                   help="llama.cpp's llama-server binary (benchmarks/build_llama_server.sh)")
    p.add_argument("--kv-memory", action="store_true",
                   help="also measure KV bytes reserved / needed on forklm's pool")
    args = p.parse_args()
    if args.scale == "full":
        args.scale, args.kv_memory = 1.0, True
        if "--workloads" not in _argv():
            args.workloads = FULL_WORKLOADS
        if "--systems" not in _argv():
            args.systems = FULL_SYSTEMS
    args.scale = float(args.scale)
    return args


def _argv() -> list[str]:
    import sys

    return [a.split("=")[0] for a in sys.argv[1:]]


def main() -> None:
    # glibc's malloc as `forklm serve` sets it, before a second thread exists: the in-process
    # engines run as served (runtime/process_heap.py)
    tune_heap()
    args = _parse_args()
    systems, names = args.systems.split(","), args.workloads.split(",")
    runs: report.Runs = {}
    t0 = time.perf_counter()
    with contextlib.ExitStack() as stack:
        stacks = {s: stack.enter_context(contextlib.ExitStack()) for s in systems}
        runners = {s: _make_runner(s, args, stacks[s]) for s in systems}
        for rep in range(args.repeats):
            print(f"repeat {rep + 1}/{args.repeats}", flush=True)
            for system in systems:
                if rep and system in RESTARTED_EACH_REPEAT:
                    # A server's prompt cache would hold every prompt of the repeat before:
                    # measured again, nothing would be prefilled (the in-process engine flushes
                    # its cache before each run instead).
                    stacks[system].close()
                    stacks[system] = stack.enter_context(contextlib.ExitStack())
                    runners[system] = _make_runner(system, args, stacks[system])
                # This thread's OpenMP team (left by loading transformers' model or running its
                # batches) would give libgomp more threads than cores next to the engine's,
                # and libgomp then cuts the engine's spin short (runtime/cpu_threads.py).
                release_openmp_threads()
                try:
                    _run_once(system, runners[system], names, args, runs)
                except Exception as e:  # one system failing (a server crash) keeps the others
                    print(f"  {system} failed, its remaining workloads skipped: {e!r}",
                          flush=True)
        extra = _extras(runners, runs, args)
    text = (f"`python -m benchmarks {' '.join(_quoted_argv())}` ({time.perf_counter() - t0:.0f} s)"
            f" on {report.machine(args.num_threads)}"
            f"\n\n{report.table(runs)}\n\n{report.ratios(runs, extra)}\n")
    print(text)
    _write(runs, text)


def _extras(runners: dict[str, Any], runs: report.Runs,
            args: argparse.Namespace) -> dict[str, Any]:
    """The bandwidth floor, KV-memory and step-split measurements; a failure there is reported,
    and the runs measured before it (often an hour of them) are still written."""
    try:
        extra = _bandwidth_floor(runners, runs)
        if args.kv_memory:
            extra |= _kv_memory(runners, args)
        return extra
    except Exception as e:
        print(f"a measurement after the runs failed, runs kept: {e!r}", flush=True)
        return {}


# The read bandwidth measured just before and just after each of forklm's S1 runs: this VM's
# bandwidth drifts by a quarter within minutes, so the floor is taken when S1 ran.
_S1_BANDWIDTHS: list[float] = []


def _read_bandwidth_now() -> None:
    from benchmarks.bandwidth import read_bandwidth_gbs

    _S1_BANDWIDTHS.append(read_bandwidth_gbs())
    release_openmp_threads()  # the reads' OpenMP team on this thread (see main)


def _bandwidth_floor(runners: dict[str, Any], runs: report.Runs) -> dict[str, Any]:
    """S1's ms/token over its memory-bandwidth floor (benchmarks/bandwidth.py), with the mean
    of the read bandwidths measured around forklm's S1 runs."""
    from benchmarks.bandwidth import weight_bytes_per_token
    from forklm.runtime.kvcache.pool import KVPool

    s1 = runs.get(("S1 single stream", "forklm"))
    if "forklm" not in runners or not s1 or not _S1_BANDWIDTHS:
        return {}
    engine = runners["forklm"].engine
    weight = weight_bytes_per_token(engine.parts.runner.model)
    gbs = sum(_S1_BANDWIDTHS) / len(_S1_BANDWIDTHS)
    floor_ms = weight / gbs / 1e6
    ms = report.medians(s1)["median_tpot_ms"]
    around = ", ".join(f"{b:.1f}" for b in _S1_BANDWIDTHS)
    # For context, not the goal: the floor with the KV a step reads at S1's mean context (its
    # prompt and half its answer), which the weights-only floor leaves out.
    requests = sum(m.requests_per_s * m.wall_s for m in s1)
    context = (sum(m.prompt_tokens_sent for m in s1)
               + sum(m.output_tokens_per_s * m.wall_s for m in s1) / 2) / requests
    pool = engine.parts.kv.pool  # decode attention reads a token's K and V in every layer
    kv = KVPool.bytes_per_token(pool.num_layers, pool.num_kv_heads, pool.head_dim,
                                pool.kv_dtype) * context
    with_kv_ms = (weight + kv) / gbs / 1e6
    return {f"S1 ms/token, forklm / its bandwidth floor ({weight / 1e6:.0f} MB of weights a "
            f"token / {gbs:.1f} GB/s read, the mean of {around} around S1 = {floor_ms:.1f} ms)":
            (ms / floor_ms, 1.25),
            f"S1 ms/token, forklm / that floor with the KV reads too (+ {kv / 1e6:.1f} MB at "
            f"the mean context of {context:.0f} tokens = {with_kv_ms:.1f} ms; context only)":
            (ms / with_kv_ms, None)}


def _quoted_argv() -> list[str]:
    import shlex
    import sys

    return [shlex.quote(a) for a in sys.argv[1:]]


def _write(runs: dict[tuple[str, str], list[Metrics]], text: str) -> None:
    RESULTS.mkdir(exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    (RESULTS / f"{stamp}.md").write_text(text)
    (RESULTS / f"{stamp}.json").write_text(json.dumps(
        [m.as_dict() for ms in runs.values() for m in ms], indent=1))
    if report.plot(runs, RESULTS / f"{stamp}.png"):
        print(f"wrote {RESULTS / stamp}.md, .json, .png")


if __name__ == "__main__":
    main()
