"""The rest of SGLang's frontend, one program per name, written as an SGLang user writes it (only
the import changed) and run on the default model: Runtime, flush_cache, get_server_info,
separate_reasoning, gen(n, stop_regex, return_text_in_logprobs), fork(position_ids_offset),
Program.cache, __version__, global_config and the OpenAI backend (against forklm's own server)."""

from __future__ import annotations

import json
import re
from importlib import metadata

import pytest
from conftest import REPO_ROOT, wait_until

import forklm.frontend_dsl as sgl
from forklm.frontend_dsl import program as program_module
from forklm.runtime.errors import InvalidArgumentError

GREEDY = {"temperature": 0.0}


@pytest.fixture(scope="module")
def engine(make_engine):
    return make_engine()


@pytest.fixture
def default_backend(engine):
    """sgl.set_default_backend(engine) for one test; the previous default comes back after."""
    previous = program_module.current_default_backend()
    sgl.set_default_backend(engine)
    yield sgl.global_config.default_backend
    program_module._default_backend = previous


# -- __version__ and global_config ------------------------------------------------------------
def test_version_and_global_config(default_backend, monkeypatch):
    assert sgl.__version__ == metadata.version("forklm")
    assert isinstance(default_backend, sgl.EngineBackend)
    config = sgl.global_config
    assert config.enable_precache_with_tracing and config.skip_special_tokens_in_output
    with pytest.raises(InvalidArgumentError, match="enable_parallel_encoding"):
        config.enable_parallel_encoding = True
    with pytest.raises(AttributeError, match="enable_precache_with_tracin"):
        config.enable_precache_with_tracin = False  # a typo is an error, not a silent no-op
    cached, params = [], []
    monkeypatch.setattr(default_backend, "cache_prefix", cached.append)
    generate = default_backend.generate

    def recording(prompt, sampling_params, logprob_options, on_text=None):
        params.append(sampling_params)
        return generate(prompt, sampling_params, logprob_options, on_text=on_text)

    monkeypatch.setattr(default_backend, "generate", recording)

    @sgl.function
    def note(s, topic):
        s += "Here is a long constant preamble that every item of the batch shares. " * 2
        s += "Topic: " + topic + "\nNote:" + sgl.gen("note", max_tokens=2)

    monkeypatch.setattr(config, "enable_precache_with_tracing", False)
    monkeypatch.setattr(config, "skip_special_tokens_in_output", False)
    note.run_batch([{"topic": "tea"}, {"topic": "rain"}], **GREEDY)
    assert cached == [] and [p.skip_special_tokens for p in params] == [False, False]
    monkeypatch.setattr(config, "enable_precache_with_tracing", True)
    note.run_batch([{"topic": "tea"}, {"topic": "rain"}], **GREEDY)
    assert len(cached) == 1 and cached[0].startswith("Here is a long constant preamble")


# -- gen(n=..., stop_regex=..., return_text_in_logprobs=...) ------------------------------------
def test_gen_n_gives_a_list_of_samples(default_backend):
    @sgl.function
    def ideas(s):
        s += "Name a fruit:" + sgl.gen("fruit", max_tokens=3, n=3, temperature=1.0)
        s += "\nAgain:" + sgl.gen("again", max_tokens=2, **GREEDY)

    state = ideas.run()
    fruits = state["fruit"]
    assert isinstance(fruits, list) and len(fruits) == 3 and all(isinstance(f, str) for f in fruits)
    assert state.text().startswith("Name a fruit:" + fruits[0] + "\nAgain:")  # the first sample
    metas = state.get_meta_info("fruit")
    assert len(metas) == 3 and all(m["completion_tokens"] <= 3 for m in metas)
    assert isinstance(state["again"], str)


def test_gen_stop_regex(default_backend, engine):
    @sgl.function
    def count(s):
        s += "1, 2, 3, 4, 5," + sgl.gen("rest", max_tokens=24, stop_regex=r"\b8\b", **GREEDY)

    state = count.run()
    unbounded = engine.generate(prompt="1, 2, 3, 4, 5,",
                                sampling_params={"max_new_tokens": 24, "temperature": 0.0})
    assert "8" in unbounded["text"]  # the model keeps counting past 8 ...
    reason = state.get_meta_info("rest")["finish_reason"]
    assert reason["type"] == "stop" and reason["matched"] == r"\b8\b"  # ... the regex stops it
    assert state["rest"] == unbounded["text"][:len(state["rest"])] and "8" not in state["rest"]


def test_gen_return_text_in_logprobs(default_backend):
    @sgl.function
    def scored(s):
        s += "The sky is" + sgl.gen("a", max_tokens=4, return_logprob=True,
                                    return_text_in_logprobs=True, **GREEDY)
        s += "." + sgl.gen("b", max_tokens=4, return_logprob=True,
                           return_text_in_logprobs=False, **GREEDY)

    state = scored.run()
    with_text = state.get_meta_info("a")["output_token_logprobs"]
    assert "".join(entry[2] for entry in with_text) == state["a"]
    without = state.get_meta_info("b")["output_token_logprobs"]
    assert without and all(entry[2] is None and entry[0] <= 0 for entry in without)


# -- separate_reasoning -------------------------------------------------------------------------
# The default model does not think; the regex makes it write a think block, then an answer.
THINKING = r"<think>[a-z]{2,10}( [a-z]{2,10}){0,2}</think>[A-Z][a-z]{2,8}\."


@sgl.function
def answer(s, question):
    s += sgl.user(question)
    s += sgl.assistant(sgl.separate_reasoning(
        sgl.gen("answer", max_tokens=48, regex=THINKING, **GREEDY), model_type="qwen3"))


def test_separate_reasoning(default_backend):
    state = answer.run(question="Which city is the capital of France?", stream=True)
    pieces = "".join(state.text_iter("answer"))
    reasoning, content = state["answer_reasoning_content"], state["answer"]
    assert re.fullmatch(r"[a-z]{2,10}( [a-z]{2,10}){0,2}", reasoning)
    assert re.fullmatch(r"[A-Z][a-z]{2,8}\.", content)
    assert pieces == content and "<think>" not in state.text()
    assert state.messages()[-1] == {"role": "assistant", "content": content}
    with pytest.raises(InvalidArgumentError, match="name must be provided"):
        sgl.separate_reasoning(sgl.gen(), model_type="qwen3")
    with pytest.raises(InvalidArgumentError, match="model_type"):
        sgl.separate_reasoning(sgl.gen("x"), model_type="no-such-parser")


def test_separate_reasoning_in_a_graph_run_by_the_server(live_server):
    """A traced batch goes to /v1/programs/run as graph JSON; the server splits the reasoning."""
    assert "separate_reasoning=qwen3" in answer.trace().to_text()
    endpoint = sgl.RuntimeEndpoint(live_server.base_url)
    questions = ["Which city is the capital of France?", "Which city is the capital of Italy?"]
    states = answer.run_batch([{"question": q} for q in questions], backend=endpoint)
    singles = [answer.run(question=q, backend=endpoint) for q in questions]
    for state, single in zip(states, singles):
        assert re.fullmatch(r"[A-Z][a-z]{2,8}\.", state["answer"])
        assert (state["answer"], state["answer_reasoning_content"]) == (
            single["answer"], single["answer_reasoning_content"])
        assert "<think>" not in state.text()


# -- fork(size, position_ids_offset=...) --------------------------------------------------------
def test_fork_position_ids_offset(default_backend):
    @sgl.function
    def tips(s, shift):
        s += "Two tips for sleeping well:\n"
        forks = s.fork(2, position_ids_offset=shift)
        forks += lambda i: f"Tip {i + 1}:" + sgl.gen("tip", max_tokens=4, stop="\n", **GREEDY)
        forks.join()

    state = tips.run(shift=[0, 0])  # shifts nothing: accepted
    assert len(state["tip"]) == 2 and all(isinstance(t, str) for t in state["tip"])
    assert tips.run(shift=None)["tip"] == state["tip"]
    with pytest.raises(InvalidArgumentError, match="position_ids_offset"):
        tips.run(shift=[0, 16])["tip"]  # would change what the second branch generates


# -- Program.cache() ---------------------------------------------------------------------------
def test_program_cache_prefills_the_constant_prefix(default_backend, engine):
    @sgl.function
    def helpdesk(s, question):
        s += sgl.system("You are the help desk of a small library. Answer in one short sentence, "
                        "politely, and never invent opening hours you were not told.")
        s += sgl.user(question)
        s += sgl.assistant(sgl.gen("answer", max_tokens=4, **GREEDY))

    wait_until(sgl.flush_cache)  # True once the engine is idle
    cold = helpdesk.run(question="Can I renew a book online?")
    assert cold.get_meta_info("answer")["cached_tokens"] == 0
    wait_until(sgl.flush_cache)
    prefix = helpdesk.cache()  # the system message and the user turn's opening
    assert "never invent opening hours" in prefix and "renew" not in prefix
    prefix_tokens = len(engine.tokenizer.encode(prefix, add_special_tokens=False))
    warm = helpdesk.run(question="Can I renew a book online?")
    assert warm.get_meta_info("answer")["cached_tokens"] >= prefix_tokens - 1  # a boundary token
    assert warm["answer"] == cold["answer"]


# -- flush_cache() and get_server_info() ---------------------------------------------------------
def test_flush_cache_and_get_server_info_in_process(default_backend):
    @sgl.function
    def hello(s):
        s += "Hello" + sgl.gen("x", max_tokens=2, **GREEDY)

    hello.run()["x"]
    info = sgl.get_server_info()
    assert info["version"] == sgl.__version__ and "internal_states" in info
    assert info["internal_states"][0]["kv_cached"] > 0
    wait_until(sgl.flush_cache)  # refused (False) only while a request is still finishing
    assert sgl.get_server_info()["internal_states"][0]["kv_cached"] == 0


def test_flush_cache_and_get_server_info_over_http(live_server):
    endpoint = sgl.RuntimeEndpoint(live_server.base_url)

    @sgl.function
    def hello(s):
        s += "Hello there" + sgl.gen("x", max_tokens=2, **GREEDY)

    hello.run(backend=endpoint)["x"]
    info = sgl.get_server_info(backend=endpoint)
    assert info["version"] == sgl.__version__ and info["model_path"]
    assert info["internal_states"][0]["kv_cached"] > 0
    wait_until(lambda: sgl.flush_cache(backend=endpoint))
    assert sgl.get_server_info(backend=endpoint)["internal_states"][0]["kv_cached"] == 0


# -- Runtime --------------------------------------------------------------------------------
def test_runtime_refuses_unknown_flags_before_starting():
    with pytest.raises(InvalidArgumentError, match="max_totl_tokens"):
        sgl.Runtime(max_totl_tokens=4096)
    with pytest.raises(InvalidArgumentError, match="host"):
        sgl.Runtime(host="0.0.0.0")


def test_runtime_reports_a_server_that_dies_or_hangs(monkeypatch):
    import sys

    from forklm.server import local_runtime as runtime_module

    def fake_serve(script):
        monkeypatch.setattr(runtime_module, "_serve_argv",
                            lambda model_path, flags: [sys.executable, "-c", script])

    fake_serve("print('no model here'); raise SystemExit(3)")
    with pytest.raises(sgl.BackendError, match="status 3(.|\n)*no model here"):
        sgl.Runtime()
    fake_serve("import time; print('loading'); time.sleep(60)")
    with pytest.raises(TimeoutError, match="did not answer"):
        sgl.Runtime(launch_timeout=0.5)


@pytest.mark.slow
def test_runtime_starts_serves_and_shuts_down(monkeypatch):
    monkeypatch.chdir(REPO_ROOT)  # its server starts where the program runs
    previous = program_module.current_default_backend()
    runtime = sgl.Runtime(dtype="float32", max_total_tokens=4096)
    try:
        sgl.set_default_backend(runtime)
        assert runtime.endpoint is runtime and runtime.url.startswith("http://127.0.0.1:")

        @sgl.function
        def capital(s, country):
            s += sgl.user(f"What is the capital of {country}?")
            s += sgl.assistant(sgl.gen("answer", max_tokens=6, **GREEDY))

        state = capital.run(country="France")
        assert isinstance(state["answer"], str) and state["answer"]
        assert sgl.get_server_info()["version"] == sgl.__version__
        wait_until(sgl.flush_cache)
    finally:
        program_module._default_backend = previous
        runtime.shutdown()
    assert runtime.process.poll() is not None  # the server process is gone


# -- OpenAI backend -------------------------------------------------------------------------
def test_openai_chat_model(live_server):
    backend = sgl.OpenAI("default", base_url=live_server.base_url + "/v1")

    @sgl.function
    def chat(s, question):
        s += sgl.system("You answer briefly.")
        s += sgl.user(question)
        s += sgl.assistant(sgl.gen("answer", max_tokens=8, **GREEDY))
        s += sgl.user("Now a three-digit number.")
        s += sgl.assistant(sgl.gen("number", max_tokens=6, regex=r"[1-9][0-9]{2}", **GREEDY))
        s += sgl.user("And a JSON object.")
        s += sgl.assistant(sgl.gen("obj", max_tokens=24, **GREEDY, json_schema=json.dumps({
            "type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
            "additionalProperties": False})))

    state = chat.run(question="What is the capital of France?", backend=backend)
    messages = [{"role": "system", "content": "You answer briefly."},
                {"role": "user", "content": "What is the capital of France?"}]
    direct = backend.client.chat.completions.create(model="default", messages=messages,
                                                    max_tokens=8, temperature=0)
    assert state["answer"] == direct.choices[0].message.content
    assert re.fullmatch(r"[1-9][0-9]{2}", state["number"])
    assert isinstance(json.loads(state["obj"])["ok"], bool)
    assert [m["role"] for m in state.messages()] == [
        "system", "user", "assistant", "user", "assistant", "user", "assistant"]
    assert state.text().startswith("SYSTEM:You answer briefly.\nUSER:What is the capital")

    samples = chat_n.run(backend=backend)["names"]
    assert isinstance(samples, list) and len(samples) == 2

    @sgl.function
    def misplaced(s):
        s += sgl.user("Hi" + sgl.gen("x", max_tokens=2))

    with pytest.raises(InvalidArgumentError, match="right after sgl.assistant"):
        misplaced.run(backend=backend)["x"]

    @sgl.function
    def pick(s):
        s += sgl.user("Yes or no?")
        s += sgl.assistant(sgl.select("a", choices=["yes", "no"]))

    with pytest.raises(sgl.BackendError, match="is_chat_model=False"):
        pick.run(backend=backend)["a"]


@sgl.function
def chat_n(s):
    s += sgl.user("Name a color.")
    s += sgl.assistant(sgl.gen("names", max_tokens=3, n=2, temperature=1.0, top_k=20))


def test_openai_completion_model_select_scores_as_the_engine(live_server, engine):
    backend = sgl.OpenAI("default", is_chat_model=False, base_url=live_server.base_url + "/v1")

    @sgl.function
    def capital(s):
        s += "The capital of France is"
        s += sgl.select("city", choices=[" Paris", " London", " Berlin"])
        s += "." + sgl.gen("more", max_tokens=4, stop="\n", **GREEDY)

    over_http = capital.run(backend=backend)
    in_process = capital.run(backend=engine)
    assert over_http["city"] == in_process["city"] == " Paris"
    http_scores = over_http.get_meta_info("city")["normalized_prompt_logprobs"]
    engine_scores = in_process.get_meta_info("city")["normalized_prompt_logprobs"]
    assert http_scores == pytest.approx(engine_scores, abs=1e-3)
    assert over_http["more"] == in_process["more"]
    assert over_http.text() == in_process.text()


def test_openai_completion_model_gen_logprobs(live_server):
    backend = sgl.OpenAI("default", is_chat_model=False, base_url=live_server.base_url + "/v1")

    @sgl.function
    def story(s):
        s += "Once upon a time" + sgl.gen("next", max_tokens=5, return_logprob=True,
                                          top_logprobs_num=2, **GREEDY)

    state = story.run(backend=backend)
    meta = state.get_meta_info("next")
    entries, tops = meta["output_token_logprobs"], meta["output_top_logprobs"]
    assert len(entries) == meta["completion_tokens"] == 5
    assert "".join(e[2] for e in entries) == state["next"]
    assert all(len(top) >= 1 and max(t[0] for t in top) == pytest.approx(e[0])
               for top, e in zip(tops, entries))  # greedy: each token is its position's best


def test_completions_prompt_logprobs_extra(live_server, engine):
    """vLLM's prompt_logprobs on /v1/completions (what the OpenAI backend's select reads)."""
    import openai

    client = openai.OpenAI(base_url=live_server.base_url + "/v1", api_key="EMPTY")
    out = client.completions.create(model="default", prompt="The capital of France is",
                                    max_tokens=1, temperature=0,
                                    extra_body={"prompt_logprobs": 0})
    choice = out.choices[0]
    positions = choice.model_extra["prompt_logprobs"]
    ids = engine.tokenizer.encode("The capital of France is", add_special_tokens=False)
    assert positions[0] is None and len(positions) == len(ids) and choice.logprobs is None
    for position, tid in zip(positions[1:], ids[1:]):
        assert list(position) == [str(tid)] and position[str(tid)]["logprob"] <= 0
    with pytest.raises(openai.BadRequestError, match="prompt_logprobs"):
        client.completions.create(model="default", prompt="Hi", max_tokens=1, logprobs=1,
                                  extra_body={"prompt_logprobs": 3})
