"""A tiny OpenAI-compatible completions server for the benchmark client's tests: it streams one
word per token, reports usage with cached_tokens = the words shared with the previous prompt, and
records every request body. Run as a script (`--port P`) or in a thread with `serve()`."""

from __future__ import annotations

import argparse
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class FakeOpenAIHandler(BaseHTTPRequestHandler):
    bodies: list[dict[str, Any]] = []
    lock = threading.Lock()

    def log_message(self, *args: Any) -> None:  # keep test output quiet
        pass

    def do_GET(self) -> None:
        if self.path in ("/health", "/v1/models"):
            self._send(200, {"object": "list", "data": [{"id": "fake"}]})
        else:
            self._send(404, {"error": "not found"})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path != "/v1/completions":
            self._send(404, {"error": "not found"})
            return
        with self.lock:
            previous = self.bodies[-1]["prompt"].split() if self.bodies else []
            self.bodies.append(body)
        words = body["prompt"].split()
        cached = next((i for i, (a, b) in enumerate(zip(words, previous)) if a != b),
                      min(len(words), len(previous)))
        n = body["max_tokens"] if body.get("ignore_eos") else min(3, body["max_tokens"])
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for i in range(n):
            self._event({"choices": [{"index": 0, "text": f" w{i}", "finish_reason": None}]})
        usage = {"prompt_tokens": len(words), "completion_tokens": n,
                 "prompt_tokens_details": {"cached_tokens": cached}}
        self._event({"choices": [], "usage": usage})
        self.wfile.write(b"data: [DONE]\n\n")

    def _event(self, obj: dict[str, Any]) -> None:
        self.wfile.write(f"data: {json.dumps(obj)}\n\n".encode())
        self.wfile.flush()

    def _send(self, code: int, obj: dict[str, Any]) -> None:
        data = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def serve(port: int = 0) -> ThreadingHTTPServer:
    """Start in a daemon thread; the caller shuts it down. server.server_address[1] is the port."""
    server = ThreadingHTTPServer(("127.0.0.1", port), FakeOpenAIHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    ThreadingHTTPServer(("127.0.0.1", parser.parse_args().port), FakeOpenAIHandler).serve_forever()
