"""Where the native CPU kernels' libraries come from, and how they are built ahead of time.

A wheel (and `make setup` in a checkout) compiles every kernel source once per instruction-set
level (`python -m forklm.kernels.cpu.native_build`, run by setup.py's build step) into prebuilt/,
with a manifest of the source each library was built from. At run time the loader takes the best
level this CPU runs (`prebuilt_library`), so a user needs no compiler and waits for none. A
source checkout whose sources changed since (the manifest disagrees), or a CPU no level fits,
compiles at first use with -march=native instead; FORKLM_NATIVE_BUILD=native makes that the
first choice (for people who build for their own machine).

Stdlib only: setup.py runs this file before the package (or torch) can be imported.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
# FORKLM_PREBUILT_DIR: another folder of prebuilt libraries (tests; a shared install).
PREBUILT_DIR = Path(os.environ.get("FORKLM_PREBUILT_DIR") or HERE / "prebuilt")
MANIFEST = "manifest.json"

# Each library: its source and its flags but the target (-march is the level's, or native).
# No -ffast-math anywhere: results stay IEEE. gnu11 (not c11) keeps GCC's contraction of a * b + c
# into FMAs where a source does not turn it off.
_OPENMP = ["-O3", "-fopenmp", "-shared", "-fPIC", "-std=gnu11"]
_NO_CONTRACT = ["-O3", "-ffp-contract=off", "-shared", "-fPIC", "-std=gnu11"]
LIBRARIES: dict[str, list[str]] = {
    "paged_attention": _OPENMP,
    "fused_layer_ops": _NO_CONTRACT,  # each multiply and add rounds where torch's eager ops do
    "int4_gemv": _OPENMP,
    "kquant_vnni": ["-O3", "-fopenmp", "-ffp-contract=off", "-shared", "-fPIC", "-std=gnu11"],
    "greedy_pick": _NO_CONTRACT,
}


@dataclass(frozen=True)
class Level:
    """An instruction-set level: the compiler's target flags and the CPU flags (as /proc/cpuinfo
    names them) a CPU needs to run its code."""

    name: str
    target: tuple[str, ...]
    needs: frozenset[str]


_V3 = frozenset({"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe", "abm", "xsave"})
_V4 = _V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
# Best first: the loader takes the first one the CPU runs.
X86_LEVELS = (
    Level("avx512_vnni_bf16", ("-march=x86-64-v4", "-mavx512vnni", "-mavx512bf16"),
          _V4 | {"avx512_vnni", "avx512_bf16"}),
    Level("avx512", ("-march=x86-64-v4",), _V4),
    Level("avx2", ("-march=x86-64-v3",), _V3),
    Level("x86_64", ("-march=x86-64",), frozenset()),
)
ARM_LEVELS = (Level("armv8", ("-march=armv8-a",), frozenset()),)


def levels() -> tuple[Level, ...]:
    """This machine architecture's levels, best first."""
    machine = platform.machine().lower()
    if machine in ("x86_64", "amd64"):
        return X86_LEVELS
    if machine in ("aarch64", "arm64"):
        return ARM_LEVELS
    return ()


def source_key(source: Path, target: tuple[str, ...] | list[str]) -> str:
    """What a library is built from: its source, the headers beside it, its flags."""
    headers = (h.read_text() for h in sorted(source.parent.glob("*.h")))
    parts = [source.read_text(), *headers, " ".join([*LIBRARIES[source.stem], *target])]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


def cpu_flags() -> frozenset[str]:
    return frozenset(_cpuinfo_field(("flags", "Features")).split())


def cpu_vendor() -> str:
    """/proc/cpuinfo's vendor_id ("GenuineIntel", "AuthenticAMD"; "" where it has none)."""
    return _cpuinfo_field(("vendor_id",)).strip()


def _cpuinfo_field(names: tuple[str, ...]) -> str:
    """The value of the first /proc/cpuinfo line naming one of `names` ("" without one)."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((ln for ln in f if ln.startswith(names)), "")
    except OSError:
        return ""
    return line.partition(":")[2]


def best_level(flags: frozenset[str] | None = None) -> Level | None:
    """The best level this CPU runs (None: an architecture with no levels)."""
    flags = cpu_flags() if flags is None else flags
    return next((level for level in levels() if level.needs <= flags), None)


def prebuilt_library(stem: str, directory: Path = PREBUILT_DIR,
                     flags: frozenset[str] | None = None) -> tuple[Path, str] | None:
    """(the prebuilt library of `stem` for the best level this CPU runs that was built from the
    current sources, that level's name), or None."""
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    flags = cpu_flags() if flags is None else flags
    for level in levels():
        if not level.needs <= flags:
            continue
        entry = manifest.get(f"{stem}-{level.name}")
        path = directory / f"{stem}-{level.name}.so"
        key = source_key(HERE / f"{stem}.c", level.target)
        if entry and entry.get("key") == key and path.is_file():
            return path, level.name
    return None


def build_prebuilt(directory: Path = PREBUILT_DIR, cc: str | None = None,
                   only: tuple[str, ...] | None = None, log=print) -> dict[str, dict[str, str]]:
    """Compile every library for every level (`only`: those levels) into `directory`, with its
    manifest. A level the compiler cannot target (an old GCC without AVX512-BF16) is skipped with
    a line saying so; the others stand. Returns the manifest."""
    cc = cc or os.environ.get("CC", "cc")
    if shutil.which(cc) is None:
        raise RuntimeError(f"no C compiler ({cc!r} not on PATH)")
    directory.mkdir(parents=True, exist_ok=True)
    manifest: dict[str, dict[str, str]] = {}
    for level in levels():
        if only is not None and level.name not in only:
            continue
        for stem, base in LIBRARIES.items():
            target = directory / f"{stem}-{level.name}.so"
            try:
                compile_library(cc, HERE / f"{stem}.c", [*base, *level.target], target)
            except RuntimeError as e:
                log(f"native_build: {stem} for {level.name} skipped: {str(e)[-300:]}")
                continue
            manifest[f"{stem}-{level.name}"] = {"key": source_key(HERE / f"{stem}.c", level.target),
                                                 "level": level.name}
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
    return manifest


def compile_library(cc: str, source: Path, flags: list[str], target: Path) -> None:
    """cc flags source -o target, atomically (a private temp name, then a rename): concurrent
    builders never see a partial file."""
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        done = subprocess.run([cc, *flags, str(source), "-o", tmp, "-lm"], capture_output=True,
                              text=True, timeout=300)
        if done.returncode != 0:
            raise RuntimeError(f"{cc} failed: {done.stderr.strip()[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Build the native CPU kernels ahead of time.")
    parser.add_argument("--out", type=Path, default=PREBUILT_DIR)
    parser.add_argument("--levels", nargs="+", default=None,
                        help="only these levels (default: all of this architecture's)")
    args = parser.parse_args(argv)
    try:
        manifest = build_prebuilt(args.out, only=tuple(args.levels) if args.levels else None)
    except RuntimeError as e:
        print(f"native_build: {e}; the kernels will compile at first use where a compiler "
              "is, else run on the torch fallback", file=sys.stderr)
        return 0  # a build without a compiler still installs; the engine says what is missing
    built = sorted({entry["level"] for entry in manifest.values()})
    print(f"native_build: {len(manifest)} libraries for {', '.join(built) or 'no level'} "
          f"in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
