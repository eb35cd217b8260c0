"""The example programs in examples/ on the default model (fp32, greedy): their results' structure,
and equality with the same programs run one gen at a time on a transformers reference backend."""

from __future__ import annotations

import importlib.util
import re
import sys
import threading
from fractions import Fraction
from pathlib import Path
from types import ModuleType

import pytest
import torch

import forklm as sgl
from forklm.frontend_dsl import REGEX_FLOAT, REGEX_INT
from forklm.frontend_dsl.backends.base import Backend, GenResult
from forklm.frontend_dsl.choices import mean_logprob

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
SMOLLM_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


def load_example(name: str) -> ModuleType:
    """Import examples/<name>.py as a module (importing runs no program: they sit under main)."""
    spec = importlib.util.spec_from_file_location(f"forklm_example_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


class TransformersBackend(Backend):
    """The reference: transformers' Llama on the same fp32 weights, one call at a time (a lock),
    greedy with max tokens, EOS and stop strings cut as the engine cuts them; select scores each
    choice from transformers' logprobs, sliced as EngineBackend.select slices the engine's.
    Constrained gens (regex, which dtype gens use too) go to a forklm engine with the radix cache
    off, one request at a time: transformers has no grammar-constrained decoding of its own.
    The chat template (pure text, not a model computation) is taken from `template`."""

    def __init__(self, hf_model, tokenizer, eos_ids, template: Backend, constrained: Backend):
        self.model, self.tokenizer, self.eos_ids = hf_model, tokenizer, frozenset(eos_ids)
        self.template, self.constrained = template, constrained
        self.lock = threading.Lock()

    def generate(self, prompt, sampling_params, logprob_options, on_text=None):
        assert sampling_params.temperature < 1e-6, "the reference is greedy only"
        with self.lock:
            if sampling_params.regex is not None:
                return self.constrained.generate(prompt, sampling_params, logprob_options)
            ids = self.tokenizer.encode(prompt, add_special_tokens=False)
            text, num = self._greedy(ids, sampling_params)
            return GenResult(text, {"completion_tokens": num})

    @torch.inference_mode()
    def _greedy(self, prompt_ids, params) -> tuple[str, int]:
        stop_ids = set() if params.ignore_eos else self.eos_ids | set(params.stop_token_ids or ())
        out = self.model(torch.tensor([prompt_ids]), use_cache=True)
        ids: list[int] = []
        text = ""
        for _ in range(params.max_new_tokens):
            token = int(out.logits[0, -1].argmax())
            if token in stop_ids:
                break
            ids.append(token)
            text = self.tokenizer.decode(ids, skip_special_tokens=True,
                                         clean_up_tokenization_spaces=False)
            cut = _first_stop(text, params.stop or [])
            if cut is not None:
                return text[:cut], len(ids)
            out = self.model(torch.tensor([[token]]), cache=out.cache, use_cache=True)
        return text, len(ids)

    def select(self, prompt, choices, choices_method):
        with self.lock:
            prefix_ids = self.tokenizer.encode(prompt, add_special_tokens=False)
            entries = []
            for choice in choices:
                ids = self.tokenizer.encode(prompt + choice, add_special_tokens=False)
                common = next((i for i, (a, b) in enumerate(zip(prefix_ids, ids)) if a != b),
                              min(len(prefix_ids), len(ids)))
                entries.append(self._logprobs(ids, min(max(common, 1), len(ids) - 1)))
            unconditional = None
            if choices_method.requires_unconditional_logprobs:
                unconditional = [[[None, e[0][1], e[0][2]], *self._logprobs([x[1] for x in e], 1)]
                                 for e in entries]
        return choices_method(
            choices=choices, normalized_prompt_logprobs=[mean_logprob(e) for e in entries],
            input_token_logprobs=entries, output_token_logprobs=[[] for _ in choices],
            unconditional_token_logprobs=unconditional)

    @torch.inference_mode()
    def _logprobs(self, ids: list[int], start: int) -> list[list]:
        """[logprob, token_id, text] of ids[start:], each given the tokens before it."""
        logprobs = torch.log_softmax(self.model(torch.tensor([ids])).logits[0].float(), dim=-1)
        return [[float(logprobs[j - 1, ids[j]]), ids[j], self.tokenizer.decode([ids[j]])]
                for j in range(start, len(ids))]

    def role_prefix_suffix(self, role, history):
        return self.template.role_prefix_suffix(role, history)

    def default_system_prompt(self):
        return self.template.default_system_prompt()


def _first_stop(text: str, stops: list[str]) -> int | None:
    """Where the text is cut: the start of the stop string that ends first (longest on a tie)."""
    found = [(text.find(s) + len(s), -len(s), text.find(s)) for s in stops if s in text]
    return min(found)[2] if found else None


def exact_value(expression: str) -> Fraction:
    """An oracle for EXPRESSION_REGEX's expressions (no parentheses), independent of the example's
    AST walk: sum of terms, each a left-to-right product/quotient."""
    total = Fraction(0)
    for sign, term in re.findall(r"(^|[-+]) ?([^-+]+)", expression.replace(" ", "")):
        factors = re.findall(r"([*/]?)(\d+)", term)
        value = Fraction(int(factors[0][1]))
        for op, number in factors[1:]:
            value = value * int(number) if op == "*" else value / int(number)
        total += -value if sign == "-" else value
    return total


# -- model-free ------------------------------------------------------------------------------------
def test_calculator_is_exact_and_refuses_everything_but_arithmetic():
    tool_use = load_example("tool_use")
    assert tool_use.calculate("2 + 3 * (4 - 1) / 2") == Fraction(13, 2)
    assert tool_use.calculate("-(7 - 10) * 2") == 6
    assert tool_use.format_number(Fraction(13, 2)) == "6.5"
    assert tool_use.format_number(Fraction(42)) == "42"
    for bad in ("__import__('os')", "2 ** 10", "abs(-1)", "x + 1", "'a' * 3", "[1][0]"):
        with pytest.raises(ValueError, match="not allowed"):
            tool_use.calculate(bad)
    with pytest.raises(ValueError, match="not an arithmetic expression"):
        tool_use.calculate("2 +")
    with pytest.raises(ZeroDivisionError):
        tool_use.calculate("1 / (2 - 2)")
    assert exact_value("4 * 3 + 2 * 5 - 6 / 4") == Fraction(41, 2)


def test_make_demo_runs_the_fork_and_select_example():
    makefile = (EXAMPLES.parent / "Makefile").read_text()
    demo = makefile[makefile.index("\ndemo:"):].split("\n\n")[0]
    assert "examples/tips_fork.py" in demo


# -- on the default model --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def backend(make_engine):
    return sgl.EngineBackend(make_engine())


@pytest.fixture(scope="module")
def reference(make_engine, hf_model, tokenizer, backend):
    constrained = sgl.EngineBackend(make_engine(disable_radix_cache=True))
    return TransformersBackend(hf_model, tokenizer, make_engine().parts.eos_token_ids,
                               template=backend, constrained=constrained)


def assert_same_run(state, ref_state, names):
    assert state.text() == ref_state.text()
    for name in names:
        assert state[name] == ref_state[name], name


@pytest.mark.slow
def test_few_shot_qa(backend, reference):
    example = load_example("few_shot_qa")
    states, ref_states = example.run(backend), example.run(reference)
    assert len(states) == len(example.COUNTRIES)
    for country, state, ref_state in zip(example.COUNTRIES, states, ref_states):
        answer = state["answer"]
        assert isinstance(answer, str) and answer.strip() and "\n" not in answer
        assert state.get_meta_info("answer")["completion_tokens"] <= 16
        assert state.text().endswith(f"What is the capital of {country}?\nA:{answer}")
        assert_same_run(state, ref_state, ["answer"])
    assert states[0]["answer"].strip() == "Tokyo"  # the model knows this one


@pytest.mark.slow
def test_multi_turn_chat(backend, reference):
    example = load_example("multi_turn_chat")
    state, ref_state = example.run(backend), example.run(reference)
    messages = state.messages()
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant"]
    assert messages[0]["content"] == SMOLLM_SYSTEM  # the template's, as the text has it
    assert messages[1]["content"] == example.QUESTION_1
    assert messages[3]["content"] == example.QUESTION_2
    for i, name in ((2, "answer_1"), (4, "answer_2")):
        assert messages[i]["content"] == state[name].lstrip() and state[name].strip()
        assert state.get_meta_info(name)["completion_tokens"] <= 48
    assert state.text().index(state["answer_1"]) < state.text().index(example.QUESTION_2)
    assert_same_run(state, ref_state, ["answer_1", "answer_2"])


@pytest.mark.slow
def test_select_truth(backend, reference):
    example = load_example("select_truth")
    states, ref_states = example.run(backend), example.run(reference)
    for state, ref_state in zip(states, ref_states):
        verdict, meta = state["verdict"], state.get_meta_info("verdict")
        assert verdict in example.CHOICES
        assert state.text().endswith(f"<|im_start|>assistant\n{verdict}<|im_end|>\n")
        scores = meta["normalized_prompt_logprobs"]
        assert verdict == example.CHOICES[max(range(3), key=scores.__getitem__)]
        ref_scores = ref_state.get_meta_info("verdict")["normalized_prompt_logprobs"]
        assert scores == pytest.approx(ref_scores, abs=1e-3)
        assert_same_run(state, ref_state, ["verdict"])


@pytest.mark.slow
def test_typed_gen(backend, reference):
    example = load_example("typed_gen")
    state, ref_state = example.run(backend), example.run(reference)
    assert re.fullmatch(REGEX_INT, state["legs"]) and int(state["legs"]) >= 0
    assert re.fullmatch(example.IP_REGEX, state["ip"])
    assert re.fullmatch(example.DATE_REGEX, state["date"])
    assert state["wet"] in ("True", "False")
    assert re.fullmatch(REGEX_FLOAT, state["pi"]) and isinstance(float(state["pi"]), float)
    assert_same_run(state, ref_state, ["legs", "ip", "date", "wet", "pi"])


@pytest.mark.slow
def test_tool_use(backend, reference):
    example = load_example("tool_use")
    state, ref_state = example.run(backend), example.run(reference)
    expression = state["expression"]
    assert re.fullmatch(example.EXPRESSION_REGEX, expression)
    assert state["result"] == example.format_number(exact_value(expression))
    assert f"The calculator says {expression} = {state['result']}." in state.text()
    assert isinstance(state["answer"], str) and state["answer"].strip()
    assert_same_run(state, ref_state, ["expression", "result", "answer"])


@pytest.mark.slow
def test_tips_fork(backend, reference):
    example = load_example("tips_fork")
    state, ref_state = example.run(backend), example.run(reference)
    assert state["topic"] in example.TOPICS
    tips = state["tip"]
    assert isinstance(tips, list) and len(tips) == example.NUM_TIPS == 5
    assert all(isinstance(t, str) and t.strip() and "\n" not in t for t in tips)
    # the branches reused the parent's prompt from the radix cache
    assert all(meta["cached_tokens"] > 0 for meta in state.get_meta_info("tip"))
    assert isinstance(state["summary"], str) and state["summary"].strip()
    assert [m["role"] for m in state.messages()] == ["system", "user", "assistant", "user",
                                                     "assistant"]
    assert all(tip.strip() in state.text() for tip in tips)  # listed in the summary request
    assert_same_run(state, ref_state, ["topic", "tip", "summary"])
