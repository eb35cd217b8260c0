"""The event log behind streaming: every text piece a program state appends and every variable it
sets, in order, readable from the start by any number of blocking or async iterators."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any, NamedTuple


class TextEvent(NamedTuple):
    """A piece of text appended to the state; `owners` are the variables it is part of (the gen or
    select producing it and every open var_scope). A gen streamed with return_logprob also logs
    its tokens' [logprob, token_id, text] entries with the piece they decoded to (a token whose
    text is not complete yet comes with an empty piece)."""

    text: str
    owners: tuple[Any, ...]
    logprobs: list[list[Any]] | None = None


class VariableEvent(NamedTuple):
    name: Any
    value: Any


Event = TextEvent | VariableEvent


class EventLog:
    """Append-only; writers hold `cond` (the executor's) while appending and call `notify` after
    any change that may end the stream. `is_done` (called with `cond` held) says that no more
    events can come. Blocking readers wait on `cond`; async readers register a listener that wakes
    their event loop, so neither polls."""

    def __init__(self, cond: threading.Condition, is_done: Callable[[], bool]):
        self._cond, self._is_done = cond, is_done
        self._events: list[Event] = []
        self._listeners: list[Callable[[], None]] = []

    def append(self, event: Event) -> None:
        """Log one event and wake the readers (caller holds `cond`)."""
        self._events.append(event)
        self.notify()

    def notify(self) -> None:
        """Wake every reader (caller holds `cond`)."""
        self._cond.notify_all()
        for listener in list(self._listeners):
            try:
                listener()
            except RuntimeError:  # its event loop is closed: the reader is gone
                self._listeners.remove(listener)

    def iter(self) -> Iterator[Event]:
        """Every event from the first, blocking for new ones until the state is done."""
        seen = 0

        def ready() -> bool:
            return len(self._events) > seen or self._is_done()

        while True:
            with self._cond:
                self._cond.wait_for(ready)
                batch, done = self._events[seen:], self._is_done()
            seen += len(batch)
            yield from batch
            if done:
                return

    async def aiter(self) -> AsyncIterator[Event]:
        """`iter` for an event loop: waits on an asyncio.Event set from the writer's thread."""
        loop = asyncio.get_running_loop()
        wake = asyncio.Event()

        def listener() -> None:
            loop.call_soon_threadsafe(wake.set)

        with self._cond:
            self._listeners.append(listener)
        seen = 0
        try:
            while True:
                wake.clear()  # before reading, so an event logged after the read sets it again
                with self._cond:  # held only to copy, never while waiting
                    batch, done = self._events[seen:], self._is_done()
                seen += len(batch)
                for event in batch:
                    yield event
                if done:
                    return
                if not batch:
                    await wake.wait()
        finally:
            with self._cond:
                if listener in self._listeners:
                    self._listeners.remove(listener)


class PieceFilter:
    """Turns the event stream into the text pieces `text_iter(var_name)` yields. With no name:
    every text piece, until the stream ends. With a name: the pieces that variable owns, ending
    at its first set; a value that arrived without text (`s[name] = "..."`) is yielded as its
    remaining text, and a value that is not text (a join's list) is yielded once as it is.
    `with_logprobs`: each piece as `(piece, entries)`, the [logprob, token_id, text] entries of
    the tokens it holds ([] for text no gen streamed logprobs for); a piece may be "" when its
    tokens' text is still incomplete."""

    def __init__(self, var_name: Any = None, with_logprobs: bool = False):
        self.var_name, self.with_logprobs = var_name, with_logprobs
        self._yielded = ""
        self.done = False

    def feed(self, event: Event) -> list[Any]:
        if self.done:
            return []
        if isinstance(event, TextEvent):
            if self.var_name is None or self.var_name in event.owners:
                self._yielded += event.text
                if self.with_logprobs:
                    entries = event.logprobs or []
                    return [(event.text, entries)] if event.text or entries else []
                return [event.text] if event.text else []
            return []
        if self.var_name is None or event.name != self.var_name:
            return []
        self.done = True
        value = event.value
        if not isinstance(value, str):
            return [] if self._yielded else [self._piece(value)]
        if value.startswith(self._yielded) and len(value) > len(self._yielded):
            return [self._piece(value[len(self._yielded):])]
        return []

    def _piece(self, value: Any) -> Any:
        return (value, []) if self.with_logprobs else value
