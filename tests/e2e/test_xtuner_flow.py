"""``examples/xtuner_flow.py`` runs to its end state across Ray actors: XTuner-shaped
rollout worker (with its SessionServer), buffer, text-keyed trace trie and one trainer
actor per SP rank, the samples pickled between them, a BPE tokenizer and an MTP layer;
one trainer rank killed mid-step; exact rows on every rank and nothing left behind."""

from __future__ import annotations

import pytest
from example_module import load_example

pytestmark = [pytest.mark.e2e, pytest.mark.long]


@pytest.mark.usefixtures("ray_local")
def test_the_xtuner_flow_ends_with_exact_rows_and_nothing_left() -> None:
    flow = load_example("xtuner_flow")
    report = flow.main()
    # The aborted member resumed and stored only its new rows.
    assert report.resumed_new_rows > 0
    assert report.resumed_bytes == flow.SPEC.nbytes(report.resumed_new_rows)
    # The stale group expired inside its group (XTuner's formula) and regenerated.
    assert report.expired == [20, 21]
    # The driver's copies, stale once the buffer took the samples over, released nothing.
    assert report.stale_copy_released == 0
    # Text-keyed trie with a BPE tokenizer: the engine's tokens are not the text's
    # encoding; a second turn stored only the rows its prefix lacked.
    assert report.bpe_differs
    assert 0 < report.turn_two_bytes < flow.SPEC.nbytes(report.turn_two_tokens)
    # The killed rank's leases were named by leaks() under its holder, and revoked.
    assert report.killed_rank_leaks
    assert set(report.killed_rank_leaks) == {"train/step-1/sp1"}
    assert report.revoked == len(report.killed_rank_leaks)
    # Two steps of two SP ranks (a fresh rank redid the killed one's share), three passes
    # each; XTuner's padding accepted as padding, a zero row of routing refused.
    assert report.samples_trained == 2 + 3 + 2
    assert report.ranks == 2 * flow.SP
    assert report.forwards == 3 * report.ranks
    assert report.rows_checked > 0
    assert report.padding_rows > 0
    assert report.refused == report.ranks
    assert (report.leases, report.live_payloads, report.engine_keys, report.trie_leases) == (
        0,
        0,
        0,
        0,
    )
