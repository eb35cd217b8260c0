"""Formats whose calls are tags around parameters written as text, read into JSON arguments:

- `qwen3_coder` (Qwen3-Coder, Qwen3.5): `<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE
  \\n</parameter>\\n</function>\\n</tool_call>`
- `glm45` (GLM-4.5, 4.6; 4.7 without the newlines): `<tool_call>NAME\\n<arg_key>KEY</arg_key>\\n
  <arg_value>VALUE</arg_value>\\n</tool_call>`

A value is typed by the tool's schema (`schemas`): a string parameter keeps its text (less one
newline at each edge, which the templates add), an enum's value is its choice less the
whitespace around it, any other is read as a JSON or Python literal, else kept as text. The
arguments stream one parameter at a time, once its value is closed: `{"city": "Paris"`, then
`, "days": 3`, then `}`. Content is the text before the first call;
text between and after calls is dropped; a call whose name does not read is content.
"""

from __future__ import annotations

import re
from typing import Any

from forklm.parsers.calls import Schemas, ToolCallParser, tag
from forklm.parsers.markup import MAX_HEADER_LEN, MarkupStream, json_argument, literal_value


class XmlFormat(ToolCallParser):
    """`name_pattern` reads a call's header (the text after `<tool_call>` up to the first of
    `header_ends`); a parameter is key_open KEY key_close [value_open] VALUE value_close;
    `body_close` ends the parameters."""

    call_open, call_close = "<tool_call>", "</tool_call>"
    triggers = (call_open,)
    header_ends: tuple[str, ...]
    name_pattern: re.Pattern[str]
    key_open = key_close = value_close = body_close = ""
    value_open: str | None = None

    def stream(self, schemas: Schemas | None = None) -> XmlCallStream:
        return XmlCallStream(self, schemas or {})


class Qwen3CoderParser(XmlFormat):
    name = "qwen3_coder"
    args_style = "qwen_xml"
    header_ends = (">",)
    name_pattern = re.compile(r"\s*<function=([^>\s]+)\s*")
    key_open, key_close, value_close = "<parameter=", ">", "</parameter>"
    body_close = "</function>"

    def tags(self, tool_name: str, args: dict[str, Any]) -> list[dict[str, Any]]:
        return [tag(f"<tool_call>\n<function={tool_name}>\n", args,
                    "\n</function>\n</tool_call>")]

    def call_example(self) -> str:
        return ("<tool_call>\n<function=<tool name>>\n<parameter=<name>>\n<value>\n"
                "</parameter>\n</function>\n</tool_call>")


class Glm45Parser(XmlFormat):
    name = "glm45"
    args_style = "glm_xml"
    special_tokens_in_text = True
    header_ends = ("\n", "<arg_key>", "</tool_call>")
    name_pattern = re.compile(r"\s*([^\s<>]+)\s*")
    key_open, key_close = "<arg_key>", "</arg_key>"
    value_open, value_close = "<arg_value>", "</arg_value>"
    body_close = "</tool_call>"

    def tags(self, tool_name: str, args: dict[str, Any]) -> list[dict[str, Any]]:
        return [tag(f"<tool_call>{tool_name}\n", args, "</tool_call>")]

    def call_example(self) -> str:
        return ("<tool_call><tool name>\n<arg_key><name></arg_key>\n<arg_value><value>"
                "</arg_value>\n</tool_call>")


class XmlCallStream(MarkupStream):
    def __init__(self, fmt: XmlFormat, schemas: Schemas):
        super().__init__()
        self.fmt, self.schemas = fmt, schemas
        self.closers = tuple(dict.fromkeys((fmt.body_close, fmt.call_close)))
        self.state = self._content
        self.raw = ""  # the current call's text while its header is read
        self.name = self.key = self.value = ""
        self.num_params = 0

    def _content(self) -> bool:
        if self.read_content(self.fmt.call_open) is None:
            return False
        self.raw, self.state = self.fmt.call_open, self._header
        return True

    def _header(self) -> bool:
        text, marker = self.until(*self.fmt.header_ends, self.fmt.call_close, keep=True)
        self.raw += text
        if marker is None and len(self.raw) <= MAX_HEADER_LEN:
            return False  # more to come (once ended: a call cut off, dropped)
        header = self.raw[len(self.fmt.call_open):]
        if marker == "\n" and not header.strip():  # a newline before the name
            self.raw += self.text[:1]
            self.text = self.text[1:]
            return True
        name = self.fmt.name_pattern.fullmatch(header) if marker in self.fmt.header_ends else None
        if name is None:
            self.emit(self.raw)
            self.state = self._malformed
            return True
        self.name, self.num_params = name[1], 0
        self.open_call(self.name)
        self.state = self._params
        return True

    def _params(self) -> bool:
        """Between parameters: text here (newlines, the header's `>`) is dropped."""
        _, marker = self.until(self.fmt.key_open, *self.closers)
        if marker == self.fmt.key_open:
            self.key, self.state = "", self._key
        elif marker is not None:
            self.add_arguments("}" if self.num_params else "{}")
            self.close_call()
            self.state = self._after
        return marker is not None

    def _key(self) -> bool:
        text, marker = self.until(self.fmt.key_close)
        self.key += text
        if marker is not None:
            self.value = ""
            self.state = self._value_open if self.fmt.value_open else self._value
        return marker is not None

    def _value_open(self) -> bool:
        assert self.fmt.value_open is not None
        _, marker = self.until(self.fmt.value_open, *self.closers, keep=True)
        if marker == self.fmt.value_open:
            self.text = self.text[len(marker):]
            self.state = self._value
        elif marker is not None:  # a key without a value: dropped
            self.state = self._params
        return marker is not None

    def _value(self) -> bool:
        text, marker = self.until(self.fmt.value_close, self.fmt.key_open, *self.closers,
                                  keep=True)
        self.value += text
        if marker is None:
            return False
        if marker == self.fmt.value_close:
            self.text = self.text[len(marker):]
        key = self.key.strip()
        value = typed_value(self.value, _parameter_schema(self.schemas, self.name, key))
        self.add_arguments(json_argument(key, value, first=not self.num_params))
        self.num_params += 1
        self.state = self._params
        return True

    def _after(self) -> bool:
        """After a call: text is dropped until the next one."""
        _, marker = self.until(self.fmt.call_open)
        if marker is not None:
            self.raw, self.state = marker, self._header
        return marker is not None

    def _malformed(self) -> bool:
        """A call that does not read: its text, to its end, is content."""
        text, end = self.until(self.fmt.call_close)
        self.emit(text + (end or ""))
        if end is not None:
            self.state = self._after
        return end is not None


def typed_value(text: str, schema: dict[str, Any] | None) -> Any:
    """A parameter's text as the JSON value its schema asks for."""
    text = text.removeprefix("\n").removesuffix("\n")
    if schema is not None and _is_free_text(schema):
        return text
    # Around other values whitespace is padding (xgrammar's XML styles allow it).
    if schema is not None and text.strip() in _string_choices(schema):
        return text.strip()
    try:
        return literal_value(text.strip())
    except ValueError:
        return text


def _is_free_text(schema: dict[str, Any]) -> bool:
    kind = schema.get("type")
    kinds = {kind} if isinstance(kind, str) else set(kind) if isinstance(kind, list) else set()
    return kinds - {"null"} == {"string"} and "enum" not in schema and "const" not in schema


def _string_choices(schema: dict[str, Any]) -> list[str]:
    choices = schema.get("enum")
    choices = [*(choices if isinstance(choices, list) else ()), schema.get("const")]
    return [c for c in choices if isinstance(c, str)]


def _parameter_schema(schemas: Schemas, tool: str, key: str) -> dict[str, Any] | None:
    properties = (schemas.get(tool) or {}).get("properties")
    schema = properties.get(key) if isinstance(properties, dict) else None
    return schema if isinstance(schema, dict) else None
