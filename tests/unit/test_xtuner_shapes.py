"""Where XTuner bites the library (issue 41), checked without XTuner:

- MTP layers: XTuner numbers its multi-token-prediction blocks' ``MoEDecoderLayer`` from
  ``num_hidden_layers`` on and replays only ``layer_idx < rollout_routed_experts.shape[1]``;
  ``ReplaySource.decoder_ids`` answers None for the spec's MTP layers (the router routes
  itself) and still refuses an index past them; the spec reads them from a config;
- XTuner's padding: zero rows for the SP split and random ids for pad sequences repeat
  experts; given the rows that are routing (``mask``), replay accepts them as padding and
  still refuses a repeated expert in a real row, and an id out of range anywhere;
- XTuner's version source: its worker never knows the weight version (its buffer stamps
  it at ``put``); rows are written ``Handle.UNSTAMPED`` and ``Handle.stamped`` labels the
  rows added since the last stamp, the earlier ones keeping theirs.
"""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from strategies import random_routing  # noqa: E402

from routeplay.core import Handle, InlineSource, RouteSpec, Segment, spec_from_hf_config  # noqa: E402
from routeplay.errors import (  # noqa: E402
    DuplicateExperts,
    ExpertOutOfRange,
    HandleError,
    MisuseError,
    RowCountMismatch,
    SpecMismatch,
)
from routeplay.train import ReplaySource  # noqa: E402

# Four decoder layers (the first dense) and one MTP layer, numbered 4 as XTuner does.
SPEC = RouteSpec(
    num_layers=3, top_k=2, num_experts=8, layer_map=(1, 2, 3), total_layers=4, mtp_layers=1
)
CPU = torch.device("cpu")


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# -- MTP layers ------------------------------------------------------------------------------


def test_mtp_layers_get_no_routing_and_past_them_is_refused() -> None:
    routes = random_routing(SPEC, 6, seed=1).astype(np.uint8)
    source = ReplaySource(routes, SPEC)
    assert [SPEC.is_mtp_layer(i) for i in range(6)] == [False] * 4 + [True, False]
    assert source.decoder_ids(4, device=CPU, rows=6) is None
    ids = source.decoder_ids(3, device=CPU, rows=6)
    assert ids is not None
    np.testing.assert_array_equal(ids.numpy(), routes[:, 2])
    with pytest.raises(SpecMismatch, match="out of range"):
        source.decoder_ids(5, device=CPU, rows=6)
    without = RouteSpec(num_layers=3, top_k=2, num_experts=8, layer_map=(1, 2, 3), total_layers=4)
    with pytest.raises(SpecMismatch, match="out of range"):
        ReplaySource(routes, without).decoder_ids(4, device=CPU, rows=6)


def test_mtp_layers_are_geometry_for_replay_not_for_the_payload() -> None:
    without = RouteSpec(num_layers=3, top_k=2, num_experts=8, layer_map=(1, 2, 3), total_layers=4)
    assert without == SPEC  # the payload is the same; routes validated for one replay on both
    assert "+1 MTP" in SPEC.describe()
    with pytest.raises(SpecMismatch, match="mtp_layers"):
        RouteSpec(num_layers=2, top_k=2, num_experts=8, mtp_layers=-1)


@pytest.mark.parametrize(
    ("extra", "mtp"),
    [
        ({"num_nextn_predict_layers": 1}, 1),  # Hugging Face DeepSeek-V3, GLM-4.5
        ({"mtp_config": SimpleNamespace(num_layers=2, share_weights=False)}, 2),  # XTuner
        ({"mtp_config": SimpleNamespace(num_layers=3, share_weights=True)}, 1),  # one layer
        ({"mtp_config": None}, 0),
        ({}, 0),
    ],
)
def test_the_spec_reads_mtp_layers_from_a_config(extra: dict[str, object], mtp: int) -> None:
    config = SimpleNamespace(
        num_hidden_layers=4,
        n_routed_experts=8,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
        model_type=None,  # XTuner's configs have none: no "None" name
        **extra,
    )
    spec = spec_from_hf_config(config)
    assert (spec.layer_map, spec.decoder_layers, spec.mtp_layers) == ((1, 2, 3), 4, mtp)
    assert spec.name == ""


# -- XTuner's padding ------------------------------------------------------------------------


def xtuner_padded(rows: int, pad: int, zeros: int) -> tuple[np.ndarray, np.ndarray]:
    """Real rows, a pad sequence of random ids (repeats within a row), zero rows."""
    real = random_routing(SPEC, rows, seed=3).astype(np.uint8)
    rng = np.random.default_rng(0)
    random_pad = rng.integers(0, SPEC.num_experts, (pad, SPEC.num_layers, SPEC.top_k))
    random_pad[0, :, :] = 5  # surely a repeated id
    padded = np.concatenate([real, random_pad.astype(np.uint8), np.zeros((zeros, 3, 2), np.uint8)])
    mask = np.arange(len(padded)) < rows
    return padded, mask


@pytest.mark.parametrize("kind", ["numpy", "tensor"])
def test_xtuners_padding_is_accepted_as_padding_and_refused_as_routing(kind: str) -> None:
    padded, mask = xtuner_padded(rows=7, pad=4, zeros=1)
    data = padded if kind == "numpy" else torch.from_numpy(padded)
    flags = mask if kind == "numpy" else torch.from_numpy(mask)
    with pytest.raises(DuplicateExperts, match="padding"):
        ReplaySource(data, SPEC)  # without a mask every row is routing
    source = ReplaySource(data, SPEC, mask=flags)
    ids = source.decoder_ids(1, device=CPU, rows=len(mask))
    assert ids is not None
    np.testing.assert_array_equal(ids.numpy(), padded[:, 0])  # replayed as laid out
    bad = padded.copy()
    bad[2] = 0  # a zero row where there is routing
    with pytest.raises(DuplicateExperts, match="real rows"):
        ReplaySource(bad if kind == "numpy" else torch.from_numpy(bad), SPEC, mask=flags)
    far = padded.copy()
    far[-1, 0, 0] = SPEC.num_experts  # out of range is refused anywhere
    with pytest.raises(ExpertOutOfRange):
        ReplaySource(far if kind == "numpy" else torch.from_numpy(far), SPEC, mask=flags)


def test_a_mask_of_other_rows_is_refused() -> None:
    padded, mask = xtuner_padded(rows=5, pad=2, zeros=1)
    with pytest.raises(RowCountMismatch, match="mask"):
        ReplaySource(padded, SPEC, mask=mask[:-1])


def test_a_providers_blocks_are_checked_on_their_real_rows() -> None:
    padded, mask = xtuner_padded(rows=6, pad=3, zeros=1)
    source = ReplaySource(lambda layer: padded[:, layer], SPEC, mask=mask)
    assert source.decoder_ids(2, device=CPU, rows=len(mask)) is not None
    bad = padded.copy()
    bad[0, 1] = [4, 4]
    with pytest.raises(DuplicateExperts):
        ReplaySource(lambda layer: bad[:, layer], SPEC, mask=mask).decoder_ids(
            2, device=CPU, rows=len(mask)
        )


def test_a_mask_is_checked_on_every_kind_of_routes() -> None:
    padded, mask = xtuner_padded(rows=6, pad=3, zeros=1)
    for bad in (mask.astype(np.uint8), mask[None, :], [True] * len(mask)):
        with pytest.raises(MisuseError, match="one bool per routing row"):
            ReplaySource(padded, SPEC, mask=bad)  # type: ignore[arg-type]
    source = ReplaySource(lambda layer: padded[:, layer], SPEC, mask=mask[:-1])
    with pytest.raises(RowCountMismatch, match="mask"):  # a provider's block: not ignored
        source.decoder_ids(2, device=CPU, rows=len(mask))
    on_host = ReplaySource(padded, SPEC, mask=torch.from_numpy(mask))  # numpy routes
    assert on_host.decoder_ids(1, device=CPU, rows=len(mask)) is not None


# -- XTuner's version source -----------------------------------------------------------------


def segment(source: InlineSource, start: int, stop: int, version: int) -> Segment:
    return Segment(source=source, start=start, stop=stop, spec=SPEC, weight_version=version)


def test_stamping_labels_only_the_rows_added_since_the_last_stamp() -> None:
    history = InlineSource(array=random_routing(SPEC, 5, seed=4).astype(np.uint8))
    resumed = InlineSource(array=random_routing(SPEC, 9, seed=5).astype(np.uint8))
    handle = Handle(SPEC, [segment(history, 0, 5, 0), segment(resumed, 5, 9, Handle.UNSTAMPED)])
    assert handle.unstamped
    stamped = handle.stamped(3)
    assert not stamped.unstamped
    assert stamped.weight_versions().tolist() == [0] * 5 + [3] * 4
    assert stamped.stamped(7) is stamped  # stamped rows keep their version
    assert stamped.rows == handle.rows
    assert stamped.sources() == handle.sources()


def test_stamping_merges_what_it_makes_continuous_and_refuses_no_version() -> None:
    rows = InlineSource(array=random_routing(SPEC, 8, seed=6).astype(np.uint8))
    handle = Handle(SPEC, [segment(rows, 0, 3, 2), segment(rows, 3, 8, Handle.UNSTAMPED)])
    assert len(handle.segments) == 2
    assert len(handle.stamped(2).segments) == 1  # one run of one version now
    with pytest.raises(HandleError, match="model step"):
        handle.stamped(Handle.UNSTAMPED)
