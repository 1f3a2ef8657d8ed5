"""Every bad input the fuzzing campaign of issue 12 found is a typed refusal, in bounded
memory: non-object elements, deep nesting in error messages, hostile .npy headers, long
strings among LMDeploy ids, keys whose counts imply -1 rows, oversized counts, and
``routeplay inspect`` on JSON its parser cannot hold."""

from __future__ import annotations

import json
import struct
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from bodies import KEY, SPEC, routing

from routeplay.cli.main import main
from routeplay.core import RouteSpec, preset, read_response
from routeplay.core.formats import lmdeploy, vllm
from routeplay.core.formats.npy import read_npy
from routeplay.core.wires import Engine, read_stream
from routeplay.errors import (
    DtypeError,
    MalformedPayload,
    RouteplayError,
    RowCountMismatch,
    UnsafePayload,
    describe,
)


def _deep(depth: int) -> list[Any]:
    root: list[Any] = []
    node = root
    for _ in range(depth):
        node.append([])
        node = node[0]
    return root


# --------------------------------------------------------------------------- describe


def test_describe_is_bounded_on_deep_long_and_huge_values() -> None:
    for value in (_deep(200_000), "x" * 10_000_000, 10**100_000, [list(range(10**5))] * 10**3):
        text = describe(value)
        assert len(text) <= 420
    assert describe([1, 2, 3]) == "[1, 2, 3]"
    assert "more" not in describe("short")
    assert "10000000 chars" in describe("x" * 10_000_000)
    assert "digits" in describe(10**100_000)


def test_an_error_built_from_a_deep_value_prints() -> None:
    error = MalformedPayload("bad", expected="a list", found=_deep(100_000), where="w")
    assert len(str(error)) < 600
    assert error.found is not None  # the value itself stays on the error


# --------------------------------------------------------------------------- bodies


@pytest.mark.parametrize(
    ("engine", "body"),
    [
        ("sglang", {"meta_info": 5}),
        ("sglang", {"meta_info": {"prompt_tokens": 3, "routed_experts": ["x"]}}),
        ("sglang", {"choices": [5], "sglext": {"routed_experts": "AAAA"}, "usage": 7}),
        ("sglang", {"choices": [{"meta_info": 5}]}),
        ("sglang", {"choices": [], "sglext": 5}),
        ("sglang", [5, "x"]),
        ("vllm", {"choices": [5], "usage": {"prompt_tokens": 1}}),
        ("vllm", {"choices": [{"routed_experts": "AAAA"}], "usage": [1, 2]}),
        ("vllm", {"choices": "abc"}),
        ("lmdeploy", {"meta_info": [1, 2]}),
        ("lmdeploy", {"choices": [None]}),
        ("lmdeploy", {"routed_experts": [[[1, 2]]], "usage": "x"}),
    ],
)
def test_non_object_elements_are_malformed(engine: str, body: Any) -> None:
    with pytest.raises(MalformedPayload):
        read_response(engine, body, SPEC)


def test_stream_chunks_that_are_not_objects_are_malformed() -> None:
    for engine in Engine:
        with pytest.raises(MalformedPayload):
            read_stream(engine, [5, {"choices": [7]}], SPEC)


def test_counts_beyond_64_bits_are_malformed() -> None:
    body = {"meta_info": {"prompt_tokens": 10**5000, "completion_tokens": 1}}
    body["meta_info"]["routed_experts"] = lmdeploy.encode_lists(routing(6))
    with pytest.raises(MalformedPayload, match="non-negative integer") as info:
        read_response("lmdeploy", body, SPEC)
    assert "digits" in str(info.value)


@pytest.mark.parametrize("engine", ["lmdeploy", "sglang"])
def test_a_key_whose_counts_imply_minus_one_rows_is_refused(engine: str) -> None:
    body = {"meta_info": {"prompt_tokens": 0, "completion_tokens": 0, "routed_experts": KEY}}
    with pytest.raises(RowCountMismatch, match="negative row count"):
        read_response(engine, body, SPEC)


# --------------------------------------------------------------------------- npy


def _npy(header: str, data: bytes = b"") -> bytes:
    text = header.encode()
    text += b" " * (64 - (10 + len(text) + 1) % 64) + b"\n"
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(text)) + text + data


@pytest.mark.parametrize(
    ("header", "cls"),
    [
        ("{'descr': '<u1', 'fortran_order': False, 'shape': (2,", MalformedPayload),
        ("{'descr': '<u1', 'fortran_order': False, 'shape': (" + "-" * 5000 + "1,)}", None),
        (f"{{'descr': '<u1', 'fortran_order': False, 'shape': (0, {2**63}), }}", None),
        (f"{{'descr': '<u1', 'fortran_order': False, 'shape': (0, {2**40}, {2**40}), }}", None),
        (f"{{'descr': '<i8', 'fortran_order': True, 'shape': (0, {2**62}, 4), }}", None),
        ("{'descr': '(2,)<u1', 'fortran_order': False, 'shape': (3,), }", UnsafePayload),
        ("{'descr': [('a', '<u1')], 'fortran_order': False, 'shape': (3,), }", UnsafePayload),
        ("{'descr': '<u1', 'fortran_order': False, 'shape': " + "(" * 3000 + "}", None),
    ],
    ids=[
        "truncated",
        "unary-minus",
        "zero-size-2**63",
        "zero-size-2**80",
        "zero-size-itemsize",
        "subarray",
        "record",
        "deep-parens",
    ],
)
def test_hostile_npy_headers_are_typed(header: str, cls: type[RouteplayError] | None) -> None:
    with pytest.raises(cls or MalformedPayload):
        read_npy(_npy(header, b"\x00" * 6))


# --------------------------------------------------------------------------- LMDeploy lists


def test_a_long_string_among_lmdeploy_ids_is_refused_without_allocating_for_it() -> None:
    spec = preset("qwen3-235b-a22b")
    lists: list[Any] = np.zeros((2, 94, 8), np.uint16).tolist()
    lists[1][50][3] = "x" * 4_000_000  # numpy would build a <U4000000 array of 1504 cells
    tracemalloc.start()
    try:
        with pytest.raises(MalformedPayload, match="type str"):
            lmdeploy.decode_lists(lists, spec)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"{peak} bytes allocated to refuse the body"


@pytest.mark.parametrize(
    ("leaf", "cls"),
    [(True, DtypeError), (1.0, DtypeError), (None, MalformedPayload), ([1], MalformedPayload)],
)
def test_one_bad_leaf_is_refused_before_conversion(leaf: object, cls: type[Exception]) -> None:
    lists: list[Any] = lmdeploy.encode_lists(routing(6))
    lists[5][2][1] = leaf
    with pytest.raises(cls):
        lmdeploy.decode_lists(lists, SPEC)


def test_nesting_errors_name_the_shape() -> None:
    for bad in ([1, 2], [[1, 2]], [[[1, 2]] * 3, [[1, 2]] * 2], [[[1, 2]] * 3, [[1], [2], [3]]]):
        with pytest.raises(MalformedPayload, match=r"\[T\]\[3\]\[2\]"):
            lmdeploy.decode_lists(bad, SPEC)


def test_valid_lists_still_decode_with_dense_layers() -> None:
    spec = RouteSpec(num_layers=2, top_k=2, num_experts=8, layer_map=(1, 3), total_layers=4)
    wire = np.zeros((5, 4, 2), np.uint16)
    wire[:, :, 1] = 1
    wire[:, [1, 3], :] = [3, 6]
    routes = lmdeploy.decode_lists(wire.tolist(), spec, expected=5)
    assert routes.array.shape == (5, 2, 2)
    assert (routes.array == [3, 6]).all()


def test_a_vllm_npy_of_subarrays_is_unsafe() -> None:
    raw = _npy("{'descr': '(2,)<u1', 'fortran_order': False, 'shape': (3,), }", b"\x00" * 6)
    import base64

    with pytest.raises(UnsafePayload):
        vllm.decode(base64.b64encode(raw).decode(), SPEC)


# --------------------------------------------------------------------------- inspect


@pytest.mark.parametrize(
    "text",
    ["[" * 100_000 + "]" * 100_000, '{"meta_info": {"prompt_tokens": ' + "7" * 5000 + "}}"],
    ids=["nested-100000", "int-5000-digits"],
)
def test_inspect_refuses_json_its_parser_cannot_hold(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str
) -> None:
    path = tmp_path / "body.json"
    path.write_text(text)
    args = ["inspect", str(path), "--engine", "sglang", "--preset", "qwen3-30b-a3b", "--json"]
    assert main(args) == 2
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report == {"ok": False, "error": "MalformedPayload", "message": report["message"]}
