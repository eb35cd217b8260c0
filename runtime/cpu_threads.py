"""How the engine's CPU threads wait, and how many it uses.

torch's OpenMP threads meet at a barrier after every parallel op, a few hundred times per decode
step. With libgomp's PASSIVE policy each barrier puts the other thread to sleep and wakes it for
the next op, which on a 2-vCPU VM costs more than the op: the batch-1 forward takes 2-2.5x as long
as with threads that spin briefly (benchmarks/NOTES.md, session 11). But spinning threads that
share their cores with another busy process wait out whole time slices at every barrier (up to
10x slower). So forklm spins a bounded while by default (`preload_openmp`, at `import forklm`),
and the engine thread watches whether it gets its core (`ThreadGovernor`): when it does not, it
drops to one thread, which has no barriers to wait at, and tries again later.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib.util
import logging
import os
import sys
import time
import weakref
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, field
from pathlib import Path

from forklm.kernels.cpu.openmp import threads_spin

logger = logging.getLogger(__name__)

# libgomp spins this many pause loops (libgomp reckons 100 per microsecond: about 0.3 ms) before a
# waiting thread sleeps: longer than the gap between two ops of a forward, shorter than a
# scheduler tick. (This module imports no torch: forklm's __init__ uses it before torch loads.)
DEFAULT_SPIN_COUNT = "30000"


def preload_openmp(environ: MutableMapping[str, str] = os.environ) -> bool:
    """Load torch's libgomp now, with the bounded spin, unless the user chose a policy. libgomp
    reads its environment once, when it loads; torch then reuses this copy (the loader matches
    its SONAME), so the spin count is set only while it loads and the process environment, which
    child processes inherit, stays the caller's. True when it loaded one."""
    if "OMP_WAIT_POLICY" in environ or "GOMP_SPINCOUNT" in environ or "torch" in sys.modules:
        return False  # the user's choice, or too late: torch's libgomp has read its environment
    library = _openmp_library()
    if library is None or _is_loaded(library):
        return False  # none to load, or another library loaded it already
    environ["GOMP_SPINCOUNT"] = DEFAULT_SPIN_COUNT
    try:
        ctypes.CDLL(library)
    except OSError:
        return False
    finally:
        del environ["GOMP_SPINCOUNT"]
    return True


def _openmp_library() -> str | None:
    """The libgomp torch will load, found without importing torch: the copy its wheel bundles
    (libtorch_cpu.so needs it by that file's name), else the system's."""
    spec = importlib.util.find_spec("torch")
    if spec is not None:
        for folder in spec.submodule_search_locations or []:
            bundled = sorted(Path(folder, "lib").glob("libgomp*.so*"))
            if bundled:
                return str(bundled[0])
    return ctypes.util.find_library("gomp")


def _is_loaded(library: str) -> bool:
    """Whether a library of that name (or SONAME) is loaded already: the loader would reuse it."""
    try:
        ctypes.CDLL(os.path.basename(library), mode=os.RTLD_NOLOAD)
    except OSError:
        return False
    return True


def sleeping_threads_env(environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """A child process's environment for processes that share their cores (replicas on one
    host, a server beside its client's work): OpenMP threads that sleep at once, unless the user
    chose a policy (a GOMP_SPINCOUNT of theirs overrides it in libgomp, and stays)."""
    env = dict(environ)
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    return env


@dataclass
class ThreadGovernor:
    """Runs on the thread that runs the forwards, around each step, and measures the share of
    step time that thread spent runnable but off its core (the kernel's run-queue delay,
    /proc/thread-self/schedstat): a few percent while the spinning threads have their cores,
    a third to a half when another busy process wants them. Past `max_wait_fraction` over a
    window of step time the steps continue on one thread; after `backoff_s` it tries all threads
    again, doubling the back-off each time the cores turn out still busy.

    Not a count of preemptions: a server's event loop and its client wake for every token and
    preempt a spinning thread for a fraction of a millisecond, 100-300 times a second, while a
    busy neighbour preempts it less often (80-100 a second) for whole slices (benchmarks/NOTES.md,
    http_overhead).

    It also counts how often the thread is put back on its core (the same file's time slices):
    a thread whose OpenMP team spins runs a step through, 0-5 times a step while it streams
    (up to ~660 a second over HTTP at batch 1 on 2 cores), but once libgomp manages more OpenMP
    threads than there are cores (another thread of the process ran torch work and keeps its
    team) every barrier sleeps: ~120 times a batch-1 step of the default model, ~9000 a second,
    3x the time a token. Past both `max_sleeps_per_s` and `max_sleeps_per_step` (a fast
    machine's short steps reach the first alone, a large batch's GIL waits the second) the
    steps continue on one thread, which has no barriers (1.9x faster than the throttled pair
    at batch 1, 0.9x at batch 16: benchmarks/NOTES.md, session 31), with the same back-off,
    and a warning says what to do about it once.

    A window is judged once it holds `min_steps` steps, on all of them but its longest: a
    burst of this process's own work (a batch of requests arriving, tokenized on the caller's
    thread) can crowd one long step, 250-320 ms with ~1000 slices and a quarter of it waited on
    AMD EPYC (session 32), and one such step is not a trend worth a second on one thread."""

    max_threads: int
    window_s: float = 0.2
    # Batch 1 on two threads, 2 cores (benchmarks/http_overhead.py): 0-5% quiet, in process or
    # serving over HTTP with the client beside it (a 0.2 s window reached 9%); 35-49% beside
    # another's busy processes (10-17% even on one thread).
    max_wait_fraction: float = 0.15
    # Times the thread may be put back on its core, a second of step time and a step, before
    # its OpenMP barriers count as sleeping (see above).
    max_sleeps_per_s: float = 2000.0
    max_sleeps_per_step: float = 30.0
    min_steps: int = 4
    first_backoff_s: float = 1.0
    max_backoff_s: float = 30.0
    threads: int = field(init=False)
    switches: int = field(default=0, init=False)  # thread-count changes, for stats and tests
    _backoff_s: float = field(init=False)
    _retry_at: float = field(default=0.0, init=False)
    _wall: float = field(default=0.0, init=False)
    _waited: float = field(default=0.0, init=False)
    _slices: int = field(default=0, init=False)
    _steps: int = field(default=0, init=False)
    _longest: tuple[float, float, int] = field(default=(0.0, 0.0, 0), init=False)  # its step
    _step_t0: float = field(default=0.0, init=False)
    _step_sched0: tuple[float, int] = field(default=(0.0, 0), init=False)
    _warned: bool = field(default=False, init=False)
    _schedstat: int | None = field(default=None, init=False)  # fd: the stepping thread's file

    def __post_init__(self) -> None:
        self.threads = self.max_threads
        self._backoff_s = self.first_backoff_s

    def step_started(self) -> None:
        self._step_t0, self._step_sched0 = time.perf_counter(), self._sched()

    def step_finished(self) -> None:
        now = time.perf_counter()
        waited, slices = self._sched()
        step = (now - self._step_t0, waited - self._step_sched0[0], slices - self._step_sched0[1])
        self._wall += step[0]
        self._waited += step[1]
        self._slices += step[2]
        self._steps += 1
        if step[0] > self._longest[0]:
            self._longest = step
        if self.threads == 1:
            if now >= self._retry_at:
                self._use(self.max_threads)  # probe: are the cores free again?
            return
        if self._wall < self.window_s or self._steps < self.min_steps:
            return
        longest = self._longest  # the window is judged on its other steps
        wall, slices, steps = self._wall - longest[0], self._slices - longest[2], self._steps - 1
        contended = (self._waited - longest[1]) / wall > self.max_wait_fraction
        throttled = (slices / wall > self.max_sleeps_per_s
                     and slices / steps > self.max_sleeps_per_step)
        self._reset_window()
        if contended or throttled:
            if throttled and not self._warned:
                self._warned = True
                logger.warning(
                    "the engine's OpenMP threads sleep at every barrier: libgomp manages more "
                    "threads than there are cores, because another thread of this process ran "
                    "torch work and keeps its OpenMP team. Decoding continues on one thread "
                    "(about half the batch-1 speed of two). Call forklm.runtime.cpu_threads."
                    "release_openmp_threads() on that thread when its work is done.")
            self._retry_at = now + self._backoff_s
            self._backoff_s = min(2 * self._backoff_s, self.max_backoff_s)
            self._use(1)
        else:
            self._backoff_s = self.first_backoff_s

    def _sched(self) -> tuple[float, int]:
        """(seconds the stepping thread has spent runnable but waiting for a core, times it has
        been put on a core), so far."""
        if self._schedstat is None:  # opened on the stepping thread: the file is per thread
            self._schedstat = os.open(SCHEDSTAT, os.O_RDONLY)
            # Closed when the governor goes, but not at interpreter exit: a daemon engine thread
            # of a script that never shut its engine down still steps while atexit runs.
            weakref.finalize(self, os.close, self._schedstat).atexit = False
        return _parse_schedstat(os.pread(self._schedstat, 128, 0))

    def _reset_window(self) -> None:
        self._wall, self._waited, self._slices, self._steps = 0.0, 0.0, 0, 0
        self._longest = (0.0, 0.0, 0)

    def _use(self, threads: int) -> None:
        import torch

        self.threads = threads
        self._reset_window()
        self.switches += 1
        torch.set_num_threads(threads)


SCHEDSTAT = "/proc/thread-self/schedstat"  # "<cpu ns> <run-queue delay ns> <time slices>"


def _parse_schedstat(schedstat: bytes) -> tuple[float, int]:
    """(run-queue delay in seconds, time slices) of a schedstat line."""
    fields = schedstat.split()
    return int(fields[1]) / 1e9, int(fields[2])


def release_openmp_threads() -> bool:
    """Let the calling thread's OpenMP workers go (OpenMP 5's omp_pause_resource_all). libgomp
    keeps a team of workers per thread that ever ran a parallel op, and once it manages more
    threads than there are cores it cuts every spin to ~100 loops, which is PASSIVE again. A
    thread that built an engine (loading weights runs parallel ops) and now only waits, while the
    engine thread runs the forwards, should not keep its team. True when released."""
    lib = _loaded_libgomp()
    if lib is None or not hasattr(lib, "omp_pause_resource_all"):
        return False
    return lib.omp_pause_resource_all(1) == 0  # omp_pause_soft


def _loaded_libgomp() -> ctypes.CDLL | None:
    """The libgomp this process already loaded (torch's own copy), never a second one."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libgomp" in line and "/" in line}
    except OSError:
        return None
    return ctypes.CDLL(sorted(paths)[0]) if paths else None


def thread_governor(max_threads: int, on_cpu: bool,
                    environ: Mapping[str, str] = os.environ) -> ThreadGovernor | None:
    """A governor where it can help: forwards on this CPU with spinning threads, more than one."""
    if not on_cpu or max_threads < 2 or not threads_spin(environ):
        return None
    if not os.path.exists(SCHEDSTAT):  # Linux with the kernel's scheduler statistics only
        return None
    return ThreadGovernor(max_threads)
