"""Builders of engine HTTP response bodies, good and bad, shared by refusal and CLI tests.

Every body is plain JSON data (dicts, lists, str, int), exactly what ``json.loads``
returns for the engine's response, so the same body can be passed to ``read_response``
or written to a file for ``routeplay inspect``.
"""

from __future__ import annotations

import base64
import io
import pickle
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
from strategies import random_routing

from routeplay.core import RouteSpec
from routeplay.core.formats import lmdeploy, sglang, vllm
from routeplay.errors import (
    DtypeError,
    DuplicateExperts,
    ExpertOutOfRange,
    MalformedPayload,
    RoutesDataError,
    RowCountMismatch,
    SpecMismatch,
    UnsafePayload,
)

__all__ = [
    "KEY",
    "SPEC",
    "BadCase",
    "GoodCase",
    "MarkerTrap",
    "bad_cases",
    "cli_spec_args",
    "good_cases",
    "lmdeploy_chat",
    "lmdeploy_generate",
    "npy_b64",
    "object_npy_b64",
    "pickle_b64",
    "routing",
    "sglang_generate",
    "vllm_chat",
    "vllm_completion",
]

SPEC = RouteSpec(num_layers=3, top_k=2, num_experts=8)
"""Small uint8 model used by most bad cases: 3 MoE layers, top-2 of 8 experts."""
SPEC_256 = RouteSpec(num_layers=3, top_k=2, num_experts=256)
SPEC_300 = RouteSpec(num_layers=3, top_k=2, num_experts=300)

KEY = "0123456789abcdef" * 3 + "deadbeef"
"""A well-formed LMDeploy shared_store key (56 lowercase hex characters)."""

PROMPT, COMPLETION = 4, 3
ROWS = PROMPT + COMPLETION - 1
"""Rows a payload for PROMPT/COMPLETION tokens must have (6)."""


def routing(rows: int = ROWS, spec: RouteSpec = SPEC, seed: int = 0) -> npt.NDArray[np.int64]:
    """Deterministic valid routing for ``spec``."""
    return random_routing(spec, rows, seed)


# --- bodies -------------------------------------------------------------------------------


def _usage(prompt: int | None, completion: int | None) -> dict[str, int]:
    usage: dict[str, int] = {}
    if prompt is not None:
        usage["prompt_tokens"] = prompt
    if completion is not None:
        usage["completion_tokens"] = completion
    if prompt is not None and completion is not None:
        usage["total_tokens"] = prompt + completion
    return usage


def vllm_completion(
    routed: object, prompt: int | None = PROMPT, completion: int | None = COMPLETION
) -> dict[str, Any]:
    """vLLM ``/v1/completions`` body with ``choices[0].routed_experts``."""
    choice: dict[str, Any] = {"index": 0, "text": " hi", "finish_reason": "stop"}
    if routed is not None:
        choice["routed_experts"] = routed
    return {
        "id": "cmpl-1",
        "object": "text_completion",
        "model": "m",
        "choices": [choice],
        "usage": _usage(prompt, completion),
    }


def vllm_chat(
    routed: object, prompt: int | None = PROMPT, completion: int | None = COMPLETION
) -> dict[str, Any]:
    """vLLM ``/v1/chat/completions`` body with ``choices[0].routed_experts``."""
    choice: dict[str, Any] = {
        "index": 0,
        "message": {"role": "assistant", "content": "hi"},
        "finish_reason": "stop",
    }
    if routed is not None:
        choice["routed_experts"] = routed
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "model": "m",
        "choices": [choice],
        "usage": _usage(prompt, completion),
    }


def sglang_generate(
    routed: object, prompt: int | None = PROMPT, completion: int | None = COMPLETION
) -> dict[str, Any]:
    """SGLang ``/generate`` body with ``meta_info.routed_experts``; a request's
    ``routed_experts_start_len`` is never echoed, so the body cannot say where rows start."""
    meta: dict[str, Any] = {"id": "r1", "finish_reason": {"type": "stop"}}
    if prompt is not None:
        meta["prompt_tokens"] = prompt
    if completion is not None:
        meta["completion_tokens"] = completion
    if routed is not None:
        meta["routed_experts"] = routed
    return {"text": " hi", "meta_info": meta}


def lmdeploy_generate(
    routed: object, prompt: int | None = PROMPT, completion: int | None = COMPLETION
) -> dict[str, Any]:
    """LMDeploy ``/generate`` body: ``meta_info.routed_experts`` lists or a store key."""
    meta: dict[str, Any] = {"finish_reason": {"type": "stop"}}
    if prompt is not None:
        meta["prompt_tokens"] = prompt
    if completion is not None:
        meta["completion_tokens"] = completion
    if routed is not None:
        meta["routed_experts"] = routed
    return {"text": " hi", "meta_info": meta}


def lmdeploy_chat(
    routed: object, prompt: int | None = PROMPT, completion: int | None = COMPLETION
) -> dict[str, Any]:
    """LMDeploy OpenAI-style chat body with ``choices[0].routed_experts``."""
    body = vllm_chat(routed, prompt, completion)
    body["model"] = "internlm"
    return body


# --- payload builders ---------------------------------------------------------------------


def npy_b64(array: npt.NDArray[Any], *, allow_pickle: bool = False) -> str:
    """base64 of ``np.save(array)`` exactly as given (dtype, order and all)."""
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=allow_pickle)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def b64(raw: bytes) -> str:
    """Standard base64 text of ``raw``."""
    return base64.b64encode(raw).decode("ascii")


class MarkerTrap:
    """Unpickling this object creates ``path``: proof that bytes were executed."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.touch, (Path(self.path),))


def pickle_b64(marker: Path, *, protocol: int = pickle.DEFAULT_PROTOCOL) -> str:
    """base64 of a pickle that would create ``marker`` if anyone unpickled it."""
    return b64(pickle.dumps(MarkerTrap(marker), protocol=protocol))


def object_npy_b64(marker: Path) -> str:
    """base64 ``.npy`` of an object array whose element would create ``marker`` on load."""
    array = np.empty((1, SPEC.num_layers, SPEC.top_k), dtype=object)
    array[...] = 0
    array[0, 0, 0] = MarkerTrap(marker)
    return npy_b64(array, allow_pickle=True)


def short_npy_b64(array: npt.NDArray[Any], missing: int = 1) -> str:
    """An ``.npy`` whose data is ``missing`` bytes shorter than its header says."""
    raw = base64.b64decode(npy_b64(array))
    return b64(raw[:-missing])


def cli_spec_args(spec: RouteSpec) -> list[str]:
    """``--layers/--top-k/--experts`` flags for a plain spec."""
    return [
        "--layers",
        str(spec.num_layers),
        "--top-k",
        str(spec.top_k),
        "--experts",
        str(spec.num_experts),
    ]


# --- good cases ---------------------------------------------------------------------------


@dataclass(frozen=True)
class GoodCase:
    """A valid body and what decoding it must give."""

    engine: str
    body: Any
    spec: RouteSpec
    expected: npt.NDArray[np.int64] | None
    """Canonical rows (None for a key body)."""
    start_row: int = 0
    source_dtype: str = ""
    key: str | None = None
    prompt: int = PROMPT
    completion: int = COMPLETION


def good_cases() -> dict[str, GoodCase]:
    """One valid body per engine body shape."""
    full = routing(ROWS)
    big = routing(ROWS, SPEC_300, seed=1)
    start = 2
    return {
        "vllm-completion": GoodCase(
            "vllm", vllm_completion(vllm.encode(full, SPEC)), SPEC, full, source_dtype="uint8"
        ),
        "vllm-chat": GoodCase(
            "vllm",
            vllm_chat(vllm.encode(big, SPEC_300)),
            SPEC_300,
            big,
            source_dtype="int16",
        ),
        "sglang-start-len": GoodCase(
            "sglang",
            sglang_generate(sglang.encode(full, start_row=start)),
            SPEC,
            full[start:],
            start_row=start,
            source_dtype="int32",
        ),
        "sglang-list": GoodCase(
            "sglang", [sglang_generate(sglang.encode(full))], SPEC, full, source_dtype="int32"
        ),
        "lmdeploy-lists": GoodCase(
            "lmdeploy",
            lmdeploy_generate(lmdeploy.encode_lists(full)),
            SPEC,
            full,
            source_dtype="int64",
        ),
        "lmdeploy-chat": GoodCase(
            "lmdeploy",
            lmdeploy_chat(lmdeploy.encode_lists(big)),
            SPEC_300,
            big,
            source_dtype="int64",
        ),
        "lmdeploy-key": GoodCase("lmdeploy", lmdeploy_generate(KEY), SPEC, None, key=KEY),
    }


# --- bad cases ----------------------------------------------------------------------------


@dataclass(frozen=True)
class BadCase:
    """A body every reader must refuse with exactly ``error``; ``mentions`` are in the message."""

    engine: str
    body: Any
    error: type[RoutesDataError]
    mentions: tuple[str, ...] = ()
    spec: RouteSpec = field(default=SPEC)
    start_row: int = 0
    """The request's start row (engines never echo it)."""


def _with(array: npt.NDArray[np.int64], index: tuple[int, ...], value: object) -> Any:
    out = array.copy()
    out[index] = value
    return out


def bad_cases(marker: Path) -> dict[str, BadCase]:
    """Every refusal, by name. ``marker`` is the file the unsafe payloads would create."""
    good = routing(ROWS)
    v = "vllm choices[0].routed_experts"
    s = "sglang meta_info.routed_experts"
    lm = "lmdeploy meta_info.routed_experts"

    out_of_range = _with(good, (2, 1, 0), SPEC.num_experts)
    negative = _with(good, (1, 2, 1), -1)
    duplicate = _with(good, (4, 2), [5, 5])
    zero_row = _with(good, (3, 0), [0, 0])
    sglang_start = 2
    sglang_bad = _with(good, (5, 0, 1), 9)  # local row 3, absolute row 5
    good_lists = lmdeploy.encode_lists(good)
    ragged = lmdeploy.encode_lists(good)
    ragged[3][1] = [1]
    floats = [[[float(x) + 0.5 for x in layer] for layer in row] for row in good_lists]
    bools = [[[True, False] for _ in row] for row in good_lists]
    strings = [[[str(x) for x in layer] for layer in row] for row in good_lists]
    huge = lmdeploy.encode_lists(good)
    huge[0][0][0] = 2**70
    valid_b64 = vllm.encode(good, SPEC)
    sglang_valid = sglang.encode(good)
    layers_4 = RouteSpec(num_layers=4, top_k=2, num_experts=8)
    top_k_3 = RouteSpec(num_layers=3, top_k=3, num_experts=8)

    return {
        "vllm-one-row-too-many": BadCase(
            "vllm",
            vllm_completion(vllm.encode(routing(ROWS + 1), SPEC)),
            RowCountMismatch,
            (v, f"{ROWS} rows", f"{ROWS + 1} rows", "One row too many"),
        ),
        "vllm-one-row-too-few": BadCase(
            "vllm",
            vllm_chat(vllm.encode(routing(ROWS - 1), SPEC)),
            RowCountMismatch,
            (v, f"{ROWS} rows", f"{ROWS - 1} rows"),
        ),
        "lmdeploy-one-row-too-many": BadCase(
            "lmdeploy",
            lmdeploy_generate(lmdeploy.encode_lists(routing(ROWS + 1))),
            RowCountMismatch,
            (lm, f"{ROWS} rows", f"{ROWS + 1} rows"),
        ),
        "lmdeploy-chat-one-row-too-few": BadCase(
            "lmdeploy",
            lmdeploy_chat(lmdeploy.encode_lists(routing(ROWS - 1))),
            RowCountMismatch,
            ("lmdeploy choices[0].routed_experts", f"{ROWS} rows", f"{ROWS - 1} rows"),
        ),
        "vllm-wrong-layers": BadCase(
            "vllm",
            vllm_completion(vllm.encode(routing(ROWS, layers_4), layers_4)),
            SpecMismatch,
            (v, "[rows, 3, 2]", f"[{ROWS}, 4, 2]"),
        ),
        "vllm-wrong-top-k": BadCase(
            "vllm",
            vllm_completion(vllm.encode(routing(ROWS, top_k_3), top_k_3)),
            SpecMismatch,
            (v, "[rows, 3, 2]", f"[{ROWS}, 3, 3]"),
        ),
        "lmdeploy-wrong-layers": BadCase(
            "lmdeploy",
            lmdeploy_generate(lmdeploy.encode_lists(routing(ROWS, layers_4))),
            SpecMismatch,
            (lm, "[rows, 3, 2]", f"[{ROWS}, 4, 2]"),
        ),
        "vllm-out-of-range": BadCase(
            "vllm",
            vllm_completion(vllm.encode(out_of_range, SPEC)),
            ExpertOutOfRange,
            (f"{v}, row 2, layer 1, slot 0", "[0, 8)", "found 8"),
        ),
        "sglang-out-of-range-after-start": BadCase(
            "sglang",
            sglang_generate(sglang.encode(sglang_bad, start_row=sglang_start)),
            ExpertOutOfRange,
            (f"{s}, row 5, layer 0, slot 1", "[0, 8)", "found 9"),
            start_row=sglang_start,
        ),
        "vllm-negative-int16": BadCase(
            "vllm",
            vllm_completion(vllm.encode(negative, SPEC, dtype="int16")),
            ExpertOutOfRange,
            (f"{v}, row 1, layer 2, slot 1", "[0, 8)", "found -1"),
        ),
        "sglang-negative-int32": BadCase(
            "sglang",
            sglang_generate(sglang.encode(negative)),
            ExpertOutOfRange,
            (f"{s}, row 1, layer 2, slot 1", "[0, 8)", "found -1"),
        ),
        "lmdeploy-negative": BadCase(
            "lmdeploy",
            lmdeploy_generate(lmdeploy.encode_lists(negative)),
            ExpertOutOfRange,
            (f"{lm}, row 1, layer 2, slot 1", "found -1"),
        ),
        "vllm-duplicate": BadCase(
            "vllm",
            vllm_completion(vllm.encode(duplicate, SPEC)),
            DuplicateExperts,
            (f"{v}, row 4, layer 2", "2 distinct ids", "found [5, 5]"),
        ),
        "lmdeploy-all-zero-row": BadCase(
            "lmdeploy",
            lmdeploy_generate(lmdeploy.encode_lists(zero_row)),
            DuplicateExperts,
            (f"{lm}, row 3, layer 0", "found [0, 0]", "all zeros"),
        ),
        "vllm-truncated-base64": BadCase(
            "vllm",
            vllm_completion(valid_b64[:-3]),
            MalformedPayload,
            (v, "not valid base64", f"{len(valid_b64) - 3} characters"),
        ),
        "sglang-invalid-base64-characters": BadCase(
            "sglang",
            sglang_generate("*" + sglang_valid[1:]),
            MalformedPayload,
            (s, "not valid base64", "length a multiple of 4"),
        ),
        "sglang-wrong-byte-length": BadCase(
            "sglang",
            sglang_generate(b64(base64.b64decode(sglang_valid) + b"\0\0\0\0"), completion=None),
            MalformedPayload,
            (s, "byte length", "a multiple of 24 bytes", f"{ROWS * 24 + 4} bytes"),
        ),
        "vllm-npy-short-data": BadCase(
            "vllm",
            vllm_completion(short_npy_b64(good.astype(np.uint8))),
            MalformedPayload,
            (v, "data length", f"{ROWS * 6} bytes for shape [{ROWS}, 3, 2]", f"{ROWS * 6 - 1}"),
        ),
        "vllm-not-npy": BadCase(
            "vllm",
            vllm_completion(b64(b"hello world!")),
            MalformedPayload,
            (v, "not an .npy", "magic"),
        ),
        "lmdeploy-ragged-lists": BadCase(
            "lmdeploy",
            lmdeploy_generate(ragged),
            MalformedPayload,
            (lm, "ragged", "[T][3][2] integers"),
        ),
        "lmdeploy-float-lists": BadCase(
            "lmdeploy", lmdeploy_generate(floats), DtypeError, (lm, "integers", "float")
        ),
        "lmdeploy-bool-lists": BadCase(
            "lmdeploy", lmdeploy_generate(bools), DtypeError, (lm, "integers", "bool")
        ),
        "lmdeploy-string-lists": BadCase(
            "lmdeploy", lmdeploy_generate(strings), MalformedPayload, (lm, "integers", "type str")
        ),
        "lmdeploy-huge-int-lists": BadCase(
            "lmdeploy", lmdeploy_generate(huge), MalformedPayload, (lm, "integers", "64 bits")
        ),
        "vllm-pickle": BadCase(
            "vllm",
            vllm_completion(pickle_b64(marker)),
            UnsafePayload,
            (v, "pickle", "not unpickled", ".npy"),
        ),
        "vllm-object-npy": BadCase(
            "vllm",
            vllm_completion(object_npy_b64(marker)),
            UnsafePayload,
            (v, "objects", "plain integer dtype", "found object"),
        ),
        "vllm-float-npy": BadCase(
            "vllm",
            vllm_completion(npy_b64(good.astype(np.float32))),
            DtypeError,
            (v, "integer", "float32"),
        ),
        "vllm-int8-for-256-experts": BadCase(
            "vllm",
            vllm_completion(npy_b64(routing(ROWS, SPEC_256).astype(np.int8))),
            DtypeError,
            (v, "cannot hold", "ids up to 255", "int8"),
            SPEC_256,
        ),
        "vllm-uint8-for-300-experts": BadCase(
            "vllm",
            vllm_completion(npy_b64(routing(ROWS).astype(np.uint8))),
            DtypeError,
            (v, "cannot hold", "ids up to 299", "uint8"),
            SPEC_300,
        ),
        "vllm-missing-routed-experts": BadCase(
            "vllm",
            vllm_completion(None),
            MalformedPayload,
            (v, "no routed_experts", "'routed_experts'", "routed-experts return enabled"),
        ),
        "sglang-missing-routed-experts": BadCase(
            "sglang",
            sglang_generate(None),
            MalformedPayload,
            (s, "no routed_experts", "routed-experts return enabled"),
        ),
        "lmdeploy-missing-routed-experts": BadCase(
            "lmdeploy",
            lmdeploy_generate(None),
            MalformedPayload,
            (lm, "no routed_experts", "routed-experts return enabled"),
        ),
        "lmdeploy-string-not-a-key": BadCase(
            "lmdeploy",
            lmdeploy_generate(KEY.upper()),
            MalformedPayload,
            (lm, "not an LMDeploy shared_store key", "56 lowercase hex", KEY.upper()[:20]),
        ),
        "lmdeploy-chat-string-not-a-key": BadCase(
            "lmdeploy",
            lmdeploy_chat("not-a-key"),
            MalformedPayload,
            ("lmdeploy choices[0].routed_experts", "shared_store key", "'not-a-key'"),
        ),
    }


BAD_CASE_NAMES = tuple(bad_cases(Path("unused-marker")))
GOOD_CASE_NAMES = tuple(good_cases())
