"""Work an engine leaves to the time it has no requests: weight copies and page moves that make
later steps faster but that no request must wait for at start-up.

The loop (runtime/engine/loop.py) runs it once it has been idle for IDLE_BUILD_AFTER_S, a
slice at a time between looks at its inbox, so a request that arrives meanwhile waits for one
slice at most (a few ms), and the rest waits for the next idle spell."""

from __future__ import annotations

from collections.abc import Generator
from typing import Protocol


class IdleWork(Protocol):
    def run_slice(self) -> bool:
        """Do a short piece of the work on the engine's thread (a few ms at most, or hand it to
        a background thread); False once nothing is left."""

    def close(self) -> None:
        """The engine is shutting down: stop, or wait for what runs in the background (a thread
        still inside torch as the process exits aborts it)."""


class InSlices:
    """A generator's steps as IdleWork: one `next` per slice; closing it runs its cleanup."""

    def __init__(self, steps: Generator[object, None, None]) -> None:
        self._steps = steps

    def run_slice(self) -> bool:
        return next(self._steps, self) is not self

    def close(self) -> None:
        self._steps.close()
