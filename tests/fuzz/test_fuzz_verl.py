"""Fuzzing routeplay's verl boundary: ``TOKEN_OUTPUT.read`` (a verl ``TokenOutput`` and the
prompt it answered) and ``handles_in`` (the batch's handle column). Success or a
``RouteplayError`` (``fuzzing.check``), never anything else.

The outputs are verl 0.9.1's own ``TokenOutput`` (pydantic: ``routed_experts`` takes any
value) with valid routing mutated: wrong shapes, dtypes, negative and huge ids, NaN,
ragged and nested lists, strings, None, tensors, row counts off by one, prompts of any
length and type; the columns mix handles with anything else.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from fuzzing import FUZZ, SPEC, check, hostile_values
from hypothesis import given
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
replica = pytest.importorskip("verl.workers.rollout.replica", reason="verl is not installed")

from routeplay.core import Handle  # noqa: E402
from routeplay.integrations.verl import TOKEN_OUTPUT, VerlTurn, handles_in  # noqa: E402


@st.composite
def routed(draw: st.DrawFn, rows: int) -> Any:
    """Near-valid ``routed_experts`` for ``rows`` rows, often mutated."""
    keys = np.random.default_rng(draw(st.integers(0, 2**16))).random((rows, 3, 8))
    valid = np.argsort(keys, axis=-1)[..., : SPEC.top_k]
    kind = draw(st.sampled_from(["valid", "rows", "shape", "dtype", "ids", "list", "odd"]))
    if kind == "rows":
        return valid[: max(0, rows + draw(st.integers(-2, 2)))]
    if kind == "shape":
        return valid.reshape(-1)[: draw(st.integers(0, valid.size))]
    if kind == "dtype":
        return valid.astype(draw(st.sampled_from([np.float32, np.int8, np.uint64, np.bool_])))
    if kind == "ids" and valid.size:
        out = valid.astype(np.int64)
        out.flat[draw(st.integers(0, out.size - 1))] = draw(
            st.sampled_from([-1, 8, 2**40, -(2**63)])
        )
        return out
    if kind == "list":
        out = valid.tolist()
        if out and draw(st.booleans()):
            out[0] = out[0][:1]  # ragged
        return out
    if kind == "odd":
        return draw(hostile_values())
    return draw(st.sampled_from([valid, torch.from_numpy(valid), valid.astype(np.int16)]))


@st.composite
def turns(draw: st.DrawFn) -> VerlTurn:
    prompt = draw(st.integers(0, 6))
    tokens = draw(st.lists(st.integers(0, 63), max_size=5))
    routes = draw(routed(max(0, prompt + len(tokens) - 1)))
    output = replica.TokenOutput(token_ids=tokens, routed_experts=routes)
    prompt_ids: Any = draw(st.sampled_from([list(range(prompt)), tuple(range(prompt))]))
    return VerlTurn(prompt_ids, output)


@FUZZ
@given(turns())
def test_token_output_reads_or_refuses_typed(turn: VerlTurn) -> None:
    check("verl.TOKEN_OUTPUT.read", lambda: TOKEN_OUTPUT.read(turn, spec=SPEC))


@FUZZ
@given(st.lists(st.one_of(st.just(Handle(SPEC)), hostile_values()), max_size=6))
def test_handle_column_reads_or_refuses_typed(values: list[Any]) -> None:
    column = np.empty(len(values), dtype=object)
    for index, value in enumerate(values):
        column[index] = value
    check("verl.handles_in", lambda: handles_in({"routeplay_routing": column}))
