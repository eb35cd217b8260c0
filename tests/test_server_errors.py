"""Bad input, overload and auth on a real server: each gets its status and an OpenAI-style error
body naming the problem, never a 500, and a valid request succeeds afterwards."""

from __future__ import annotations

import threading

import httpx
import pytest
from conftest import assert_idle_and_clean, serve_in_thread

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"
OK_GEN = {"text": "Hi", "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def client(live_server):
    with httpx.Client(base_url=live_server.base_url, timeout=60) as c:
        yield c


def assert_error(r: httpx.Response, status: int, param: str | None = None,
                 says: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status
    assert err["message"], err
    if param is not None:
        assert err["param"] == param, err
    if says is not None:
        assert says in err["message"], err
    return err


BAD_GENERATE = [
    ({"text": 123}, "text"),  # wrong type
    ({"text": "x", "bogus": 1}, "bogus"),  # unknown field
    ({"text": "x", "sampling_params": {"bogus": 1}}, "bogus"),  # unknown sampling parameter
    ({"text": "x", "sampling_params": {"temperature": -1}}, "temperature"),  # out of range
    ({"text": "x", "sampling_params": {"top_p": 1.5}}, "top_p"),
    ({"text": "x", "sampling_params": {"max_new_tokens": "many"}}, "max_new_tokens"),
    ({"text": "x", "sampling_params": {"regex": "a+", "json_schema": {"type": "object"}}},
     "json_schema"),  # two constraints at once
    ({"text": "x", "sampling_params": {"regex": "(unclosed"}}, "regex"),
    ({"text": "x", "sampling_params": {"json_schema": {"type": "no-such-type"}}}, "json_schema"),
    ({"text": "x", "sampling_params": {"json_schema": "{not json"}}, "json_schema"),
    ({"text": "x", "sampling_params": {"ebnf": "root ::= undefined_rule"}}, "ebnf"),
    ({"text": "", "sampling_params": {}}, "prompt"),
    ({"input_ids": [1, 10**9]}, "input_ids"),
    ({"text": "x", "input_ids": [1]}, "prompt"),
    ({"text": ["a", "b"], "stream": True}, "stream"),
    ({"text": "x", "top_logprobs_num": -1}, "top_logprobs_num"),
    ({"text": "x", "return_logprob": True, "logprob_start_len": 99}, "logprob_start_len"),
]


@pytest.mark.parametrize("body,param", BAD_GENERATE, ids=[p for _, p in BAD_GENERATE])
def test_bad_generate_is_400(client, body, param):
    assert_error(client.post("/generate", json=body), 400, param)


BAD_CHAT = [
    ({**CHAT, "max_tokens": "abc"}, "max_tokens"),
    ({**CHAT, "max_tokens": -1}, "max_tokens"),
    ({**CHAT, "n": 0}, "n"),
    ({**CHAT, "temperature": 9}, "temperature"),
    ({**CHAT, "messages": []}, "messages"),
    ({**CHAT, "messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
    ({**CHAT, "frobnicate": True}, "frobnicate"),
    ({**CHAT, "regex": "a", "response_format": {"type": "json_object"}}, "json_schema"),
    ({**CHAT, "tool_choice": "required"}, "tool_choice"),  # no tools
    ({**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
    ({**CHAT, "top_logprobs": 2}, "top_logprobs"),
    ({**CHAT, "logit_bias": {"1": 500}}, "logit_bias"),  # OpenAI's range is [-100, 100]
    ({**CHAT, "response_format": {"type": "json_schema"}}, "response_format.json_schema"),
]


@pytest.mark.parametrize("body,param", BAD_CHAT, ids=[p for _, p in BAD_CHAT])
def test_bad_chat_is_400(client, body, param):
    assert_error(client.post("/v1/chat/completions", json=body), 400, param)


def test_malformed_json_and_wrong_shapes(client):
    r = client.post("/generate", content=b'{"text": "x", ', headers={"content-type": "application/json"})
    assert_error(r, 400, says="malformed JSON")
    assert_error(client.post("/generate", json=["not", "an", "object"]), 400)
    assert_error(client.post("/v1/completions", content=b"\xff\xfe", headers={
        "content-type": "application/json"}), 400)


def test_prompt_longer_than_context(client, live_server):
    long_text = "hello " * (live_server.engine.parts.context_len + 100)
    assert_error(client.post("/generate", json={"text": long_text}), 400, "prompt",
                 says="context_length")
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": long_text})
    assert_error(r, 400, "prompt")


def test_unknown_model_and_route(client):
    assert_error(client.post("/v1/chat/completions", json={**CHAT, "model": "gpt-9"}), 404,
                 "model", says="gpt-9")
    assert_error(client.post("/v1/completions", json={"model": "gpt-9", "prompt": "x"}), 404)
    assert_error(client.get("/no/such/route"), 404)
    assert_error(client.get("/generate"), 405)


def test_then_a_valid_request_succeeds(client, live_server):
    r = client.post("/generate", json=OK_GEN)
    assert r.status_code == 200 and len(r.json()["output_ids"]) == 2
    assert client.post("/v1/chat/completions", json=CHAT).status_code == 200
    assert_idle_and_clean(live_server.engine)
    assert live_server.app.state.service.admission.admitted == 0  # rejected ones left no trace


@pytest.fixture(scope="module")
def guarded(live_server):
    """A second server on the same engine, with an API key and a small body limit."""
    server = serve_in_thread(live_server.engine, api_key="sekrit", max_request_body_bytes=2000)
    yield server
    server.stop()


def test_api_key(guarded):
    url = guarded.base_url
    assert httpx.get(url + "/health").status_code == 200  # open for liveness probes
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekrit"}):
        for method, path in (("POST", "/generate"), ("GET", "/v1/models"), ("GET", "/metrics")):
            r = httpx.request(method, url + path, json=OK_GEN, headers=headers)
            assert_error(r, 401, says="API key")
    r = httpx.post(url + "/generate", json=OK_GEN, headers={"Authorization": "Bearer sekrit"})
    assert r.status_code == 200


def test_body_too_large(guarded):
    auth = {"Authorization": "Bearer sekrit"}
    big = {"text": "x" * 5000}
    assert_error(httpx.post(guarded.base_url + "/generate", json=big, headers=auth), 413,
                 says="max_request_body_bytes")

    def chunks():  # no Content-Length: the limit is enforced while reading
        yield b'{"text": "'
        for _ in range(10):
            yield b"y" * 500
        yield b'"}'

    r = httpx.post(guarded.base_url + "/generate", content=chunks(),
                   headers={**auth, "content-type": "application/json"})
    assert_error(r, 413)
    assert httpx.post(guarded.base_url + "/generate", json=OK_GEN, headers=auth).status_code == 200


def test_queue_full_is_503_and_accepted_requests_finish(make_engine):
    engine = make_engine(max_running_requests=2)
    server = serve_in_thread(engine, max_queued_requests=1, retry_after_s=2)
    try:
        body = {"text": "Tell me a story.",
                "sampling_params": {"max_new_tokens": 16, "ignore_eos": True, "temperature": 0}}
        results: list[httpx.Response] = []
        threads = [threading.Thread(target=lambda: results.append(
            httpx.post(server.base_url + "/generate", json=body, timeout=120))) for _ in range(3)]
        for t in threads:
            t.start()
        service = server.app.state.service
        wait = threading.Event()
        for _ in range(1000):
            if service.admission.admitted == 3:
                break
            wait.wait(0.01)
        assert service.admission.admitted == 3
        r = httpx.post(server.base_url + "/generate", json=OK_GEN)
        assert_error(r, 503, says="max_queued_requests")
        assert r.headers["Retry-After"] == "2"
        program = {"program_text": 'program p()\n"Hi"\ngen x max_tokens=2\n'}
        r = httpx.post(server.base_url + "/v1/programs/run", json=program)
        assert_error(r, 503, says="max_queued_requests")  # programs share the same bound
        for t in threads:
            t.join(timeout=120)
        assert [x.status_code for x in results] == [200] * 3  # none of the accepted was lost
        assert all(len(x.json()["output_ids"]) == 16 for x in results)
        assert httpx.post(server.base_url + "/generate", json=OK_GEN).status_code == 200
        assert httpx.post(server.base_url + "/v1/programs/run", json=program).status_code == 200
        assert service.admission.admitted == 0
        assert_idle_and_clean(engine)
    finally:
        server.stop()
