"""Few-shot question answering: three worked examples, then the model answers in the same shape.
Every item of the batch shares the few-shot prefix, which the radix cache computes once.

Run: `python examples/few_shot_qa.py` (greedy, on the default model).
"""

from __future__ import annotations

from typing import Any

import forklm as sgl

FEW_SHOT = (
    "Answer each question with the name of a city.\n\n"
    "Q: What is the capital of France?\nA: Paris\n\n"
    "Q: What is the capital of Germany?\nA: Berlin\n\n"
    "Q: What is the capital of Italy?\nA: Rome\n\n"
)
COUNTRIES = ["Japan", "Spain", "Egypt", "Canada"]


@sgl.function
def capital_qa(s, country):
    s += FEW_SHOT
    s += f"Q: What is the capital of {country}?\nA:" + sgl.gen("answer", max_tokens=16, stop="\n")


def run(backend: Any = None) -> list[sgl.ProgramState]:
    """The demo's run: one program per country, greedy."""
    return capital_qa.run_batch([{"country": c} for c in COUNTRIES], backend=backend,
                                temperature=0.0)


def main() -> None:
    with sgl.Engine() as engine:  # the default model; stopped cleanly at the end
        for country, state in zip(COUNTRIES, run(engine)):
            print(f"{country}: {state['answer'].strip()}")


if __name__ == "__main__":
    main()
