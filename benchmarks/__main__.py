"""Run benchmark workloads on several systems side by side in one process and report medians.

  python -m benchmarks --workloads W1,W2,W3 --systems forklm,forklm-nocache,hf1,hf8 --repeats 3

Writes a markdown table (stdout and benchmarks/results/<stamp>.md), the raw runs as JSON, and a PNG
plot of output tokens/s per workload and system when matplotlib is installed.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import time
from typing import Any

from benchmarks.runners import EngineRunner, HFRunner, Metrics
from benchmarks.workloads import WORKLOADS

ENGINE_SYSTEMS = {  # name -> Engine options (the ablations of the radix cache and the policy)
    "forklm": {},
    "forklm-nocache": {"disable_radix_cache": True},
    "forklm-fcfs": {"schedule_policy": "fcfs"},
}
RESULTS = pathlib.Path(__file__).parent / "results"


def _make_runner(system: str, args: argparse.Namespace) -> Any:
    from forklm import Engine

    if system in ENGINE_SYSTEMS:
        engine = Engine(dtype=args.dtype, max_total_tokens=args.max_total_tokens,
                        **ENGINE_SYSTEMS[system])
        return EngineRunner(engine, system)
    if system in ("hf1", "hf8"):
        import torch
        import transformers

        from forklm.runtime.model_loader import load_model

        loaded = load_model("SmolLM2-135M-Instruct")
        model = transformers.LlamaForCausalLM(loaded.config)
        model.load_state_dict(loaded.state_dict, strict=False)
        model.tie_weights()
        dtype = torch.float32 if args.dtype == "float32" else torch.bfloat16
        return HFRunner(model.to(dtype).eval(), loaded.tokenizer, 1 if system == "hf1" else 8)
    raise SystemExit(f"unknown system {system!r}; known: {', '.join([*ENGINE_SYSTEMS, 'hf1', 'hf8'])}")


def _table(runs: dict[tuple[str, str], list[Metrics]]) -> str:
    lines = ["| workload | system | output tok/s | req/s | median latency s | p99 latency s | "
             "median TTFT s | prompt computed / sent | peak RSS MB |", "|" + "---|" * 9]
    for (wl, system), ms in runs.items():
        med = {k: statistics.median(getattr(m, k) for m in ms)
               for k in ("output_tokens_per_s", "requests_per_s", "median_latency_s",
                         "p99_latency_s", "median_ttft_s", "peak_rss_mb")}
        sent, computed = ms[-1].prompt_tokens_sent, ms[-1].prompt_tokens_computed
        lines.append(f"| {wl} | {system} | {med['output_tokens_per_s']:.1f} | "
                     f"{med['requests_per_s']:.2f} | {med['median_latency_s']:.2f} | "
                     f"{med['p99_latency_s']:.2f} | {med['median_ttft_s']:.2f} | "
                     f"{computed}/{sent} ({computed / max(sent, 1):.0%}) | {med['peak_rss_mb']:.0f} |")
    return "\n".join(lines)


def _plot(runs: dict[tuple[str, str], list[Metrics]], path: pathlib.Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    workloads = sorted({wl for wl, _ in runs})
    systems = sorted({s for _, s in runs})
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(systems)
    for i, system in enumerate(systems):
        values = [statistics.median(m.output_tokens_per_s for m in runs.get((wl, system), []))
                  if (wl, system) in runs else 0 for wl in workloads]
        ax.bar([x + i * width for x in range(len(workloads))], values, width, label=system)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(workloads))], workloads)
    ax.set_ylabel("output tokens/s")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default="W1,W2,W3")
    parser.add_argument("--systems", default="forklm,forklm-nocache,hf8")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--scale", type=float, default=1.0, help="fraction of each workload's requests")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-total-tokens", type=int, default=65536)
    args = parser.parse_args()
    runs: dict[tuple[str, str], list[Metrics]] = {}
    for system in args.systems.split(","):
        runner = _make_runner(system, args)
        for name in args.workloads.split(","):
            wl = WORKLOADS[name]()
            wl.requests = wl.requests[: max(1, int(len(wl.requests) * args.scale))]
            if not runner.supports(wl):
                continue
            for _ in range(args.repeats):
                runs.setdefault((wl.name, system), []).append(runner.run(wl))
        if hasattr(runner, "engine"):
            runner.engine.shutdown()
    table = _table(runs)
    print(table)
    RESULTS.mkdir(exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    (RESULTS / f"{stamp}.md").write_text(table + "\n")
    (RESULTS / f"{stamp}.json").write_text(json.dumps(
        [m.as_dict() for ms in runs.values() for m in ms], indent=1))
    _plot(runs, RESULTS / f"{stamp}.png")


if __name__ == "__main__":
    main()
