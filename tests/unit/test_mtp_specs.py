"""Multi-token-prediction layers survive where a spec is rebuilt: the presets of models
with MTP blocks and a buffer checkpoint's spec (a review found both dropping them, so a
restored spec refused XTuner's MTP router where the original answered None)."""

from __future__ import annotations

import numpy as np
import torch

from routeplay.core import preset
from routeplay.rollout.checkpoint import _spec_from_record, _spec_record
from routeplay.train import ReplaySource


def test_presets_of_models_with_mtp_blocks_carry_them() -> None:
    assert [preset(name).mtp_layers for name in ("deepseek-v3", "glm-4.5", "glm-4.5-air")] == [
        1,
        1,
        1,
    ]
    assert preset("kimi-k2").mtp_layers == 0
    spec = preset("deepseek-v3")
    routes = np.zeros((4, spec.num_layers, spec.top_k), dtype=spec.dtype)
    routes[:] = np.arange(spec.top_k, dtype=spec.dtype)
    source = ReplaySource(routes, spec)
    assert source.decoder_ids(61, device=torch.device("cpu"), rows=4) is None  # the MTP block


def test_a_checkpoints_spec_keeps_its_mtp_layers() -> None:
    spec = preset("deepseek-v3")
    again = _spec_from_record(_spec_record(spec))
    assert again == spec
    assert again.mtp_layers == 1
    old = {k: v for k, v in _spec_record(spec).items() if k != "mtp_layers"}
    assert _spec_from_record(old).mtp_layers == 0  # a record from before the field
