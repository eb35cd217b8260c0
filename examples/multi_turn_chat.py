"""A two-turn chat in the style of MT-Bench: a question, the model's answer, a follow-up that
depends on it, and the second answer. The chat template is the model's own.

Run: `python examples/multi_turn_chat.py` (greedy, on the default model; the answers stream).
"""

from __future__ import annotations

from typing import Any

import forklm as sgl

QUESTION_1 = "Name three fruits that are rich in vitamin C."
QUESTION_2 = "Which of them is the sweetest?"


@sgl.function
def two_turn_chat(s, question_1, question_2):
    s += sgl.user(question_1)
    s += sgl.assistant(sgl.gen("answer_1", max_tokens=48))
    s += sgl.user(question_2)
    s += sgl.assistant(sgl.gen("answer_2", max_tokens=48))


def run(backend: Any = None) -> sgl.ProgramState:
    """The demo's run: both turns, greedy."""
    return two_turn_chat.run(QUESTION_1, QUESTION_2, backend=backend, temperature=0.0)


def main() -> None:
    with sgl.Engine() as engine:  # the default model; stopped cleanly at the end
        # stream=True runs the program body in the background; text_iter yields each answer's
        # pieces as the engine decodes them
        state = two_turn_chat.run(QUESTION_1, QUESTION_2, backend=engine, temperature=0.0,
                                  stream=True)
        for name, question in (("answer_1", QUESTION_1), ("answer_2", QUESTION_2)):
            print(f"[user] {question}\n[assistant] ", end="", flush=True)
            for piece in state.text_iter(name):
                print(piece, end="", flush=True)
            print("\n")
        system = state.messages()[0]  # the template's default system prompt, as in the text
        print(f"({len(state.messages())} messages; the first is {system['role']}: "
              f"{system['content']!r})")

if __name__ == "__main__":
    main()
