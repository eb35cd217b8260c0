"""The OpenMP wait policy forklm picks, and the ThreadGovernor that drops to one thread while the
cores are contended (runtime/cpu_threads.py)."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from forklm.runtime import cpu_threads
from forklm.runtime.cpu_threads import (
    DEFAULT_SPIN_COUNT,
    ThreadGovernor,
    preload_openmp,
    sleeping_threads_env,
    thread_governor,
    threads_spin,
)

# What libgomp prints of its spin count when it loads, with OMP_DISPLAY_ENV=VERBOSE.
SPIN_30000 = f"GOMP_SPINCOUNT = '{DEFAULT_SPIN_COUNT}'"


def _libgomp_spin_counts(code: str, **env: str) -> list[str]:
    """Run `code` in a child with no wait policy but `env`'s: libgomp's printed spin count, once
    for each libgomp that loaded."""
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    stderr = subprocess.run([sys.executable, "-c", code],
                            env={**base, **env, "OMP_DISPLAY_ENV": "VERBOSE"},
                            capture_output=True, text=True, check=True, timeout=120).stderr
    return [line.strip() for line in stderr.splitlines()
            if line.strip().startswith("GOMP_SPINCOUNT =")]


# forklm and torch load, the environment stays as it was before either.
_IMPORT_FORKLM_THEN_TORCH = """
import os, sys
before = dict(os.environ)
import forklm
assert 'torch' not in sys.modules
import torch
torch.ones(4).sum()
assert dict(os.environ) == before, set(os.environ.items()) ^ set(before.items())
"""


def test_importing_forklm_gives_torch_the_bounded_spin_and_leaves_the_environment() -> None:
    assert _libgomp_spin_counts(_IMPORT_FORKLM_THEN_TORCH) == [SPIN_30000]  # one libgomp: torch's
    plain = _libgomp_spin_counts("import torch; torch.ones(4).sum()")  # libgomp's own default
    assert len(plain) == 1 and plain != [SPIN_30000]


@pytest.mark.parametrize(("env", "printed"), [
    ({"OMP_WAIT_POLICY": "PASSIVE"}, "GOMP_SPINCOUNT = '0'"),
    ({"GOMP_SPINCOUNT": "1000"}, "GOMP_SPINCOUNT = '1000'"),
])
def test_importing_forklm_keeps_the_users_policy(env: dict[str, str], printed: str) -> None:
    assert _libgomp_spin_counts(_IMPORT_FORKLM_THEN_TORCH, **env) == [printed]


def _no_load(path: str, *args: object, **kwargs: object) -> None:
    raise AssertionError(f"loaded {path}")


@pytest.mark.parametrize("chosen", [{"OMP_WAIT_POLICY": "PASSIVE"}, {"OMP_WAIT_POLICY": "active"},
                                    {"GOMP_SPINCOUNT": "0"}])
def test_preload_leaves_a_users_policy_alone(chosen: dict[str, str],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "torch")  # as before torch is imported
    monkeypatch.setattr(ctypes, "CDLL", _no_load)
    env = dict(chosen)
    assert preload_openmp(env) is False and env == chosen


def test_preload_does_nothing_once_libgomp_is_loaded(monkeypatch: pytest.MonkeyPatch) -> None:
    env: dict[str, str] = {}
    assert "torch" in sys.modules and preload_openmp(env) is False and env == {}
    # torch not imported, but its libgomp loaded all the same (this process has it)
    monkeypatch.delitem(sys.modules, "torch")
    assert preload_openmp(env) is False and env == {}


def test_preload_sets_the_spin_count_only_while_libgomp_loads(
        monkeypatch: pytest.MonkeyPatch) -> None:
    env: dict[str, str] = {"PATH": "/bin"}
    loads: list[tuple[str, dict[str, str]]] = []
    monkeypatch.delitem(sys.modules, "torch")
    monkeypatch.setattr(cpu_threads, "_is_loaded", lambda library: False)
    monkeypatch.setattr(ctypes, "CDLL", lambda path: loads.append((path, dict(env))))
    assert preload_openmp(env) is True and env == {"PATH": "/bin"}
    torch_libgomp = str(Path(torch.__file__).parent / "lib" / "libgomp.so.1")
    assert loads == [(torch_libgomp, {"PATH": "/bin", "GOMP_SPINCOUNT": DEFAULT_SPIN_COUNT})]

    def fails(path: str) -> None:
        assert env["GOMP_SPINCOUNT"] == DEFAULT_SPIN_COUNT
        raise OSError("cannot load")

    monkeypatch.setattr(ctypes, "CDLL", fails)
    assert preload_openmp(env) is False and env == {"PATH": "/bin"}


@pytest.mark.parametrize(("env", "spins"), [
    ({}, True),  # libgomp's own default spins
    ({"OMP_WAIT_POLICY": "passive"}, False),
    ({"OMP_WAIT_POLICY": "ACTIVE"}, True),
    ({"GOMP_SPINCOUNT": "0"}, False),
    # libgomp: a spin count overrides the policy
    ({"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "1000"}, True),
])
def test_threads_spin_reads_the_environment_as_libgomp_does(env: dict[str, str], spins: bool) -> None:
    assert threads_spin(env) is spins


def test_children_that_share_the_cores_get_sleeping_threads() -> None:
    env = sleeping_threads_env({"PATH": "/bin"})
    assert env == {"OMP_WAIT_POLICY": "PASSIVE", "PATH": "/bin"} and not threads_spin(env)
    # a user's own choice stays
    assert sleeping_threads_env({"OMP_WAIT_POLICY": "ACTIVE"}) == {"OMP_WAIT_POLICY": "ACTIVE"}
    assert sleeping_threads_env({"GOMP_SPINCOUNT": "5"})["GOMP_SPINCOUNT"] == "5"


def test_no_governor_where_threads_sleep_or_there_is_one() -> None:
    assert thread_governor(2, True, {"OMP_WAIT_POLICY": "PASSIVE"}) is None
    assert thread_governor(1, True, {}) is None
    assert thread_governor(2, False, {}) is None  # forwards on a GPU
    assert isinstance(thread_governor(2, True, {}), ThreadGovernor)


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0
        self.waited = 0.0  # seconds the stepping thread was runnable but off its core
        self.slices = 0  # times it was put on a core

    def perf_counter(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch):
    fake = _Clock()
    monkeypatch.setattr(cpu_threads.time, "perf_counter", fake.perf_counter)
    monkeypatch.setattr(ThreadGovernor, "_sched", lambda self: (fake.waited, fake.slices))
    threads = torch.get_num_threads()
    yield fake
    torch.set_num_threads(threads)


def _steps(gov: ThreadGovernor, clock: _Clock, n: int, step_s: float, waited: float,
           sleeps: int = 0) -> None:
    """n steps of step_s seconds, each with `waited` of it spent waiting for a core (a share)
    and put back on its core `sleeps` times."""
    for _ in range(n):
        gov.step_started()
        clock.now += step_s
        clock.waited += waited * step_s
        clock.slices += sleeps
        gov.step_finished()


def test_governor_keeps_all_threads_while_the_cores_are_free(clock: _Clock) -> None:
    gov = ThreadGovernor(2)
    _steps(gov, clock, 100, 0.01, 0)  # 1 s of steps, never waiting
    assert gov.threads == 2 and gov.switches == 0


def test_governor_drops_to_one_thread_under_contention_and_probes_back(clock: _Clock) -> None:
    gov = ThreadGovernor(2, window_s=0.2, max_wait_fraction=0.15, first_backoff_s=1.0)
    _steps(gov, clock, 20, 0.01, 0.45)  # a busy neighbour: off the core 45% of the time
    assert gov.threads == 1 and torch.get_num_threads() == 1
    _steps(gov, clock, 50, 0.01, 0)  # 0.5 s: still within the back-off
    assert gov.threads == 1
    _steps(gov, clock, 60, 0.01, 0)  # past 1 s: tries both threads again
    assert gov.threads == 2 and torch.get_num_threads() == 2
    # still contended: back to one thread, and the next probe waits twice as long
    _steps(gov, clock, 20, 0.01, 0.45)
    assert gov.threads == 1
    _steps(gov, clock, 150, 0.01, 0)
    assert gov.threads == 1
    _steps(gov, clock, 60, 0.01, 0)
    assert gov.threads == 2
    # a clean window resets the back-off to its first value
    _steps(gov, clock, 20, 0.01, 0)
    _steps(gov, clock, 20, 0.01, 0.45)
    assert gov.threads == 1
    _steps(gov, clock, 110, 0.01, 0)
    assert gov.threads == 2 and gov.switches == 6


def test_short_waits_do_not_count_as_contention(clock: _Clock) -> None:
    # A server's event loop and its client take the core for ~0.5 ms at every token: a few
    # percent of the step time, however many preemptions that makes.
    gov = ThreadGovernor(2, window_s=0.2, max_wait_fraction=0.15)
    _steps(gov, clock, 200, 0.01, 0.09)
    assert gov.threads == 2 and gov.switches == 0


def test_governor_reads_its_threads_run_queue_delay_and_time_slices() -> None:
    waited, slices = cpu_threads._parse_schedstat(b"124962855 13707521 9\n")
    assert waited == pytest.approx(0.013707521) and slices == 9
    gov = ThreadGovernor(2)
    if not os.path.exists(cpu_threads.SCHEDSTAT):
        pytest.skip("no scheduler statistics in /proc")
    first = gov._sched()
    later = gov._sched()
    assert 0.0 <= first[0] <= later[0] and 0 <= first[1] <= later[1]


def test_governor_drops_to_one_thread_when_its_openmp_barriers_sleep(
        clock: _Clock, caplog: pytest.LogCaptureFixture) -> None:
    # libgomp throttled (another thread's OpenMP team): ~120 sleeps a 12 ms batch-1 step, no
    # run-queue delay. One thread, a warning once, and the same probes back as under contention.
    gov = ThreadGovernor(2, window_s=0.2, first_backoff_s=1.0)
    with caplog.at_level("WARNING", logger="forklm.runtime.cpu_threads"):
        _steps(gov, clock, 20, 0.012, 0, sleeps=120)
        assert gov.threads == 1 and torch.get_num_threads() == 1
        _steps(gov, clock, 90, 0.012, 0)  # past the back-off: both threads again
        assert gov.threads == 2
        _steps(gov, clock, 20, 0.012, 0, sleeps=120)  # still throttled
        assert gov.threads == 1
    warnings = [r for r in caplog.records if "release_openmp_threads" in r.getMessage()]
    assert len(warnings) == 1


def test_a_servers_wake_ups_are_not_a_throttled_spin(clock: _Clock) -> None:
    # Streaming in process or over HTTP puts the engine thread back on its core 0-5 times a
    # step, a few hundred times a second; a prefill step waiting on the GIL, ~130 in a long step;
    # a faster machine's 1 ms steps, thousands of times a second but a few a step.
    gov = ThreadGovernor(2, window_s=0.2)
    _steps(gov, clock, 200, 0.004, 0.02, sleeps=3)  # 750 a second
    _steps(gov, clock, 3, 0.5, 0.02, sleeps=130)  # 260 a second
    _steps(gov, clock, 600, 0.001, 0.02, sleeps=3)  # 3000 a second, 3 a step
    _steps(gov, clock, 10, 0.05, 0.02, sleeps=60)  # a large batch's GIL waits: 1200 a second
    assert gov.threads == 2 and gov.switches == 0


def test_one_crowded_step_is_not_a_trend(clock: _Clock) -> None:
    # A burst of requests tokenized on the caller's thread crowds the first prefill step: 320 ms,
    # a quarter of it off the core, ~1000 slices (AMD EPYC, session 32). Alone it decides nothing.
    gov = ThreadGovernor(2, window_s=0.2)
    _steps(gov, clock, 1, 0.32, 0.26, sleeps=1000)
    _steps(gov, clock, 100, 0.004, 0.02, sleeps=2)
    assert gov.threads == 2 and gov.switches == 0
    # The same steps again and again are a trend: a busy neighbour, or a throttled spin.
    _steps(gov, clock, 6, 0.32, 0.26)
    assert gov.threads == 1
    gov = ThreadGovernor(2, window_s=0.2)
    _steps(gov, clock, 6, 0.32, 0, sleeps=1000)
    assert gov.threads == 1


def test_governor_still_reads_after_the_exit_handlers_ran() -> None:
    # A script that exits without shutting its engine down: the daemon engine thread keeps
    # stepping while the interpreter runs its exit handlers (weakref finalizers among them).
    if not os.path.exists(cpu_threads.SCHEDSTAT):
        pytest.skip("no scheduler statistics in /proc")
    code = """
import atexit
from forklm.runtime.cpu_threads import ThreadGovernor
governor = ThreadGovernor(2)
governor.step_started(); governor.step_finished()
atexit._run_exitfuncs()
governor.step_started(); governor.step_finished()
"""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stderr == "", run.stderr


def test_release_lets_the_calling_threads_openmp_workers_go() -> None:
    # In a child: this process's pytest threads and torch state must not count.
    code = """
import os, torch
from forklm.runtime.cpu_threads import release_openmp_threads
torch.set_num_threads(2)
x = torch.randn(512, 512)
(x @ x).sum()  # a parallel op: libgomp starts this thread's team
before = len(os.listdir('/proc/self/task'))
released = release_openmp_threads()
print(released, before, len(os.listdir('/proc/self/task')))
"""
    out = subprocess.run([sys.executable, "-c", code], env=sleeping_threads_env(),
                         capture_output=True, text=True, check=True, timeout=120).stdout.split()
    assert out[0] == "True", out
    assert int(out[2]) == int(out[1]) - 1  # the one worker of a 2-thread team is gone
