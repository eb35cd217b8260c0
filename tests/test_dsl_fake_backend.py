"""The program language on a scripted fake backend: no model, exact values."""

from __future__ import annotations

import math
import re
import threading
import time

import pytest

import forklm as sgl
from forklm.frontend_dsl.backends.base import Backend, GenResult
from forklm.frontend_dsl.choices import ChoicesDecision, mean_logprob


class FakeBackend(Backend):
    """gen answers `reply(prompt, params)`; select scores choices with scripted logprobs; the chat
    template is `<role>...</role>` with a default system prompt before the first non-system turn."""

    def __init__(self, reply=None, logprobs=None, delay=0.0):
        self.reply = reply or (lambda prompt, params: f"<{params.max_new_tokens}>")
        self.logprobs = logprobs or {}
        self.delay = delay
        self.calls: list[tuple[str, object]] = []
        self.lock = threading.Lock()

    def generate(self, prompt, sampling_params, logprob_options, on_text=None):
        time.sleep(self.delay)
        with self.lock:
            self.calls.append((prompt, sampling_params))
        return GenResult(self.reply(prompt, sampling_params), {"prompt": prompt, "logprobs": logprob_options})

    def select(self, prompt, choices, choices_method):
        lps = [[[lp, i, ""] for i, lp in enumerate(self.logprobs[c])] for c in choices]
        return choices_method(choices=choices, normalized_prompt_logprobs=[mean_logprob(e) for e in lps],
                              input_token_logprobs=lps, output_token_logprobs=[[] for _ in choices],
                              unconditional_token_logprobs=None)

    def role_prefix_suffix(self, role, history):
        system = "<system>default</system>" if not history and role != "system" else ""
        return f"{system}<{role}>", f"</{role}>"


def test_text_gen_and_run_defaults():
    @sgl.function
    def prog(s, question):
        s += "Q: " + question + "\nA:"
        s += sgl.gen("answer", 7, stop="\n")
        s += sgl.gen("more")

    backend = FakeBackend()
    state = prog.run(question="hi", backend=backend, temperature=0.0, max_new_tokens=3)
    assert state["answer"] == "<7>" and state["more"] == "<3>"
    assert state.text() == "Q: hi\nA:<7><3>"
    first, second = backend.calls
    assert first[0] == "Q: hi\nA:" and first[1].stop == ["\n"] and first[1].temperature == 0.0
    assert second[1].max_new_tokens == 3 and second[1].stop is None
    assert state.get_meta_info("answer")["prompt"] == "Q: hi\nA:"


def test_positional_args_prog_call_and_unknown_keyword():
    @sgl.function()
    def prog(s, a, b="B"):
        s += a + b

    assert prog("x", backend=FakeBackend()).text() == "xB"
    with pytest.raises(TypeError, match="unexpected keyword 'colour'"):
        prog.run("x", colour=1, backend=FakeBackend())


def test_reads_block_until_the_value_exists():
    @sgl.function
    def prog(s):
        s += "x"
        s += sgl.gen("slow", 5)
        s["after"] = s["slow"] + "!"  # control flow on a generated value

    backend = FakeBackend(delay=0.2)
    t0 = time.perf_counter()
    state = prog.run(backend=backend)
    assert state["after"] == "<5>!" and time.perf_counter() - t0 >= 0.2
    assert "after" in state and "nope" not in state
    with pytest.raises(KeyError, match="nope"):
        state["nope"]


def test_appends_run_asynchronously_and_forks_overlap():
    @sgl.function
    def prog(s):
        s += "p"
        forks = s.fork(4)
        forks += lambda i: sgl.gen(f"g{i}", i)
        forks.join()

    backend = FakeBackend(delay=0.3)
    t0 = time.perf_counter()
    state = prog.run(backend=backend)
    state.sync()
    assert time.perf_counter() - t0 < 0.3 * 2  # 4 gens of 0.3 s ran concurrently
    assert state["g2"] == [None, None, "<2>", None]


def test_fork_join_gathers_new_variables_as_lists():
    @sgl.function
    def prog(s):
        s += "Tips:"
        s["before"] = "kept"
        forks = s.fork(3)
        forks += [f" tip{i}" for i in range(3)]
        forks += sgl.gen("tip", 2)
        for i, f in enumerate(forks):
            assert f["before"] == "kept" and f.text().startswith("Tips: tip")
            f["n"] = i
        forks.join()
        s += "\nSummary:" + sgl.gen("summary", 9)

    backend = FakeBackend(reply=lambda p, sp: f"[{p[-4:]}]")
    state = prog.run(backend=backend)
    assert state["tip"] == ["[tip0]", "[tip1]", "[tip2]"]
    assert state["n"] == [0, 1, 2]
    assert state["before"] == "kept"
    assert state.get_meta_info("tip")[1]["prompt"] == "Tips: tip1"
    # the parent's text does not include the branches in gather mode
    assert state.text() == "Tips:\nSummary:[ary:]"


def test_join_concate_and_append():
    @sgl.function
    def prog(s):
        s += "A"
        forks = s.fork(2)
        forks += lambda i: f"-{i}" + sgl.gen("x", i + 1)
        forks.join(mode="concate_and_append")
        s += "|"

    state = prog.run(backend=FakeBackend())
    assert state.text() == "A-0<1>-1<2>|"
    assert state["x"] == ["<1>", "<2>"]
    with pytest.raises(ValueError, match="Invalid join mode"):
        state.fork(2).join(mode="nope")


def test_roles_and_messages():
    @sgl.function
    def prog(s):
        s += sgl.system("Be brief.")
        with s.user():
            s += "  Hello"
        s += sgl.assistant(sgl.gen("reply", 4))
        s += sgl.user_begin() + "Again" + sgl.user_end()
        s.assistant("ok")

    state = prog.run(backend=FakeBackend())
    assert state.text() == ("<system>Be brief.</system><user>  Hello</user><assistant><4></assistant>"
                            "<user>Again</user><assistant>ok</assistant>")
    assert state.messages() == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "<4>"}, {"role": "user", "content": "Again"},
        {"role": "assistant", "content": "ok"}]


def test_default_system_prompt_from_template_and_nested_role_error():
    @sgl.function
    def prog(s):
        s += sgl.user("q")
        s += sgl.user_begin() + sgl.assistant_begin()

    state = prog.run(backend=FakeBackend())
    with pytest.raises(ValueError, match="Nested roles are not allowed"):
        state.text()
    assert state.error() is not None


def test_var_scope_captures_appended_text():
    @sgl.function
    def prog(s):
        s += "intro "
        with s.var_scope("body"):
            s += "a=" + sgl.gen("a", 1) + ";"
        s += " end"

    state = prog.run(backend=FakeBackend())
    assert state["body"] == "a=<1>;" and state["a"] == "<1>"
    assert state.text() == "intro a=<1>; end"


def test_error_in_a_gen_is_raised_at_the_next_read_with_its_message():
    def reply(prompt, params):
        raise RuntimeError("engine exploded: KV cache on fire")

    @sgl.function
    def prog(s):
        s += "x" + sgl.gen("a", 3)
        s += sgl.gen("b", 3)

    state = prog.run(backend=FakeBackend(reply=reply))
    for read in (lambda: state["b"], state.text, state.sync, lambda: state["a"]):
        with pytest.raises(RuntimeError, match="KV cache on fire"):
            read()


def test_bad_sampling_value_and_bad_regex_surface_with_the_field_name():
    @sgl.function
    def prog(s):
        s += "x" + sgl.gen("a", temperature=-1.0)

    with pytest.raises(ValueError, match="temperature"):
        prog.run(backend=FakeBackend())["a"]
    with pytest.raises(ValueError, match=re.escape("regex")):
        sgl.gen("a", regex="(unclosed")
    with pytest.raises(ValueError, match="greedy"):
        sgl.select("a", ["x"], temperature=0.7)
    with pytest.raises(ValueError, match="Tried to append None"):
        prog.run(backend=FakeBackend()).__iadd__(None)


def test_error_in_a_branch_is_raised_by_join():
    @sgl.function
    def prog(s):
        s += "x"
        forks = s.fork(2)
        forks += lambda i: sgl.gen("g", 1 + i)
        forks.join()

    def reply(prompt, params):
        if params.max_new_tokens == 2:
            raise KeyError("branch 1 failed")
        return "ok"

    with pytest.raises(KeyError, match="branch 1 failed"):
        prog.run(backend=FakeBackend(reply=reply))


def test_select_appends_the_decision_and_gen_choices_is_a_select():
    @sgl.function
    def prog(s):
        s += "Answer: " + sgl.select("ans", ["yes", "no"])
        s += " " + sgl.gen("g", choices=["yes", "no"], choices_method=sgl.greedy_token_selection)

    state = prog.run(backend=FakeBackend(logprobs={"yes": [-1.0, -3.0], "no": [-1.5]}))
    assert state["ans"] == "no"  # mean -1.5 > mean -2.0
    assert state["g"] == "yes"  # first token -1.0 beats -1.5
    assert state.text() == "Answer: no yes"
    assert state.get_meta_info("ans")["normalized_prompt_logprobs"] == [-2.0, -1.5]


def _entries(values):
    return [[v, i, f"t{i}"] for i, v in enumerate(values)]


def _call(method, choices, rows, unconditional=None):
    rows = [_entries(r) for r in rows]
    return method(choices=choices, normalized_prompt_logprobs=[mean_logprob(r) for r in rows],
                  input_token_logprobs=rows, output_token_logprobs=[[] for _ in rows],
                  unconditional_token_logprobs=unconditional)


def test_token_length_normalized_on_hand_numbers():
    out = _call(sgl.token_length_normalized, ["a", "b", "c"],
                [[None, -1.0, -2.0], [-1.2, -1.2], [-0.5, -3.0]])
    assert isinstance(out, ChoicesDecision)
    assert out.decision == "b"  # means: -1.5, -1.2, -1.75 (the None is skipped)
    assert out.meta_info["normalized_prompt_logprobs"] == pytest.approx([-1.5, -1.2, -1.75])
    tie = _call(sgl.token_length_normalized, ["x", "y"], [[-1.0], [-1.0]])
    assert tie.decision == "x"  # the first maximum


def test_greedy_token_selection_pads_with_own_mean():
    # a: [-1, -4] mean -2.5;  b: [-1] padded with its mean -1 -> [-1, -1];  c: [-2, 0]
    out = _call(sgl.greedy_token_selection, ["a", "b", "c"], [[-1.0, -4.0], [-1.0], [-2.0, 0.0]])
    assert out.decision == "b"
    assert out.meta_info["greedy_logprob_matrix"] == [[-1.0, -4.0], [-1.0, -1.0], [-2.0, 0.0]]
    # first column decides alone: c has the best first token despite a worse mean
    assert _call(sgl.greedy_token_selection, ["a", "c"], [[-2.0, -0.1], [-1.0, -9.0]]).decision == "c"


def test_unconditional_likelihood_normalized_on_hand_numbers():
    cond = [[-1.0, -1.0], [-0.5, -0.5]]
    uncond = [_entries([None, -3.0]), _entries([None, -0.2])]
    # a: ((-1 - 0) + (-1 + 3)) / 2 = 0.5 ;  b: ((-0.5 - 0) + (-0.5 + 0.2)) / 2 = -0.4
    out = _call(sgl.unconditional_likelihood_normalized, ["a", "b"], cond, uncond)
    assert out.decision == "a"
    assert out.meta_info["normalized_unconditional_prompt_logprobs"] == pytest.approx([0.5, -0.4])
    assert sgl.unconditional_likelihood_normalized.requires_unconditional_logprobs
    with pytest.raises(ValueError, match="needs unconditional"):
        _call(sgl.unconditional_likelihood_normalized, ["a"], [[-1.0]])
    with pytest.raises(ValueError, match="1 conditional vs 2 unconditional"):
        _call(sgl.unconditional_likelihood_normalized, ["a"], [[-1.0]], [_entries([None, -1.0])])


def test_run_batch_keeps_order_isolates_errors_and_accepts_lists():
    @sgl.function
    def prog(s, n):
        s += f"n={n}"
        if n == 2:
            raise RuntimeError("item 2 is bad")
        s += sgl.gen("g", n + 1)

    backend = FakeBackend(delay=0.05)
    states = prog.run_batch([{"n": i} for i in range(5)], backend=backend, progress_bar=True)
    assert [s["g"] for i, s in enumerate(states) if i != 2] == ["<1>", "<2>", "<4>", "<5>"]
    with pytest.raises(RuntimeError, match="item 2 is bad"):
        states[2].text()
    assert [s["g"] for s in prog.run_batch([[0], (1,)], backend=backend, num_threads=1)] == \
        ["<1>", "<2>"]
    assert list(prog.run_batch([{"n": 3}], backend=backend, generator_style=True))[0]["g"] == "<4>"
    assert prog.run_batch([], backend=backend) == []


def test_run_async_and_run_batch_async():
    import asyncio

    @sgl.function
    def prog(s, n):
        s += "x" + sgl.gen("g", n)

    backend = FakeBackend()

    async def main():
        one = await prog.run_async(2, backend=backend)
        many = await prog.run_batch_async([{"n": 1}, {"n": 3}], backend=backend)
        return one, many

    one, many = asyncio.run(main())
    assert one["g"] == "<2>" and [s["g"] for s in many] == ["<1>", "<3>"]


def test_bind_and_mean_logprob_edge():
    @sgl.function
    def prog(s, a, b):
        s += a + b

    assert prog.bind(b="!").run("hi", backend=FakeBackend()).text() == "hi!"
    assert mean_logprob([[None, 1, ""]]) == -math.inf


def test_copy_stream_run_and_text_iter():
    @sgl.function
    def prog(s):
        s += "a"
        with s.copy() as c:
            c += "b" + sgl.gen("g", 1)
        s += sgl.gen(None, 2)  # an unnamed gen is stored under None, as in SGLang

    state = prog.run(backend=FakeBackend(delay=0.05), stream=True)
    assert list(state.text_iter("g")) == [["<1>"]]
    state.sync()
    assert state.text() == "a<2>" and state[None] == "<2>"
    assert "".join(state.text_iter()) == "a<2>"  # pieces: "a", then the gen's "<2>"
