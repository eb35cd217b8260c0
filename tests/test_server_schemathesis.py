"""Property-based fuzzing of every operation in the server's own OpenAPI schema (schemathesis):
whatever a client sends, the answer is never a 5xx. The engine has a short context, so any
generation the fuzzer happens to request stays short."""

from __future__ import annotations

import pytest
import schemathesis
from conftest import assert_idle_and_clean, serve_in_thread
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable

pytestmark = pytest.mark.slow
EXAMPLES = 25  # per operation and mode; parameterless GETs run once: ~300 requests


@pytest.fixture(scope="module")
def fuzz_server(make_engine):
    server = serve_in_thread(make_engine(context_length=64, max_total_tokens=2048))
    yield server
    server.stop()


def test_no_server_errors(fuzz_server):
    """Positive (schema-conforming) and negative cases for every operation; any 5xx fails."""
    from schemathesis.generation.modes import GenerationMode

    api = schemathesis.openapi.from_url(fuzz_server.base_url + "/openapi.json")
    operations = [result.ok() for result in api.get_all_operations()]
    assert {"/generate", "/v1/chat/completions", "/v1/completions"} <= {op.path for op in operations}
    failures, calls = [], [0]
    for op in operations:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

            @given(case=op.as_strategy(generation_mode=mode))
            @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                      phases=[Phase.explicit, Phase.generate],
                      suppress_health_check=list(HealthCheck))
            def run(case) -> None:
                response = case.call(base_url=fuzz_server.base_url, timeout=60)
                calls[0] += 1
                if response.status_code >= 500:
                    failures.append((case.method, case.path, case.body, response.text[:300]))

            try:
                run()
            except Unsatisfiable:  # e.g. no negative case exists for a GET without parameters
                assert mode == GenerationMode.NEGATIVE, op.path
    assert not failures, failures
    assert calls[0] >= 100  # the fuzzer really exercised the API


def test_fuzzed_engine_is_clean(fuzz_server):
    import time

    deadline = time.monotonic() + 20
    while fuzz_server.engine.stats()["running"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert_idle_and_clean(fuzz_server.engine)
