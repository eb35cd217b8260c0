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


def pause_collection() -> None:
    """Off until started(): call first thing in a command that builds an engine."""
    gc.disable()


def started() -> None:
    """Start-up is over: freeze what it made and collect from here on. A no-op where the
    collector is on (nothing paused it: an engine or server built inside someone's process)."""
    if not gc.isenabled():
        gc.freeze()
        gc.enable()
