"""Report of a benchmark run: a markdown table of medians, the issue-3 and issue-15 target ratios
computed from systems measured in the same run, and a PNG plot of output tokens/s."""

from __future__ import annotations

import math
import pathlib
import statistics
from typing import Any

from benchmarks.runners import Metrics

Runs = dict[tuple[str, str], list[Metrics]]
_MEDIANS = ("output_tokens_per_s", "requests_per_s", "median_latency_s", "p99_latency_s",
            "median_ttft_s", "median_tpot_ms", "peak_rss_mb", "wall_s")


def machine(threads: int | None = None) -> str:
    """This CPU in one line, for every result: its name, the vector ISA the kernels use
    (machines of one kind differ: AVX-512 with VNNI and bf16 on some, AVX2 only on others), and
    the threads (default: torch's)."""
    import platform

    import torch

    from forklm.runtime.config import cpu_flags

    flags = cpu_flags()
    name = next((line.split(":", 1)[1].strip()
                 for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines()
                 if line.startswith("model name")), platform.processor() or platform.machine())
    isa = ("AVX-512" + "".join(f" {f}" for f in ("VNNI", "bf16") if f"avx512_{f.lower()}" in flags)
           if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2")
    from forklm.kernels.cpu.bindings import kquant_amx_available

    # AMX as the kernels find it (the tiles granted), not as /proc/cpuinfo lists it
    amx = ", AMX" if kquant_amx_available() else ", AMX listed, off" if "amx_tile" in flags else ""
    return f"{name}, {isa}{amx}, {threads or torch.get_num_threads()} threads"


def medians(ms: list[Metrics]) -> dict[str, float]:
    return {k: statistics.median(getattr(m, k) for m in ms) for k in _MEDIANS}


def table(runs: Runs) -> str:
    lines = ["| workload | system | output tok/s | req/s | median latency s | p99 latency s | "
             "median TTFT s | ms/token | prompt computed / sent | peak RSS MB | runs |",
             "|" + "---|" * 11]
    for (wl, system), ms in runs.items():
        med = medians(ms)
        sent, computed = ms[-1].prompt_tokens_sent, ms[-1].prompt_tokens_computed
        lines.append(f"| {wl} | {system} | {med['output_tokens_per_s']:.1f} | "
                     f"{med['requests_per_s']:.2f} | {med['median_latency_s']:.2f} | "
                     f"{med['p99_latency_s']:.2f} | {_num(med['median_ttft_s'])} | "
                     f"{_num(med['median_tpot_ms'], 1)} | "
                     f"{computed}/{sent} ({computed / max(sent, 1):.0%}) | "
                     f"{_num(med['peak_rss_mb'], 0)} | {len(ms)} |")
    return "\n".join(lines)


def ab_table(names: tuple[str, str], labels: tuple[str, str], batches: list[int],
             step_s: dict[tuple[str, int], list[float]]) -> str:
    """Two engine setups side by side from their seconds per decode step (medians of each
    (name, batch) list): ms/token at batch 1, tokens/s above, and B's time over A's."""
    lines = [f"| batch | {labels[0]} | {labels[1]} | {labels[1]} / {labels[0]} time |",
             "|---|---|---|---|"]
    for batch in batches:
        a, b = (statistics.median(step_s[(name, batch)]) for name in names)
        if batch == 1:
            cells = f"{a * 1e3:.1f} ms/token", f"{b * 1e3:.1f} ms/token"
        else:
            cells = f"{batch / a:.1f} tok/s", f"{batch / b:.1f} tok/s"
        lines.append(f"| {batch} | {cells[0]} | {cells[1]} | {b / a:.3f} |")
    return "\n".join(lines)


def _num(x: float, digits: int = 2) -> str:
    return "-" if math.isnan(x) else f"{x:.{digits}f}"


def _median(runs: Runs, wl_name: str, system: str, key: str) -> float | None:
    """Median `key` of the workload whose name is wl_name or starts with wl_name + " "."""
    for (wl, s), ms in runs.items():
        if s == system and (wl == wl_name or (wl.startswith(wl_name + " ") and "64 in" not in wl)):
            value = medians(ms)[key]
            return None if math.isnan(value) else value
    return None


def _tps(runs: Runs, wl_name: str, system: str) -> float | None:
    return _median(runs, wl_name, system, "output_tokens_per_s")


def _best(runs: Runs, wl_name: str, systems: tuple[str, ...], key: str,
          higher_is_better: bool) -> float | None:
    """The best median `key` among the systems that ran wl_name (issue 15: the better of the
    llama-server slot counts is the peer)."""
    values = [v for s in systems if (v := _median(runs, wl_name, s, key)) is not None]
    if not values:
        return None
    return max(values) if higher_is_better else min(values)


def _rps(runs: Runs, wl_name: str, system: str) -> float | None:
    ms = runs.get((wl_name, system))
    return medians(ms)["requests_per_s"] if ms else None


# (label, workload ["numerator's|denominator's"], numerator system, denominator system, target)
_RATIO_TARGETS = [
    ("W1 forklm / transformers batch 8", "W1", "forklm", "hf8", 10.0),
    # transformers' static batches do not depend on the number in flight: its W1 run is the base
    ("W1, 64 in flight: forklm / transformers batch 8", "W1 shared prefix, 64 in flight|W1",
     "forklm", "hf8", 10.0),
    ("W1 radix cache on / off", "W1", "forklm", "forklm-nocache", 3.0),
    ("W2 forklm / transformers batch 8", "W2", "forklm", "hf8", 4.0),
    ("W1 forklm / llama.cpp server", "W1", "forklm", "llamacpp", 3.0),
    ("W2 forklm / llama.cpp server", "W2", "forklm", "llamacpp", 2.0),
    ("W3 forklm / llama.cpp server", "W3", "forklm", "llamacpp", 3.0),
    ("W1 forklm over HTTP / llama.cpp server", "W1", "forklm-http", "llamacpp", 3.0),
    ("W2 forklm over HTTP / llama.cpp server", "W2", "forklm-http", "llamacpp", 2.0),
    ("W3 forklm over HTTP / llama.cpp server", "W3", "forklm-http", "llamacpp", 3.0),
    ("W1 lpm / fcfs policy", "W1", "forklm", "forklm-fcfs", None),
    ("W3 radix cache on / off", "W3", "forklm", "forklm-nocache", None),
]

# Issue 15: against the best of llama.cpp's C++ llama-server slot counts (continuous batching).
LLAMA_SERVERS = ("llama-server-np8", "llama-server-np16")
_TPS, _TPOT, _TTFT = "output_tokens_per_s", "median_tpot_ms", "median_ttft_s"
# (label, workload, numerator system, metric, target); tokens/s: higher is better, else lower.
_PEER_TARGETS = [
    ("W1 forklm / llama-server", "W1", "forklm", _TPS, 3.0),
    ("W2 forklm / llama-server", "W2", "forklm", _TPS, 2.0),
    ("W3 forklm / llama-server", "W3", "forklm", _TPS, 3.0),
    ("W1 forklm over HTTP / llama-server", "W1", "forklm-http", _TPS, 3.0),
    ("W2 forklm over HTTP / llama-server", "W2", "forklm-http", _TPS, 2.0),
    ("W3 forklm over HTTP / llama-server", "W3", "forklm-http", _TPS, 3.0),
    ("S1 ms/token, forklm over HTTP / llama-server", "S1", "forklm-http", _TPOT, 1.0),
    ("S1 TTFT, forklm over HTTP / llama-server", "S1", "forklm-http", _TTFT, None),
    ("S1 ms/token, forklm in process / llama-server", "S1", "forklm", _TPOT, 0.8),
    ("P1 TTFT of a 2000-token prompt, forklm in process / llama-server", "P1", "forklm", _TTFT,
     0.7),
]


def ratios(runs: Runs, extra: dict[str, Any] | None = None) -> str:
    """Target ratios between systems of this run (output tokens/s medians), where both ran."""
    lines = ["| measure | value | target | met |", "|---|---|---|---|"]
    for label, wl, num, den, target in _RATIO_TARGETS:
        wl_num, _, wl_den = wl.partition("|")
        a, b = _tps(runs, wl_num, num), _tps(runs, wl_den or wl_num, den)
        if a is not None and b:
            lines.append(_ratio_line(label, a / b, target, higher_is_better=True))
    lines += _peer_lines(runs)
    for (wl, system), ms in runs.items():
        if wl.startswith("W3") and system == "forklm":
            share = ms[-1].prompt_tokens_computed / max(ms[-1].prompt_tokens_sent, 1)
            lines.append(f"| W3 prompt tokens computed / sent ({system}) | {share:.0%} | "
                         f"<= 35% | {'yes' if share <= 0.35 else 'no'} |")
        if wl.startswith("W5") and wl.endswith("(run_batch)"):
            single = _rps(runs, wl.replace("(run_batch)", "(one at a time)"), system)
            batch = _rps(runs, wl, system)
            if single and batch:
                lines.append(f"| {wl.replace(' (run_batch)', '')} run_batch / one at a time "
                             f"({system}) | {batch / single:.2f}x | - | - |")
    for label, (value, target) in (extra or {}).items():
        lines.append(_ratio_line(label, value, target, higher_is_better=False))
    return "\n".join(lines)


def _peer_lines(runs: Runs) -> list[str]:
    """The issue-15 ratios against the best llama-server slot count that ran. Always numerator /
    peer, so for ms/token and TTFT (lower is better) <= 1.0 is parity."""
    lines = []
    for label, wl, num, key, target in _PEER_TARGETS:
        higher = key == _TPS
        a, b = _median(runs, wl, num, key), _best(runs, wl, LLAMA_SERVERS, key, higher)
        if a is not None and b:
            lines.append(_ratio_line(f"{label} (best of np8, np16)", a / b, target, higher))
    return lines


def _ratio_line(label: str, value: float, target: float | None, higher_is_better: bool) -> str:
    if target is None:
        return f"| {label} | {value:.2f}x | - | - |"
    met = value >= target if higher_is_better else value <= target
    sign = ">=" if higher_is_better else "<="
    return f"| {label} | {value:.2f}x | {sign} {target}x | {'yes' if met else 'no'} |"


def plot(runs: Runs, path: pathlib.Path) -> bool:
    """Grouped bars of output tokens/s per workload and system; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    workloads = list(dict.fromkeys(wl for wl, _ in runs))
    systems = list(dict.fromkeys(s for _, s in runs))
    fig, ax = plt.subplots(figsize=(max(8, 1.4 * len(workloads)), 4.5))
    width = 0.8 / len(systems)
    for i, system in enumerate(systems):
        values = [medians(runs[(wl, system)])["output_tokens_per_s"] if (wl, system) in runs
                  else 0.0 for wl in workloads]
        ax.bar([x + i * width for x in range(len(workloads))], values, width, label=system)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(workloads))],
                  [wl.replace(" ", "\n", 1) for wl in workloads], fontsize=7)
    ax.set_ylabel("output tokens/s (median)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True
