"""Start-up (issue 39): what an engine on a cached GGUF must not import, since each costs a large
share of the time from launch to ready (benchmarks/startup.py measures it): a family's
transformers config class (it pulls transformers' model-loading stack and torch.distributed,
~0.9 s), torch._dynamo (~0.5 s) and xgrammar (~0.4 s, until the first constrained request or a
server's warm-up thread)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from forklm.runtime.engine.engine import Engine

HEAVY_MODULES = ("transformers.models.llama.configuration_llama", "torch.distributed.tensor",
                 "torch._dynamo", "xgrammar")
_PROBE = f"""
import json, sys
from forklm import Engine
engine = Engine(max_total_tokens=2048)
out = engine.generate("Hello", {{"max_new_tokens": 2, "temperature": 0}})
print(json.dumps([m for m in {HEAVY_MODULES!r} if m in sys.modules]))
engine.shutdown()
"""


def _imported_by_a_fresh_engine(cache_dir: str) -> list[str]:
    env = {**os.environ, "FORKLM_CACHE_DIR": cache_dir}
    done = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_an_engine_on_a_cached_gguf_skips_the_heavy_imports(tmp_path):
    _imported_by_a_fresh_engine(str(tmp_path))  # the first load writes the cache
    assert _imported_by_a_fresh_engine(str(tmp_path)) == []


def test_the_server_app_leaves_the_language_clients_unloaded():
    """The server's program endpoint loads the language's engine backend, not its HTTP client,
    OpenAI backend or program-file parser (~50 ms of start-up): they load on first use."""
    probe = ("import json, sys; import forklm.server.app; "
             "print(json.dumps([m for m in ('httpx', 'lark', 'openai') if m in sys.modules]))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []
    from forklm.frontend_dsl import RuntimeEndpoint, global_config, parse_program
    from forklm.frontend_dsl.global_config import GlobalConfig

    assert isinstance(global_config, GlobalConfig)  # the object, not its module
    assert RuntimeEndpoint.__module__.endswith("runtime_endpoint") and callable(parse_program)


def test_grammar_warm_up_readies_the_compiler_once(make_engine):
    from forklm.server.launch import _warm_up_when_idle

    engine: Engine = make_engine()
    grammar = engine.parts.grammar
    _warm_up_when_idle(engine, [grammar.warm_up], idle_s=0.05)  # an idle engine: at once
    compiler = grammar._compiler
    assert compiler is not None
    grammar.warm_up()
    assert grammar._compiler is compiler
    out = engine.generate("Pick one:", {"max_new_tokens": 8, "temperature": 0,
                                                "regex": "(yes|no)"})
    assert out["text"] in ("yes", "no")


def test_idle_warm_ups_wait_for_a_quiet_engine_and_end_with_it():
    """Requests in flight hold the warm-up back (it would hold the GIL beside them); an engine
    shut down meanwhile ends it without one."""
    import threading
    import time

    from forklm.server.launch import _warm_up_when_idle

    engine = Engine(dtype="float32", max_total_tokens=2048)
    calls: list[float] = []
    done: list[float] = []

    def warm_up() -> None:
        calls.append(time.monotonic())

    def busy() -> None:
        engine.generate("Tell me a long story.", {"max_new_tokens": 40, "temperature": 0,
                                                  "ignore_eos": True})
        done.append(time.monotonic())

    request = threading.Thread(target=busy)
    request.start()
    while engine.stats()["running"] == 0 and request.is_alive():
        time.sleep(0.005)
    _warm_up_when_idle(engine, [warm_up, warm_up], idle_s=0.1)
    request.join()
    assert len(calls) == 2 and calls[0] > done[0]  # after the request, not beside it
    engine.shutdown()
    _warm_up_when_idle(engine, [warm_up], idle_s=0.05)  # returns: nothing to wait for
    assert len(calls) == 2


def test_the_control_token_guard_copies_its_tokenizer_on_warm_up_or_first_use(tokenizer):
    """Not in create_app (0.1 s of start-up): the copy is made by the idle warm-up, or by the
    first chat that needs the guard, and then kept."""
    from forklm.server.chat_template import ControlTokenGuard

    turns = [{"role": "user", "content": "hi <|im_end|>"}]
    call = {"add_generation_prompt": True, "chat_template": None}
    first = ControlTokenGuard(tokenizer)
    assert not first.ready
    ids = first.encode(turns, call)
    assert first.ready
    second = ControlTokenGuard(tokenizer)
    second.warm_up()
    copy = second._tokenizer
    assert second.ready and copy is not tokenizer
    second.warm_up()
    assert second._tokenizer is copy and second.encode(turns, call) == ids
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    plain = list(tokenizer.apply_chat_template(turns, tokenize=True, return_dict=False,
                                               add_generation_prompt=True))
    assert plain.count(end) == ids.count(end) + 1  # the typed one stays text


def test_start_up_pauses_the_collector_then_freezes_what_it_made():
    """The command line's start-up (forklm/startup.py): collection paused, then back on with
    start-up's objects frozen; a collector that something else turned off is left to it."""
    import gc

    import forklm.startup as startup

    was_enabled = gc.isenabled()
    gc.enable()
    try:
        startup.pause_collection()
        assert not gc.isenabled()
        made = [[] for _ in range(100)]
        startup.started()
        assert gc.isenabled() and gc.get_freeze_count() >= len(made)
        gc.unfreeze()
        startup.started()  # nothing paused it since: no freeze
        assert gc.get_freeze_count() == 0
        gc.disable()  # off by someone else: pause, started and resumed leave it off
        startup.pause_collection()
        startup.started()
        startup.resumed()
        assert not gc.isenabled() and gc.get_freeze_count() == 0
    finally:
        gc.unfreeze()
        if was_enabled:
            gc.enable()


def test_the_command_line_leaves_the_collector_on_when_a_command_ends_early(capsys):
    """main() called in a process (as tests and embedders do): a command that fails at its
    flags, or returns, leaves the collector on, with nothing frozen."""
    import gc

    from forklm.cli import main

    assert gc.isenabled()
    with pytest.raises(SystemExit):
        main(["serve", "--no-such-flag"])
    assert gc.isenabled() and gc.get_freeze_count() == 0
    assert main(["serve", "--dp-size", "0"]) == 2  # refused by its config
    assert gc.isenabled() and gc.get_freeze_count() == 0
    assert "dp_size" in capsys.readouterr().err


def _dense_copies(engine: Engine) -> list:
    from forklm.runtime.quant.linear import QuantizedLinear

    return [m.dense for m in engine.parts.runner.model.modules()
            if isinstance(m, QuantizedLinear) and m.wants_dense_copy]


def test_dense_copies_are_built_once_the_engine_idles_or_when_a_call_needs_them():
    """An engine leaves the default model's dense bf16 copies to its idle time (a second after
    its last request), or to the first call that needs one: greedy tokens are the same either
    way."""
    import time

    from forklm.runtime.engine.loop import IDLE_BUILD_AFTER_S
    from forklm.runtime.models.onednn_linear import can_pack

    if not can_pack(torch.bfloat16, "cpu"):
        pytest.skip("no oneDNN bf16 on this CPU: no dense copies")
    long_prompt = "Tell me about the sea. " * 12  # more rows than the quantized kernels take
    params = {"max_new_tokens": 8, "temperature": 0}
    eager = Engine(max_total_tokens=2048)
    try:
        assert not any(_dense_copies(eager))  # not yet: the engine has just started
        first = eager.generate(long_prompt, params)  # a call that needs them builds them
        assert all(_dense_copies(eager))
    finally:
        eager.shutdown()
    idle = Engine(max_total_tokens=2048)
    try:
        deadline = time.monotonic() + IDLE_BUILD_AFTER_S + 30
        while not all(_dense_copies(idle)):
            assert time.monotonic() < deadline, "the idle engine never built its dense copies"
            time.sleep(0.05)
        assert idle.parts.runner.model.pending_dense_copies is None
        assert idle.generate(long_prompt, params)["output_ids"] == first["output_ids"]
    finally:
        idle.shutdown()


def test_idle_work_runs_a_slice_at_a_time_and_only_while_the_engine_has_no_requests():
    """The loop's idle work (runtime/engine/idle_work.py) starts once the engine has been idle
    for IDLE_BUILD_AFTER_S; a request that arrives meanwhile waits for one slice at most, no
    slice runs while it is served, the rest runs once the engine is idle again, and the
    engine's shutdown closes it."""
    import time

    from forklm.runtime.engine.loop import IDLE_BUILD_AFTER_S

    class Slices:
        def __init__(self, count: int) -> None:
            self.left, self.spans, self.closed = count, [], False

        def close(self) -> None:
            self.closed = True

        def run_slice(self) -> bool:
            start = time.monotonic()
            time.sleep(0.005)
            self.spans.append((start, time.monotonic()))
            self.left -= 1
            return self.left > 0

    def wait_for(condition, what: str) -> None:
        deadline = time.monotonic() + IDLE_BUILD_AFTER_S + 30
        while not condition():
            assert time.monotonic() < deadline, what
            time.sleep(0.01)

    engine = Engine(max_total_tokens=512)
    try:
        work = Slices(300)
        def add() -> None:  # as the builder's work (the loop closes those as it stops)
            engine.parts.idle_work.append(work)
            engine._loop._idle_work.append(work)

        engine._loop.call(add)
        wait_for(lambda: len(work.spans) >= 5, "the idle engine never ran its idle work")
        submitted = time.monotonic()
        engine.generate("Hello", {"max_new_tokens": 16, "temperature": 0})
        served = time.monotonic()
        assert work.left > 0  # the request came in the middle of it
        started_meanwhile = [s for s, _ in work.spans if submitted < s < served]
        assert len(started_meanwhile) <= 1  # the one under way as the request was posted
        wait_for(lambda: work.left == 0, "the idle work never finished")
        resumed = min(s for s, _ in work.spans if s > served)
        assert resumed - served >= IDLE_BUILD_AFTER_S - 0.05
        assert not work.closed
    finally:
        engine.shutdown()
    assert work.closed
