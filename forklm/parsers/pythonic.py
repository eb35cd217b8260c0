"""`pythonic` (Llama 3.2, Llama 4; SGLang's name): the reply is a Python list of calls with
keyword arguments, `[get_weather(city="Paris", days=3), get_time(tz="UTC")]`, maybe wrapped in
Llama 4's `<|python_start|>`/`<|python_end|>`. Values are Python literals, read into JSON
arguments that stream one parameter at a time, once its value is complete.

A reply is calls only when it starts with `[`; until a first call has a complete parameter (or
its `)`) the text is held, and if it turns out to be no call list (`[1, 2]`, a positional or
non-literal argument) all of it is content. Text that breaks the list after calls were emitted
is content from where it breaks; text after the closing `]` is dropped.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from forklm.parsers.calls import Schemas, ToolCallParser
from forklm.parsers.markup import MarkupStream, json_argument, literal_value

PYTHON_START = "<|python_start|>"
_KEYWORD = re.compile(r"\s*([A-Za-z_]\w*)\s*=(.*)", re.DOTALL)


class PythonicParser(ToolCallParser):
    name = "pythonic"

    def call_example(self) -> str:
        return "[<tool name>(<name>=<value>, ...), ...]"

    def stream(self, schemas: Schemas | None = None) -> PythonicStream:
        return PythonicStream()


class PythonicStream(MarkupStream):
    def __init__(self) -> None:
        super().__init__()
        self.state = self._start
        self.read: Callable[[str], bool] = self._before_name  # the list's reader of one char
        self.raw = ""  # text not yet emitted as call pieces: content if it breaks the list
        self.tentative = True  # no call emitted yet: everything is content if it breaks
        self.name = self.arg = ""
        self.num_args = 0
        self.opened = False  # the current call's first piece is out
        self.nesting = _Nesting()

    def _start(self) -> bool:
        head = self.text.lstrip()
        if not self.ended and PYTHON_START.startswith(head):
            return False  # empty, or maybe Llama 4's tag
        rest = head.removeprefix(PYTHON_START).lstrip()
        if not rest and not self.ended:
            return False
        if rest.startswith("["):
            self.raw, self.text = self.text[:len(self.text) - len(rest) + 1], rest[1:]
            self.state = self._list
        else:
            self.state = self._plain
        return True

    def _plain(self) -> bool:
        self.emit(self.text)
        self.text = ""
        return False

    def _list(self) -> bool:
        for at, ch in enumerate(self.text):
            self.raw += ch
            if not self.read(ch):
                self.text = self.text[at + 1:]
                self._broken()
                return True
            if self.state != self._list:  # the list closed
                self.text = self.text[at + 1:]
                return True
        self.text = ""
        if self.ended:
            self._cut_off()
        return False

    # -- one character of the list: False when it breaks the list ------------------------------
    def _before_name(self, ch: str) -> bool:
        if ch.isspace():
            return True
        if not (ch.isalpha() or ch == "_"):
            return False
        self.name, self.read = ch, self._name
        return True

    def _name(self, ch: str) -> bool:
        if ch.isalnum() or ch in "_.":
            self.name += ch
        elif ch.isspace() or ch == "(":
            self.read = self._after_name
            return self._after_name(ch)
        else:
            return False
        return True

    def _after_name(self, ch: str) -> bool:
        if ch == "(":
            self.arg, self.num_args, self.opened, self.nesting = "", 0, False, _Nesting()
            self.read = self._argument
        return ch == "(" or ch.isspace()

    def _argument(self, ch: str) -> bool:
        if not self.nesting.top or ch not in ",)":
            self.nesting.push(ch)
            self.arg += ch
            return True
        if self.arg.strip() and not self._add_argument():
            return False
        self.arg = ""
        if ch == ")":
            self._open()
            self.add_arguments("}" if self.num_args else "{}")
            self.close_call()
            self.raw, self.read = "", self._after_call
        return True

    def _after_call(self, ch: str) -> bool:
        if ch == ",":
            self.read = self._before_name
        elif ch == "]":
            self.state = self._dropped
        return ch in ",]" or ch.isspace()

    # -- emitting ------------------------------------------------------------------------------
    def _add_argument(self) -> bool:
        keyword = _KEYWORD.fullmatch(self.arg)
        if keyword is None:
            return False
        try:
            value = literal_value(keyword[2].strip())
        except ValueError:
            return False
        self._open()
        self.add_arguments(json_argument(keyword[1], value, first=not self.num_args))
        self.num_args += 1
        self.raw = ""
        return True

    def _open(self) -> None:
        if not self.opened:
            self.open_call(self.name)
            self.opened, self.tentative = True, False

    def _broken(self) -> None:
        """The text is no (more) call list: what was not emitted as calls is content."""
        self.emit(self.raw)
        self.raw = ""
        self.state = self._plain

    def _cut_off(self) -> None:
        """The text ended inside the list: a call with its name is a call cut off."""
        if self.read == self._argument:
            self._open()
        elif self.tentative:
            self.emit(self.raw)

    def _dropped(self) -> bool:
        self.text = ""
        return False


class _Nesting:
    """Where a Python expression is so far: inside a string literal, how deep in brackets."""

    def __init__(self) -> None:
        self.depth = 0
        self.quote: str | None = None
        self.escaped = False

    @property
    def top(self) -> bool:
        return self.depth == 0 and self.quote is None

    def push(self, ch: str) -> None:
        if self.quote is not None:
            if self.escaped:
                self.escaped = False
            elif ch == "\\":
                self.escaped = True
            elif ch == self.quote:
                self.quote = None
        elif ch in "'\"":
            self.quote = ch
        elif ch in "([{":
            self.depth += 1
        elif ch in ")]}":
            self.depth -= 1
