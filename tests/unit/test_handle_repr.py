"""A handle prints as what it covers (rows, geometry, where the rows live), never as
the routing it carries: ``repr`` of an inline handle once dumped its numpy array."""

from __future__ import annotations

import numpy as np

from routeplay.core import EngineKey, Handle, InlineSource, RouteSpec, Segment, StoreRef

SPEC = RouteSpec(num_layers=3, top_k=2, num_experts=8)


def _inline(rows: int) -> Segment:
    array = np.arange(rows * 6, dtype=np.uint8).reshape(rows, 3, 2) % 8
    return Segment(source=InlineSource(array=array), start=0, stop=rows, spec=SPEC)


def test_an_inline_handle_prints_its_rows_not_its_array() -> None:
    handle = Handle.of(_inline(1000))
    text = repr(handle)
    assert text == (
        "Handle(inline, rows=1000, layers=3, top_k=2, segments=1, sources=[inline 1000 rows])"
    )
    assert len(text) < 300
    assert "array" not in text
    assert str(handle) == text


def test_a_handle_of_many_sources_stays_short() -> None:
    ref = StoreRef(payload_id="0." + "ab" * 16, run="demo-0a0a0a0a", rows=40)
    key = EngineKey(key="cd" * 28, rows=10)
    segments = [
        Segment(source=ref, start=0, stop=40, spec=SPEC),
        Segment(source=key, start=0, stop=10, spec=SPEC),
        *(_inline(7) for _ in range(200)),
    ]
    text = repr(Handle(SPEC, segments))
    assert len(text) < 300
    assert text.startswith("Handle(mixed, rows=1450, layers=3, top_k=2, segments=202, ")
    assert "store 0.ababababab... (40 rows)" in text
    assert "key cdcdcdcdcdcd... (10 rows)" in text
    assert "... 199 more" in text


def test_an_empty_handle() -> None:
    assert repr(Handle(SPEC)) == (
        "Handle(empty, rows=0, layers=3, top_k=2, segments=0, sources=[])"
    )
