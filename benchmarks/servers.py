"""Start a serving process on 127.0.0.1 for the HTTP runner, wait until it answers, stop it after:
forklm's own server (`forklm serve`) and the CPU peers on the same GGUF: llama.cpp's C++
`llama-server` (parallel slots) and llama-cpp-python's server (one request at a time)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import tempfile
import time
from dataclasses import dataclass, field

import httpx

from forklm.runtime.child_process import forklm_command, free_port


@dataclass
class ServerProcess:
    """`with ServerProcess(cmd, port) as server:` runs cmd until the block ends. Waits for
    GET health_path to answer 200; raises RuntimeError with the log's tail if the process exits
    or the wait times out. The child starts without this process's OpenMP wait settings
    (OMP_WAIT_POLICY, GOMP_SPINCOUNT): each server runs with its own default (forklm: a bounded
    spin and its thread governor; llama.cpp: libgomp's default) unless env says otherwise; an env
    value of None removes that variable."""

    command: list[str]
    port: int
    health_path: str = "/health"
    startup_timeout_s: float = 600.0
    poll_s: float = 0.5  # between health checks
    env: dict[str, str | None] = field(default_factory=dict)
    proc: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        assert self.proc is not None, "server not started"
        return self.proc.pid

    def __enter__(self) -> ServerProcess:
        self._log = tempfile.NamedTemporaryFile("w+", prefix="bench-server-", suffix=".log",
                                                delete=False)
        inherited = {k: v for k, v in os.environ.items()
                     if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
        merged = {**inherited, **self.env}
        env = {k: v for k, v in merged.items() if v is not None}
        self.proc = subprocess.Popen(self.command, stdout=self._log, stderr=subprocess.STDOUT,
                                     env=env)
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()

    def log_tail(self, num_chars: int = 2000) -> str:
        return pathlib.Path(self._log.name).read_text(errors="replace")[-num_chars:]

    def _wait_healthy(self) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + self.startup_timeout_s
        url = self.base_url + self.health_path
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode} before answering "
                                   f"{url}; command {' '.join(self.command)}\n{self.log_tail()}")
            try:
                if httpx.get(url, timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(self.poll_s)
        raise RuntimeError(f"server did not answer {url} within {self.startup_timeout_s:.0f} s\n"
                           f"{self.log_tail()}")


def default_gguf() -> pathlib.Path:
    """The default model's GGUF file, located the way the engine's model loader finds it."""
    from forklm.runtime.models.source import default_model_gguf

    return default_model_gguf()


def llamacpp_server(python: str, num_threads: int = 2, n_ctx: int = 4096,
                    model: str | None = None, port: int | None = None) -> ServerProcess:
    """llama-cpp-python's OpenAI-compatible server on the GGUF file, `num_threads` threads (the
    same count as forklm's engine), one context of n_ctx tokens (it serves one request at a
    time, queueing the others, and reuses the previous prompt's prefix)."""
    if not pathlib.Path(python).exists():
        raise FileNotFoundError(f"--llamacpp-python {python!r} does not exist; create it with "
                                "python3.11 -m venv DIR && DIR/bin/pip install "
                                "'llama-cpp-python[server]'")
    port = port or free_port()
    cmd = [python, "-m", "llama_cpp.server", "--model", str(model or default_gguf()),
           "--host", "127.0.0.1", "--port", str(port), "--n_threads", str(num_threads),
           "--n_threads_batch", str(num_threads), "--n_ctx", str(n_ctx),
           # By default a new request aborts the one being streamed; queue them instead.
           "--interrupt_requests", "False"]
    return ServerProcess(cmd, port, health_path="/v1/models")


# OMP_WAIT_POLICY for llama-server: S1 (8 requests at batch 1, -np 8, 2 threads, Xeon with
# AVX-512 bf16), median ms/token, on the shared 2-core machine. Load average ~2: PASSIVE 31.7,
# unset 16.0, ACTIVE 15.3 (TTFT 4.45 / 2.18 / 2.19 s); load ~2.7: 29.6 / 19.3 / 17.3; load ~5:
# PASSIVE 40.2, ACTIVE 239.9 (spinning threads starve under contention). Unset is libgomp's
# default (spin a while, then sleep): near the best when quiet, without ACTIVE's collapse when the
# cores are oversubscribed; PASSIVE sleeps inside ggml's per-op barriers. None = leave it unset.
LLAMA_SERVER_OMP: str | None = None


def llama_server(binary: str, parallel: int, num_threads: int = 2, ctx_per_slot: int = 2048,
                 model: str | None = None, port: int | None = None,
                 omp_wait_policy: str | None = LLAMA_SERVER_OMP) -> ServerProcess:
    """llama.cpp's C++ server on the GGUF file: `parallel` slots decoded together (continuous
    batching is its default), each with its own ctx_per_slot tokens of KV (2048 holds W1/W2's
    ~470-token prompts and W3's last turn, ~350 tokens, with room to spare), and its defaults
    otherwise (prompt cache per slot and in RAM, flash attention auto). omp_wait_policy None
    leaves OMP_WAIT_POLICY unset."""
    if not pathlib.Path(binary).exists():
        raise FileNotFoundError(f"--llama-server {binary!r} does not exist; build it with "
                                "benchmarks/build_llama_server.sh")
    port = port or free_port()
    cmd = [binary, "-m", str(model or default_gguf()), "--host", "127.0.0.1", "--port", str(port),
           "-t", str(num_threads), "-tb", str(num_threads), "-np", str(parallel),
           "-c", str(parallel * ctx_per_slot), "--no-webui"]
    return ServerProcess(cmd, port, health_path="/health",
                         env={"OMP_WAIT_POLICY": omp_wait_policy})


def forklm_server(engine_flags: list[str] | None = None, port: int | None = None) -> ServerProcess:
    """`forklm serve` in a child process with this interpreter; engine_flags are EngineConfig
    flags such as ["--dtype", "bfloat16"]."""
    port = port or free_port()
    cmd = forklm_command("serve", "--host", "127.0.0.1", "--port", str(port), *(engine_flags or []))
    return ServerProcess(cmd, port, health_path="/health")
