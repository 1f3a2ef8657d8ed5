"""Fuzzing ``routeplay inspect``: whatever the file holds, exit 0 with a report or exit 2
with a JSON refusal on the last line; never a traceback, never exit 1 for a bad body.

In process through typer's ``CliRunner`` (hypothesis-driven), and a few hostile files
through a real subprocess (``python -m routeplay.cli.main``). Settings and replaying a
failure: see ``test_fuzz_decoders``.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
from fuzzing import FUZZ, REFUSED, Deep, check, engine_cases, to_json_bytes
from hypothesis import given
from hypothesis import strategies as st
from typer.testing import CliRunner

from routeplay.cli.main import app
from routeplay.core import RouteSpec
from routeplay.core.wires import Engine

RUNNER = CliRunner()
_DIR = Path(tempfile.mkdtemp(prefix="routeplay-fuzz-inspect-"))
atexit.register(shutil.rmtree, _DIR, ignore_errors=True)


class InspectBroke(AssertionError):
    """``routeplay inspect`` answered something other than a report or a JSON refusal."""


def _geometry(spec: RouteSpec) -> list[str]:
    # Flags cannot name dense layers: a DENSE seed is then refused (SpecMismatch), which
    # is one more kind of input the command must refuse cleanly.
    return ["--layers", str(spec.num_layers), "--top-k", str(spec.top_k), "--experts", "8"]


def inspect_bytes(raw: bytes, engine: Engine, spec: RouteSpec, start: int) -> str:
    """Run ``routeplay inspect --json`` on ``raw`` in process; the last line's JSON."""
    path = _DIR / f"body-{os.getpid()}.json"
    path.write_bytes(raw)
    args = ["inspect", str(path), "--engine", engine.value, "--start-row", str(start), "--json"]
    result = RUNNER.invoke(app, args + _geometry(spec))
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise InspectBroke(f"exception {type(result.exception).__name__}: {result.exception}")
    if result.exit_code not in (0, 2):
        raise InspectBroke(f"exit {result.exit_code}: {result.output[-300:]}")
    lines = result.output.strip().splitlines()
    report = json.loads(lines[-1]) if lines else None
    if not isinstance(report, dict) or report.get("ok") is not (result.exit_code == 0):
        raise InspectBroke(f"last line is not the JSON verdict: {result.output[-300:]}")
    return "ok" if report["ok"] else REFUSED


@FUZZ
@given(engine_cases())
def test_inspect_on_mutated_bodies(case: tuple[Engine, RouteSpec, int, Any]) -> None:
    engine, spec, start, body = case
    raw = to_json_bytes(body)
    check(f"inspect-{engine.value}", lambda: inspect_bytes(raw, engine, spec, start))


@FUZZ
@given(st.binary(max_size=400), st.sampled_from(list(Engine)))
def test_inspect_on_raw_bytes(raw: bytes, engine: Engine) -> None:
    spec = RouteSpec(num_layers=3, top_k=2, num_experts=8)
    check("inspect-bytes", lambda: inspect_bytes(raw, engine, spec, 0))


HOSTILE_FILES = {
    "nested-100000": ("sglang", to_json_bytes({"meta_info": Deep(100_000)})),
    "int-5000-digits": ("sglang", b'{"meta_info": {"prompt_tokens": ' + b"9" * 5000 + b"}}"),
    "meta-info-not-object": ("sglang", b'{"meta_info": 5}'),
    "choices-not-objects": ("vllm", b'{"choices": [5, "x"], "usage": [], "sglext": 3}'),
    "long-string-in-lists": (
        "lmdeploy",
        json.dumps(
            {
                "meta_info": {
                    "prompt_tokens": 2,
                    "completion_tokens": 2,
                    "routed_experts": [[["x" * 1_000_000, 1]] * 3] * 3,
                }
            }
        ).encode(),
    ),
    "key-minus-one-rows": (
        "lmdeploy",
        json.dumps(
            {"meta_info": {"prompt_tokens": 0, "completion_tokens": 0, "routed_experts": "ab" * 28}}
        ).encode(),
    ),
}
"""Files that once crashed the command (the issue's list), with the engine to read them as."""


@pytest.mark.parametrize("name", sorted(HOSTILE_FILES))
def test_console_command_refuses_hostile_files_with_exit_2(tmp_path: Path, name: str) -> None:
    engine, raw = HOSTILE_FILES[name]
    path = tmp_path / "body.json"
    path.write_bytes(raw)
    command = [sys.executable, "-m", "routeplay.cli.main", "inspect", str(path)]
    flags = ["--engine", engine, "--layers", "3", "--top-k", "2", "--experts", "8", "--json"]
    done = subprocess.run(
        [*command, *flags],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["ok"] is False
    assert report["error"] in {"MalformedPayload", "RowCountMismatch", "DtypeError"}
