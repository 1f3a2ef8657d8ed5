"""``load_buffer`` on a real checkpoint (``save_buffer``'s own output) whose
``buffer.json`` a hypothesis strategy mutates at one place: the buffer loads, or a typed
routeplay error refuses it; never another exception, and nothing it leased stays leased.
A checkpoint is outside data (docs/security.md)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from routeplay.core import RouteSpec, canonicalize
from routeplay.errors import RouteplayError
from routeplay.rollout import BufferConfig, Origin, RolloutState, Status, load_buffer, save_buffer
from routeplay.store import RouteStore, StoreConfig

SPEC = RouteSpec(num_layers=2, top_k=2, num_experts=8)
VALUES = (
    st.none()
    | st.booleans()
    | st.integers(-(2**40), 2**40)
    | st.text(max_size=6)
    | st.lists(st.integers(-3, 20), max_size=4)
    | st.dictionaries(st.text(max_size=4), st.integers(-3, 20), max_size=3)
)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A buffer of two groups (one member resumed: two segments), saved once."""
    store = RouteStore.local(StoreConfig(run="fuzz-checkpoint-save"))
    folder = tmp_path_factory.mktemp("ckpt")
    buffer = BufferConfig().build(store)
    rng = np.random.default_rng(0)
    for group in ("g0", "g1"):
        members = []
        for member in range(2):
            sid = f"{group}-{member}"
            state = RolloutState(sample_id=sid, group_id=group, prompt_ids=(1, 2, 3))
            state = state.extend((4, 5), (-0.1, -0.2), 1).with_status(Status.COMPLETED)
            ids = np.argsort(rng.random((state.tokens - 1, 2, 8)), axis=-1)[..., :2]
            handle = store.put(canonicalize(ids.astype(np.uint8), SPEC), weight_version=1)
            lease = store.acquire(handle, f"rollout/{sid}")
            members.append(
                state.with_sample_routing(state.routing.attach(handle, lease, Origin.PRODUCED))
            )
        buffer.add(group, members)
    save_buffer(buffer, folder, SPEC)
    buffer.close()
    return folder


def _paths(node: Any, at: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every place in a JSON value (keys and list indices from the root)."""
    found = [at]
    if isinstance(node, dict):
        for key, value in node.items():
            found += _paths(value, (*at, key))
    elif isinstance(node, list):
        for index, value in enumerate(node):
            found += _paths(value, (*at, index))
    return found


def _replaced(node: Any, at: tuple[Any, ...], value: Any) -> Any:
    if not at:
        return value
    copy = dict(node) if isinstance(node, dict) else list(node)
    copy[at[0]] = _replaced(node[at[0]], at[1:], value)
    return copy


@settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_a_mutated_checkpoint_loads_or_is_refused_typed(
    saved: Path, tmp_path: Path, data: st.DataObject
) -> None:
    meta = json.loads((saved / "buffer.json").read_text(encoding="utf-8"))
    at = data.draw(st.sampled_from(_paths(meta)[1:]))
    mutated = _replaced(meta, at, data.draw(VALUES))
    folder = tmp_path / "mutated"
    shutil.rmtree(folder, ignore_errors=True)
    shutil.copytree(saved, folder)
    (folder / "buffer.json").write_text(json.dumps(mutated), encoding="utf-8")
    store = RouteStore.local(StoreConfig(run="fuzz-checkpoint-load"))
    try:
        buffer = load_buffer(folder, store, BufferConfig())
    except RouteplayError:
        pass
    else:
        buffer.close()
    assert store.leaks() == []
    assert store.stats().leases == 0
