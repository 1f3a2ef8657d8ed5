"""``examples/verl_flow.py`` runs to its end state: a verl-shaped step through verl
0.9.1's own classes (``TokenOutput``, ``DataProto``, ``get_tensordict``,
``prepare_micro_batches``, its Megatron engine's ``prepare_model_inputs``, its R3 alignment
and mask), with exact rows on every rank and no lease left, also after a rank raised."""

from __future__ import annotations

import pytest
from example_module import load_example

pytestmark = [pytest.mark.e2e, pytest.mark.long]

pytest.importorskip(
    "verl.workers.engine.megatron.transformer_impl",
    reason="verl's Megatron engine does not import (make test installs its dependencies)",
)


@pytest.mark.usefixtures("ray_local")
def test_the_verl_flow_ends_with_exact_rows_and_nothing_left() -> None:
    flow = load_example("verl_flow")
    report = flow.main()
    assert [rank.samples for rank in report.ranks] == [flow.PROMPTS * flow.N // flow.DP] * 2
    assert all(rank.micro_batches > 1 for rank in report.ranks)  # verl split by tokens
    rows = sum(flow.truth(s).shape[0] for s in range(flow.PROMPTS * flow.N))
    assert sum(rank.bytes_read for rank in report.ranks) == flow.SPEC.nbytes(rows)
    # 16 samples x 2 turns written by one coroutine each: every turn's writes and leases
    # go out together (2 + 2 calls here), never one call per sample (32 each).
    assert set(report.rollout_calls) == {"adopt_from_many", "lease_many"}
    assert all(1 <= calls <= 4 for calls in report.rollout_calls.values())
    assert report.leases_after_step == 0
    assert report.live_bytes_after_step == 0
    assert report.failed_step_error == "the rank's forward failed"
    assert report.leases_after_failed_step == 0
