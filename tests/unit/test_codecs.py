"""Round trips of every engine codec, over shapes, dtypes and body shapes (property tests).

Whatever the wire format, decoding must give the canonical form: equal to the ids that
were sent, in ``spec.dtype`` (chosen from ``num_experts`` alone, never from the data),
read-only, C-contiguous, with the sent element type recorded in ``source_dtype``.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from bodies import (
    lmdeploy_chat,
    lmdeploy_generate,
    sglang_generate,
    vllm_chat,
    vllm_completion,
)
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from strategies import MAX_ROWS, dense_specs, random_routing, routing_arrays, seeds, specs

from routeplay.core import Engine, EngineKey, Routes, RouteSpec, canonical_dtype, read_response
from routeplay.core.formats import lmdeploy, sglang, vllm
from routeplay.errors import SpecMismatch

CODEC_SETTINGS = settings(
    max_examples=40,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)

WIRE_DTYPES = ("uint8", "int16", "uint16", "int32", ">i4", "<i8", ">u2")
HEX = "0123456789abcdef"


def holds(dtype: str, spec: RouteSpec) -> bool:
    """True when ``dtype`` can carry every id of ``spec``."""
    return bool(np.iinfo(np.dtype(dtype)).max >= spec.num_experts - 1)


def sha256_of(array: npt.NDArray[Any], spec: RouteSpec) -> str:
    return hashlib.sha256(np.ascontiguousarray(array, dtype=spec.dtype).tobytes()).hexdigest()


def check_canonical(
    routes: Routes,
    expected: npt.NDArray[Any],
    spec: RouteSpec,
    *,
    start_row: int = 0,
    source_dtype: str | None = None,
) -> None:
    """``routes`` is the canonical form of ``expected``."""
    array = routes.array
    assert array.dtype == spec.dtype
    assert array.shape == (len(expected), spec.num_layers, spec.top_k)
    np.testing.assert_array_equal(array, expected)
    assert not array.flags.writeable
    assert array.flags.c_contiguous
    assert routes.spec == spec
    assert routes.start_row == start_row
    assert routes.rows == len(expected)
    assert routes.stop_row == start_row + len(expected)
    assert routes.nbytes == spec.nbytes(len(expected))
    assert routes.sha256() == sha256_of(expected, spec)
    if source_dtype is not None:
        assert routes.source_dtype == source_dtype
    if array.size:
        with pytest.raises(ValueError, match="read-only"):
            array[0, 0, 0] = 0


def npy_bytes(array: npt.NDArray[Any], version: tuple[int, int] | None = None) -> bytes:
    """``.npy`` bytes of ``array`` as given (dtype, byte order, memory order, version)."""
    buffer = io.BytesIO()
    np.lib.format.write_array(buffer, array, version=version, allow_pickle=False)
    return buffer.getvalue()


def b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode("ascii")


# --- vLLM ---------------------------------------------------------------------------------


@CODEC_SETTINGS
@given(data=st.data())
def test_vllm_npy_round_trip(data: st.DataObject) -> None:
    spec = data.draw(specs(), label="spec")
    array = data.draw(routing_arrays(spec), label="array")
    wire = data.draw(st.sampled_from([d for d in WIRE_DTYPES if holds(d, spec)]), label="wire")
    fortran = data.draw(st.booleans(), label="fortran")
    version = data.draw(st.sampled_from([(1, 0), (2, 0), (3, 0)]), label="npy version")
    sent = array.astype(wire)
    if fortran:
        sent = np.asfortranarray(sent)
    raw = npy_bytes(sent, version)
    if fortran and not sent.flags.c_contiguous:
        assert b"'fortran_order': True" in raw
    expected = data.draw(st.sampled_from([None, len(array)]), label="expected rows")
    routes = vllm.decode(b64(raw), spec, expected=expected)
    check_canonical(routes, array, spec, source_dtype=np.dtype(wire).name)


@CODEC_SETTINGS
@given(data=st.data())
def test_vllm_encode_uses_the_engine_wire_dtype(data: st.DataObject) -> None:
    spec = data.draw(specs(), label="spec")
    array = data.draw(routing_arrays(spec), label="array")
    wire = "uint8" if spec.num_experts <= 256 else "int16"
    assert vllm.wire_dtype(spec) == np.dtype(wire)
    routes = vllm.decode(vllm.encode(array, spec), spec)
    check_canonical(routes, array, spec, source_dtype=wire)


def test_vllm_big_endian_int32() -> None:
    spec = RouteSpec(num_layers=4, top_k=3, num_experts=300)
    array = random_routing(spec, 9, seed=3)
    raw = npy_bytes(array.astype(">i4"))
    assert b"'descr': '>i4'" in raw
    routes = vllm.decode(b64(raw), spec, expected=9)
    check_canonical(routes, array, spec, source_dtype="int32")


def test_vllm_fortran_ordered() -> None:
    spec = RouteSpec(num_layers=3, top_k=2, num_experts=64)
    array = random_routing(spec, 7, seed=4)
    sent = np.asfortranarray(array.astype(np.int16))
    raw = npy_bytes(sent)
    assert b"'fortran_order': True" in raw
    routes = vllm.decode(b64(raw), spec)
    check_canonical(routes, array, spec, source_dtype="int16")


def test_vllm_decode_accepts_bytes_payload() -> None:
    spec = RouteSpec(num_layers=2, top_k=2, num_experts=16)
    array = random_routing(spec, 3, seed=5)
    routes = vllm.decode(vllm.encode(array, spec).encode("ascii"), spec)
    check_canonical(routes, array, spec, source_dtype="uint8")


@CODEC_SETTINGS
@given(data=st.data())
def test_vllm_in_process_outputs_concatenate(data: st.DataObject) -> None:
    spec = data.draw(specs(), label="spec")
    array = data.draw(routing_arrays(spec, st.integers(1, MAX_ROWS)), label="array")
    split = data.draw(st.integers(0, len(array)), label="split")
    native = [d for d in WIRE_DTYPES if holds(d, spec)]
    prompt_dtype = data.draw(st.sampled_from(native), label="prompt dtype")
    completion_dtype = data.draw(st.sampled_from(native), label="completion dtype")
    prompt = array[:split].astype(prompt_dtype)
    completion = array[split:].astype(completion_dtype)
    routes = vllm.from_outputs(prompt, completion, spec, expected=len(array))
    joined = np.concatenate([prompt, completion])
    check_canonical(routes, joined, spec, source_dtype=joined.dtype.name)
    np.testing.assert_array_equal(routes.array, array)


@CODEC_SETTINGS
@given(spec=specs(), seed=seeds, rows=st.integers(0, MAX_ROWS))
def test_vllm_in_process_without_prompt(spec: RouteSpec, seed: int, rows: int) -> None:
    array = random_routing(spec, rows, seed).astype(vllm.wire_dtype(spec))
    routes = vllm.from_outputs(None, array, spec, expected=rows)
    check_canonical(routes, array, spec, source_dtype=array.dtype.name)


def test_in_process_decode_leaves_the_callers_array_writeable() -> None:
    spec = RouteSpec(num_layers=2, top_k=2, num_experts=16)
    array = random_routing(spec, 4, seed=6).astype(np.uint8)
    routes = vllm.from_outputs(None, array, spec)
    assert array.flags.writeable
    assert not routes.array.flags.writeable


def test_in_process_routes_do_not_change_when_the_caller_reuses_its_buffer() -> None:
    spec = RouteSpec(num_layers=2, top_k=2, num_experts=16)
    array = random_routing(spec, 4, seed=6).astype(np.uint8)
    routes = vllm.from_outputs(None, array, spec)
    before = routes.array.copy()
    array[...] = 0  # the engine recycles its output buffer
    np.testing.assert_array_equal(routes.array, before)


# --- SGLang -------------------------------------------------------------------------------


@CODEC_SETTINGS
@given(data=st.data())
def test_sglang_round_trip_from_start_row(data: st.DataObject) -> None:
    spec = data.draw(specs(), label="spec")
    full = data.draw(routing_arrays(spec), label="full")
    start = data.draw(st.one_of(st.just(0), st.integers(0, len(full))), label="start_row")
    payload = sglang.encode(full, start_row=start)
    assert len(base64.b64decode(payload)) == (len(full) - start) * spec.num_layers * spec.top_k * 4
    for expected in (None, len(full) - start):
        routes = sglang.decode(payload, spec, start_row=start, expected=expected)
        check_canonical(routes, full[start:], spec, start_row=start, source_dtype="int32")
        assert routes.stop_row == len(full)


def test_sglang_payload_is_little_endian_int32_without_header() -> None:
    spec = RouteSpec(num_layers=1, top_k=2, num_experts=300)
    array = np.array([[[1, 299]]])
    payload = sglang.encode(array)
    raw = base64.b64decode(payload)
    assert raw == (1).to_bytes(4, "little") + (299).to_bytes(4, "little")
    check_canonical(sglang.decode(payload, spec), array, spec, source_dtype="int32")


# --- LMDeploy -----------------------------------------------------------------------------


@CODEC_SETTINGS
@given(data=st.data())
def test_lmdeploy_lists_round_trip_through_json(data: st.DataObject) -> None:
    spec = data.draw(specs(), label="spec")
    array = data.draw(routing_arrays(spec), label="array")
    lists = lmdeploy.encode_lists(array)
    assert isinstance(lists, list)
    assert all(isinstance(x, int) for row in lists for layer in row for x in layer)
    wire = json.loads(json.dumps(lists))
    routes = lmdeploy.decode_lists(wire, spec, expected=len(array))
    check_canonical(routes, array, spec, source_dtype="int64" if len(array) else "uint16")


hex_keys = st.text(alphabet=HEX, min_size=56, max_size=56)


@CODEC_SETTINGS
@given(key=hex_keys, rows=st.integers(0, 10_000))
def test_lmdeploy_key_parses_to_engine_key(key: str, rows: int) -> None:
    assert lmdeploy.is_key(key)
    parsed = lmdeploy.parse_key(key, rows=rows, run="run-1")
    assert parsed == EngineKey(key=key, rows=rows, run="run-1")
    assert (parsed.actor, parsed.namespace) == ("shared_store", "lmdeploy")


@CODEC_SETTINGS
@given(key=hex_keys, data=st.data())
def test_lmdeploy_non_keys_are_not_keys(key: str, data: st.DataObject) -> None:
    where = data.draw(st.integers(0, 55), label="position")
    upper = data.draw(st.sampled_from("ABCDEF"), label="upper")
    stray = data.draw(
        st.characters(blacklist_characters=HEX, blacklist_categories=("Cs",)), label="stray"
    )
    extra = data.draw(st.text(alphabet=HEX, min_size=1, max_size=8), label="extra")
    cut = data.draw(st.integers(0, 55), label="cut")
    assert not lmdeploy.is_key(key[:where] + upper + key[where + 1 :])  # uppercase
    assert not lmdeploy.is_key(key[:where] + stray + key[where + 1 :])  # non-hex
    assert not lmdeploy.is_key(key + extra)  # too long
    assert not lmdeploy.is_key(key[:cut])  # too short
    assert not lmdeploy.is_key(key.encode())  # bytes, not str


# --- dtype comes from the spec, never from the data ---------------------------------------


@pytest.mark.parametrize(
    ("experts", "dtype"),
    [(1, "uint8"), (8, "uint8"), (256, "uint8"), (257, "uint16"), (65536, "uint16")],
)
def test_canonical_dtype_depends_on_num_experts_only(experts: int, dtype: str) -> None:
    assert canonical_dtype(experts) == np.dtype(dtype)
    assert RouteSpec(num_layers=1, top_k=1, num_experts=experts).dtype == np.dtype(dtype)


@pytest.mark.parametrize("experts", [0, 65537])
def test_canonical_dtype_refuses_unsupported_expert_counts(experts: int) -> None:
    with pytest.raises(SpecMismatch):
        canonical_dtype(experts)


def _small_id_payloads(spec: RouteSpec, array: npt.NDArray[Any]) -> dict[str, Routes]:
    return {
        "vllm-int16": vllm.decode(vllm.encode(array, spec, dtype="int16"), spec),
        "vllm-uint16": vllm.decode(vllm.encode(array, spec, dtype="uint16"), spec),
        "vllm-int32": vllm.decode(vllm.encode(array, spec, dtype="int32"), spec),
        "sglang": sglang.decode(sglang.encode(array), spec),
        "lmdeploy": lmdeploy.decode_lists(lmdeploy.encode_lists(array), spec),
        "in-process": vllm.from_outputs(None, array.astype(np.int32), spec),
    }


def test_uint16_spec_with_only_small_ids_stays_uint16() -> None:
    spec = RouteSpec(num_layers=3, top_k=4, num_experts=300)
    array = random_routing(spec, 12, seed=7, num_experts=10)
    assert array.max() < 10
    for name, routes in _small_id_payloads(spec, array).items():
        assert routes.array.dtype == np.uint16, name
        assert routes.nbytes == 12 * 3 * 4 * 2, name
        check_canonical(routes, array, spec)


@CODEC_SETTINGS
@given(spec=specs(), seed=seeds, rows=st.integers(0, MAX_ROWS))
def test_dtype_never_depends_on_the_ids_sent(spec: RouteSpec, seed: int, rows: int) -> None:
    assume(spec.top_k <= 10)
    array = random_routing(spec, rows, seed, num_experts=min(spec.num_experts, 10))
    for name, routes in _small_id_payloads(spec, array).items():
        assert routes.array.dtype == canonical_dtype(spec.num_experts), name
        check_canonical(routes, array, spec)


def test_uint8_spec_with_wide_wire_ids_narrows_to_uint8() -> None:
    spec = RouteSpec(num_layers=2, top_k=3, num_experts=256)
    array = random_routing(spec, 5, seed=8)
    array[0, 0] = [255, 0, 128]
    routes = sglang.decode(sglang.encode(array), spec)
    check_canonical(routes, array, spec, source_dtype="int32")


# --- engines that send every decoder layer ------------------------------------------------


def _all_layers(spec: RouteSpec, moe: npt.NDArray[Any]) -> npt.NDArray[Any]:
    """Every decoder layer: MoE layers at their layer_map index, dense layers all zeros."""
    full = np.zeros((len(moe), spec.decoder_layers, spec.top_k), dtype=moe.dtype)
    full[:, list(spec.moe_layer_indices()), :] = moe
    return full


def _body(kind: str, spec: RouteSpec, payload: npt.NDArray[Any], p: int, c: int) -> Any:
    if kind == "vllm":
        return vllm_completion(vllm.encode(payload, spec), p, c)
    if kind == "sglang":
        return sglang_generate(sglang.encode(payload), p, c)
    return lmdeploy_generate(lmdeploy.encode_lists(payload), p, c)


@CODEC_SETTINGS
@given(data=st.data())
def test_payload_with_every_decoder_layer_keeps_only_moe_layers(data: st.DataObject) -> None:
    spec = data.draw(dense_specs(), label="spec")
    assert spec.decoder_layers > spec.num_layers
    moe = data.draw(routing_arrays(spec, st.integers(0, 20)), label="moe rows")
    full = _all_layers(spec, moe)
    kind = data.draw(st.sampled_from(["vllm", "sglang", "lmdeploy"]), label="engine")
    prompt = data.draw(st.integers(1, len(moe) + 1), label="prompt")
    completion = len(moe) + 1 - prompt
    result = read_response(kind, _body(kind, spec, full, prompt, completion), spec)
    assert result.routes is not None
    check_canonical(result.routes, moe, spec)
    assert result.routes.array.shape[1] == spec.num_layers


def test_dense_layers_in_front_like_deepseek() -> None:
    spec = RouteSpec(num_layers=4, top_k=2, num_experts=256, layer_map=(3, 4, 5, 6), total_layers=7)
    moe = random_routing(spec, 6, seed=9)
    full = _all_layers(spec, moe)
    assert (full[:, :3] == 0).all()
    for routes in (
        vllm.decode(vllm.encode(full, spec), spec, expected=6),
        sglang.decode(sglang.encode(full), spec, expected=6),
        lmdeploy.decode_lists(lmdeploy.encode_lists(full), spec, expected=6),
        vllm.from_outputs(full[:2], full[2:], spec, expected=6),
    ):
        check_canonical(routes, moe, spec)


# --- whole response bodies ----------------------------------------------------------------

BODY_KINDS = (
    "vllm-completion",
    "vllm-chat",
    "sglang-dict",
    "sglang-list",
    "lmdeploy-generate-lists",
    "lmdeploy-generate-key",
    "lmdeploy-chat-lists",
)


@pytest.mark.parametrize("kind", BODY_KINDS)
@CODEC_SETTINGS
@given(data=st.data())
def test_read_response_for_every_body_shape(kind: str, data: st.DataObject) -> None:
    spec = data.draw(specs(), label="spec")
    rows = data.draw(st.integers(0, MAX_ROWS), label="rows")  # prompt + completion - 1
    full = random_routing(spec, rows, data.draw(seeds, label="seed"))
    prompt = data.draw(st.integers(1, rows + 1), label="prompt")
    completion = rows + 1 - prompt
    start = 0
    engine = kind.split("-")[0]
    if kind == "vllm-completion":
        body: Any = vllm_completion(vllm.encode(full, spec), prompt, completion)
    elif kind == "vllm-chat":
        body = vllm_chat(vllm.encode(full, spec), prompt, completion)
    elif kind.startswith("sglang"):
        start = data.draw(st.integers(0, rows), label="start_len")
        body = sglang_generate(sglang.encode(full, start_row=start), prompt, completion)
        if kind == "sglang-list":
            body = [body]
    elif kind == "lmdeploy-generate-lists":
        body = lmdeploy_generate(lmdeploy.encode_lists(full), prompt, completion)
    elif kind == "lmdeploy-generate-key":
        key = data.draw(hex_keys, label="key")
        body = lmdeploy_generate(key, prompt, completion)
    else:
        body = lmdeploy_chat(lmdeploy.encode_lists(full), prompt, completion)
    body = json.loads(json.dumps(body))  # exactly what the HTTP client hands over
    result = read_response(engine, body, spec, start_row=start, where="resp")
    assert result.engine is Engine(engine)
    assert (result.prompt_tokens, result.completion_tokens) == (prompt, completion)
    if kind == "lmdeploy-generate-key":
        assert result.routes is None
        assert result.key == EngineKey(key=key, rows=rows, trailing_rows=1)
        return
    assert result.key is None
    assert result.routes is not None
    check_canonical(result.routes, full[start:], spec, start_row=start)


def test_sglang_without_start_len_starts_at_row_zero() -> None:
    spec = RouteSpec(num_layers=2, top_k=2, num_experts=32)
    full = random_routing(spec, 5, seed=10)
    body = sglang_generate(sglang.encode(full), prompt=3, completion=3)
    result = read_response("sglang", body, spec)
    assert result.routes is not None
    check_canonical(result.routes, full, spec, source_dtype="int32")


def test_body_without_token_counts_skips_the_row_check() -> None:
    spec = RouteSpec(num_layers=2, top_k=2, num_experts=32)
    full = random_routing(spec, 5, seed=11)
    result = read_response("vllm", vllm_completion(vllm.encode(full, spec), None, None), spec)
    assert (result.prompt_tokens, result.completion_tokens) == (None, None)
    assert result.routes is not None
    check_canonical(result.routes, full, spec)


def test_vllm_choice_n_uses_token_ids_of_that_choice() -> None:
    spec = RouteSpec(num_layers=2, top_k=2, num_experts=32)
    first = random_routing(spec, 5, seed=12)  # prompt 3 + 3 generated - 1
    second = random_routing(spec, 6, seed=13)  # prompt 3 + 4 generated - 1
    body = {
        "choices": [
            {"index": 0, "token_ids": [1, 2, 3], "routed_experts": vllm.encode(first, spec)},
            {"index": 1, "token_ids": [4, 5, 6, 7], "routed_experts": vllm.encode(second, spec)},
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": 7},
    }
    for choice, expected, completion in ((0, first, 3), (1, second, 4)):
        result = read_response("vllm", body, spec, choice=choice)
        assert (result.prompt_tokens, result.completion_tokens) == (3, completion)
        assert result.routes is not None
        check_canonical(result.routes, expected, spec)


def test_lmdeploy_chat_with_key() -> None:
    spec = RouteSpec(num_layers=2, top_k=2, num_experts=32)
    key = "ab" * 28
    result = read_response("lmdeploy", lmdeploy_chat(key, prompt=5, completion=2), spec)
    assert result.routes is None
    assert result.key == EngineKey(key=key, rows=6, trailing_rows=1)


def test_engine_may_be_given_as_enum_or_string() -> None:
    spec = RouteSpec(num_layers=2, top_k=2, num_experts=32)
    full = random_routing(spec, 3, seed=14)
    body = sglang_generate(sglang.encode(full), prompt=2, completion=2)
    for engine in ("sglang", Engine.SGLANG):
        result = read_response(engine, body, spec)
        assert result.engine is Engine.SGLANG
        assert result.routes is not None
        check_canonical(result.routes, full, spec)


def test_vllm_prompt_start_omits_leading_rows() -> None:
    spec = RouteSpec(num_layers=2, top_k=2, num_experts=8)
    full = np.argsort(np.random.default_rng(3).random((9, 2, 8)), axis=-1)[..., :2].astype(np.uint8)
    body = {
        "choices": [{"routed_experts": vllm.encode(full[4:], spec)}],
        "usage": {"prompt_tokens": 6, "completion_tokens": 4},
    }
    routes = read_response("vllm", body, spec, start_row=4).routes
    assert routes is not None
    assert routes.start_row == 4
    np.testing.assert_array_equal(routes.array, full[4:])
