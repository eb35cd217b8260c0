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


class LogprobStreamingBackend(StreamingBackend):
    """Streams each word with its chunk's meta_info (one token per word, token id = its index)
    when logprobs are asked for; the middle word's token arrives first with no text (as a token
    whose UTF-8 is incomplete does) and its text with the next call."""

    def generate(self, prompt, sampling_params, logprob_options, on_text=None):
        entries = [[-0.5 * (i + 1), i, w] for i, w in enumerate(self.words)]
        meta = {"completion_tokens": len(self.words), "output_token_logprobs": entries,
                "input_token_logprobs": [[None, 7, "p"]]}
        if not logprob_options.return_logprob:
            return super().generate(prompt, sampling_params, logprob_options, on_text)
        if on_text is None:
            return GenResult("".join(self.words), meta)
        for i, word in enumerate(self.words):
            chunk = {"completion_tokens": i + 1, "output_token_logprobs": [entries[i]]}
            if i == 0:
                chunk["input_token_logprobs"] = [[None, 7, "p"]]
            if i == 1:
                on_text("", chunk)
                on_text(word, {"completion_tokens": i + 1, "output_token_logprobs": []})
            else:
                on_text(word, chunk)
        return GenResult("".join(self.words), meta)


def test_streamed_logprobs_come_with_their_pieces_and_grow_meta_info():
    gate = threading.Event()

    @sgl.function
    def prog(s):
        s += "Q:" + sgl.gen("answer", 8, return_logprob=True) + "."

    backend = LogprobStreamingBackend()
    state = prog.run(backend=backend, stream=True)
    pairs = list(state.text_iter("answer", return_logprobs=True))
    assert pairs == [("one", [[-0.5, 0, "one"]]), ("", [[-1.0, 1, " two"]]), (" two", []),
                     (" three", [[-1.5, 2, " three"]])]
    assert "".join(p for p, _ in pairs) == state["answer"]
    meta = state.get_meta_info("answer")
    assert meta["output_token_logprobs"] == [e for _, es in pairs for e in es]
    assert meta["input_token_logprobs"] == [[None, 7, "p"]]
    # The whole text's stream: pieces outside the gen carry no entries.
    whole = list(state.text_iter(return_logprobs=True))
    assert whole[0] == ("Q:", []) and whole[-1] == (".", [])
    assert [e for _, es in whole for e in es] == meta["output_token_logprobs"]

    # A reader sees each chunk's entries while the gen is still running.
    class Held(LogprobStreamingBackend):
        def generate(self, prompt, sampling_params, logprob_options, on_text=None):
            def held(piece, meta=None):
                on_text(piece, meta)
                if piece == "one":
                    assert gate.wait(10), "the test never released the stream"
            return super().generate(prompt, sampling_params, logprob_options, held)

    state = prog.run(backend=Held(), stream=True)
    stream = state.text_iter("answer", return_logprobs=True)
    assert next(stream) == ("one", [[-0.5, 0, "one"]])
    gate.set()
    assert [e for _, es in stream for e in es] == [[-1.0, 1, " two"], [-1.5, 2, " three"]]
    assert len(state.get_meta_info("answer")["output_token_logprobs"]) == 3


def test_a_backend_returning_whole_gives_its_logprobs_with_the_last_piece():
    @sgl.function
    def prog(s):
        s += "Q:" + sgl.gen("answer", 8, return_logprob=True)

    class Whole(LogprobStreamingBackend):
        def generate(self, prompt, sampling_params, logprob_options, on_text=None):
            return super().generate(prompt, sampling_params, logprob_options, None)

    state = prog.run(backend=Whole())
    assert list(state.text_iter("answer", return_logprobs=True)) == [
        ("one two three", [[-0.5, 0, "one"], [-1.0, 1, " two"], [-1.5, 2, " three"]])]
    # Without return_logprob no entries are made up.
    plain = qa.run("Why?", backend=StreamingBackend())
    assert all(es == [] for _, es in plain.text_iter("answer", return_logprobs=True))


def test_async_programs_stream_logprobs_too():
    @sgl.function
    async def prog(s):
        s += "Q:" + sgl.gen("answer", 8, return_logprob=True)

    async def main():
        state = await prog.run_async(backend=LogprobStreamingBackend())
        return [pair async for pair in state.text_async_iter("answer", return_logprobs=True)]

    pairs = asyncio.run(main())
    assert "".join(p for p, _ in pairs) == "one two three"
    assert [e[1] for _, es in pairs for e in es] == [0, 1, 2]


@pytest.mark.slow
def test_engine_streams_each_tokens_logprob_with_its_text(make_engine):
    engine = make_engine()
    backend = sgl.EngineBackend(engine)

    @sgl.function
    def story(s):
        s += sgl.user("Name a planet.")
        s += sgl.assistant(sgl.gen("name", 12, return_logprob=True, top_logprobs_num=2,
                                   return_text_in_logprobs=True))

    state = story.run(backend=backend, stream=True, temperature=0.0)
    pairs = list(state.text_iter("name", return_logprobs=True))
    entries = [e for _, es in pairs for e in es]
    meta = state.get_meta_info("name")
    assert len(pairs) > 3 and "".join(p for p, _ in pairs) == state["name"]
    assert entries == meta["output_token_logprobs"]
    assert len(entries) == meta["completion_tokens"]
    assert "".join(e[2] for e in entries) == state["name"]  # each token's own text
    assert len(meta["output_top_logprobs"]) == len(entries)
    # The same request whole: the same tokens and logprobs.
    whole = story.run(backend=backend, temperature=0.0)
    whole_meta = whole.get_meta_info("name")
    assert [e[1] for e in whole_meta["output_token_logprobs"]] == [e[1] for e in entries]
    for a, b in zip(whole_meta["output_token_logprobs"], entries):
        assert a[0] == pytest.approx(b[0], abs=1e-4)
