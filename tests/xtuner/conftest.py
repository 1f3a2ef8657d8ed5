"""XTuner's own code, from the checkout beside the project (``../shared/xtuner``, XTuner at
``b934f462``: its v1 RL code is not on the package index). Tests here skip, saying why,
where that folder is absent; CI has it."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

XTUNER = Path(__file__).parents[2] / ".." / "shared" / "xtuner"


@pytest.fixture(scope="session")
def xtuner_root() -> Iterator[Path]:
    """The XTuner checkout, importable as ``xtuner`` while the tests here run."""
    root = XTUNER.resolve()
    if not (root / "xtuner" / "v1" / "rl" / "replay_buffer.py").is_file():
        pytest.skip(f"XTuner's checkout is not at {root} (CI has it: ../shared/xtuner)")
    sys.path.insert(0, str(root))
    try:
        yield root
    finally:
        sys.path.remove(str(root))
