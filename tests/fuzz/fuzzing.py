"""What the fuzz tests share: the property check, the counters, the settings profiles, the
seed bodies and the strategies that mutate them.

The property is one sentence: every input ends in success or in a ``RouteplayError``;
any other exception is a bug. ``check`` runs one input under that property. Under pytest
an untyped exception propagates (hypothesis shrinks it and prints the blob to replay);
under the counting runner (``ROUTEPLAY_FUZZ_COUNT=1``, ``benchmarks/fuzz_long.py``) it is
counted and the run goes on, so one crash does not hide the next.

Profiles (``ROUTEPLAY_FUZZ``): ``ci`` (default, a few seconds per test) and ``long``
(thousands of inputs per test, for the counting runner).
"""

from __future__ import annotations

import base64
import copy
import io
import json
import os
import struct
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import cache
from typing import Any, Final

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from routeplay.core import RouteSpec
from routeplay.core.wires import ENGINES, Answer, BodyOptions, Engine
from routeplay.errors import RouteplayError

SPEC: Final = RouteSpec(num_layers=3, top_k=2, num_experts=8)
"""Small model: 3 MoE layers, top-2 of 8."""
DENSE: Final = RouteSpec(num_layers=2, top_k=2, num_experts=8, layer_map=(1, 3), total_layers=4)
"""The same with dense layers 0 and 2 (engines send every decoder layer)."""
KEY: Final = "5f" * 28
"""A well-formed 56-hex store key."""
_MUTABLE_LIST: Final = 64
"""Lists longer than this are mutated as a whole, never inside (keeps paths few)."""
HANG_S: Final = 5.0
"""An input taking longer than this counts as a hang."""

# ------------------------------------------------------------------ profiles

_BASE = settings(
    deadline=None,
    print_blob=True,  # a failure prints @reproduce_failure(...) to replay it exactly
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.filter_too_much,
        HealthCheck.large_base_example,
    ],
)
LONG_ROUND: Final = 1000
"""Inputs per call of a test under the long profile. The counting runner calls each test
several times (``--rounds``): hypothesis keeps what it explored of one call in memory, so
short calls keep a worker's memory flat however many inputs it runs in total."""
settings.register_profile("fuzz-ci", _BASE, max_examples=60)
settings.register_profile("fuzz-long", _BASE, max_examples=LONG_ROUND, database=None)
MODE: Final = os.environ.get("ROUTEPLAY_FUZZ", "ci")
FUZZ: Final = settings.get_profile("fuzz-long" if MODE == "long" else "fuzz-ci")
"""The settings every fuzz test runs under (a decorator)."""


def scaled(examples: int) -> settings:
    """``FUZZ`` with ``examples`` inputs in CI and ten times as many per long round (for
    a slow target, such as the engine server, that gets a smaller share in both)."""
    if MODE == "long":
        return settings(FUZZ, max_examples=examples * 10)
    return settings(FUZZ, max_examples=examples)


# ------------------------------------------------------------------ the property


@dataclass
class Tally:
    """Counts over every input ``check`` ran (one per process)."""

    inputs: Counter[str] = field(default_factory=Counter)
    refused: Counter[str] = field(default_factory=Counter)
    untyped: Counter[str] = field(default_factory=Counter)
    hangs: Counter[str] = field(default_factory=Counter)
    slowest_s: float = 0.0
    untyped_examples: list[str] = field(default_factory=list)


TALLY: Final = Tally()
COUNTING: Final = os.environ.get("ROUTEPLAY_FUZZ_COUNT") == "1"


REFUSED: Final = "refused"
"""What a target returns when it saw a clean refusal outside Python (an HTTP 4xx with a
JSON error, ``routeplay inspect`` exiting 2 with a JSON verdict)."""


def check(target: str, call: Callable[[], object]) -> object:
    """Run ``call`` under the property: success or a ``RouteplayError``, in < HANG_S."""
    TALLY.inputs[target] += 1
    started = time.perf_counter()
    try:
        result = call()
        if isinstance(result, str) and result == REFUSED:  # arrays compare elementwise
            TALLY.refused[target] += 1
        return result
    except RouteplayError:
        TALLY.refused[target] += 1
        return None
    except Exception as exc:
        if not COUNTING:
            raise
        TALLY.untyped[target] += 1
        if len(TALLY.untyped_examples) < 20:
            TALLY.untyped_examples.append(
                f"{target}: {type(exc).__name__}: {str(exc)[:200]}\n"
                + "".join(traceback.format_tb(exc.__traceback__)[-3:])
            )
        return None
    finally:
        spent = time.perf_counter() - started
        TALLY.slowest_s = max(TALLY.slowest_s, spent)
        if spent > HANG_S:
            TALLY.hangs[target] += 1


# ------------------------------------------------------------------ seed bodies


def _routing(spec: RouteSpec, rows: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    keys = rng.random((rows, spec.num_layers, spec.num_experts))
    return np.argsort(keys, axis=-1)[..., : spec.top_k].astype(np.uint16)


def _answer(spec: RouteSpec, prompt: int = 4, generated: int = 3) -> Answer:
    ids = tuple(range(1, generated + 1))
    return Answer(
        prompt_tokens=prompt,
        token_ids=ids,
        logprobs=tuple(-0.5 for _ in ids),
        finish_reason="length",
        routing=_routing(spec, prompt + generated - 1),
    )


def _put(rows: object) -> str:
    return KEY


@cache
def seed_bodies() -> tuple[tuple[Engine, RouteSpec, int, Any], ...]:
    """Valid bodies of every engine, endpoint and option, as (engine, spec, start, body),
    built by the real body builders (what the reference engine sends)."""
    out: list[tuple[Engine, RouteSpec, int, Any]] = []
    option_sets: dict[Engine, list[BodyOptions]] = {
        Engine.VLLM: [
            BodyOptions(endpoint="completions"),
            BodyOptions(endpoint="chat", start_row=2),
        ],
        Engine.SGLANG: [
            BodyOptions(endpoint="generate"),
            BodyOptions(endpoint="generate", start_row=3),
            BodyOptions(endpoint="generate", batched=True),
            BodyOptions(endpoint="generate", put=_put),
            BodyOptions(endpoint="completions"),
            BodyOptions(endpoint="chat", return_meta_info=True),
            BodyOptions(endpoint="chat", stream=True),
        ],
        Engine.LMDEPLOY: [
            BodyOptions(endpoint="generate"),
            BodyOptions(endpoint="generate", put=_put),
            BodyOptions(endpoint="chat"),
            BodyOptions(endpoint="messages"),
            BodyOptions(endpoint="chat", put=_put),
        ],
    }
    for engine, options in option_sets.items():
        for spec in (SPEC, DENSE):
            for option in options:
                answers = [_answer(spec), _answer(spec, 4, 2)]
                if engine is Engine.LMDEPLOY and option.endpoint != "chat":
                    answers = answers[:1]
                body = ENGINES[engine].build_body(answers, spec, option)
                out.append((engine, spec, option.start_row, body))
    return tuple(out)


# ------------------------------------------------------------------ hostile values


@dataclass(frozen=True)
class Deep:
    """A JSON list nested ``depth`` deep: built iteratively, written as text directly
    (``json.dumps`` itself would recurse)."""

    depth: int

    def build(self) -> list[Any]:
        return _nested(self.depth)


@cache
def _nested(depth: int) -> list[Any]:
    # Built once per depth and shared: no target mutates its input, and a 100,000-deep
    # list takes a tenth of a second to build.
    root: list[Any] = []
    node = root
    for _ in range(depth - 1):
        child: list[Any] = []
        node.append(child)
        node = child
    return root


def materialize(value: Any) -> Any:
    """``value`` with every ``Deep`` marker replaced by the nested list it stands for."""
    if isinstance(value, Deep):
        return value.build()
    if isinstance(value, dict):
        return {k: materialize(v) for k, v in value.items()}
    if isinstance(value, list) and len(value) <= _MUTABLE_LIST:  # longer: never mutated
        return [materialize(v) for v in value]
    return value


def to_json_bytes(value: Any) -> bytes:
    """JSON text of ``value``, ``Deep`` markers written as brackets (never recursing)."""
    deep: list[Deep] = []

    def marker(obj: object) -> str:
        if isinstance(obj, Deep):
            deep.append(obj)
            return f"\x00deep{len(deep) - 1}\x00"
        raise TypeError(type(obj).__name__)

    text = json.dumps(value, default=marker, allow_nan=True)
    for index, item in enumerate(deep):
        text = text.replace(f'"\\u0000deep{index}\\u0000"', "[" * item.depth + "]" * item.depth)
    return text.encode()


def npy_header(descr: str, shape: str, fortran: str = "False", version: int = 1) -> bytes:
    """An .npy file start with a hand-written header dict (any text in its fields)."""
    text = f"{{'descr': {descr}, 'fortran_order': {fortran}, 'shape': {shape}, }}".encode()
    pad = 64 - (10 + len(text) + 1) % 64 if version == 1 else 64 - (12 + len(text) + 1) % 64
    text = text + b" " * pad + b"\n"
    if version == 1:
        return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(text)) + text
    return b"\x93NUMPY" + bytes([version, 0]) + struct.pack("<I", len(text)) + text


_DESCRS: Final = [
    "'<u1'",
    "'|u1'",
    "'<u2'",
    "'>u2'",
    "'<i4'",
    "'<i8'",
    "'<u8'",
    "'<f4'",
    "'|b1'",
    "'|O'",
    "'<U4'",
    "'|S3'",
    "'<M8[s]'",
    "'|V4'",
    "'(2,)<u1'",
    "'(2,3)<i2'",
    "[('a', '<u1')]",
    "[('a', '<u1'), ('b', '|O')]",
    "'not a dtype'",
    "5",
    "None",
]


@st.composite
def npy_files(draw: st.DrawFn) -> bytes:
    """Near-valid .npy files: real and hostile descrs, shapes (huge, negative, zero-size
    with huge dims, 5,000 unary minus signs, deep parens, truncated), data of any length."""
    descr = draw(st.sampled_from(_DESCRS))
    dims = draw(
        st.lists(
            st.one_of(
                st.integers(0, 8),
                st.sampled_from([2**31, 2**63 - 1, 2**63, 2**64, -1, -(2**63)]),
            ),
            max_size=4,
        )
    )
    shape_text = "(" + "".join(f"{d}, " for d in dims) + ")"
    shape = draw(
        st.one_of(
            st.just(shape_text),
            st.just("(" + "-" * draw(st.integers(1, 6000)) + "1,)"),
            st.just("(" * draw(st.integers(1, 3000)) + ")" * draw(st.integers(0, 3000))),
            st.just(shape_text[: draw(st.integers(0, len(shape_text)))]),
            st.text(max_size=40),
        )
    )
    fortran = draw(st.sampled_from(["False", "True", "0", "'x'"]))
    raw = npy_header(descr, shape, fortran, draw(st.sampled_from([1, 2, 3])))
    if draw(st.booleans()):
        raw = raw[: draw(st.integers(0, len(raw)))]  # a truncated header
    return raw + draw(st.binary(max_size=96))


def b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def _npy(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


@st.composite
def payload_strings(draw: st.DrawFn) -> str:
    """Routing strings: truncated or corrupted base64, base64 of bad npy / odd lengths /
    pickles, keys of every near-valid form, long strings."""
    good = b64(_npy(_routing(SPEC, 6).astype(np.uint8)))
    kind = draw(st.integers(0, 8))
    if kind == 0:
        return good[: draw(st.integers(0, len(good)))]
    if kind == 1:
        cut = draw(st.integers(0, len(good) - 1))
        return good[:cut] + draw(st.sampled_from(["!", "=", " ", "\n", "é", "-", "_"])) + good[cut:]
    if kind == 2:
        return b64(draw(npy_files()))
    if kind == 3:
        return b64(draw(st.binary(max_size=200)))
    if kind == 4:
        return draw(st.sampled_from([KEY, KEY.upper(), KEY[:-1], KEY + "0", "g" * 56]))
    if kind == 5:
        return b64(b"\x80\x04\x95" + draw(st.binary(max_size=40)))  # a pickle's start
    if kind == 6:
        return "A" * draw(st.sampled_from([4, 4000, 40_000]))
    if kind == 7:
        return draw(st.text(max_size=64))
    return b64(np.zeros(draw(st.integers(0, 100)), "<i4").tobytes())


@cache
def hostile_values() -> st.SearchStrategy[Any]:
    """Values to put anywhere in a body: wrong types, huge and odd numbers, deep nesting,
    long strings, hostile routing strings, near-valid routing lists. The costly ones
    (100,000-deep nesting, megabyte strings, 100,000-element lists) are drawn about one
    time in ten so that a run spends its time on many inputs."""
    numbers = st.one_of(
        st.sampled_from(
            [0, -1, 1, 2**31, 2**63 - 1, 2**63, 2**64, -(2**63) - 1, 10**400, 10**4000]
        ),
        st.integers(),
        st.floats(allow_nan=True, allow_infinity=True),
        st.sampled_from([1e-320, 1e-39, 5e-324, -0.0, 1e308]),
    )
    scalars = st.one_of(st.none(), st.booleans(), numbers, st.text(max_size=20))
    leaf = st.one_of(st.integers(0, 9), scalars)
    cheap = st.one_of(
        scalars,
        payload_strings(),
        st.lists(st.lists(st.lists(leaf, max_size=3), max_size=4), max_size=5),
        st.builds(Deep, st.sampled_from([2, 50, 999, 1001, 3000])),
        st.dictionaries(st.text(max_size=8), scalars, max_size=3),
        st.lists(scalars, max_size=4),
    )
    # fresh objects each time (st.builds): mutations write into what they insert
    costly = st.one_of(
        st.builds(Deep, st.just(100_000)),
        st.builds(lambda: [[["x" * 1_000_000, 1] for _ in range(3)] for _ in range(2)]),
        st.builds(lambda: [[[True, False] for _ in range(3)] for _ in range(2)]),
        st.builds(lambda: [[[1.0, 2.0] for _ in range(3)] for _ in range(2)]),
        st.builds(lambda: [[[2**70, 1] for _ in range(3)] for _ in range(2)]),
        st.builds(lambda: list(range(100_000))),
        st.builds(lambda: "A" * 4_000_000),
    )
    return _one_in_ten(costly, cheap)


@st.composite
def _one_in_ten(
    draw: st.DrawFn, rare: st.SearchStrategy[Any], common: st.SearchStrategy[Any]
) -> Any:
    return draw(rare if draw(st.integers(0, 9)) == 0 else common)


def paths(value: Any) -> Iterator[tuple[Any, ...]]:
    """Every path (keys and indices) into a JSON value, the root included."""
    stack: list[tuple[tuple[Any, ...], Any]] = [((), value)]
    while stack:
        path, node = stack.pop()
        yield path
        if isinstance(node, dict):
            stack.extend(((*path, k), v) for k, v in node.items())
        elif isinstance(node, list) and len(node) <= _MUTABLE_LIST:
            stack.extend(((*path, i), v) for i, v in enumerate(node))


def _set(body: Any, path: tuple[Any, ...], value: Any, delete: bool) -> Any:
    if not path:
        return value
    parent = body
    for step in path[:-1]:
        parent = parent[step]
    if delete:
        del parent[path[-1]]
    else:
        parent[path[-1]] = value
    return body


@st.composite
def mutated(draw: st.DrawFn, body: Any) -> Any:
    """``body`` with one to three paths replaced by hostile values, deleted, or given an
    extra field (it may still contain ``Deep`` markers: ``materialize`` or
    ``to_json_bytes`` them)."""
    out = copy.deepcopy(body)
    for _ in range(draw(st.integers(1, 3))):
        candidates = sorted(paths(out), key=repr)
        path = candidates[draw(st.integers(0, len(candidates) - 1))]
        action = draw(st.integers(0, 9))
        if action == 0 and path:
            out = _set(out, path, None, delete=True)
        elif action == 1:
            holder = out if isinstance(out, dict) else None
            if holder is not None:
                holder[draw(st.text(max_size=12))] = draw(hostile_values())
        else:
            out = _set(out, path, draw(hostile_values()), delete=False)
    return out


@st.composite
def engine_cases(draw: st.DrawFn) -> tuple[Engine, RouteSpec, int, Any]:
    """A seed body of an engine drawn first (so each engine gets a third of the inputs),
    mutated (or, one time in eight, as it is)."""
    engine = draw(st.sampled_from(list(Engine)))
    seeds = [seed for seed in seed_bodies() if seed[0] is engine]
    engine, spec, start, body = seeds[draw(st.integers(0, len(seeds) - 1))]
    if draw(st.integers(0, 7)):
        body = draw(mutated(body))
    start = draw(st.one_of(st.just(start), st.integers(0, 8)))
    return engine, spec, start, body
