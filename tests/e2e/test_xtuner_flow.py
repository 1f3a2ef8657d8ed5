"""``examples/xtuner_flow.py`` runs to its end state: XTuner-shaped rollout, buffer, trace
trie and trainer on routeplay, with exact rows on every rank and nothing left behind."""

from __future__ import annotations

import pytest
from example_module import load_example

pytestmark = pytest.mark.e2e


@pytest.mark.usefixtures("ray_local")
def test_the_xtuner_flow_ends_with_exact_rows_and_nothing_left() -> None:
    flow = load_example("xtuner_flow")
    report = flow.main()
    # The resumed member stored only its new rows (4 tokens past its abort), then was
    # aborted again and expired inside its group (the other two members stayed).
    assert report.resumed_new_rows == 4
    assert report.resumed_bytes == flow.SPEC.nbytes(4)
    assert report.expired == [14]
    # Two steps: 3 + 2 samples, then 3; every DP x SP rank read exact rows in 3 passes.
    step = report.step
    assert step.samples == 8
    assert step.ranks == 2 * flow.DP * flow.SP
    assert step.padding_packs >= 1
    assert step.rows_checked > 0
    assert step.forwards % 3 == 0
    assert (report.leases, report.live_payloads, report.engine_keys, report.trie_leases) == (
        0,
        0,
        0,
        0,
    )
