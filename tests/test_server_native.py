"""The native HTTP API on a real uvicorn server: /generate (single, batch, stream, logprobs,
prefix caching), health/info/admin endpoints, /metrics, and abort on client disconnect."""

from __future__ import annotations

import json

import httpx
import pytest
from conftest import assert_idle_and_clean, serve_in_thread, wait_until
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.slow
GREEDY = {"temperature": 0.0, "max_new_tokens": 12}


@pytest.fixture(scope="module")
def client(live_server):
    with httpx.Client(base_url=live_server.base_url, timeout=60) as c:
        yield c


def sse_payloads(response: httpx.Response) -> list:
    """The JSON events of an SSE response; asserts the framing and the final [DONE]."""
    events = [line for line in response.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events), events
    assert events[-1] == "data: [DONE]"
    return [json.loads(e[len("data: "):]) for e in events[:-1]]


def test_generate_single_equals_in_process(client, live_server):
    prompt = "The capital of France is"
    r = client.post("/generate", json={"text": prompt, "sampling_params": GREEDY})
    assert r.status_code == 200, r.text
    body = r.json()
    expected = live_server.engine.generate(prompt, GREEDY)
    assert body["output_ids"] == expected["output_ids"] and body["text"] == expected["text"]
    meta = body["meta_info"]
    assert meta["finish_reason"] in ({"type": "length", "length": 12},
                                     {"type": "stop", "matched": 2})
    assert meta["prompt_tokens"] == 5 and meta["completion_tokens"] == len(body["output_ids"])
    assert_idle_and_clean(live_server.engine)


def test_generate_batch_input_ids_and_params_list(client, tokenizer):
    prompts = ["One, two,", "Red, green,"]
    ids = [tokenizer.encode(p, add_special_tokens=False) for p in prompts]
    params = [{**GREEDY, "max_new_tokens": 3}, {**GREEDY, "max_new_tokens": 5, "top_k": None}]
    r = client.post("/generate", json={"input_ids": ids, "sampling_params": params, "rid": ["a", "b"]})
    assert r.status_code == 200, r.text
    by_text = client.post("/generate", json={"text": prompts, "sampling_params": params}).json()
    out = r.json()
    assert [o["meta_info"]["id"] for o in out] == ["a", "b"]
    assert [o["output_ids"] for o in out] == [o["output_ids"] for o in by_text]
    assert [len(o["output_ids"]) for o in out] == [3, 5]


def test_generate_stream_is_cumulative_and_matches(client):
    req = {"text": "Count with me: 1, 2, 3,", "sampling_params": GREEDY}
    full = client.post("/generate", json=req).json()
    with client.stream("POST", "/generate", json={**req, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_payloads(r)
    assert len(events) >= 2
    for prev, cur in zip(events, events[1:]):  # cumulative: each event extends the last
        assert cur["text"].startswith(prev["text"])
        assert cur["output_ids"][: len(prev["output_ids"])] == prev["output_ids"]
    assert all(e["meta_info"]["finish_reason"] is None for e in events[:-1])
    assert events[-1]["text"] == full["text"] and events[-1]["output_ids"] == full["output_ids"]
    assert events[-1]["meta_info"]["finish_reason"] == full["meta_info"]["finish_reason"]


def test_generate_stream_n2_is_cumulative_per_index(client):
    params = {"n": 2, "temperature": 0.8, "seed": 3, "max_new_tokens": 8, "ignore_eos": True}
    req = {"text": "Count with me: 1, 2, 3,", "sampling_params": params}
    full = client.post("/generate", json=req).json()
    with client.stream("POST", "/generate", json={**req, "stream": True}) as r:
        events = sse_payloads(r)
    for i, result in enumerate(full):
        mine = [e for e in events if e["index"] == i]
        assert mine[-1]["text"] == result["text"]
        assert mine[-1]["output_ids"] == result["output_ids"]
        assert mine[-1]["meta_info"]["finish_reason"] == result["meta_info"]["finish_reason"]


def test_generate_logprobs(client, live_server):
    req = {"text": "Hello, my name is", "sampling_params": {**GREEDY, "max_new_tokens": 4},
           "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 3}
    meta = client.post("/generate", json=req).json()["meta_info"]
    out, inp = meta["output_token_logprobs"], meta["input_token_logprobs"]
    assert len(out) == 4 and len(inp) == meta["prompt_tokens"]
    assert inp[0][0] is None and all(e[2] is None for e in out)  # text only when asked for
    for (lp, tid, _), top in zip(out, meta["output_top_logprobs"]):
        assert len(top) == 3 and top[0][1] == tid and top[0][0] == pytest.approx(lp)  # greedy
    with_text = client.post("/generate", json={**req, "return_text_in_logprobs": True}).json()
    tokens = [e[2] for e in with_text["meta_info"]["output_token_logprobs"]]
    assert "".join(tokens) == with_text["text"]


def test_repeated_prefix_is_cached(client):
    prefix = "You are a helpful assistant who answers in one word. " * 6
    first = client.post("/generate", json={"text": prefix + "Sky color?",
                                           "sampling_params": GREEDY}).json()
    second = client.post("/generate", json={"text": prefix + "Grass color?",
                                            "sampling_params": GREEDY}).json()
    assert second["meta_info"]["cached_tokens"] > 30
    assert second["meta_info"]["cached_tokens"] > first["meta_info"]["cached_tokens"] or (
        first["meta_info"]["cached_tokens"] > 30)


def test_health_info_and_admin(client, live_server):
    assert client.get("/health").json() == {"status": "ok"}
    r = client.get("/health_generate")
    assert r.status_code == 200 and len(r.json()["output_ids"]) == 1
    info = client.get("/get_model_info").json()
    assert info["model_path"] == live_server.engine.config.model_path and info["is_generation"]
    server = client.get("/get_server_info").json()
    assert server["port"] == live_server.config.port and server["dtype"] == "float32"
    assert server["internal_states"][0]["running"] == 0
    assert client.post("/flush_cache").json()["success"] is True
    assert live_server.engine.stats()["kv_cached"] == 0
    assert client.post("/abort_request", json={"rid": "no-such-request"}).status_code == 200


def test_abort_request_by_rid(client, live_server):
    """A non-streaming request aborted from a second connection ends with finish_reason abort."""
    import threading

    result = {}

    def run() -> None:
        body = {"text": "Tell me a long story.", "rid": "abort-me",
                "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True}}
        result["r"] = httpx.post(live_server.base_url + "/generate", json=body, timeout=60)

    t = threading.Thread(target=run)
    t.start()
    wait_until(lambda: live_server.engine.stats()["running"] == 1)
    assert client.post("/abort_request", json={"rid": "abort-me"}).status_code == 200
    t.join(timeout=30)
    assert result["r"].json()["meta_info"]["finish_reason"]["type"] == "abort"
    wait_until(lambda: live_server.engine.stats()["kv_used"] == 0)


def test_disconnect_mid_stream_frees_kv(live_server):
    engine = live_server.engine
    assert engine.stats()["kv_used"] == 0
    body = {"text": "Write a very long essay about the sea.", "stream": True,
            "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}}
    with (httpx.Client(base_url=live_server.base_url, timeout=60) as c,
          c.stream("POST", "/generate", json=body) as r):
        lines = r.iter_lines()
        seen = [line for line, _ in zip(lines, range(6)) if line]
        assert seen and seen[0].startswith("data: ")
        assert engine.stats()["kv_used"] > 0  # still generating while we hold the stream
    # the connection is closed now: the server must abort the request and free its KV
    wait_until(lambda: engine.stats()["kv_used"] == 0 and engine.stats()["running"] == 0)
    wait_until(lambda: live_server.app.state.service.admission.admitted == 0)
    assert_idle_and_clean(engine)


def test_disconnect_before_a_non_streamed_result_aborts_it(live_server):
    engine = live_server.engine
    body = {"text": "Write a very long essay about the mountains.",
            "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes the connection
        httpx.post(live_server.base_url + "/generate", json=body, timeout=1.5)
    # 3000 tokens would take minutes; the server notices the disconnect and aborts instead
    wait_until(lambda: engine.stats()["kv_used"] == 0 and engine.stats()["running"] == 0,
               timeout=10)
    wait_until(lambda: live_server.app.state.service.admission.admitted == 0)
    assert_idle_and_clean(engine)


def test_disconnect_mid_openai_stream_with_n2_frees_kv(make_engine):
    """The OpenAI stream fans n=2 out to two engine requests; closing it aborts both. (Its own
    engine and server: the shared engine's cache state from other tests must not matter.)"""
    engine = make_engine(max_total_tokens=12288)
    server = serve_in_thread(engine)
    body = {"model": "SmolLM2-135M-Instruct", "n": 2, "stream": True, "ignore_eos": True,
            "max_tokens": 1000, "messages": [{"role": "user", "content": "Write an essay."}]}
    try:
        with (httpx.Client(base_url=server.base_url, timeout=60) as c,
              c.stream("POST", "/v1/chat/completions", json=body) as r):
            # Keep the line iterator for the whole block: a dropped one is closed, and closing it
            # closes the response stream, i.e. the client disconnects right there and the server
            # (rightly) aborts both samples, racing the check below.
            lines = r.iter_lines()
            seen = [line for line, _ in zip(lines, range(12)) if line]
            assert len(seen) >= 4 and all(line.startswith("data: ") for line in seen)
            stats = engine.stats()  # both samples alive: running, or waiting after a retraction
            assert stats["running"] + stats["waiting"] == 2, (stats, seen[-1])
        wait_until(lambda: engine.stats()["kv_used"] == 0 and engine.stats()["running"] == 0)
        wait_until(lambda: server.app.state.service.admission.admitted == 0)
        assert_idle_and_clean(engine)
    finally:
        server.stop()


def metric_values(text: str) -> dict[str, float]:
    """{sample name + labels: value} from the Prometheus text format (parsed, so it must be valid)."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}"] = s.value
    return out


def test_metrics_parse_and_move(client):
    before = metric_values(client.get("/metrics").text)
    r = client.post("/generate", json={"text": "Metrics test prompt", "sampling_params": GREEDY})
    assert r.status_code == 200
    client.post("/generate", json={"text": "x", "sampling_params": {"bogus": 1}})
    after = metric_values(client.get("/metrics").text)
    reason = r.json()["meta_info"]["finish_reason"]["type"]
    key = f"forklm_requests_total{{endpoint=generate,finish_reason={reason}}}"
    assert after[key] == before.get(key, 0) + 1
    assert after["forklm_prompt_tokens_total{}"] > before["forklm_prompt_tokens_total{}"]
    assert (after["forklm_generation_tokens_total{}"]
            >= before["forklm_generation_tokens_total{}"] + len(r.json()["output_ids"]))
    assert after["forklm_http_errors_total{status=400}"] == before.get(
        "forklm_http_errors_total{status=400}", 0) + 1
    ttft = "forklm_time_to_first_token_seconds_count{}"
    assert after[ttft] == before[ttft] + 1
    for gauge in ("forklm_num_running_reqs{}", "forklm_kv_usage{}", "forklm_cache_hit_rate{}",
                  "forklm_spec_accept_rate{}", "forklm_spec_accept_length{}"):
        assert gauge in after
