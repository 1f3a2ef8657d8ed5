"""``routeplay inspect``: exit status 0 valid, 1 usage error, 2 payload refused.

Most tests call ``routeplay.cli.main.main`` in process; a few run the real command in
a subprocess (``python -m routeplay.cli.main`` and the ``routeplay`` console script).
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from bodies import (
    BAD_CASE_NAMES,
    GOOD_CASE_NAMES,
    PROMPT,
    SPEC,
    bad_cases,
    cli_spec_args,
    good_cases,
    routing,
    sglang_generate,
    vllm_completion,
)

from routeplay.cli.main import main
from routeplay.cli.options import _wire_name
from routeplay.core import RouteSpec, preset
from routeplay.core.formats import sglang, vllm
from routeplay.core.wires import WIRE_NAMES

EXIT_OK, EXIT_USAGE, EXIT_REFUSED = 0, 1, 2


def write_body(tmp_path: Path, body: Any, name: str = "body.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(body), encoding="utf-8")
    return path


def run_cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    status = main(list(args))
    out, err = capsys.readouterr()
    return status, out, err


def last_json(out: str) -> dict[str, Any]:
    lines = [line for line in out.splitlines() if line.strip()]
    assert lines, "no output"
    report = json.loads(lines[-1])
    assert isinstance(report, dict)
    return report


def canonical_sha(array: np.ndarray[Any, Any], spec: RouteSpec) -> str:
    return hashlib.sha256(np.ascontiguousarray(array, dtype=spec.dtype).tobytes()).hexdigest()


# --- valid bodies -------------------------------------------------------------------------


@pytest.mark.parametrize("name", GOOD_CASE_NAMES)
def test_inspect_json_reports_the_canonical_payload(
    name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    case = good_cases()[name]
    path = write_body(tmp_path, case.body)
    status, out, _ = run_cli(
        capsys,
        *("inspect", str(path), "--engine", case.engine, *cli_spec_args(case.spec), "--json"),
        *("--start-row", str(case.start_row)),
    )
    assert status == EXIT_OK, out
    report = last_json(out)
    assert report["ok"] is True
    assert report["prompt_tokens"] == case.prompt
    assert report["completion_tokens"] == case.completion
    if case.key is not None:
        assert report["kind"] == "key"
        assert report["key"] == case.key
        assert report["rows"] == case.prompt + case.completion - 1
        return
    expected = case.expected
    assert expected is not None
    spec = case.spec
    assert report["kind"] == "routes"
    assert report["rows"] == len(expected)
    assert report["start_row"] == case.start_row
    assert report["layers"] == spec.num_layers
    assert report["top_k"] == spec.top_k
    assert report["dtype"] == spec.dtype.name
    assert report["source_dtype"] == case.source_dtype
    assert report["nbytes"] == len(expected) * spec.num_layers * spec.top_k * spec.dtype.itemsize
    assert report["sha256"] == canonical_sha(expected, spec)


def test_start_row_flag_shifts_rows_in_the_report(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    full = routing(9)
    body = sglang_generate(sglang.encode(full, start_row=5), prompt=6, completion=4)
    path = write_body(tmp_path, body)
    args = ("inspect", str(path), "--engine", "sglang", *cli_spec_args(SPEC), "--json")
    status, out, _ = run_cli(capsys, *args, "--start-row", "5")
    assert status == EXIT_OK
    report = last_json(out)
    assert (report["rows"], report["start_row"]) == (4, 5)
    assert report["sha256"] == canonical_sha(full[5:], SPEC)


def test_missing_start_row_is_refused_with_the_request_field_to_pass(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    body = sglang_generate(sglang.encode(routing(9), start_row=5), prompt=6, completion=4)
    path = write_body(tmp_path, body)
    args = ("inspect", str(path), "--engine", "sglang", *cli_spec_args(SPEC), "--json")
    status, out, _ = run_cli(capsys, *args)
    assert status == EXIT_REFUSED
    report = last_json(out)
    assert report["error"] == "RowCountMismatch"
    assert "routed_experts_start_len=5" in report["message"]
    assert "--start-row 5" in report["message"]


def test_uint16_model_reports_uint16(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = RouteSpec(num_layers=2, top_k=3, num_experts=1000)
    array = routing(6, spec)
    array[0, 0] = [0, 1, 2]  # small ids do not change the dtype
    path = write_body(tmp_path, vllm_completion(vllm.encode(array, spec, dtype="uint16")))
    status, out, _ = run_cli(
        capsys, "inspect", str(path), "--engine", "vllm", *cli_spec_args(spec), "--json"
    )
    assert status == EXIT_OK
    report = last_json(out)
    assert (report["dtype"], report["source_dtype"]) == ("uint16", "uint16")
    assert report["nbytes"] == 6 * 2 * 3 * 2
    assert report["sha256"] == canonical_sha(array, spec)


def test_choice_option_picks_another_choice(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    first, second = routing(5), routing(6, seed=1)
    body = {
        "choices": [
            {"token_ids": [1, 2, 3], "routed_experts": vllm.encode(first, SPEC)},
            {"token_ids": [1, 2, 3, 4], "routed_experts": vllm.encode(second, SPEC)},
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": 7},
    }
    path = write_body(tmp_path, body)
    args = ("inspect", str(path), "--engine", "vllm", *cli_spec_args(SPEC), "--json")
    status, out, _ = run_cli(capsys, *args, "--choice", "1")
    assert status == EXIT_OK
    assert last_json(out)["sha256"] == canonical_sha(second, SPEC)
    status, out, _ = run_cli(capsys, *args, "--choice", "2")
    assert status == EXIT_REFUSED
    assert last_json(out)["error"] == "MalformedPayload"


def test_preset_replaces_geometry_flags(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = preset("qwen3-30b-a3b")
    array = routing(PROMPT + 2 - 1, spec, seed=2)
    path = write_body(tmp_path, vllm_completion(vllm.encode(array, spec), PROMPT, 2))
    status, out, _ = run_cli(
        capsys, "inspect", str(path), "--engine", "vllm", "--preset", "qwen3-30b-a3b", "--json"
    )
    assert status == EXIT_OK, out
    report = last_json(out)
    assert (report["layers"], report["top_k"], report["dtype"]) == (48, 8, "uint8")
    assert report["rows"] == len(array)
    assert report["sha256"] == canonical_sha(array, spec)


def test_preset_name_is_case_insensitive(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = preset("mixtral-8x7b")
    array = routing(3, spec)
    path = write_body(tmp_path, vllm_completion(vllm.encode(array, spec), 2, 2))
    status, out, _ = run_cli(
        capsys, "inspect", str(path), "--engine", "vllm", "--preset", "Mixtral-8x7B", "--json"
    )
    assert status == EXIT_OK, out
    assert last_json(out)["layers"] == 32


def test_summary_without_json_is_readable(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    array = routing(11)
    path = write_body(tmp_path, vllm_completion(vllm.encode(array, SPEC), 5, 7))
    status, out, _ = run_cli(capsys, "inspect", str(path), "--engine", "vllm", *cli_spec_args(SPEC))
    assert status == EXIT_OK
    assert "valid" in out
    match = re.search(r"(?m)^\W*rows\W+(\d+)", out)
    assert match is not None, out
    assert int(match.group(1)) == 11
    assert "uint8" in out
    with pytest.raises(json.JSONDecodeError):
        json.loads(out.strip().splitlines()[-1])


# --- refusals exit 2 ----------------------------------------------------------------------


@pytest.mark.parametrize("name", BAD_CASE_NAMES)
def test_every_bad_body_exits_2_with_the_error_class(
    name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    marker = tmp_path / "marker"
    case = bad_cases(marker)[name]
    path = write_body(tmp_path, case.body, name="resp.json")
    status, out, _ = run_cli(
        capsys,
        *("inspect", str(path), "--engine", case.engine, *cli_spec_args(case.spec), "--json"),
        *("--start-row", str(case.start_row)),
    )
    assert status == EXIT_REFUSED, out
    report = last_json(out)
    assert report["ok"] is False
    assert report["error"] == case.error.__name__
    message = report["message"]
    assert "at resp.json" in message
    assert "expected " in message
    assert "found " in message
    for text in case.mentions:
        assert text.replace(case.engine + " ", "resp.json ", 1) in message
    assert not marker.exists()


def _npy_with_shape(shape: tuple[int, ...], data: bytes) -> str:
    header = repr({"descr": "|u1", "fortran_order": False, "shape": shape}).encode("latin1")
    header += b" " * ((64 - (10 + len(header) + 1) % 64) % 64) + b"\n"
    raw = b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header + data
    return base64.b64encode(raw).decode("ascii")


@pytest.mark.parametrize(
    ("shape", "data"),
    [((-1, -2, 2), b"\0" * 4), ((2**70, 3, 2), b"")],
    ids=["negative-dims", "beyond-int64"],
)
def test_npy_with_impossible_shape_exits_2(
    shape: tuple[int, ...], data: bytes, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_body(tmp_path, vllm_completion(_npy_with_shape(shape, data)))
    status, out, _ = run_cli(
        capsys, "inspect", str(path), "--engine", "vllm", *cli_spec_args(SPEC), "--json"
    )
    assert status == EXIT_REFUSED
    assert last_json(out)["error"] == "MalformedPayload"


@pytest.mark.parametrize("extra", [1, -1], ids=["too-many", "too-few"])
def test_sglang_off_by_one_exits_2(
    extra: int, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    body = sglang_generate(sglang.encode(routing(6 + extra)), prompt=4, completion=3)
    path = write_body(tmp_path, body)
    status, out, _ = run_cli(
        capsys, "inspect", str(path), "--engine", "sglang", *cli_spec_args(SPEC), "--json"
    )
    assert status == EXIT_REFUSED
    assert last_json(out)["ok"] is False


def test_body_that_is_not_json_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "body.json"
    path.write_text('{"choices": [', encoding="utf-8")
    status, out, _ = run_cli(
        capsys, "inspect", str(path), "--engine", "vllm", *cli_spec_args(SPEC), "--json"
    )
    assert status == EXIT_REFUSED
    report = last_json(out)
    assert (report["ok"], report["error"]) == (False, "MalformedPayload")
    assert "not JSON" in report["message"]
    assert "line 1" in report["message"]


def test_refusal_without_json_names_the_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    case = bad_cases(tmp_path / "marker")["vllm-duplicate"]
    path = write_body(tmp_path, case.body)
    status, out, _ = run_cli(capsys, "inspect", str(path), "--engine", "vllm", *cli_spec_args(SPEC))
    assert status == EXIT_REFUSED
    flat = " ".join(out.split())
    assert "refused (DuplicateExperts)" in flat
    assert "row 4, layer 2" in flat


# --- usage errors exit 1 ------------------------------------------------------------------


@pytest.fixture
def good_body(tmp_path: Path) -> Path:
    return write_body(tmp_path, good_cases()["vllm-completion"].body)


def test_missing_file_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # A path longer than any terminal: the message keeps it whole (copyable), unwrapped.
    missing = tmp_path / ("d" * 150) / "nope.json"
    status, out, err = run_cli(
        capsys, "inspect", str(missing), "--engine", "vllm", *cli_spec_args(SPEC), "--json"
    )
    assert status == EXIT_USAGE
    assert "usage error" in err
    assert str(missing) in err
    assert out == ""


@pytest.mark.parametrize(
    "drop", ["--layers", "--top-k", "--experts"], ids=["layers", "top-k", "experts"]
)
def test_missing_geometry_without_preset_is_a_usage_error(
    drop: str, good_body: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = cli_spec_args(SPEC)
    index = args.index(drop)
    del args[index : index + 2]
    status, _, err = run_cli(capsys, "inspect", str(good_body), "--engine", "vllm", *args)
    assert status == EXIT_USAGE
    assert "--preset" in err


def test_unknown_engine_is_a_usage_error(
    good_body: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status, _, err = run_cli(
        capsys, "inspect", str(good_body), "--engine", "tgi", *cli_spec_args(SPEC)
    )
    assert status == EXIT_USAGE
    assert "tgi" in err


def test_top_k_above_experts_is_a_usage_error(
    good_body: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status, _, err = run_cli(
        capsys,
        "inspect",
        str(good_body),
        "--engine",
        "vllm",
        *["--layers", "3", "--top-k", "9", "--experts", "8"],
    )
    assert status == EXIT_USAGE
    assert "top_k cannot exceed num_experts" in err


def test_unknown_preset_is_a_usage_error(
    good_body: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status, _, err = run_cli(
        capsys, "inspect", str(good_body), "--engine", "vllm", "--preset", "gpt-5"
    )
    assert status == EXIT_USAGE
    assert "unknown model preset" in err


def test_missing_engine_option_is_a_usage_error(
    good_body: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status, _, _ = run_cli(capsys, "inspect", str(good_body), *cli_spec_args(SPEC))
    assert status == EXIT_USAGE


def test_no_arguments_shows_help_and_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, err = run_cli(capsys)
    assert status == EXIT_USAGE
    assert "inspect" in out + err


# --- the real command ---------------------------------------------------------------------


def _subprocess(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONIOENCODING": "utf-8"}
    return subprocess.run(
        args, cwd=cwd, env=env, capture_output=True, text=True, timeout=60, check=False
    )


def test_python_dash_m_runs_the_cli(tmp_path: Path) -> None:
    case = good_cases()["sglang-start-len"]
    path = write_body(tmp_path, case.body)
    done = _subprocess(
        [
            *(sys.executable, "-m", "routeplay.cli.main", "inspect", str(path)),
            *("--engine", "sglang", *cli_spec_args(case.spec), "--json"),
            *("--start-row", str(case.start_row)),
        ],
        tmp_path,
    )
    assert done.returncode == EXIT_OK, done.stderr
    report = last_json(done.stdout)
    assert report["ok"] is True
    assert report["start_row"] == case.start_row
    assert case.expected is not None
    assert report["sha256"] == canonical_sha(case.expected, case.spec)


def test_console_script_refuses_a_pickle_without_running_it(tmp_path: Path) -> None:
    script = Path(sys.executable).parent / "routeplay"
    if not script.exists():
        pytest.skip("console script not installed next to the interpreter")
    marker = tmp_path / "marker"
    case = bad_cases(marker)["vllm-pickle"]
    path = write_body(tmp_path, case.body)
    done = _subprocess(
        [str(script), "inspect", str(path), "--engine", "vllm", *cli_spec_args(SPEC), "--json"],
        tmp_path,
    )
    assert done.returncode == EXIT_REFUSED, done.stderr
    report = last_json(done.stdout)
    assert (report["ok"], report["error"]) == (False, "UnsafePayload")
    assert not marker.exists()
    assert not list(tmp_path.glob("marker*"))


def test_console_script_usage_error_exits_1(tmp_path: Path) -> None:
    done = _subprocess(
        [
            *(sys.executable, "-m", "routeplay.cli.main", "inspect", "missing.json"),
            *("--engine", "vllm", *cli_spec_args(SPEC)),
        ],
        tmp_path,
    )
    assert done.returncode == EXIT_USAGE
    assert "usage error" in done.stderr


def test_a_body_that_is_not_utf8_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "latin1.json"
    path.write_bytes(b'{"meta_info": "\xff\xfe"}')
    status = main(
        ["inspect", str(path), "--engine", "sglang", "--preset", "qwen3-30b-a3b", "--json"]
    )
    assert status == 2
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["error"] == "MalformedPayload"
    assert "UTF-8" in report["message"]


@pytest.mark.parametrize("command", ["demo", "soak"])
def test_an_unknown_engine_format_is_a_usage_error_that_lists_the_wires(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # Refused while parsing: nothing of the command runs (no Ray, no model).
    status, out, err = run_cli(capsys, command, "--engine-format", "tgi")
    assert status == EXIT_USAGE
    assert "'tgi' is not one of" in err
    assert all(name in err for name in WIRE_NAMES)
    assert out == ""


def test_every_registered_wire_name_is_an_engine_format() -> None:
    assert [_wire_name(name) for name in WIRE_NAMES] == list(WIRE_NAMES)


def test_an_unknown_trainer_dtype_is_a_usage_error_that_lists_the_dtypes(
    capsys: pytest.CaptureFixture[str],
) -> None:
    status, out, err = run_cli(capsys, "demo", "--trainer-dtype", "fp8")
    assert status == EXIT_USAGE
    assert "'fp8' is not one of fp32, float32, bf16, bfloat16" in err
    assert out == ""


def test_an_unknown_demo_recipe_is_a_usage_error_before_anything_starts(
    capsys: pytest.CaptureFixture[str],
) -> None:
    status, out, err = run_cli(capsys, "demo", "--recipe", "huge")
    assert status == EXIT_USAGE
    assert "usage error: unknown demo recipe" in err
    assert "default" in err  # the recipes it knows
    assert out == ""


def test_bench_refuses_quick_and_smoke_together(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, err = run_cli(capsys, "bench", "--quick", "--smoke")
    assert status == EXIT_USAGE
    assert "--quick and --smoke exclude each other" in err
    assert out == ""
