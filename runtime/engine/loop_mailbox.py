"""LoopMailbox: the engine thread's streaming events for one asyncio event loop, handed over with
one wake-up per burst instead of one per event.

A decode step of 16 streamed requests produced 16 `call_soon_threadsafe` calls, each a lock, a
byte written to the loop's self-pipe (a syscall on the engine thread) and a wake-up of the loop.
Here the first event of a burst schedules one drain; the events that follow before the loop runs
it join the same drain, in the order they were posted."""

from __future__ import annotations

import asyncio
import threading
import weakref
from collections.abc import Callable
from typing import Any

_Event = tuple[Callable[[Any], None], Any]


class LoopMailbox:
    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._lock = threading.Lock()
        self._pending: list[_Event] = []
        self._scheduled = False

    def post(self, callback: Callable[[Any], None], arg: Any) -> None:
        """Run callback(arg) on the loop, after the events posted before it. From any thread;
        raises RuntimeError, as call_soon_threadsafe does, when the loop is closed."""
        with self._lock:
            self._pending.append((callback, arg))
            if self._scheduled and not self.loop.is_closed():
                return
            self._scheduled = True
        try:
            self.loop.call_soon_threadsafe(self._drain)
        except RuntimeError:
            with self._lock:
                self._scheduled = False
                self._pending.clear()  # nobody will ever read them
            raise

    def _drain(self) -> None:
        with self._lock:
            events, self._pending = self._pending, []
            self._scheduled = False
        for callback, arg in events:
            try:
                callback(arg)
            except Exception as e:  # one failing callback must not drop the others' events
                self.loop.call_exception_handler({"message": "LoopMailbox callback failed",
                                                  "exception": e})


_mailboxes: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LoopMailbox] = \
    weakref.WeakKeyDictionary()
_mailboxes_lock = threading.Lock()


def mailbox_for(loop: asyncio.AbstractEventLoop) -> LoopMailbox:
    """The loop's one mailbox (made on first use, gone with the loop)."""
    with _mailboxes_lock:
        box = _mailboxes.get(loop)
        if box is None:
            box = _mailboxes[loop] = LoopMailbox(loop)
        return box
