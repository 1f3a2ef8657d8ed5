"""routeplay handles ride verl 0.9.1's own batch code as a ``non_tensor_batch`` column.

verl builds its non-tensor columns with ``np.array(values, dtype=object)``
(``DataProto.from_dict``), then chunks, concatenates, reorders, repeats (GRPO's
``n`` samples per prompt) and pickles the batch between the driver and the workers. A
handle that numpy took for a sequence (``__len__`` and ``__getitem__``) was refused there
(``HandleError``); each operation must give back the same handles, with the same rows, in
the rows the tensors went to.
"""

from __future__ import annotations

import pickle
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
protocol = pytest.importorskip("verl.protocol", reason="verl is not installed (make test)")

from routeplay.core import Handle, RouteSpec, Segment, StoreRef  # noqa: E402

SPEC = RouteSpec(num_layers=2, top_k=2, num_experts=8)
COLUMN = "routeplay_routing"


def _handle(index: int) -> Handle:
    """A distinct handle per sample: a stored prompt shared by the group (GRPO), then
    the sample's own payload."""
    prompt = StoreRef(payload_id=f"prompt-{index // 4}", run="verl", rows=16)
    own = StoreRef(payload_id=f"own-{index}", run="verl", rows=index + 3)
    return Handle(
        SPEC,
        (
            Segment(source=prompt, start=0, stop=16, spec=SPEC),
            Segment(source=own, start=0, stop=index + 3, spec=SPEC),
        ),
    )


def _batch(count: int) -> Any:
    handles = [_handle(i) for i in range(count)]
    return protocol.DataProto.from_dict(
        tensors={"uid": torch.arange(count)}, non_tensors={COLUMN: handles}
    )


def _check(batch: Any) -> None:
    """Every row's handle is the one built for the sample that row holds."""
    column = batch.non_tensor_batch[COLUMN]
    assert column.dtype == object
    assert column.shape == (len(batch),)
    for uid, handle in zip(batch.batch["uid"].tolist(), column, strict=True):
        assert isinstance(handle, Handle)
        assert handle == _handle(uid)
        assert handle.rows == 16 + uid + 3


def test_numpy_keeps_handles_whole_in_an_object_column() -> None:
    handles = [_handle(i) for i in range(4)]
    column = np.array(handles, dtype=object)
    assert column.shape == (4,)
    assert list(column) == handles
    assert _handle(0)  # truthiness is rows > 0, as before
    assert not Handle(SPEC)


def test_handles_survive_verls_batch_operations() -> None:
    batch = _batch(8)
    _check(batch)
    repeated = batch.repeat(repeat_times=4, interleave=True)  # GRPO: n samples a prompt
    _check(repeated)
    assert repeated.batch["uid"].tolist()[:8] == [0, 0, 0, 0, 1, 1, 1, 1]
    chunks = repeated.chunk(4)  # one per DP rank
    for chunk in chunks:
        _check(chunk)
    _check(protocol.DataProto.concat(chunks))
    shuffled = repeated.select_idxs(np.random.default_rng(0).permutation(len(repeated)))
    _check(shuffled)
    reordered = _batch(8)
    reordered.reorder(torch.tensor([7, 3, 5, 1, 0, 2, 4, 6]))
    _check(reordered)
    _check(pickle.loads(pickle.dumps(shuffled)))
    for part in repeated.split(5):
        _check(part)
    _check(batch.union(protocol.DataProto.from_dict(tensors={"uid": torch.arange(8)})))
