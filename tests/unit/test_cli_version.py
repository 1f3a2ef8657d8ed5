"""``routeplay --version``: the installed distribution's version, exit status 0, no
command needed (an eager option, read before any command is looked up)."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

from routeplay.cli.main import main


def test_version_prints_the_installed_version_and_exits_0(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["--version"]) == 0
    out, err = capsys.readouterr()
    assert out == f"routeplay {version('routeplay')}\n"
    assert err == ""


def test_version_wins_over_a_command_after_it(capsys: pytest.CaptureFixture[str]) -> None:
    # Eager: the demo after it never starts (no Ray, no model).
    assert main(["--version", "demo"]) == 0
    assert capsys.readouterr().out.startswith("routeplay ")


def test_the_console_script_prints_the_version(tmp_path: Path) -> None:
    script = Path(sys.executable).parent / "routeplay"
    if not script.exists():
        pytest.skip("console script not installed next to the interpreter")
    done = subprocess.run(
        [str(script), "--version"], cwd=tmp_path, capture_output=True, text=True, timeout=60,
        check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"routeplay {version('routeplay')}"
