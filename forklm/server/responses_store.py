"""The bounded in-memory store behind `previous_response_id`: the conversation of each stored
response (its history, input and output items), least recently used first out."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from forklm.server.responses_protocol import Item

# 1000 conversations, and at most 256 Mi characters charged in all: one full-size request
# (8 MiB body) is charged its whole conversation, so the budget alone holds >= 32 of those.
DEFAULT_MAX_RESPONSES = 1000
DEFAULT_MAX_CHARS = 256 * 1024 * 1024


@dataclass(frozen=True)
class StoredResponse:
    conversation: tuple[Item, ...]  # oldest first; instructions are not carried over (as OpenAI)
    num_chars: int
    owner: str = ""  # the API key name that stored it: only that key continues it


def conversation_chars(items: tuple[Item, ...]) -> int:
    """The text a conversation holds: what the store charges for it."""
    total = 0
    for item in items:
        if item.type == "function_call":
            total += len(item.name) + len(item.arguments)
        else:
            total += len(item.text)
    return total


class ResponseStore:
    """LRU of response id -> StoredResponse, bounded in count and in characters. A response is
    charged its whole conversation although later ones share the strings of earlier ones, so
    the charge overestimates memory, never underestimates it. Used from the event loop only."""

    def __init__(self, max_responses: int = DEFAULT_MAX_RESPONSES,
                 max_chars: int = DEFAULT_MAX_CHARS):
        assert max_responses >= 1 and max_chars >= 1, (max_responses, max_chars)
        self.max_responses, self.max_chars = max_responses, max_chars
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self.num_chars = 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, response_id: str) -> StoredResponse | None:
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def put(self, response_id: str, conversation: tuple[Item, ...], owner: str = "") -> None:
        """Store a conversation; one too large for the whole budget is not stored at all."""
        entry = StoredResponse(conversation, conversation_chars(conversation), owner)
        if entry.num_chars > self.max_chars:
            return
        self._drop(response_id)
        self._entries[response_id] = entry
        self.num_chars += entry.num_chars
        while len(self._entries) > self.max_responses or self.num_chars > self.max_chars:
            self._drop(next(iter(self._entries)))

    def _drop(self, response_id: str) -> None:
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            self.num_chars -= entry.num_chars
