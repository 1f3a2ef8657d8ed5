"""``bytes_equal``: the write path's prompt compare agrees with numpy's, on every path."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from unittest import mock

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from routeplay.core import bytes_equal as module
from routeplay.core.bytes_equal import bytes_equal

_DTYPES = [np.uint8, np.uint16, np.int32, np.int64]


@st.composite
def _pairs(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray]:
    """An integer array and another: a copy, one element changed, or reshaped."""
    dtype = draw(st.sampled_from(_DTYPES))
    shape = tuple(draw(st.lists(st.integers(0, 5), min_size=1, max_size=3)))
    seed = draw(st.integers(0, 2**32 - 1))
    a = np.random.default_rng(seed).integers(0, 100, size=shape).astype(dtype)
    b = a.copy()
    change = draw(st.sampled_from(["same", "one", "shape", "dtype"]))
    if change == "one" and b.size:
        at = draw(st.integers(0, b.size - 1))
        b.reshape(-1)[at] += 1
    elif change == "shape":
        b = b.reshape(-1)
    elif change == "dtype":
        b = b.astype(np.uint32 if dtype != np.uint32 else np.uint64)
    return a, b


PATHS = pytest.mark.parametrize("path", ["memcmp", "numpy"])


@contextlib.contextmanager
def _compared_by(path: str) -> Iterator[None]:
    """Each way it compares: the C library's memcmp, and numpy where none loads."""
    if path == "memcmp":
        assert module._memcmp() is not None  # Linux: the C library loads
        yield
        return
    with mock.patch.object(module, "_memcmp", return_value=None):
        yield


@PATHS
@given(pair=_pairs())
def test_it_agrees_with_numpy(pair: tuple[np.ndarray, np.ndarray], path: str) -> None:
    a, b = pair
    expected = a.shape == b.shape and a.dtype == b.dtype and bool(np.array_equal(a, b))
    with _compared_by(path):
        assert bytes_equal(a, b) is expected


@PATHS
@given(pair=_pairs(), step=st.integers(2, 3))
def test_strided_views_are_compared_by_value(
    pair: tuple[np.ndarray, np.ndarray], step: int, path: str
) -> None:
    a, b = pair
    if a.shape != b.shape or a.dtype != b.dtype:
        return
    with _compared_by(path):
        assert bytes_equal(a[::step], b[::step]) is bool(np.array_equal(a[::step], b[::step]))


def test_integer_rows_are_compared_by_memcmp_and_floats_by_numpy() -> None:
    """The fast path is taken where it is right, and only there: equal floats need not
    have equal bytes (-0.0), nor equal bytes equal floats (NaN)."""
    real = module._memcmp()
    assert real is not None
    calls: list[int] = []

    def counted(x: int, y: int, n: int) -> int:
        calls.append(n)
        return real(x, y, n)

    with mock.patch.object(module, "_memcmp", return_value=counted):
        rows = np.arange(24, dtype=np.uint16).reshape(2, 3, 4)
        assert bytes_equal(rows, rows.copy())
        assert calls == [rows.nbytes]
        assert bytes_equal(np.array([0.0]), np.array([-0.0]))
        assert not bytes_equal(np.array([np.nan]), np.array([np.nan]))
        assert calls == [rows.nbytes]  # the floats went to numpy


@PATHS
def test_a_difference_in_the_last_byte_is_seen(path: str) -> None:
    a = np.zeros((512, 48, 8), np.uint16)
    b = a.copy()
    b.reshape(-1).view(np.uint8)[-1] = 1  # the very last byte (a high byte)
    with _compared_by(path):
        assert not bytes_equal(a, b)
        assert bytes_equal(a, a.copy())
