"""``TokenTrie``: a radix trie keyed by token-id sequences, pure Python (no Ray, no numpy).

A trace session stores one value per token sequence it has seen; later turns extend
earlier ones, so keys share long prefixes. Edges carry tuples of token ids, so a chain
of single-child nodes costs one node, and a node is split only where two keys diverge.

Invariants (kept by every operation, checked against a dict model in the tests):
- the root has the empty edge; every other node has a non-empty edge and sits in its
  parent's ``children`` under the first token of that edge;
- every non-root node holds a value or has at least two children: no empty leaves and
  no chains of valueless single-child nodes (``remove`` prunes and merges);
- ``len(trie)`` is the number of values; each value keeps the serial number of its
  key's first insertion (an overwrite keeps it), which makes ``items()`` order and the
  choice among equally short keys in ``longest_match`` deterministic.
"""

from __future__ import annotations

import heapq
import itertools
import operator
from collections.abc import Iterable, Iterator
from typing import Generic, TypeVar

__all__ = ["TokenKey", "TokenTrie", "as_key"]

V = TypeVar("V")
TokenKey = tuple[int, ...]


def as_key(tokens: Iterable[int]) -> TokenKey:
    """Token ids as a tuple of ints (numpy integers are accepted, floats are refused)."""
    return tuple(map(operator.index, tokens))


class _Entry(Generic[V]):
    __slots__ = ("serial", "value")

    def __init__(self, value: V, serial: int) -> None:
        self.value = value
        self.serial = serial


class _Node(Generic[V]):
    __slots__ = ("children", "edge", "entry")

    def __init__(self, edge: TokenKey) -> None:
        self.edge = edge
        self.children: dict[int, _Node[V]] = {}
        self.entry: _Entry[V] | None = None


class TokenTrie(Generic[V]):
    """Values keyed by token-id sequences, with longest-prefix lookup."""

    def __init__(self) -> None:
        self._root: _Node[V] = _Node(())
        self._size = 0
        self._serials = itertools.count()

    def __len__(self) -> int:
        return self._size

    # -- writing ----------------------------------------------------------------------
    def insert(self, tokens: Iterable[int], value: V) -> V | None:
        """Store ``value`` under ``tokens``; returns the value it replaced, if any."""
        key = as_key(tokens)
        node, i = self._root, 0
        while i < len(key):
            child = node.children.get(key[i])
            if child is None:
                child = node.children[key[i]] = _Node(key[i:])
            shared = _common(child.edge, key, i)
            if shared < len(child.edge):
                child = self._split(node, child, shared)
            node, i = child, i + shared
        return self._set(node, value)

    def remove(self, tokens: Iterable[int]) -> V | None:
        """Drop the value stored under exactly ``tokens``; returns it (None if absent)."""
        key = as_key(tokens)
        path, matched, inside = self._descend(key)
        node = path[-1]
        if inside is not None or matched < len(key) or node.entry is None:
            return None
        old, node.entry = node.entry, None
        self._size -= 1
        self._prune(path)
        return old.value

    # -- reading ----------------------------------------------------------------------
    def get(self, tokens: Iterable[int]) -> V | None:
        """The value stored under exactly ``tokens``, or None."""
        entry = self._exact(as_key(tokens))
        return None if entry is None else entry.value

    def longest_match(self, tokens: Iterable[int]) -> tuple[int, V | None, V | None]:
        """``(matched, exact, below)`` for the longest prefix of ``tokens`` in the trie.

        ``matched`` counts the leading tokens of the query that some key starts with (the
        match may end inside an edge); ``exact`` is the value stored under exactly those
        tokens; ``below`` is a value whose key strictly extends them: the shortest such
        key, the first inserted among equally short ones.
        """
        path, matched, inside = self._descend(as_key(tokens))
        if inside is not None:
            depth = sum(len(n.edge) for n in path) + len(inside.edge)
            return matched, None, _shallowest([(depth, inside)])
        node = path[-1]
        below = _shallowest((matched + len(c.edge), c) for c in node.children.values())
        return matched, None if node.entry is None else node.entry.value, below

    def items(self) -> list[tuple[TokenKey, V]]:
        """Every (key, value), in order of each key's first insertion."""
        found = sorted(_walk(self._root, ()), key=lambda kv: kv[1].serial)
        return [(key, entry.value) for key, entry in found]

    def values(self) -> list[V]:
        """Every value, in order of each key's first insertion."""
        entries = [node.entry for node in _nodes(self._root) if node.entry is not None]
        return [entry.value for entry in sorted(entries, key=lambda e: e.serial)]

    def node_count(self) -> int:
        """Nodes below the root (values plus branch points), a measure of trie size."""
        return sum(1 for _ in _nodes(self._root)) - 1

    # -- internals --------------------------------------------------------------------
    def _set(self, node: _Node[V], value: V) -> V | None:
        old = node.entry
        if old is None:
            self._size += 1
            node.entry = _Entry(value, next(self._serials))
            return None
        node.entry = _Entry(value, old.serial)
        return old.value

    @staticmethod
    def _split(parent: _Node[V], child: _Node[V], at: int) -> _Node[V]:
        middle: _Node[V] = _Node(child.edge[:at])
        child.edge = child.edge[at:]
        middle.children[child.edge[0]] = child
        parent.children[middle.edge[0]] = middle
        return middle

    def _descend(self, key: TokenKey) -> tuple[list[_Node[V]], int, _Node[V] | None]:
        """Nodes whose whole edge matches, tokens matched, and the node whose edge the
        match ends inside (None when it ends exactly on the last node of the path)."""
        path, i = [self._root], 0
        while i < len(key):
            child = path[-1].children.get(key[i])
            if child is None:
                break
            shared = _common(child.edge, key, i)
            if shared < len(child.edge):
                return path, i + shared, child
            path.append(child)
            i += shared
        return path, i, None

    def _exact(self, key: TokenKey) -> _Entry[V] | None:
        path, matched, inside = self._descend(key)
        return path[-1].entry if inside is None and matched == len(key) else None

    def _prune(self, path: list[_Node[V]]) -> None:
        """Restore the invariants after ``path[-1]`` lost its value."""
        node = path[-1]
        if node is self._root:
            return
        parent = path[-2]
        if node.children:
            if len(node.children) == 1:
                _merge(parent, node)
            return
        del parent.children[node.edge[0]]
        if parent is not self._root and parent.entry is None and len(parent.children) == 1:
            _merge(path[-3], parent)


def _common(edge: TokenKey, key: TokenKey, start: int) -> int:
    """Length of the common prefix of ``edge`` and ``key[start:]``."""
    if key[start : start + len(edge)] == edge:  # the usual case, compared in C
        return len(edge)
    n = 0
    for a, b in zip(edge, key[start:], strict=False):
        if a != b:
            break
        n += 1
    return n


def _merge(parent: _Node[V], node: _Node[V]) -> None:
    """Fold a valueless single-child ``node`` into its child."""
    [child] = node.children.values()
    child.edge = node.edge + child.edge
    parent.children[child.edge[0]] = child


def _shallowest(starts: Iterable[tuple[int, _Node[V]]]) -> V | None:
    """Value of the shortest key at or below the start nodes (given with their key
    lengths), the first inserted among equally short keys."""
    order = itertools.count()  # breaks ties between valueless nodes, never compares nodes
    heap = [(depth, _serial(node), next(order), node) for depth, node in starts]
    heapq.heapify(heap)
    while heap:
        depth, _, _, node = heapq.heappop(heap)
        if node.entry is not None:
            return node.entry.value
        for child in node.children.values():
            item = (depth + len(child.edge), _serial(child), next(order), child)
            heapq.heappush(heap, item)
    return None


def _serial(node: _Node[V]) -> float:
    # Valueless nodes sort after values of the same depth; their subtrees lie deeper.
    return float("inf") if node.entry is None else node.entry.serial


def _walk(root: _Node[V], prefix: TokenKey) -> Iterator[tuple[TokenKey, _Entry[V]]]:
    # Iterative: a session of many turns nests one level per turn.
    stack = [(prefix + root.edge, root)]
    while stack:
        key, node = stack.pop()
        if node.entry is not None:
            yield key, node.entry
        stack.extend((key + child.edge, child) for child in node.children.values())


def _nodes(root: _Node[V]) -> Iterator[_Node[V]]:
    stack = [root]
    while stack:
        node = stack.pop()
        yield node
        stack.extend(node.children.values())
