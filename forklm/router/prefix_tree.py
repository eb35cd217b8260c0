"""PrefixTree: an approximate, character-level radix tree of the prompts sent to one replica, so
the router can guess which replica's radix cache holds a new prompt's prefix. It never sees the
replica's real cache (which evicts on its own); it only remembers what was sent, LRU-bounded."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field


@dataclass(eq=False)
class _Node:
    edge: str  # the characters from the parent to this node
    parent: _Node | None
    children: dict[str, _Node] = field(default_factory=dict)  # first char of edge -> child
    last_used: int = 0


class PrefixTree:
    """Strings inserted, matched by longest common prefix, pruned to at most max_chars characters
    (the sum of edge lengths) by evicting least recently used leaves.

    Contract: match(p) <= len(p); after insert(p) (and before any prune), match(p) == len(p);
    after prune(), size <= max_chars."""

    def __init__(self, max_chars: int):
        assert max_chars >= 0, max_chars
        self.max_chars = max_chars
        self.root = _Node("", None)
        self.size = 0  # characters held, the sum of all edge lengths
        self._clock = itertools.count(1)

    def match(self, text: str) -> int:
        """Length of the longest prefix of `text` the tree holds; touches the matched path."""
        node, pos, now = self.root, 0, next(self._clock)
        while pos < len(text):
            child = node.children.get(text[pos])
            if child is None:
                break
            common = _common_len(child.edge, text, pos)
            child.last_used = now
            pos += common
            if common < len(child.edge):
                break
            node = child
        return pos

    def insert(self, text: str) -> None:
        """Add `text` (splitting an edge where it diverges); marks its path most recently used."""
        node, pos, now = self.root, 0, next(self._clock)
        node.last_used = now
        while pos < len(text):
            child = node.children.get(text[pos])
            if child is None:
                node.children[text[pos]] = _Node(text[pos:], node, last_used=now)
                self.size += len(text) - pos
                return
            common = _common_len(child.edge, text, pos)
            if common < len(child.edge):
                child = self._split(child, common)
            child.last_used = now
            node, pos = child, pos + common

    def prune(self) -> None:
        """Evict least recently used leaves (a whole leaf edge at a time) until size <= max_chars."""
        if self.size <= self.max_chars:
            return
        leaves = sorted(self._leaves(), key=lambda n: n.last_used)
        while self.size > self.max_chars and leaves:
            leaf = leaves.pop(0)
            parent = leaf.parent
            assert parent is not None
            del parent.children[leaf.edge[0]]
            self.size -= len(leaf.edge)
            if parent is not self.root and not parent.children:
                # the parent became a leaf: it goes in the queue by its own age
                index = next((i for i, n in enumerate(leaves) if n.last_used > parent.last_used),
                             len(leaves))
                leaves.insert(index, parent)

    def check_invariants(self) -> None:
        total, stack = 0, [self.root]
        while stack:
            node = stack.pop()
            for first, child in node.children.items():
                assert child.edge and child.edge[0] == first and child.parent is node, child.edge
                total += len(child.edge)
                stack.append(child)
        assert total == self.size, (total, self.size)

    def _split(self, child: _Node, at: int) -> _Node:
        """Cut child's edge at `at`: a new middle node holds edge[:at], child keeps the rest."""
        parent = child.parent
        assert parent is not None and 0 < at < len(child.edge)
        middle = _Node(child.edge[:at], parent, last_used=child.last_used)
        parent.children[middle.edge[0]] = middle
        child.edge, child.parent = child.edge[at:], middle
        middle.children[child.edge[0]] = child
        return middle

    def _leaves(self) -> list[_Node]:
        out, stack = [], [self.root]
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            elif node is not self.root:
                out.append(node)
        return out


def _common_len(edge: str, text: str, pos: int) -> int:
    n = min(len(edge), len(text) - pos)
    i = 0
    while i < n and edge[i] == text[pos + i]:
        i += 1
    return i
