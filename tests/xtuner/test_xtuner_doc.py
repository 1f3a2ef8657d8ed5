"""``docs/xtuner.md`` runs as written, on XTuner's own classes (the checkout at
``../shared/xtuner``, commit ``b934f462``): its ``RolloutState`` carrying a
``SampleRouting``, its ``LMDeployWorker.generate`` with partial rollout over LMDeploy
0.18's own capture and protocol models, its ``ReplayBuffer`` (statuses, staleness,
storage, save and resume), its trace store and ``SessionServer`` with a BPE tokenizer,
each with the page's patches applied to XTuner's own files, ending with exact rows and
no lease, payload or engine key left.

A wrong call on the page fails here: the old row 1 (``start_row=cont.rows`` to the
LMDeploy adapter) fails on the first resumed sample, and the page's table of changed
XTuner lines is checked against its patch blocks.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from xtuner_doc import Patcher, blocks, run
from xtuner_doubles import (
    InProcessActor,
    LmdeployServer,
    build_bpe_tokenizer,
    xtuner_lmdeploy_worker,
)

DOC = Path(__file__).parents[2] / "docs" / "xtuner.md"

pytestmark = pytest.mark.usefixtures("ray_local")


@pytest.fixture(scope="module")
def tokenizer_path(xtuner_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_bpe_tokenizer(tmp_path_factory.mktemp("bpe"))


@pytest.fixture
def page(
    xtuner_root: Path, tokenizer_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[dict[str, Any], Patcher]]:
    """The names the page is given, XTuner's trace-store actor class served in this
    process under its own name, and the patcher (undone after the test)."""
    engine_instance = pytest.importorskip(
        "lmdeploy.pytorch.engine.engine_instance",
        reason="lmdeploy 0.18.0 is not installed (make test installs it with --no-deps)",
    )
    from transformers import AutoTokenizer
    from xtuner.v1.rl.rollout import trace_store

    monkeypatch.setattr(engine_instance, "_SHARED_STORE", None)  # finds this run's store
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_path))
    module = ModuleType("xtuner_doc_page")  # the page's classes resolve their module
    monkeypatch.setitem(sys.modules, module.__name__, module)
    namespace: dict[str, Any] = module.__dict__
    server = LmdeployServer(lambda: namespace["SPEC"], tokenizer)
    namespace.update(
        RUN=f"xtuner-doc-{tmp_path.name}",
        tokenizer_path=str(tokenizer_path),
        lmdeploy_server=server,
        make_worker=lambda: xtuner_lmdeploy_worker(server, tokenizer),
        checkpoint_dir=str(tmp_path / "checkpoint"),
    )
    # XTuner's GreedyRouter counts its int64 ids with torch.histc, which has a CUDA
    # kernel and no CPU one: on CPU the same counts are made in float (torch's gap, not
    # XTuner's code, is what this papers over).
    monkeypatch.setattr(torch, "histc", _histc_of_integers_on_cpu(torch.histc))
    actor_class = trace_store.RolloutTraceStore.__ray_actor_class__
    monkeypatch.setattr(trace_store, "_handle_cache", InProcessActor(actor_class()))
    patcher = Patcher(xtuner_root)
    try:
        yield namespace, patcher
    finally:
        patcher.undo()


def test_the_page_runs_on_xtuners_own_classes(page: tuple[dict[str, Any], Patcher]) -> None:
    namespace, patcher = page
    ran = list(run(DOC.read_text(encoding="utf-8"), namespace, patcher))
    assert len(ran) == len(blocks(DOC.read_text(encoding="utf-8")))
    # The page's last block checked that nothing is left; the flow did what it says.
    assert namespace["new_rows"] > 0
    assert namespace["sessions_released"] == ["7"]


def test_the_old_row_one_fails_on_the_first_resumed_sample(
    page: tuple[dict[str, Any], Patcher],
) -> None:
    """The page before this recipe told the reader to pass ``start_row=cont.rows`` to
    the LMDeploy adapter; the page's own flow fails on it, where a sample resumes."""
    namespace, patcher = page
    text = DOC.read_text(encoding="utf-8")
    call = 'ADAPTERS["lmdeploy"], body, spec=SPEC, writer=store, weight_version=Handle.UNSTAMPED'
    assert text.count(call) == 1
    old = text.replace(call, call + ", start_row=cont.rows")
    with pytest.raises(RuntimeError, match="LMDeploy has no routing start row"):
        for _ in run(old, namespace, patcher):
            pass
    # It failed in the resume, after the fresh group went through.
    assert namespace["group"]
    assert "resumed" in namespace
    namespace["store"].shutdown()
    from routeplay.store import leave_engine_store

    leave_engine_store(namespace["shared_store"], namespace["RUN"], end_if_last=True)


def test_the_table_of_xtuner_changes_matches_the_patch_blocks() -> None:
    text = DOC.read_text(encoding="utf-8")
    table: dict[str, tuple[int, int]] = {}
    for match in re.finditer(
        r"^\| `[^`]+` \| `([\w.]+)` \| [\d, -]+ \((\d+)\) \| (\d+) \|", text, re.M
    ):
        table[match[1]] = (int(match[2]), int(match[3]))
    patched: dict[str, tuple[int, int]] = {}
    for block in blocks(text):
        if block.patch is None:
            continue
        old, new = patched.get(block.patch.name, (0, 0))
        lines = len(block.code.rstrip("\n").split("\n"))
        patched[block.patch.name] = (old + block.patch.replaced, new + lines)
    assert table == patched


def _histc_of_integers_on_cpu(histc: Callable[..., Any]) -> Callable[..., Any]:
    def counted(values: Any, *args: Any, **kwargs: Any) -> Any:
        if values.device.type == "cpu" and not values.is_floating_point():
            return histc(values.float(), *args, **kwargs)
        return histc(values, *args, **kwargs)

    return counted
