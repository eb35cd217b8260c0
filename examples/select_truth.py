"""Classify statements as True, False or Unknown with `select`: every choice is scored as a
continuation of the prompt in one engine call, and the most likely one (by mean token logprob) is
appended. The scores are in the select's meta info.

Run: `python examples/select_truth.py` (greedy, on the default model).
"""

from __future__ import annotations

from typing import Any

import forklm as sgl

CHOICES = ["True", "False", "Unknown"]
STATEMENTS = [
    "The sun is a star.",
    "Fish can live without water for a year.",
    "My neighbour's cat is called Tom.",
]


@sgl.function
def judge(s, statement):
    s += sgl.user(f"Is this statement True, False or Unknown?\nStatement: {statement}\n"
                  "Answer with one word.")
    s += sgl.assistant(sgl.select("verdict", choices=CHOICES))


def run(backend: Any = None) -> list[sgl.ProgramState]:
    """The demo's run: one program per statement."""
    return judge.run_batch([{"statement": st} for st in STATEMENTS], backend=backend)


def main() -> None:
    with sgl.Engine() as engine:  # the default model; stopped cleanly at the end
        for statement, state in zip(STATEMENTS, run(engine)):
            scores = state.get_meta_info("verdict")["normalized_prompt_logprobs"]
            shown = ", ".join(f"{c} {x:.2f}" for c, x in zip(CHOICES, scores))
            print(f"{statement}\n  -> {state['verdict']}   (mean logprobs: {shown})")


if __name__ == "__main__":
    main()
