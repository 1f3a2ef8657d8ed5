"""TokenTrie against a dict-of-tuples model: insert, get, remove, longest_match, order and
node count (which catches a missed split, prune or merge)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from routeplay.rollout.token_trie import TokenTrie

Key = tuple[int, ...]

# A tiny alphabet and short keys, so keys share prefixes and split edges mid-way.
keys = st.lists(st.integers(0, 3), max_size=7).map(tuple)


def model_longest_match(model: dict[Key, int], query: Key) -> tuple[int, int | None, int | None]:
    matched = max(
        (m for k in model for m in range(len(query) + 1) if k[:m] == query[:m] and len(k) >= m),
        default=0,
    )
    prefix = query[:matched]
    order = {k: i for i, k in enumerate(model)}  # dict order = first insertion
    longer = [k for k in model if len(k) > matched and k[:matched] == prefix]
    below = min(longer, key=lambda k: (len(k), order[k]), default=None)
    return matched, model.get(prefix), None if below is None else model[below]


def model_node_count(model: dict[Key, int]) -> int:
    """Nodes of the compressed trie of the model's keys: every key, plus every non-empty
    prefix followed by two or more different tokens."""
    prefixes = {k[:i] for k in model for i in range(1, len(k) + 1)}
    nexts: dict[Key, set[int]] = {}
    for p in prefixes:
        nexts.setdefault(p[:-1], set()).add(p[-1])
    return sum(1 for p in prefixes if p in model or len(nexts.get(p, ())) >= 2)


class TrieMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.trie: TokenTrie[int] = TokenTrie()
        self.model: dict[Key, int] = {}
        self.counter = 0

    @rule(key=keys)
    def insert(self, key: Key) -> None:
        self.counter += 1
        assert self.trie.insert(key, self.counter) == self.model.get(key)
        self.model[key] = self.counter

    @rule(key=keys)
    def remove(self, key: Key) -> None:
        assert self.trie.remove(key) == self.model.pop(key, None)

    @rule(key=keys)
    def get(self, key: Key) -> None:
        assert self.trie.get(key) == self.model.get(key)

    @rule(query=keys)
    def longest_match(self, query: Key) -> None:
        assert self.trie.longest_match(query) == model_longest_match(self.model, query)

    @invariant()
    def same_contents_and_shape(self) -> None:
        assert len(self.trie) == len(self.model)
        assert self.trie.items() == list(self.model.items())
        assert self.trie.values() == list(self.model.values())
        assert self.trie.node_count() == model_node_count(self.model)


TestTrieMachine = TrieMachine.TestCase
TestTrieMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


@given(st.lists(keys, max_size=12), st.lists(keys, max_size=12), keys)
@settings(max_examples=150)
def test_any_inserts_then_removes_match_the_model(
    inserted: list[Key], removed: list[Key], query: Key
) -> None:
    trie: TokenTrie[int] = TokenTrie()
    model: dict[Key, int] = {}
    for value, key in enumerate(inserted):
        trie.insert(key, value)
        model[key] = value
    for key in removed:
        assert trie.remove(key) == model.pop(key, None)
    assert trie.items() == list(model.items())
    assert trie.longest_match(query) == model_longest_match(model, query)
    assert trie.node_count() == model_node_count(model)


def test_match_ending_inside_an_edge_offers_the_shortest_longer_key() -> None:
    trie: TokenTrie[str] = TokenTrie()
    trie.insert([1, 2, 3, 4, 5, 6], "long")
    trie.insert([1, 2, 3, 4], "short")  # splits the edge after 4
    trie.insert([1, 2, 3, 4, 9], "other")
    assert trie.longest_match([1, 2, 7]) == (2, None, "short")
    assert trie.longest_match([1, 2, 3, 4, 5, 0]) == (5, None, "long")
    assert trie.longest_match([1, 2, 3, 4]) == (4, "short", "other")  # "other": shorter
    assert trie.longest_match([1, 2, 3, 4, 5, 6, 7]) == (6, "long", None)
    assert trie.longest_match([8]) == (0, None, "short")
    assert trie.longest_match([]) == (0, None, "short")


def test_equally_short_keys_below_prefer_the_first_inserted() -> None:
    trie: TokenTrie[str] = TokenTrie()
    trie.insert([1, 3], "second-token-3")
    trie.insert([1, 2], "second-token-2")
    assert trie.longest_match([1]) == (1, None, "second-token-3")
    trie.insert([1, 3], "overwritten")  # an overwrite keeps its place
    assert trie.longest_match([1]) == (1, None, "overwritten")
    trie.remove([1, 3])
    trie.insert([1, 3], "reinserted")  # a removal does not
    assert trie.longest_match([1]) == (1, None, "second-token-2")


def test_overwrite_returns_the_old_value_and_keeps_one_node() -> None:
    trie: TokenTrie[str] = TokenTrie()
    assert trie.insert((5, 6, 7), "a") is None
    assert trie.insert((5, 6, 7), "b") == "a"
    assert (len(trie), trie.node_count(), trie.get((5, 6, 7))) == (1, 1, "b")


def test_remove_prunes_and_merges_chains() -> None:
    trie: TokenTrie[str] = TokenTrie()
    trie.insert([1, 2, 3], "a")
    trie.insert([1, 2, 4], "b")  # branch point at (1, 2)
    trie.insert([1, 2], "c")
    assert trie.node_count() == 3
    assert trie.remove([1, 2, 3]) == "a"
    assert trie.node_count() == 2
    assert trie.remove([1, 2]) == "c"  # (1, 2) merges into its only child
    assert trie.node_count() == 1
    assert trie.longest_match([1, 2, 4]) == (3, "b", None)
    assert trie.remove([1, 2, 4]) == "b"
    assert (len(trie), trie.node_count(), trie.items()) == (0, 0, [])


def test_missing_keys_are_not_found_or_removed() -> None:
    trie: TokenTrie[str] = TokenTrie()
    trie.insert([1, 2, 3], "a")
    assert trie.get([1, 2]) is None  # ends inside an edge
    assert trie.get([1, 2, 3, 4]) is None
    assert trie.remove([1, 2]) is None
    assert trie.remove([7]) is None
    assert trie.items() == [((1, 2, 3), "a")]


def test_numpy_tokens_are_plain_keys_and_floats_are_refused() -> None:
    trie: TokenTrie[str] = TokenTrie()
    trie.insert(np.array([3, 1, 4], dtype=np.int64), "pi")
    assert trie.get([3, 1, 4]) == "pi"
    assert all(type(t) is int for t in trie.items()[0][0])
    with pytest.raises(TypeError):
        trie.insert([1.0, 2.0], "floats")  # type: ignore[list-item]


def test_empty_key_lives_at_the_root() -> None:
    trie: TokenTrie[str] = TokenTrie()
    trie.insert([], "root")
    trie.insert([1], "one")
    assert trie.longest_match([2]) == (0, "root", "one")
    assert trie.remove([]) == "root"
    assert (len(trie), trie.node_count()) == (1, 1)
