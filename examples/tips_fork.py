"""Fork and select: pick the area to work on with `select`, fork five branches that each expand
one tip about it (they run in the same engine batches and share the prompt's KV through the radix
cache), join them, and summarize. `make demo` runs this.

Run: `python examples/tips_fork.py` (greedy, on the default model).
"""

from __future__ import annotations

import time
from typing import Any

import forklm as sgl

TOPICS = ["sleep", "exercise", "nutrition", "focus", "stress"]
GOAL = "have more energy during the day"
NUM_TIPS = 5


@sgl.function
def tips_fork(s, goal):
    s += sgl.user(f"I want to {goal}. Which one area should I work on first: "
                  f"{', '.join(TOPICS)}? Answer with one word.")
    s += sgl.assistant(sgl.select("topic", choices=TOPICS))
    topic = s["topic"]  # the branches' prompts depend on the choice
    branches = s.fork(NUM_TIPS)
    branches += lambda i: sgl.user(f"Give tip number {i + 1} of {NUM_TIPS} about {topic} "
                                   "in one sentence.")
    branches += sgl.assistant(sgl.gen("tip", max_tokens=32, stop="\n"))
    branches.join()  # s["tip"] is the list of the five tips, in branch order
    listed = "\n".join(f"{i + 1}. {tip.strip()}" for i, tip in enumerate(s["tip"]))
    s += sgl.user(f"Here are {NUM_TIPS} tips about {topic}:\n{listed}\nSummarize them in one "
                  "sentence.")
    s += sgl.assistant(sgl.gen("summary", max_tokens=48))


def run(backend: Any = None) -> sgl.ProgramState:
    """The demo's run, greedy."""
    return tips_fork.run(GOAL, backend=backend, temperature=0.0)


def main() -> None:
    with sgl.Engine() as engine:  # the default model; stopped cleanly at the end
        start = time.perf_counter()
        state = run(engine)
        print(f"topic: {state['topic']}")
        for i, tip in enumerate(state["tip"]):
            print(f"tip {i + 1}: {tip.strip()}")
        print(f"summary: {state['summary'].strip()}")
        metas = state.get_meta_info("tip")  # one per branch
        cached = sum(m["cached_tokens"] for m in metas)
        prompt = sum(m["prompt_tokens"] for m in metas)
        print(f"branches' prompt tokens served from the radix cache: {cached}/{prompt}")
        print(f"({time.perf_counter() - start:.1f} s after the model loaded)")


if __name__ == "__main__":
    main()
