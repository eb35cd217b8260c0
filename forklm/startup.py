"""Python's cyclic garbage collector during a command's start-up.

Importing torch, transformers and the server, and building an engine, allocate ~285,000 objects
that live as long as the process. Left on, the collector walks them again each time a full
collection comes due: ~0.4 s of `forklm serve`'s launch -> ready on the default model
(benchmarks/startup.py), and later a 0.13-0.18 s pause with the GIL held in the middle of
serving. So the command line pauses the collector while a command starts, then freezes what
start-up made (Python's permanent generation, never walked again) and turns it back on. What
start-up leaves as cyclic garbage (~7,600 objects, a few hundred KB) stays with the frozen."""

from __future__ import annotations

import gc

_paused = False  # by pause_collection, and not yet back on


def pause_collection() -> None:
    """Off until started() or resumed(): call first thing in a command that builds an engine.
    A collector someone else turned off stays theirs to turn on."""
    global _paused
    if gc.isenabled():
        gc.disable()
        _paused = True


def started() -> None:
    """Start-up is over: freeze what it made and collect from here on (where
    pause_collection turned the collector off; a no-op otherwise)."""
    _back_on(freeze=True)


def resumed() -> None:
    """The collector back on without freezing anything, where pause_collection turned it off
    and start-up never ended (a command that failed, or did its work and returned: the command
    line called in someone's process must leave it as it found it)."""
    _back_on(freeze=False)


def _back_on(freeze: bool) -> None:
    global _paused
    if _paused:
        if freeze:
            gc.freeze()
        gc.enable()
        _paused = False
