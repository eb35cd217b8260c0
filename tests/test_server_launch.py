"""`forklm serve` as a real process: it serves, and SIGTERM stops it gracefully with exit 0
(in-flight requests finish or are aborted, new connections are refused)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_cli_flags_cover_both_configs():
    import dataclasses

    from forklm.cli import build_parser
    from forklm.runtime.config import EngineConfig
    from forklm.server.config import ServerConfig

    args = build_parser().parse_args(["serve", "--model", "m", "--port", "1234", "--api-key", "k",
                                      "--max-program-nodes", "5", "--disable-radix-cache"])
    assert (args.model_path, args.port, args.api_key, args.max_program_nodes) == ("m", 1234, "k", 5)
    assert args.disable_radix_cache is True and args.host is None  # unset -> dataclass default
    for cls in (EngineConfig, ServerConfig):
        assert {f.name for f in dataclasses.fields(cls)} <= set(vars(args))


def test_sigterm_graceful_shutdown_exits_0():
    port = free_port()
    cmd = [sys.executable, "-m", "forklm", "serve", "--port", str(port), "--dtype", "float32",
           "--max-total-tokens", "4096", "--graceful-shutdown-s", "4", "--log-level", "warning"]
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, proc.stdout.read().decode()
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "server did not come up"
            time.sleep(0.2)
        events: list[str] = []
        short: list[httpx.Response] = []

        def long_stream() -> None:  # runs past the grace period: must be cut off, not hang
            body = {"text": "Tell a long story.", "stream": True,
                    "sampling_params": {"max_new_tokens": 4000, "ignore_eos": True}}
            try:
                with httpx.stream("POST", base + "/generate", json=body, timeout=60) as r:
                    events.extend(line for line in r.iter_lines() if line)
            except httpx.HTTPError:
                events.append("<connection closed>")

        def short_request() -> None:  # finishes within the grace period: must succeed
            body = {"text": "Hi", "sampling_params": {"max_new_tokens": 8, "ignore_eos": True}}
            short.append(httpx.post(base + "/generate", json=body, timeout=60))

        threads = [threading.Thread(target=long_stream), threading.Thread(target=short_request)]
        for t in threads:
            t.start()
        while not events:
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, proc.stdout.read().decode()
        for t in threads:
            t.join(timeout=30)
        assert short and short[0].status_code == 200, (short[0].text, proc.stdout.read().decode())
        assert short[0].json()["meta_info"]["finish_reason"] == {"type": "length", "length": 8}
        # the long stream was ended after the grace period: an abort as its last event
        assert events[-1] == "data: [DONE]" and '"abort"' in events[-2], events[-2:]
        with pytest.raises(httpx.TransportError):
            httpx.get(base + "/health", timeout=2)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_cli_reports_a_model_it_cannot_find_without_a_traceback(tmp_path, capsys):
    from forklm.cli import main

    assert main(["generate", "hi", "--model-path", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("forklm generate: error: model_path=") and "Traceback" not in err
