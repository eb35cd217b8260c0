"""Streaming a program's text: text_iter / text_async_iter / stream_events on a scripted streaming
backend (model-free), plus one check on the default model through the Engine backend."""

from __future__ import annotations

import asyncio
import threading

import pytest

import forklm as sgl
from forklm.frontend_dsl.backends.base import Backend, BackendError, GenResult
from forklm.frontend_dsl.choices import mean_logprob
from forklm.runtime.engine.engine_request import LogprobOptions
from forklm.runtime.sampling.params import SamplingParams


class StreamingBackend(Backend):
    """gen streams `words` one word at a time through on_text; `gate`, when given, holds the
    stream after its first piece until the test sets it; `fail_after` raises after that many
    pieces. Chat template `<role>...</role>`, default system prompt "default" injected."""

    def __init__(self, words=("one", " two", " three"), gate=None, fail_after=None):
        self.words, self.gate, self.fail_after = list(words), gate, fail_after

    def generate(self, prompt, sampling_params, logprob_options, on_text=None):
        for i, word in enumerate(self.words):
            if self.fail_after is not None and i == self.fail_after:
                raise ConnectionError("backend went away mid-stream")
            if on_text is not None:
                on_text(word)
            if i == 0 and self.gate is not None:
                assert self.gate.wait(10), "the test never released the stream"
        return GenResult("".join(self.words), {"completion_tokens": len(self.words)})

    def select(self, prompt, choices, choices_method):
        lps = [[[-float(len(c)), 0, c]] for c in choices]  # the shortest choice wins
        return choices_method(choices=choices,
                              normalized_prompt_logprobs=[mean_logprob(e) for e in lps],
                              input_token_logprobs=lps, output_token_logprobs=[[] for _ in choices],
                              unconditional_token_logprobs=None)

    def role_prefix_suffix(self, role, history):
        system = "<system>default</system>" if not history and role != "system" else ""
        return f"{system}<{role}>", f"</{role}>"

    def default_system_prompt(self):
        return "default"


@sgl.function
def qa(s, question):
    s += sgl.user(question)
    with s.var_scope("turn"):
        s += sgl.assistant(sgl.gen("answer", 8))
    s += "Verdict:" + sgl.select("verdict", ["yes", "no way"])
    s["note"] = "done"


@pytest.mark.parametrize("stream", [True, False])
def test_pieces_concatenate_to_text_and_variables(stream):
    state = qa.run("Why?", backend=StreamingBackend(), stream=stream)
    pieces = list(state.text_iter())
    assert "".join(pieces) == state.text()
    assert [p for p in pieces if p in ("one", " two", " three")] == ["one", " two", " three"]
    assert list(state.text_iter("answer")) == ["one", " two", " three"]
    turn = "<assistant>one two three</assistant>"
    assert "".join(state.text_iter("turn")) == state["turn"] == turn
    assert list(state.text_iter("verdict")) == ["yes"]  # a select variable streams (and ends)
    assert list(state.text_iter("note")) == ["done"]  # a value set without text
    assert list(state.text_iter("missing")) == []  # never produced: ends with the program


def test_pieces_arrive_while_the_gen_is_still_running():
    gate = threading.Event()
    state = qa.run("Why?", backend=StreamingBackend(gate=gate), stream=True)
    answer = state.text_iter("answer")
    assert next(answer) == "one"  # delivered while the backend still holds the rest
    assert "answer" not in state
    gate.set()
    assert list(answer) == [" two", " three"]
    assert state["answer"] == "one two three"


def test_stream_events_order_and_shape():
    state = qa.run("Why?", backend=StreamingBackend(), stream=True)
    events = list(state.stream_events())
    assert all(len(e) == {"text": 2, "variable": 3}[e[0]] for e in events)
    assert "".join(e[1] for e in events if e[0] == "text") == state.text()
    names = [e[1] for e in events if e[0] == "variable"]
    assert names == ["answer", "turn", "verdict", "note"]
    position = {e[1]: i for i, e in enumerate(events) if e[0] == "variable"}
    last_piece = max(i for i, e in enumerate(events) if e == ("text", " three"))
    assert last_piece < position["answer"] < position["turn"]
    assert events[position["verdict"] - 1] == ("text", "yes")
    assert events[position["answer"]] == ("variable", "answer", "one two three")


def test_async_iteration_does_not_block_the_loop():
    gate = threading.Event()

    async def main():
        state = qa.run("Why?", backend=StreamingBackend(gate=gate), stream=True)
        ticks = 0

        async def ticker():
            nonlocal ticks
            while not gate.is_set():
                ticks += 1
                await asyncio.sleep(0.01)

        async def release():
            await asyncio.sleep(0.2)  # the iterator below is waiting meanwhile
            gate.set()

        tasks = [asyncio.create_task(ticker()), asyncio.create_task(release())]
        pieces = [p async for p in state.text_async_iter()]
        answer = [p async for p in state.text_async_iter("answer")]
        await asyncio.gather(*tasks)
        return state, pieces, answer, ticks

    state, pieces, answer, ticks = asyncio.run(main())
    assert "".join(pieces) == state.text() and answer == ["one", " two", " three"]
    assert ticks >= 5


def test_backend_error_is_raised_at_the_end_with_its_type_and_message():
    state = qa.run("Why?", backend=StreamingBackend(fail_after=2), stream=True)
    pieces = []
    with pytest.raises(ConnectionError, match="backend went away mid-stream"):
        for piece in state.text_iter():
            pieces.append(piece)
    assert pieces[-2:] == ["one", " two"]  # what streamed before the failure was delivered
    with pytest.raises(ConnectionError, match="mid-stream"):
        list(state.text_iter("answer"))
    with pytest.raises(ConnectionError):
        list(state.stream_events())

    async def drain():
        return [p async for p in state.text_async_iter()]

    with pytest.raises(ConnectionError, match="mid-stream"):
        asyncio.run(drain())


def test_error_in_the_program_body_is_raised_at_the_end():
    @sgl.function
    def prog(s):
        s += "x" + sgl.gen("a", 3)
        if s["a"].startswith("one"):
            raise LookupError("no such tool: calculator")

    state = prog.run(backend=StreamingBackend(), stream=True)
    with pytest.raises(LookupError, match="no such tool: calculator"):
        list(state.text_iter())
    assert list(state.text_iter("a")) == ["one", " two", " three"]  # done before the error


def test_fork_join_streams_per_branch_and_joined_lists():
    @sgl.function
    def prog(s):
        s += "Q:"
        forks = s.fork(2)
        forks += lambda i: f" b{i}:" + sgl.gen("g", 4)
        branch_text = ["".join(f.text_iter()) for f in forks]
        forks.join("concate_and_append")
        s["branch_text"] = branch_text

    state = prog.run(backend=StreamingBackend(words=["x", "y"]), stream=True)
    assert state["branch_text"] == ["Q: b0:xy", "Q: b1:xy"]  # a branch streams its whole text
    assert list(state.text_iter("g")) == [["xy", "xy"]]  # a joined list is yielded once
    assert "".join(state.text_iter()) == state.text() == "Q: b0:xy b1:xy"


def test_messages_list_the_templates_default_system_prompt():
    @sgl.function
    def chat(s, system=None):
        if system:
            s += sgl.system(system)
        s += sgl.user("hi") + sgl.assistant(sgl.gen("a", 2))

    implied = chat.run(backend=StreamingBackend())
    assert implied.text().startswith("<system>default</system><user>hi")
    assert implied.messages() == [{"role": "system", "content": "default"},
                                  {"role": "user", "content": "hi"},
                                  {"role": "assistant", "content": "one two three"}]
    own = chat.run(system="Be terse.", backend=StreamingBackend())
    assert [m["content"] for m in own.messages()][:1] == ["Be terse."]
    assert len(own.messages()) == 3


class PartialBackend(StreamingBackend):
    """Streams only its first word (or, with `wrong`, a piece its result does not begin with)."""

    def __init__(self, wrong=False):
        super().__init__()
        self.wrong = wrong

    def generate(self, prompt, sampling_params, logprob_options, on_text=None):
        on_text("nope" if self.wrong else self.words[0])
        return GenResult("".join(self.words), {})


def test_a_backend_that_streams_part_of_its_result_gets_the_rest_appended():
    state = qa.run("Why?", backend=PartialBackend())
    assert list(state.text_iter("answer")) == ["one", " two three"]
    assert state["answer"] == "one two three"
    bad = qa.run("Why?", backend=PartialBackend(wrong=True))
    with pytest.raises(BackendError, match="streamed 'nope', which does not begin"):
        bad.text()


@pytest.mark.slow
def test_engine_streaming_equals_the_plain_result(make_engine, tokenizer):
    engine = make_engine()
    backend = sgl.EngineBackend(engine)

    @sgl.function
    def story(s):
        s += sgl.user("Tell me a short fact about the moon.")
        s += sgl.assistant(sgl.gen("fact", 24))

    state = story.run(backend=backend, stream=True, temperature=0.0)
    fact_pieces = list(state.text_iter("fact"))
    assert len(fact_pieces) > 3 and "".join(fact_pieces) == state["fact"]
    assert "".join(state.text_iter()) == state.text()
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Tell me a short fact about the moon."}], tokenize=False,
        add_generation_prompt=True)
    assert state.text() == prompt + state["fact"] + "<|im_end|>\n"
    params = SamplingParams(max_new_tokens=24, temperature=0.0)
    plain = backend.generate(prompt, params, LogprobOptions())
    streamed: list[str] = []
    result = backend.generate(prompt, params, LogprobOptions(), on_text=streamed.append)
    assert plain.text == result.text == "".join(streamed) == state["fact"]
    assert plain.meta_info["completion_tokens"] == result.meta_info["completion_tokens"]
    system = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
    assert backend.default_system_prompt() == system
    assert state.messages()[0] == {"role": "system", "content": system}
    assert [m["role"] for m in state.messages()] == ["system", "user", "assistant"]
