"""The streaming SGLang decoder against the plain path (property tests).

``sglang.decode`` decodes base64 a slice of whole rows at a time and checks each slice in
cache. It must give exactly what the plain path gives (whole-string base64,
``np.frombuffer``, ``canonicalize``) on every valid payload, and refuse every corrupted
one with the same typed error. Slices are made tiny here (down to one row) so that every
payload crosses several slice boundaries, each at a 4-character base64 boundary.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import numpy.typing as npt
import pybase64
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from strategies import dense_specs, routing_arrays, specs

from routeplay.core import Routes, RouteSpec
from routeplay.core.formats import sglang
from routeplay.core.validate import canonicalize
from routeplay.errors import (
    DuplicateExperts,
    ExpertOutOfRange,
    MalformedPayload,
    RouteplayError,
    RowCountMismatch,
)

SETTINGS = settings(
    max_examples=80,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
SLICE_SIZES = st.sampled_from([1, 7, 64, 300, 4096, sglang.SLICE_BYTES])
"""Decoded bytes per slice: from one row per slice up to the default."""
REFUSALS = {"MalformedPayload", "RowCountMismatch", "ExpertOutOfRange", "DuplicateExperts"}
BASE64_CHARS = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"


@contextmanager
def slices_of(nbytes: int) -> Iterator[None]:
    """Run the decoder with ``nbytes`` decoded bytes per slice."""
    default = sglang.SLICE_BYTES
    sglang.SLICE_BYTES = nbytes
    try:
        yield
    finally:
        sglang.SLICE_BYTES = default


def wire_array(spec: RouteSpec, moe: npt.NDArray[Any], dense: int = 0) -> npt.NDArray[Any]:
    """What SGLang puts on the wire: every decoder layer, ``dense`` in the non-MoE ones."""
    wire = np.full((len(moe), spec.decoder_layers, spec.top_k), dense, dtype=np.int64)
    wire[:, list(spec.moe_layer_indices()), :] = moe
    return wire


def plain(payload: Any, spec: RouteSpec, layers: int, **kwargs: Any) -> Routes:
    """The reference: ``np.frombuffer`` of the whole string, then ``canonicalize``."""
    raw = pybase64.b64decode(payload, validate=True)
    array = np.frombuffer(raw, dtype="<i4").reshape(-1, layers, spec.top_k)
    return canonicalize(array, spec, **kwargs)


def outcome(call: Any) -> tuple[str, str] | Routes:
    """The result, or the routeplay error's type and message."""
    try:
        return call()  # type: ignore[no-any-return]
    except RouteplayError as exc:
        return type(exc).__name__, str(exc)


def check_same(fast: Routes, reference: Routes) -> None:
    assert fast.array.dtype == reference.array.dtype == fast.spec.dtype
    assert fast.array.shape == reference.array.shape
    np.testing.assert_array_equal(fast.array, reference.array)
    assert (fast.start_row, fast.source_dtype) == (reference.start_row, reference.source_dtype)
    assert fast.array.flags.c_contiguous
    assert not fast.array.flags.writeable
    with pytest.raises(ValueError, match="WRITEABLE"):
        fast.array.flags.writeable = True  # a view of a read-only base stays read-only


def detected(payload: Any, spec: RouteSpec, expected: int | None) -> bool:
    """Whether the streaming checks alone (before the plain path explains) refuse it."""
    plan = sglang._plan(payload, spec, expected)
    if plan is None:
        return True
    out = np.empty((plan.rows, spec.num_layers, spec.top_k), dtype=spec.dtype)
    return not sglang._fill(payload, plan, spec, out)


# --------------------------------------------------------------------------- valid payloads


@SETTINGS
@given(data=st.data())
def test_valid_payloads_decode_as_the_plain_path_does(data: st.DataObject) -> None:
    spec = data.draw(st.one_of(specs(), dense_specs()), label="spec")
    moe = data.draw(routing_arrays(spec), label="moe ids")
    all_layers = spec.decoder_layers != spec.num_layers and data.draw(st.booleans(), label="all")
    sent = wire_array(spec, moe) if all_layers else moe
    payload: str | bytes = sglang.encode(sent)
    if data.draw(st.booleans(), label="as bytes"):
        payload = payload.encode("ascii")
    start = data.draw(st.integers(0, 5), label="start_row")
    expected = data.draw(st.sampled_from([None, len(moe)]), label="expected")
    if all_layers:
        expected = len(moe)  # without counts, e.g. 2 rows x 1 layer = 1 row x 2 layers
    with slices_of(data.draw(SLICE_SIZES, label="slice bytes")):
        fast = sglang.decode(payload, spec, start_row=start, expected=expected)
        assert not detected(payload, spec, expected)  # the streaming path, no fallback
    reference = plain(payload, spec, sent.shape[1], start_row=start, expected=expected)
    check_same(fast, reference)
    np.testing.assert_array_equal(fast.array, moe)


def test_dense_layers_are_dropped_whatever_they_carry() -> None:
    # SGLang sends zero rows for dense layers; what they hold is never a MoE layer's ids.
    spec = RouteSpec(num_layers=2, top_k=2, num_experts=4, layer_map=(1, 3), total_layers=4)
    moe = np.array([[[0, 1], [2, 3]], [[3, 2], [1, 0]]] * 5)
    for dense in (0, -7, 99):
        with slices_of(16):
            routes = sglang.decode(sglang.encode(wire_array(spec, moe, dense)), spec, expected=10)
        np.testing.assert_array_equal(routes.array, moe)


def test_a_qwen3_235b_sized_payload_crosses_slices_at_base64_boundaries() -> None:
    # 3008 decoded bytes per row is not a multiple of 3: slices must hold 3n rows.
    spec = RouteSpec(num_layers=94, top_k=8, num_experts=128)
    rng = np.random.default_rng(3)
    moe = np.argsort(rng.random((1000, 94, 128)), axis=-1)[..., :8]
    with slices_of(3008 * 10):
        routes = sglang.decode(sglang.encode(moe), spec, expected=1000)
    np.testing.assert_array_equal(routes.array, moe)
    assert routes.array.dtype == np.uint8


# --------------------------------------------------------------------------- corrupted payloads


def _flip(payload: str, data: st.DataObject) -> str:
    at = data.draw(st.integers(0, len(payload) - 1), label="flip at")
    char = data.draw(st.sampled_from(BASE64_CHARS + "=!- \n\u00e9"), label="flip to")
    return payload[:at] + char + payload[at + 1 :]


def _truncate(payload: str, data: st.DataObject) -> str:
    cut = data.draw(st.integers(1, len(payload)), label="chars cut")
    return payload[: len(payload) - cut]


@SETTINGS
@given(data=st.data())
def test_corrupted_base64_is_refused_as_the_plain_path_refuses_it(data: st.DataObject) -> None:
    spec = data.draw(st.one_of(specs(), dense_specs()), label="spec")
    moe = data.draw(routing_arrays(spec, rows=st.integers(1, 30)), label="moe ids")
    all_layers = spec.decoder_layers != spec.num_layers and data.draw(st.booleans(), label="all")
    payload = sglang.encode(wire_array(spec, moe) if all_layers else moe)
    corrupt = data.draw(st.sampled_from([_flip, _truncate]), label="corruption")
    damaged = corrupt(payload, data)
    expected = data.draw(st.sampled_from([None, len(moe)]), label="expected")
    with slices_of(data.draw(SLICE_SIZES, label="slice bytes")):
        fast = outcome(lambda: sglang.decode(damaged, spec, expected=expected))
        caught = detected(damaged, spec, expected)
    reference = outcome(
        lambda: sglang._decode_plain(damaged, spec, start_row=0, expected=expected, where="")
    )
    if isinstance(reference, Routes):  # a flip to another valid char can still be valid data
        assert isinstance(fast, Routes)
        check_same(fast, reference)
        assert not caught
    else:
        assert fast == reference  # same type and the same message (absolute rows)
        assert caught
        assert reference[0] in REFUSALS


@SETTINGS
@given(data=st.data())
def test_bad_ids_are_refused_with_the_absolute_row_layer_and_slot(data: st.DataObject) -> None:
    spec = data.draw(st.one_of(specs(), dense_specs()), label="spec")
    moe = data.draw(routing_arrays(spec, rows=st.integers(1, 30)), label="moe ids")
    row = data.draw(st.integers(0, len(moe) - 1), label="row")
    layer = data.draw(st.integers(0, spec.num_layers - 1), label="layer")
    slot = data.draw(st.integers(0, spec.top_k - 1), label="slot")
    kind = data.draw(st.sampled_from(["too big", "negative", "duplicate"]), label="kind")
    if kind == "duplicate" and spec.top_k < 2:
        kind = "too big"
    bad = moe.copy()
    if kind == "too big":
        bad[row, layer, slot] = spec.num_experts + data.draw(
            st.integers(0, 2**31 - 1 - spec.num_experts)
        )
    elif kind == "negative":
        bad[row, layer, slot] = data.draw(st.integers(-(2**31), -1))
    else:
        bad[row, layer, slot] = bad[row, layer, (slot + 1) % spec.top_k]
    all_layers = spec.decoder_layers != spec.num_layers and data.draw(st.booleans(), label="all")
    sent = wire_array(spec, bad) if all_layers else bad
    payload = sglang.encode(sent)
    start = data.draw(st.integers(0, 100), label="start_row")
    error = DuplicateExperts if kind == "duplicate" else ExpertOutOfRange
    with slices_of(data.draw(SLICE_SIZES, label="slice bytes")):
        with pytest.raises(error) as caught:
            sglang.decode(payload, spec, start_row=start, expected=len(bad), where="sample 7")
        assert detected(payload, spec, len(bad))
    with pytest.raises(error) as reference:
        plain(payload, spec, sent.shape[1], start_row=start, expected=len(bad), where="sample 7")
    assert str(caught.value) == str(reference.value)
    # The planted id is the only bad one: named by absolute row, MoE layer (and slot).
    place = f"sample 7, row {start + row}, layer {layer}"
    assert caught.value.where == (place if kind == "duplicate" else f"{place}, slot {slot}")


def test_each_refusal_keeps_its_type() -> None:
    spec = RouteSpec(num_layers=2, top_k=2, num_experts=8)
    good = sglang.encode(np.array([[[0, 1], [2, 3]]] * 9))
    with slices_of(16):
        with pytest.raises(MalformedPayload, match="not valid base64"):
            sglang.decode(good[:-1], spec)
        with pytest.raises(MalformedPayload, match="not valid base64"):
            sglang.decode(good[:40] + "=" + good[41:], spec)  # padding mid-string
        # 3 rows x 16 bytes = 64 chars per slice: padding that ends a slice decodes short.
        for end in ("=", "=="):
            with pytest.raises(MalformedPayload, match="not valid base64"):
                sglang.decode(good[: 64 - len(end)] + end + good[64:], spec)
        with pytest.raises(MalformedPayload, match="does not fit"):
            sglang.decode(good[:-4], spec)  # 4 chars short: a valid string, not whole rows
        with pytest.raises(RowCountMismatch):
            sglang.decode(good, spec, expected=8)
        with pytest.raises(MalformedPayload, match="base64 string"):
            sglang.decode(12, spec)  # type: ignore[arg-type]
