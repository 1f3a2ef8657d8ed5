"""Every way an engine payload can be wrong is refused with the exact error class.

Each refusal must be a ``RoutesDataError`` (hence a ``ValueError``) of one precise
subclass, and its message must say where the problem is, what was expected and what
was found, so that one log line tells what to fix. Unsafe payloads (pickles, object
arrays) must be refused without executing anything: their trap would create a file.
"""

from __future__ import annotations

import base64
import io
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from bodies import (
    BAD_CASE_NAMES,
    KEY,
    SPEC,
    MarkerTrap,
    b64,
    bad_cases,
    lmdeploy_generate,
    npy_b64,
    object_npy_b64,
    pickle_b64,
    routing,
    sglang_generate,
    vllm_completion,
)

from routeplay import errors
from routeplay.core import RouteSpec, read_response
from routeplay.core.formats import lmdeploy, sglang, vllm
from routeplay.core.formats.npy import read_npy
from routeplay.errors import (
    DtypeError,
    DuplicateExperts,
    ExpertOutOfRange,
    MalformedPayload,
    MisuseError,
    RoutesDataError,
    RowCountMismatch,
    SpecMismatch,
    UnsafePayload,
)

REFUSALS = (
    MalformedPayload,
    UnsafePayload,
    DtypeError,
    SpecMismatch,
    RowCountMismatch,
    ExpertOutOfRange,
    DuplicateExperts,
)


def check_refusal(
    exc: BaseException, cls: type[RoutesDataError], *mentions: str
) -> RoutesDataError:
    """``exc`` is exactly ``cls`` and its message names where, expected, found and ``mentions``."""
    assert type(exc) is cls, f"{type(exc).__name__} raised, {cls.__name__} expected: {exc}"
    assert isinstance(exc, ValueError)
    assert isinstance(exc, RoutesDataError)
    message = str(exc)
    assert exc.where, message
    assert exc.expected is not None, message
    assert exc.found is not None, message
    assert f"at {exc.where}" in message
    assert f"expected {exc.expected}" in message
    assert f"found {exc.found}" in message
    for text in mentions:
        assert text in message, f"{text!r} not in {message!r}"
    return exc


# --- the error tree -------------------------------------------------------------------


@pytest.mark.parametrize("cls", REFUSALS, ids=lambda c: c.__name__)
def test_every_refusal_is_a_value_error_and_routes_data_error(cls: type[Exception]) -> None:
    assert issubclass(cls, ValueError)
    assert issubclass(cls, RoutesDataError)
    assert issubclass(cls, errors.RouteplayError)
    assert not issubclass(cls, errors.MisuseError)
    assert not issubclass(cls, errors.LifetimeError)


def test_unsafe_payload_is_a_malformed_payload() -> None:
    assert issubclass(UnsafePayload, MalformedPayload)


def test_message_joins_summary_where_expected_found_and_hint() -> None:
    err = DtypeError("bad", expected="int", found="float", where="here", hint="Fix it.")
    assert str(err) == "bad; at here; expected int; found float. Fix it."
    assert (err.expected, err.found, err.where, err.hint) == ("int", "float", "here", "Fix it.")


# --- one test per case of the shared table (also run through the CLI) ------------------


@pytest.mark.parametrize("name", BAD_CASE_NAMES)
def test_bad_body_is_refused_with_exact_class_and_message(name: str, tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    case = bad_cases(marker)[name]
    with pytest.raises(RoutesDataError) as info:
        read_response(case.engine, case.body, case.spec, start_row=case.start_row)
    check_refusal(info.value, case.error, *case.mentions)
    assert not marker.exists()


# --- row counts ---------------------------------------------------------------------------


def test_one_row_too_many_names_both_counts_and_the_likely_cause() -> None:
    body = vllm_completion(vllm.encode(routing(7), SPEC), prompt=4, completion=3)
    with pytest.raises(RowCountMismatch) as info:
        read_response("vllm", body, SPEC)
    check_refusal(info.value, RowCountMismatch, "expected 6 rows", "found 7 rows", "last generated")


def test_one_row_too_few_is_refused() -> None:
    body = vllm_completion(vllm.encode(routing(5), SPEC), prompt=4, completion=3)
    with pytest.raises(RowCountMismatch) as info:
        read_response("vllm", body, SPEC)
    check_refusal(info.value, RowCountMismatch, "expected 6 rows", "found 5 rows")


def test_row_count_refusal_from_in_process_outputs() -> None:
    full = routing(7)
    with pytest.raises(RowCountMismatch) as info:
        vllm.from_outputs(full[:4], full[4:], SPEC, expected=6, where="req-1")
    check_refusal(info.value, RowCountMismatch, "at req-1", "expected 6 rows", "found 7 rows")


@pytest.mark.parametrize("extra", [1, -1], ids=["too-many", "too-few"])
def test_sglang_off_by_one_rows_are_refused(extra: int) -> None:
    full = routing(8)
    start = 2
    rows = 4 + extra  # expected: 4 + 3 - 1 - 2 = 4 rows after start
    body = sglang_generate(
        sglang.encode(full[: start + rows], start_row=start), prompt=4, completion=3
    )
    with pytest.raises(RoutesDataError) as info:
        read_response("sglang", body, SPEC, start_row=start)
    exc = info.value
    assert isinstance(exc, ValueError)
    message = str(exc)
    assert "expected 4 rows" in message
    assert f"found {rows} rows" in message
    assert "sglang meta_info.routed_experts" in message


@pytest.mark.parametrize("extra", [1, -1], ids=["too-many", "too-few"])
def test_sglang_off_by_one_rows_raise_row_count_mismatch(extra: int) -> None:
    full = routing(8)
    body = sglang_generate(sglang.encode(full[: 6 + extra], start_row=2), prompt=4, completion=3)
    with pytest.raises(RowCountMismatch):
        read_response("sglang", body, SPEC, start_row=2)


# --- geometry -----------------------------------------------------------------------------


def test_wrong_layer_count_is_a_spec_mismatch() -> None:
    other = RouteSpec(num_layers=2, top_k=2, num_experts=8)
    with pytest.raises(SpecMismatch) as info:
        vllm.decode(vllm.encode(routing(3, other), other), SPEC, where="w")
    check_refusal(info.value, SpecMismatch, "at w", "[rows, 3, 2]", "[3, 2, 2]")


def test_wrong_top_k_is_a_spec_mismatch() -> None:
    other = RouteSpec(num_layers=3, top_k=1, num_experts=8)
    with pytest.raises(SpecMismatch) as info:
        lmdeploy.decode_lists(lmdeploy.encode_lists(routing(3, other)), SPEC, where="w")
    check_refusal(info.value, SpecMismatch, "[rows, 3, 2]", "[3, 3, 1]")


def test_two_dimensional_payload_is_a_spec_mismatch() -> None:
    with pytest.raises(SpecMismatch) as info:
        vllm.decode(npy_b64(np.zeros((4, 6), np.uint8)), SPEC, where="w")
    check_refusal(info.value, SpecMismatch, "[4, 6]")


def test_dense_spec_names_both_accepted_layer_counts() -> None:
    dense = RouteSpec(num_layers=2, top_k=2, num_experts=8, layer_map=(1, 3), total_layers=4)
    payload = npy_b64(np.zeros((3, 3, 2), np.uint8))
    with pytest.raises(SpecMismatch) as info:
        vllm.decode(payload, dense, where="w")
    check_refusal(info.value, SpecMismatch, "[rows, 2 or 4, 2]", "[3, 3, 2]")


# --- expert ids ---------------------------------------------------------------------------


def test_id_equal_to_num_experts_is_out_of_range() -> None:
    bad = routing(5)
    bad[3, 2, 1] = SPEC.num_experts
    with pytest.raises(ExpertOutOfRange) as info:
        vllm.decode(vllm.encode(bad, SPEC, dtype="int32"), SPEC, where="w")
    check_refusal(info.value, ExpertOutOfRange, "row 3, layer 2, slot 1", "[0, 8)", "found 8")


def test_out_of_range_reports_the_first_bad_id_and_how_many() -> None:
    bad = routing(5)
    bad[4, 0, 0] = 100
    bad[1, 1, 1] = 9
    with pytest.raises(ExpertOutOfRange) as info:
        lmdeploy.decode_lists(lmdeploy.encode_lists(bad), SPEC, where="w")
    check_refusal(info.value, ExpertOutOfRange, "row 1, layer 1, slot 1", "found 9", "2 ids")


def test_out_of_range_row_is_absolute_for_sglang_start_row() -> None:
    full = routing(10)
    full[7, 1, 0] = 200
    with pytest.raises(ExpertOutOfRange) as info:
        sglang.decode(sglang.encode(full, start_row=4), SPEC, start_row=4, where="w")
    # Local row 3 of the payload is absolute token row 7.
    check_refusal(info.value, ExpertOutOfRange, "at w, row 7, layer 1, slot 0", "found 200")


@pytest.mark.parametrize("dtype", ["int16", "int32", ">i4", "int64"])
def test_negative_id_is_out_of_range(dtype: str) -> None:
    bad = routing(4)
    bad[2, 0, 1] = -3
    with pytest.raises(ExpertOutOfRange) as info:
        vllm.decode(vllm.encode(bad, SPEC, dtype=dtype), SPEC, where="w")
    check_refusal(info.value, ExpertOutOfRange, "row 2, layer 0, slot 1", "found -3")


def test_negative_int32_from_sglang_is_out_of_range() -> None:
    bad = routing(4)
    bad[0, 2, 0] = -(2**31)
    with pytest.raises(ExpertOutOfRange) as info:
        sglang.decode(sglang.encode(bad), SPEC, where="w")
    check_refusal(info.value, ExpertOutOfRange, "row 0, layer 2, slot 0", f"found {-(2**31)}")


def test_duplicate_ids_report_row_layer_and_ids() -> None:
    bad = routing(6)
    bad[5, 1] = [3, 3]
    with pytest.raises(DuplicateExperts) as info:
        vllm.decode(vllm.encode(bad, SPEC), SPEC, where="w")
    check_refusal(info.value, DuplicateExperts, "row 5, layer 1", "found [3, 3]", "2 distinct")


def test_duplicate_not_adjacent_in_top_k_is_found() -> None:
    spec = RouteSpec(num_layers=2, top_k=5, num_experts=64)
    bad = routing(3, spec)
    bad[1, 1] = [9, 1, 2, 3, 9]
    with pytest.raises(DuplicateExperts) as info:
        lmdeploy.decode_lists(lmdeploy.encode_lists(bad), spec, where="w")
    check_refusal(info.value, DuplicateExperts, "row 1, layer 1", "[9, 1, 2, 3, 9]")


def test_duplicate_row_is_absolute_for_sglang_start_row() -> None:
    full = routing(9)
    full[6, 2] = [4, 4]
    with pytest.raises(DuplicateExperts) as info:
        sglang.decode(sglang.encode(full, start_row=5), SPEC, start_row=5, where="w")
    check_refusal(info.value, DuplicateExperts, "at w, row 6, layer 2", "found [4, 4]")


def test_all_zero_row_is_a_duplicate_with_a_padding_hint() -> None:
    bad = routing(4)
    bad[2, 0] = 0
    bad[3, 1] = 0
    with pytest.raises(DuplicateExperts) as info:
        sglang.decode(sglang.encode(bad), SPEC, where="w")
    check_refusal(info.value, DuplicateExperts, "row 2, layer 0", "found [0, 0]", "2 are all zeros")


# --- base64 and .npy ----------------------------------------------------------------------


def test_truncated_base64_is_malformed() -> None:
    payload = vllm.encode(routing(6), SPEC)
    with pytest.raises(MalformedPayload) as info:
        vllm.decode(payload[:-1], SPEC, where="w")
    check_refusal(info.value, MalformedPayload, "not valid base64", f"{len(payload) - 1} char")


def test_base64_missing_padding_is_malformed() -> None:
    payload = sglang.encode(routing(1, RouteSpec(num_layers=1, top_k=1, num_experts=8)))
    assert payload.endswith("==")
    spec = RouteSpec(num_layers=1, top_k=1, num_experts=8)
    with pytest.raises(MalformedPayload) as info:
        sglang.decode(payload.rstrip("="), spec, where="w")
    check_refusal(info.value, MalformedPayload, "not valid base64")


@pytest.mark.parametrize("bad", ["!", "\n", " ", "-", "_", "é"])
def test_base64_with_invalid_characters_is_malformed(bad: str) -> None:
    payload = sglang.encode(routing(3))
    corrupted = payload[:8] + bad + payload[9:]
    with pytest.raises(MalformedPayload) as info:
        sglang.decode(corrupted, SPEC, where="w")
    check_refusal(info.value, MalformedPayload, "not valid base64")


@pytest.mark.parametrize(
    "inserted", ["\n", " ", "\r\n", "!!!!", "===="], ids=["lf", "space", "crlf", "bang", "pad"]
)
def test_base64_with_stray_characters_inserted_is_malformed(inserted: str) -> None:
    """Line-wrapped (MIME-style) or padded-in-the-middle base64 is refused, not skipped over."""
    payload = vllm.encode(routing(20), SPEC)
    corrupted = payload[:76] + inserted + payload[76:]
    with pytest.raises(MalformedPayload) as info:
        vllm.decode(corrupted, SPEC, where="w")
    check_refusal(info.value, MalformedPayload, "not valid base64")


def test_non_string_payload_is_malformed() -> None:
    with pytest.raises(MalformedPayload) as info:
        vllm.decode(12345, SPEC, where="w")  # type: ignore[arg-type]
    check_refusal(info.value, MalformedPayload, "must be a base64 string", "found int")


def test_sglang_byte_length_not_a_whole_row_is_malformed() -> None:
    raw = base64.b64decode(sglang.encode(routing(3)))
    with pytest.raises(MalformedPayload) as info:
        sglang.decode(b64(raw[:-4]), SPEC, where="w")
    check_refusal(info.value, MalformedPayload, "a multiple of 24 bytes", f"{len(raw) - 4} bytes")


def test_sglang_byte_length_against_expected_rows_names_both() -> None:
    raw = base64.b64decode(sglang.encode(routing(3)))
    with pytest.raises(MalformedPayload) as info:
        sglang.decode(b64(raw + b"\0\0"), SPEC, expected=3, where="w")
    check_refusal(info.value, MalformedPayload, "3 rows x 24 bytes = 72 bytes", "found 74 bytes")


def test_npy_data_shorter_than_header_is_malformed() -> None:
    raw = base64.b64decode(npy_b64(routing(5).astype(np.uint16)))
    with pytest.raises(MalformedPayload) as info:
        vllm.decode(b64(raw[:-3]), SPEC, where="w")
    check_refusal(
        info.value, MalformedPayload, "60 bytes for shape [5, 3, 2] uint16", "found 57 bytes"
    )


def test_npy_data_longer_than_header_is_malformed() -> None:
    raw = base64.b64decode(npy_b64(routing(5).astype(np.uint8)))
    with pytest.raises(MalformedPayload) as info:
        vllm.decode(b64(raw + b"\0"), SPEC, where="w")
    check_refusal(info.value, MalformedPayload, "30 bytes", "found 31 bytes")


def test_npy_with_garbled_header_is_malformed() -> None:
    raw = base64.b64decode(npy_b64(routing(2).astype(np.uint8)))
    garbled = raw[:10] + raw[10:].replace(b"'descr'", b"'dexxx'", 1)
    with pytest.raises(MalformedPayload) as info:
        vllm.decode(b64(garbled), SPEC, where="w")
    check_refusal(info.value, MalformedPayload, ".npy header is malformed")


def test_npy_magic_only_is_malformed() -> None:
    with pytest.raises(MalformedPayload) as info:
        vllm.decode(b64(b"\x93NUMPY\x01"), SPEC, where="w")
    check_refusal(info.value, MalformedPayload, ".npy header is malformed")


def _npy_with_header(header: dict[str, Any], data: bytes) -> str:
    text = repr(header).encode("latin1")
    pad = (64 - (10 + len(text) + 1) % 64) % 64
    text += b" " * pad + b"\n"
    return b64(b"\x93NUMPY\x01\x00" + len(text).to_bytes(2, "little") + text + data)


@pytest.mark.parametrize(
    ("shape", "data"),
    [
        ((-1, -2, 2), b"\0" * 4),
        ((0, -1, 2), b""),
        ((2**62, 4, 1), b""),
        ((2**70, 3, 2), b""),
    ],
    ids=["two-negative-dims", "zero-and-negative", "int64-wraparound", "beyond-int64"],
)
def test_npy_header_with_impossible_shape_is_malformed(shape: tuple[int, ...], data: bytes) -> None:
    payload = _npy_with_header({"descr": "|u1", "fortran_order": False, "shape": shape}, data)
    with pytest.raises(MalformedPayload):
        vllm.decode(payload, SPEC, where="w")


def test_npy_header_with_one_negative_dim_is_malformed() -> None:
    payload = _npy_with_header(
        {"descr": "|u1", "fortran_order": False, "shape": (-1, 3, 2)}, b"\0" * 6
    )
    with pytest.raises(MalformedPayload) as info:
        vllm.decode(payload, SPEC, where="w")
    check_refusal(info.value, MalformedPayload, "negative dimension")


def test_npy_of_records_is_unsafe() -> None:
    records = np.zeros((2, 3, 2), dtype=[("a", "u1")])
    with pytest.raises(UnsafePayload) as info:
        vllm.decode(npy_b64(records), SPEC, where="w")
    check_refusal(info.value, UnsafePayload, "records")


# --- unsafe payloads: refused, never executed -------------------------------------------


def test_marker_trap_is_live_when_unpickled(tmp_path: Path) -> None:
    """Sanity: the trap used below really would create the marker if unpickled."""
    marker = tmp_path / "marker"
    pickle.loads(base64.b64decode(pickle_b64(marker)))
    assert marker.exists()
    object_marker = tmp_path / "object-marker"
    raw = base64.b64decode(object_npy_b64(object_marker))
    np.load(io.BytesIO(raw), allow_pickle=True)
    assert object_marker.exists()


@pytest.mark.parametrize("protocol", range(2, pickle.HIGHEST_PROTOCOL + 1))
def test_pickle_payload_is_unsafe_and_not_executed(tmp_path: Path, protocol: int) -> None:
    marker = tmp_path / "marker"
    body = vllm_completion(pickle_b64(marker, protocol=protocol))
    with pytest.raises(UnsafePayload) as info:
        read_response("vllm", body, SPEC)
    check_refusal(info.value, UnsafePayload, "not unpickled", "pickle protocol header")
    assert not marker.exists()


@pytest.mark.parametrize("protocol", [0, 1])
def test_old_protocol_pickle_is_refused_and_not_executed(tmp_path: Path, protocol: int) -> None:
    marker = tmp_path / "marker"
    with pytest.raises(MalformedPayload) as info:
        vllm.decode(pickle_b64(marker, protocol=protocol), SPEC, where="w")
    check_refusal(info.value, MalformedPayload, "not an .npy file")
    assert not marker.exists()


def test_object_npy_is_unsafe_and_not_executed(tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    with pytest.raises(UnsafePayload) as info:
        read_response("vllm", vllm_completion(object_npy_b64(marker)), SPEC)
    check_refusal(info.value, UnsafePayload, "found object")
    assert not marker.exists()


def test_read_npy_refuses_object_array_directly(tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    array = np.array([MarkerTrap(marker), 1], dtype=object)
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=True)
    with pytest.raises(UnsafePayload):
        read_npy(buffer.getvalue(), where="w")
    assert not marker.exists()


# --- dtypes -------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64", "complex64", "bool"])
def test_npy_of_non_integers_is_a_dtype_error(dtype: str) -> None:
    with pytest.raises(DtypeError) as info:
        vllm.decode(npy_b64(routing(3).astype(dtype)), SPEC, where="w")
    check_refusal(info.value, DtypeError, "integer dtype", f"found {np.dtype(dtype)}")


def test_int8_cannot_hold_ids_of_256_experts() -> None:
    spec = RouteSpec(num_layers=3, top_k=2, num_experts=256)
    payload = npy_b64(routing(3).astype(np.int8))  # every id < 8 still: the dtype decides
    with pytest.raises(DtypeError) as info:
        vllm.decode(payload, spec, where="w")
    check_refusal(info.value, DtypeError, "cannot hold", "ids up to 255", "found int8")


def test_int8_holds_ids_of_128_experts() -> None:
    spec = RouteSpec(num_layers=3, top_k=2, num_experts=128)
    routes = vllm.decode(npy_b64(routing(3).astype(np.int8)), spec)
    assert routes.source_dtype == "int8"


def test_int16_cannot_hold_ids_of_65536_experts() -> None:
    spec = RouteSpec(num_layers=3, top_k=2, num_experts=65536)
    with pytest.raises(DtypeError) as info:
        vllm.decode(npy_b64(routing(2).astype(np.int16)), spec, where="w")
    check_refusal(info.value, DtypeError, "ids up to 65535", "found int16")


def test_in_process_float_array_is_a_dtype_error() -> None:
    with pytest.raises(DtypeError) as info:
        vllm.from_outputs(None, routing(3).astype(np.float32), SPEC, where="w")
    check_refusal(info.value, DtypeError, "found float32")


def test_in_process_non_array_is_malformed() -> None:
    with pytest.raises(MalformedPayload) as info:
        vllm.from_outputs(None, routing(3).tolist(), SPEC, where="w")  # type: ignore[arg-type]
    check_refusal(info.value, MalformedPayload, "numpy.ndarray", "found list")


def test_in_process_wrong_shape_is_a_spec_mismatch() -> None:
    with pytest.raises(SpecMismatch) as info:
        vllm.from_outputs(routing(2), np.zeros((1, 3, 3), np.uint8), SPEC, where="w")
    check_refusal(info.value, SpecMismatch, "[1, 3, 3]")


def test_in_process_parts_with_different_layer_counts_are_a_spec_mismatch() -> None:
    dense = RouteSpec(num_layers=2, top_k=2, num_experts=8, layer_map=(1, 2), total_layers=3)
    prompt = np.zeros((2, 3, 2), np.uint8)
    prompt[:, :, 1] = 1
    completion = np.array([[[0, 1], [2, 3]]], np.uint8)
    with pytest.raises(SpecMismatch):
        vllm.from_outputs(prompt, completion, dense, where="w")


# --- nested lists -------------------------------------------------------------------------


def test_ragged_lists_are_malformed() -> None:
    lists = lmdeploy.encode_lists(routing(4))
    lists[2][0] = [1, 2, 3]
    with pytest.raises(MalformedPayload) as info:
        lmdeploy.decode_lists(lists, SPEC, where="w")
    check_refusal(info.value, MalformedPayload, "ragged", "[T][3][2] integers")


def test_rows_with_missing_layer_are_malformed() -> None:
    lists = lmdeploy.encode_lists(routing(4))
    del lists[1][2]
    with pytest.raises(MalformedPayload) as info:
        lmdeploy.decode_lists(lists, SPEC, where="w")
    check_refusal(info.value, MalformedPayload, "ragged")


@pytest.mark.parametrize(
    ("value", "cls", "found"),
    [
        (1.5, DtypeError, "type float"),
        (2.0, DtypeError, "type float"),
        ("3", MalformedPayload, "type str"),  # refused before numpy could parse "3"
        (None, MalformedPayload, "type NoneType"),
        (2**70, MalformedPayload, "64 bits"),
        (2**64, MalformedPayload, "64 bits"),
        (2**63, MalformedPayload, "64 bits"),
    ],
    ids=["float", "integral-float", "string", "null", "2**70", "2**64", "2**63"],
)
def test_lists_holding_a_non_integer_are_refused(
    value: object, cls: type[RoutesDataError], found: str
) -> None:
    lists: list[Any] = lmdeploy.encode_lists(routing(3))
    lists[1][1][0] = value
    with pytest.raises(RoutesDataError) as info:
        lmdeploy.decode_lists(lists, SPEC, where="w")
    check_refusal(info.value, cls, "integers", found)


def test_lists_of_only_bools_are_a_dtype_error() -> None:
    lists = [[[True, False]] * 3] * 2
    with pytest.raises(DtypeError) as info:
        lmdeploy.decode_lists(lists, SPEC, where="w")
    check_refusal(info.value, DtypeError, "found elements of type bool")


def test_lists_with_a_bool_among_ints_are_refused() -> None:
    lists: list[Any] = lmdeploy.encode_lists(routing(3))
    lists[0][0] = [True, 5]
    with pytest.raises(RoutesDataError):
        lmdeploy.decode_lists(lists, SPEC, where="w")


def test_non_list_inline_routing_is_malformed() -> None:
    with pytest.raises(MalformedPayload) as info:
        lmdeploy.decode_lists({"0": [[1, 2]]}, SPEC, where="w")
    check_refusal(info.value, MalformedPayload, "nested lists", "found dict")


# --- keys ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value",
    [KEY.upper(), KEY[:-1], KEY + "0", KEY[:-1] + "g", " " + KEY[1:], KEY + "\n", ""],
    ids=["uppercase", "55-chars", "57-chars", "non-hex", "leading-space", "newline", "empty"],
)
def test_string_that_is_not_a_key_is_refused(value: str) -> None:
    assert not lmdeploy.is_key(value)
    with pytest.raises(MalformedPayload) as info:
        read_response("lmdeploy", lmdeploy_generate(value), SPEC)
    check_refusal(info.value, MalformedPayload, "not an LMDeploy shared_store key", "56 lowercase")


@pytest.mark.parametrize("value", [KEY.encode(), 123, None, [KEY]], ids=repr)
def test_parse_key_refuses_non_strings(value: object) -> None:
    assert not lmdeploy.is_key(value)
    with pytest.raises(MalformedPayload) as info:
        lmdeploy.parse_key(value, rows=3, where="w")
    check_refusal(info.value, MalformedPayload, "shared_store key")


def test_key_without_token_counts_is_malformed() -> None:
    body = lmdeploy_generate(KEY, prompt=None, completion=None)
    with pytest.raises(MalformedPayload) as info:
        read_response("lmdeploy", body, SPEC)
    check_refusal(info.value, MalformedPayload, "needs token counts")


# --- body structure -----------------------------------------------------------------------


def test_missing_routed_experts_has_a_hint() -> None:
    with pytest.raises(MalformedPayload) as info:
        read_response("vllm", vllm_completion(None), SPEC, where="resp.json")
    exc = check_refusal(info.value, MalformedPayload, "field 'routed_experts'", "found missing")
    assert exc.hint == "Was the engine started with routed-experts return enabled?"
    assert exc.where == "resp.json choices[0].routed_experts"


def test_null_routed_experts_is_missing() -> None:
    body = sglang_generate(None)
    body["meta_info"]["routed_experts"] = None
    with pytest.raises(MalformedPayload) as info:
        read_response("sglang", body, SPEC)
    assert info.value.hint


def test_missing_meta_info_is_malformed_without_the_routing_hint() -> None:
    with pytest.raises(MalformedPayload) as info:
        read_response("sglang", {"text": "hi"}, SPEC)
    exc = check_refusal(info.value, MalformedPayload, "no meta_info", "'meta_info'")
    assert exc.hint == ""


@pytest.mark.parametrize("body", [[], [1, 2], "text", 3, None], ids=repr)
def test_body_that_is_not_an_object_is_malformed(body: object) -> None:
    with pytest.raises(MalformedPayload) as info:
        read_response("vllm", body, SPEC, where="w")
    check_refusal(info.value, MalformedPayload, "must be a JSON object")


@pytest.mark.parametrize(
    ("body", "mention"),
    [([], "no batched /generate list[0]"), ([1, 2], "list[0] is not an object"), ("t", "object")],
    ids=repr,
)
def test_sglang_batch_that_holds_no_objects_is_malformed(body: object, mention: str) -> None:
    with pytest.raises(MalformedPayload) as info:
        read_response("sglang", body, SPEC, where="w")
    check_refusal(info.value, MalformedPayload, mention)


@pytest.mark.parametrize("choice", [1, 2])
def test_missing_choice_is_malformed(choice: int) -> None:
    body = vllm_completion(vllm.encode(routing(6), SPEC))
    with pytest.raises(MalformedPayload) as info:
        read_response("vllm", body, SPEC, choice=choice)
    check_refusal(info.value, MalformedPayload, f"choices[{choice}]", "1 choices")


def test_choice_that_is_not_an_object_is_malformed() -> None:
    with pytest.raises(MalformedPayload) as info:
        read_response("vllm", {"choices": ["x"]}, SPEC)
    check_refusal(info.value, MalformedPayload, "choices[0] is not an object", "found str")


@pytest.mark.parametrize("count", [-1, 1.5, "4", True], ids=repr)
def test_bad_token_count_is_malformed(count: object) -> None:
    body = vllm_completion(vllm.encode(routing(6), SPEC))
    body["usage"]["prompt_tokens"] = count
    with pytest.raises(MalformedPayload) as info:
        read_response("vllm", body, SPEC)
    check_refusal(info.value, MalformedPayload, "prompt_tokens must be a non-negative integer")


def test_negative_start_row_is_the_callers_mistake() -> None:
    body = sglang_generate(sglang.encode(routing(6)))
    with pytest.raises(MisuseError, match="start_row"):
        read_response("sglang", body, SPEC, start_row=-2)


def test_unknown_engine_is_the_callers_mistake_not_a_refusal() -> None:
    with pytest.raises(MisuseError, match="tgi") as info:
        read_response("tgi", {}, SPEC)
    assert not isinstance(info.value, RoutesDataError)
