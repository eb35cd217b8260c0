"""tool_choice "auto" with and without the structural-tag constraint, on a tiny random model whose
tokenizer has a hermes chat template (written here) and `<tool_call>` tokens: of N tool-eliciting
prompts, how many replies opened a call (wrote `<tool_call>`), produced one (a call object naming a
tool), and of the calls closed before max_tokens, how many parsed as JSON and validated against
the tool's schema.

A random model never opens a call by itself, so a logit_bias on the `<tool_call>` token makes it
(the same bias in both runs); what follows the opener is the model's own, free or constrained.

Run: `python -m benchmarks.auto_tool_calls [--num-prompts 24] [--bias 100]`

Measured (24 prompts, temperature 0.8, 64 new tokens): with bias 100 every reply opens calls;
unconstrained none is a call (0/24: free random text after the opener), constrained 24/24 are,
39 calls of which the 26 closed before max_tokens all parse and validate (13 cut off). With bias
4, one reply opens a call: unconstrained it is no call, constrained it is a valid one.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import tempfile
import time
from typing import Any

import jsonschema
import transformers

from forklm import Engine
from forklm.parsers.tool_calls import HermesParser
from forklm.server.protocol import ChatCompletionRequest
from forklm.server.tools import ToolPlan, whole_calls

HERMES_TEMPLATE = (
    # Tools by name only: the tiny model's context is 256 tokens.
    "{%- if tools %}<|im_start|>system\n<tools>"
    "{%- for t in tools %} {{ t.function.name }}{%- endfor %}</tools> Call one as <tool_call>\n"
    '{"name": <name>, "arguments": <args>}\n</tool_call><|im_end|>\n{%- endif %}'
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant"
    "{%- for c in m.tool_calls %}\n<tool_call>\n{\"name\": \"{{ c.function.name }}\", "
    "\"arguments\": {{ c.function.arguments | tojson }}}\n</tool_call>{%- endfor %}<|im_end|>\n"
    "{%- elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n"
    "</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}")
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                         "unit": {"enum": ["C", "F"]}},
        "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"tz": {"type": "string", "maxLength": 8}},
        "required": ["tz"], "additionalProperties": False}}}]
CITIES = ["Paris", "Rome", "Oslo", "Lima", "Cairo", "Tokyo", "Quito", "Perth", "Dakar", "Hanoi",
          "Seoul", "Accra"]


def build_hermes_model(folder: pathlib.Path | str, tokenizer: Any) -> int:
    """Save a tiny random Qwen2 with `tokenizer` plus `<tool_call>` tokens and HERMES_TEMPLATE
    into `folder`; returns the `<tool_call>` token id."""
    from tests.tiny_models import build_tiny_model

    # A copy through save/load: `tokenizer` may have been built from a GGUF, whose folder holds no
    # tokenizer files to load it from again.
    folder = pathlib.Path(folder)
    tokenizer.save_pretrained(folder)
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    tok.add_tokens(["<tool_call>", "</tool_call>"])  # not special: they stay in the text
    tok.chat_template = HERMES_TEMPLATE
    build_tiny_model("qwen2", folder, tok)
    return tok.convert_tokens_to_ids("<tool_call>")


def prompts(num: int) -> list[list[dict[str, str]]]:
    asks = ["What is the weather in {}?", "Is it cold in {} right now?", "What time is it in {}?"]
    return [[{"role": "user", "content": asks[i % 3].format(CITIES[i % len(CITIES)])}]
            for i in range(num)]


def measure(engine: Engine, plan: ToolPlan, constrained: bool, bias: dict[int, float],
            num: int) -> dict[str, Any]:
    schemas = {t.function.name: t.function.parameters for t in plan.tools}
    tools = [t.model_dump(exclude_none=True) for t in plan.tools]
    counts = dict(replies=num, opened=0, called=0, calls=0, cut=0, parsed=0, validated=0)
    start = time.perf_counter()
    for i, messages in enumerate(prompts(num)):
        prompt = engine.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                                      add_generation_prompt=True)
        params: dict[str, Any] = {"max_new_tokens": 64, "temperature": 0.8, "seed": i,
                                  "logit_bias": bias}
        if constrained:
            params["structural_tag"] = plan.structural_tag()
        text = engine.generate(prompt, params)["text"]
        reader = plan.reader()
        calls = whole_calls(reader.read(text), reader.complete)
        counts["opened"] += "<tool_call>" in text
        counts["called"] += bool(calls)
        for call in calls:
            counts["calls"] += 1
            if not call.complete:  # cut off by max_new_tokens: partial arguments
                counts["cut"] += 1
                continue
            try:
                args = json.loads(call.arguments)
            except ValueError:
                continue
            counts["parsed"] += 1
            if call.name in schemas and _valid(args, schemas[call.name]):
                counts["validated"] += 1
    return {**counts, "seconds": round(time.perf_counter() - start, 1)}


def _valid(args: Any, schema: dict[str, Any] | None) -> bool:
    try:
        jsonschema.validate(args, schema or {"type": "object"})
    except jsonschema.ValidationError:
        return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=24)
    parser.add_argument("--bias", type=float, default=100.0,
                        help="logit bias on <tool_call> (makes the random model open calls)")
    args = parser.parse_args()
    from forklm.runtime.models.loader import load_model

    tokenizer = load_model("SmolLM2-135M-Instruct").tokenizer
    with tempfile.TemporaryDirectory() as folder:
        tool_call_id = build_hermes_model(folder, tokenizer)
        body = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}],
                                     tools=TOOLS)
        plan = ToolPlan("auto", tuple(body.tools or ()), parser=HermesParser())
        with Engine(model_path=folder, dtype="float32", max_total_tokens=4096) as engine:
            print(f"bias {args.bias} on <tool_call>\n| structural tag | replies | opened a call "
                  "| produced a call | calls | cut off | closed calls parsed | validated | "
                  "seconds |\n|---|---|---|---|---|---|---|---|---|")
            for constrained in (False, True):
                r = measure(engine, plan, constrained, {tool_call_id: args.bias},
                            args.num_prompts)
                print(f"| {'yes' if constrained else 'no'} | {r['replies']} | {r['opened']} | "
                      f"{r['called']} | {r['calls']} | {r['cut']} | {r['parsed']} | "
                      f"{r['validated']} | "
                      f"{r['seconds']} |")


if __name__ == "__main__":
    main()
