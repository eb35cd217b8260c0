"""RuntimeEndpoint: DSL programs over HTTP give the in-process EngineBackend's results (greedy, fp32
on both sides); run_batch of a traceable program is one /v1/programs/run request, and a program
with data-dependent control flow falls back to per-call requests with the same results."""

from __future__ import annotations

import importlib.util
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import forklm as sgl
from forklm.frontend_dsl.backends import BackendError

pytestmark = pytest.mark.slow

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.fixture(scope="module")
def endpoint(live_server):
    backend = sgl.RuntimeEndpoint(live_server.base_url)
    yield backend
    backend.close()


@pytest.fixture(scope="module")
def local(make_engine):
    return sgl.EngineBackend(make_engine())


@pytest.fixture
def paths(endpoint):
    """The request paths `endpoint` sends during the test, counted (without the program
    sessions' /open_session and /close_session: a close is sent in the background and may land
    in the next test)."""
    seen: Counter[str] = Counter()

    def hook(request) -> None:
        if not request.url.path.endswith("_session"):
            seen.update([request.url.path])

    endpoint.client.event_hooks["request"].append(hook)
    yield seen
    endpoint.client.event_hooks["request"].remove(hook)


def test_tokenizer_and_chat_template_are_the_servers(endpoint, local):
    history = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    for role, hist in (("system", []), ("user", []), ("user", history)):
        assert endpoint.role_prefix_suffix(role, hist) == local.role_prefix_suffix(role, hist)
    assert endpoint.default_system_prompt() == local.default_system_prompt()
    text = "Zürich's naïve café: 12×3 = 36 🙂"
    assert endpoint.tokenizer.encode(text) == local.tokenizer.encode(text)
    endpoint.abort("no-such-request")  # an unknown rid is a no-op on the server, not an error


def _view(state):
    return {"text": state.text(), "variables": state.variables(), "messages": state.messages()}


@sgl.function
def everything(s, question):
    s += sgl.system("You are terse.")
    s += sgl.user(question)
    s += sgl.assistant(sgl.gen("answer", max_tokens=8))
    s += "\nTrue or false: the sky is green. Answer: "
    s += sgl.select("tf", ["True", "False", "Unknown"])
    s += "\n" + sgl.select("greedy", ["maybe", "certainly"],
                           choices_method=sgl.greedy_token_selection)
    s += "\n" + sgl.select("uncond", ["red", "blue"],
                           choices_method=sgl.unconditional_likelihood_normalized)
    s += "\nA number: " + sgl.gen("number", max_tokens=4, regex=r"[0-9]{1,3}")
    s += "\nAn int: " + sgl.gen_int("count", max_tokens=4)
    forks = s.fork(2)
    forks += lambda i: f"\nIdea {i}:" + sgl.gen("idea", max_tokens=5, stop="\n")
    forks.join()


def test_primitives_match_in_process(endpoint, local):
    question = "What is the capital of France?"
    remote = everything.run(question, backend=endpoint, temperature=0.0)
    expected = everything.run(question, backend=local, temperature=0.0)
    assert _view(remote) == _view(expected)
    assert len(remote["idea"]) == 2 and remote["number"].isdigit()
    # the same scores up to float noise (the second run reads its prefix from the radix cache)
    scores = remote.get_meta_info("tf")["normalized_prompt_logprobs"]
    assert scores == pytest.approx(expected.get_meta_info("tf")["normalized_prompt_logprobs"],
                                   abs=1e-3)


def _example_runs():
    names = sorted(p.stem for p in EXAMPLES.glob("*.py"))
    return [n for n in names if "def run(backend" in (EXAMPLES / f"{n}.py").read_text()]


@pytest.mark.parametrize("name", _example_runs())
def test_examples_match_in_process(name, endpoint, local):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with ThreadPoolExecutor(2) as pool:  # both at once: the shared engine batches them together
        remote, expected = pool.map(lambda backend: module.run(backend=backend), [endpoint, local])
    if isinstance(remote, list):
        assert [_view(s) for s in remote] == [_view(s) for s in expected]
    else:
        assert _view(remote) == _view(expected)


@sgl.function
def capital(s, country):
    s += "Answer with a city.\nQ: What is the capital of Italy?\nA: Rome\n"
    s += f"Q: What is the capital of {country}?\nA:" + sgl.gen("city", max_tokens=6, stop="\n")


@sgl.function
def branchy(s, country):
    s += f"Is {country} in Europe? Answer yes or no: " + sgl.select("eu", ["yes", "no"])
    if s["eu"] == "yes":  # data-dependent: this program cannot be traced
        s += "\nIts capital is" + sgl.gen("city", max_tokens=6, stop="\n")
    else:
        s += "\nIts largest city is" + sgl.gen("city", max_tokens=6, stop="\n")


COUNTRIES = [{"country": c} for c in ("France", "Japan", "Peru")]


def test_traceable_batch_is_one_request(endpoint, local, paths):
    remote = capital.run_batch(COUNTRIES, backend=endpoint, temperature=0.0)
    assert paths == {"/v1/programs/run": 1}
    expected = capital.run_batch(COUNTRIES, backend=local, temperature=0.0)
    assert [_view(s) for s in remote] == [_view(s) for s in expected]
    assert remote[0].get_meta_info("city")["completion_tokens"] >= 1


def test_batch_over_the_servers_limits_falls_back_to_calls(live_server, local):
    from conftest import serve_in_thread

    small = serve_in_thread(live_server.engine, max_program_nodes=2)
    backend = sgl.RuntimeEndpoint(small.base_url)
    try:
        seen: Counter[str] = Counter()
        backend.client.event_hooks["request"].append(lambda r: seen.update([r.url.path]))
        states = capital.run_batch(COUNTRIES, backend=backend, temperature=0.0)
        assert seen["/v1/programs/run"] == 1 and seen["/generate"] >= len(COUNTRIES)
        expected = capital.run_batch(COUNTRIES, backend=local, temperature=0.0)
        assert [_view(s) for s in states] == [_view(s) for s in expected]
    finally:
        backend.close()
        small.stop()


def test_data_dependent_batch_falls_back_to_calls(endpoint, local, paths):
    remote = branchy.run_batch(COUNTRIES, backend=endpoint, temperature=0.0)
    assert "/v1/programs/run" not in paths and paths["/generate"] >= 2 * len(COUNTRIES)
    expected = branchy.run_batch(COUNTRIES, backend=local, temperature=0.0)
    assert [_view(s) for s in remote] == [_view(s) for s in expected]


def test_streaming_over_http(endpoint):
    @sgl.function
    def count(s):
        s += "Count from one to ten in words: one, two," + sgl.gen("rest", max_tokens=10)

    state = count.run(backend=endpoint, stream=True, temperature=0.0)
    pieces = list(state.text_iter("rest"))
    assert len(pieces) >= 3 and "".join(pieces) == state["rest"]


def test_streamed_logprobs_over_http_match_the_local_engine(endpoint, local):
    @sgl.function
    def count(s):
        s += "Count from one to ten in words: one, two," + sgl.gen(
            "rest", max_tokens=10, return_logprob=True, return_text_in_logprobs=True)

    state = count.run(backend=endpoint, stream=True, temperature=0.0)
    pairs = list(state.text_iter("rest", return_logprobs=True))
    entries = [e for _, es in pairs for e in es]
    assert len(pairs) >= 3 and "".join(p for p, _ in pairs) == state["rest"]
    assert len(entries) == state.get_meta_info("rest")["completion_tokens"]
    assert entries == state.get_meta_info("rest")["output_token_logprobs"]
    expected = count.run(backend=local, temperature=0.0).get_meta_info("rest")
    assert [e[1:] for e in entries] == [e[1:] for e in expected["output_token_logprobs"]]


def test_server_errors_are_raised_with_the_servers_message(endpoint):
    @sgl.function
    def too_long(s):
        s += "word " * 9000 + sgl.gen("x", max_tokens=2)

    state = too_long.run(backend=endpoint)
    with pytest.raises(sgl.InvalidArgumentError, match="context"):
        state["x"]

    @sgl.function
    def bad_regex(s):  # Python accepts the lookahead, the server's grammar compiler does not
        s += "n=" + sgl.gen("n", max_tokens=3, regex="(?=1)[0-9]+")

    states = bad_regex.run_batch([{}, {}], backend=endpoint)
    for state in states:  # both items failed on the server; each raises on read
        with pytest.raises((sgl.InvalidArgumentError, BackendError)):
            state["n"]


def test_api_key_is_sent(live_server):
    from conftest import serve_in_thread

    guarded = serve_in_thread(live_server.engine, api_key="sesame")
    try:
        with pytest.raises(BackendError, match="API key"):
            sgl.RuntimeEndpoint(guarded.base_url)
        backend = sgl.RuntimeEndpoint(guarded.base_url, api_key="sesame")
        state = capital.run("Chile", backend=backend, temperature=0.0, max_new_tokens=2)
        assert state["city"]
        backend.close()
    finally:
        guarded.stop()
