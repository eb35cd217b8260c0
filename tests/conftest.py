"""Shared fixtures: the default model loaded once per session, a transformers reference model on the
same weights, and engines built on demand (cached per config so tests share them)."""

from __future__ import annotations

import os
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# The Triton kernels are tested under the interpreter, which Triton reads when it is imported;
# transformers' model modules import it, some of them while pytest collects the test files.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch
import transformers

from forklm.runtime.engine.engine import Engine
from forklm.runtime.models.loader import LoadedModel, load_model

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
# Where servers and programs under test start: the repository root puts the checkout first on
# sys.path, the case tests/test_import_isolation.py is about.
REPO_ROOT = Path(__file__).resolve().parent.parent
# Prompts of the full-model comparisons: chat and raw text, a few tokens to ~50.
EVAL_QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers and explain why they are prime.",
    "Translate 'good morning' into Spanish and German.",
    "def fibonacci(n):",
    "Explain what a radix tree is in two sentences.",
    "Once upon a time, in a village by the mountains,",
    "2 + 2 * 3 = ? Show your steps.",
]


@pytest.fixture(scope="session")
def default_model() -> LoadedModel:
    return load_model(DEFAULT_MODEL)


@pytest.fixture(scope="session")
def tokenizer(default_model: LoadedModel):
    return default_model.tokenizer


@pytest.fixture(scope="session")
def hf_model(default_model: LoadedModel) -> transformers.PreTrainedModel:
    """transformers' own Llama on the same fp32 weights: the correctness reference."""
    model = transformers.LlamaForCausalLM(default_model.config)
    missing, unexpected = model.load_state_dict(default_model.state_dict(), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    model.tie_weights()
    return model.float().eval()


_engines: dict[tuple, Engine] = {}
# Engines with a non-default config kept alive besides the default one (each holds its own copy
# of the weights and a KV pool, ~1 GB in fp32): the least recently used beyond this are shut
# down, which keeps the suite's memory flat as configs accumulate. No test uses more at once.
MAX_OTHER_ENGINES = 3
_DEFAULT_KEY = (("debug_check_invariants", True), ("dtype", "float32"), ("max_total_tokens", 8192))


def _shut_down_least_used(keep: tuple) -> None:
    others = [k for k in _engines if k != _DEFAULT_KEY]
    for key in others[: max(len(others) - MAX_OTHER_ENGINES, 0)]:
        if key != keep:
            _engines.pop(key).shutdown()


@pytest.fixture(scope="session")
def make_engine():
    """make_engine(**config) -> an Engine on the default model, shared by tests asking the same
    config. Every engine checks its KV invariants after every step."""

    def make(**config) -> Engine:
        default = not config
        config.setdefault("dtype", "float32")
        config.setdefault("max_total_tokens", 8192)
        config.setdefault("debug_check_invariants", True)
        key = tuple(sorted(config.items()))
        if key not in _engines:
            _engines[key] = Engine(**config)
        engine = _engines.pop(key)
        _engines[key] = engine  # most recently used last
        if not default:
            _shut_down_least_used(keep=key)
        return engine

    yield make
    for engine in _engines.values():
        engine.shutdown()
    _engines.clear()


def assert_idle_and_clean(engine: Engine) -> None:
    """No step failed, the KV accounting holds, and no request is left or still owns a slot."""
    assert engine.last_error is None
    engine.check_invariants()
    stats = engine.stats()
    assert (stats["running"], stats["waiting"], stats["kv_used"]) == (0, 0, 0)


def chat_prompt(tokenizer, question: str) -> str:
    return tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                         add_generation_prompt=True)


@torch.inference_mode()
def hf_greedy(hf_model, input_ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy decoding with its KV cache, never stopping at EOS (like ignore_eos)."""
    out = hf_model(torch.tensor([input_ids]), use_cache=True)
    tokens: list[int] = []
    for _ in range(max_new_tokens):
        tokens.append(int(out.logits[0, -1].argmax()))
        out = hf_model(torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values,
                       use_cache=True)
    return tokens


class LiveServer:
    """A real uvicorn server on 127.0.0.1 in a background thread (see `serve_in_thread`)."""

    def __init__(self, app, engine: Engine, config, server, thread, port: int):
        self.app, self.engine, self.config = app, engine, config
        self.server, self.thread, self.port = server, thread, port
        self.base_url = f"http://127.0.0.1:{port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        assert not self.thread.is_alive(), "uvicorn did not stop"


def serve_in_thread(engine: Engine, **server_config) -> LiveServer:
    """Start create_app(engine, ServerConfig(**server_config)) on a free port; returns when it
    accepts connections. The caller stops it (LiveServer.stop); the engine stays up."""
    import socket
    import threading
    import time

    import uvicorn

    from forklm.server.app import create_app
    from forklm.server.config import ServerConfig

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))  # the OS picks a free port; the bound socket avoids races
    port = sock.getsockname()[1]
    config = ServerConfig(port=port, **server_config)
    app = create_app(engine, config)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    return LiveServer(app, engine, config, server, thread, port)


@pytest.fixture(scope="session")
def live_server(make_engine):
    """The HTTP server on the default model (fp32, like make_engine's engines; it shares the
    default make_engine() engine), default ServerConfig. Has .base_url, .engine, .app, .config."""
    server = serve_in_thread(make_engine())
    yield server
    server.stop()


def wait_until(cond, timeout: float = 20.0) -> None:
    """Poll `cond` every 20 ms until it holds; fail the test after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


@pytest.fixture
def engine_prompts(live_server, monkeypatch) -> list:
    """The prompt (text or token ids) of every engine call the live server's engine prepares
    while the test runs."""
    engine, seen = live_server.engine, []
    prepare = engine.prepare

    def recording(request, **kwargs):
        seen.append(request.prompt)
        return prepare(request, **kwargs)

    monkeypatch.setattr(engine, "prepare", recording)
    return seen
