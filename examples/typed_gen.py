"""Typed generation: `gen_int`, a regex-constrained `gen`, and `gen(dtype=...)`. The constraint is
enforced while decoding (a grammar masks the tokens that cannot continue a match), so the text
always parses.

Run: `python examples/typed_gen.py` (greedy, on the default model).
"""

from __future__ import annotations

from typing import Any

import forklm as sgl

# A dotted quad of numbers 0-255.
IP_REGEX = r"((25[0-5]|2[0-4][0-9]|1?[0-9]?[0-9])\.){3}(25[0-5]|2[0-4][0-9]|1?[0-9]?[0-9])"
DATE_REGEX = r"[0-9]{4}-[0-9]{2}-[0-9]{2}"


@sgl.function
def typed_answers(s):
    s += "Answer each question.\n"
    s += "Q: How many legs does a spider have?\nA: " + sgl.gen_int("legs", max_tokens=8) + "\n"
    s += "Q: What is the IP address of localhost?\nA: "
    s += sgl.gen("ip", max_tokens=24, regex=IP_REGEX) + "\n"
    s += "Q: On which date did the first person walk on the moon?\nA: "
    s += sgl.gen("date", max_tokens=16, regex=DATE_REGEX) + "\n"
    s += "Q: Is water wet? Answer True or False.\nA: " + sgl.gen("wet", max_tokens=4, dtype=bool)
    s += "\nQ: What is the value of pi to two decimal places?\nA: "
    s += sgl.gen("pi", max_tokens=8, dtype=float)


def run(backend: Any = None) -> sgl.ProgramState:
    """The demo's run, greedy."""
    return typed_answers.run(backend=backend, temperature=0.0)


def main() -> None:
    with sgl.Engine() as engine:  # the default model; stopped cleanly at the end
        state = run(engine)
        print(f"legs: {int(state['legs'])}")
        print(f"ip:   {state['ip']}")
        print(f"date: {state['date']}")
        print(f"wet:  {state['wet'] == 'True'}")
        print(f"pi:   {float(state['pi'])}")


if __name__ == "__main__":
    main()
