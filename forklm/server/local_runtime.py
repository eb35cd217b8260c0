"""Runtime: SGLang's `sgl.Runtime`, a local `forklm serve` process that is also a backend. It
sits with the server, whose flags it checks before starting one; the language re-exports it."""

from __future__ import annotations

import atexit
import dataclasses
import os
import subprocess
import tempfile
import time
from typing import Any

import httpx

from forklm.frontend_dsl.backends.base import BackendError
from forklm.frontend_dsl.backends.runtime_endpoint import RuntimeEndpoint
from forklm.runtime.child_process import forklm_command, free_port
from forklm.runtime.config import EngineConfig
from forklm.runtime.cpu_threads import sleeping_threads_env
from forklm.runtime.errors import InvalidArgumentError
from forklm.server.config import ServerConfig

_POLL_S = 0.2
_LOG_TAIL_CHARS = 4000  # of the server's output, quoted when it fails to start


class Runtime(RuntimeEndpoint):
    """`Runtime(model_path=None, launch_timeout=300.0, log_level="error", **flags)`: start
    `forklm serve` on a free 127.0.0.1 port (flags are EngineConfig and ServerConfig fields,
    checked here before anything starts), wait until its /health answers, and run programs on
    it (it is a RuntimeEndpoint). `shutdown()` stops the process; it also runs at interpreter
    exit and when a `with Runtime(...)` block ends. A server that exits or does not come up
    within `launch_timeout` seconds raises BackendError / TimeoutError with its output's tail."""

    def __init__(self, model_path: str | None = None, launch_timeout: float = 300.0,
                 log_level: str = "error", **flags: Any):
        api_key = flags.get("api_key")
        port = flags.pop("port", None) or free_port()
        argv = _serve_argv(model_path, {**flags, "port": port, "log_level": log_level})
        self.url = f"http://127.0.0.1:{port}"
        # the server's output, read back when it fails to start
        self._log = tempfile.NamedTemporaryFile(  # noqa: SIM115 - closed in shutdown()
            prefix="forklm-runtime-", suffix=".log", delete=False)
        env = sleeping_threads_env()  # the server shares the cores with this program
        self.process = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT,
                                        env=env)
        atexit.register(self.shutdown)
        try:
            self._wait_healthy(launch_timeout)
            super().__init__(self.url, api_key=api_key)
        except BaseException:
            self.shutdown()
            raise

    @property
    def endpoint(self) -> RuntimeEndpoint:
        """SGLang's `runtime.endpoint`: the backend (this object)."""
        return self

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def shutdown(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL if it lingers); idempotent."""
        atexit.unregister(self.shutdown)
        if getattr(self, "client", None) is not None:
            self.close()
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()
        if os.path.exists(self._log.name):
            os.unlink(self._log.name)

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            code = self.process.poll()
            if code is not None:
                raise BackendError(f"forklm serve exited with status {code} before it was "
                                   f"ready; its output ends:\n{self._log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass  # not listening yet
            if time.monotonic() > deadline:
                raise TimeoutError(f"forklm serve did not answer {self.url}/health within "
                                   f"{timeout:g} s; its output ends:\n{self._log_tail()}")
            time.sleep(_POLL_S)

    def _log_tail(self) -> str:
        with open(self._log.name, encoding="utf-8", errors="replace") as f:
            return f.read()[-_LOG_TAIL_CHARS:]


def _serve_argv(model_path: str | None, flags: dict[str, Any]) -> list[str]:
    """The `forklm serve` command line; every flag is checked against the configs first, so a
    misspelt or invalid flag fails here, naming it."""
    if flags.get("host", "127.0.0.1") != "127.0.0.1":
        raise InvalidArgumentError("host", flags["host"], "Runtime serves on 127.0.0.1 only; "
                                   "run `forklm serve --host ...` to serve elsewhere")
    engine_names = {f.name for f in dataclasses.fields(EngineConfig)}
    server_names = {f.name for f in dataclasses.fields(ServerConfig)}
    unknown = sorted(set(flags) - engine_names - server_names)
    if unknown:
        raise InvalidArgumentError(unknown[0], flags[unknown[0]], "not a forklm serve flag; "
                                   "known: " + ", ".join(sorted(engine_names | server_names)))
    engine_flags = {k: v for k, v in flags.items() if k in engine_names}
    if model_path is not None:
        engine_flags["model_path"] = model_path
    EngineConfig.from_kwargs(**engine_flags)
    ServerConfig.from_kwargs(**{k: v for k, v in flags.items() if k in server_names})
    argv = forklm_command("serve")
    for name, value in {**flags, **engine_flags}.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + flag[2:])
        elif value is not None:
            argv += [flag, str(value)]
    return argv
