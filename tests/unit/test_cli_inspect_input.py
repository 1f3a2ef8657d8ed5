"""``routeplay inspect`` as a newcomer first runs it: a body piped into standard input
(``-`` or no path), read with a cap, checked against the geometry of a model's
``config.json`` (written here from transformers' own config classes, small sizes).

Exit status as everywhere in the CLI: 0 valid, 1 usage error, 2 payload refused.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from bodies import SPEC, cli_spec_args, routing, vllm_completion

from routeplay.cli.body import STDIN
from routeplay.cli.geometry import spec_from_config_file
from routeplay.cli.main import main
from routeplay.core import RouteSpec
from routeplay.core.formats import vllm

transformers = pytest.importorskip("transformers")

EXIT_OK, EXIT_USAGE, EXIT_REFUSED = 0, 1, 2
PROMPT, COMPLETION = 5, 4
SMALL = {
    "hidden_size": 16, "intermediate_size": 32, "moe_intermediate_size": 8,
    "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 64,
}  # fmt: skip


def _body(spec: RouteSpec) -> bytes:
    array = routing(PROMPT + COMPLETION - 1, spec)
    return json.dumps(vllm_completion(vllm.encode(array, spec), PROMPT, COMPLETION)).encode()


def _config_file(tmp_path: Path, config: Any, name: str = "config.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(config.to_dict()), encoding="utf-8")
    return path


def _stdin(monkeypatch: pytest.MonkeyPatch, body: bytes, *, tty: bool = False) -> None:
    stream = io.TextIOWrapper(io.BytesIO(body))
    monkeypatch.setattr("sys.stdin", stream)
    monkeypatch.setattr(stream, "isatty", lambda: tty)


def _run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    status = main(["inspect", "--engine", "vllm", *args])
    out, err = capsys.readouterr()
    return status, out, " ".join(err.split())


def _report(out: str) -> dict[str, Any]:
    report = json.loads(out.strip().splitlines()[-1])
    assert isinstance(report, dict)
    return report


# --- the geometry of a config.json --------------------------------------------------------


def test_qwen3_moe_every_layer_routed(tmp_path: Path) -> None:
    config = transformers.Qwen3MoeConfig(
        num_hidden_layers=4, num_experts=8, num_experts_per_tok=2, **SMALL
    )
    spec = spec_from_config_file(_config_file(tmp_path, config))
    assert (spec.num_layers, spec.top_k, spec.num_experts) == (4, 2, 8)
    assert spec.layer_map is None
    assert spec.name == "qwen3_moe"


def test_qwen3_moe_sparse_step_and_mlp_only_layers(tmp_path: Path) -> None:
    # Qwen's rule: MoE where (i + 1) % decoder_sparse_step == 0 and i not MLP-only.
    config = transformers.Qwen3MoeConfig(
        num_hidden_layers=8, num_experts=8, num_experts_per_tok=2, decoder_sparse_step=2,
        mlp_only_layers=[3], **SMALL,
    )  # fmt: skip
    spec = spec_from_config_file(_config_file(tmp_path, config))
    assert spec.layer_map == (1, 5, 7)
    assert (spec.num_layers, spec.decoder_layers) == (3, 8)


def test_deepseek_v3_dense_first_layers_and_no_mtp_layer(tmp_path: Path) -> None:
    config = transformers.DeepseekV3Config(
        num_hidden_layers=6, first_k_dense_replace=3, n_routed_experts=16,
        num_experts_per_tok=4, num_nextn_predict_layers=1, **SMALL,
    )  # fmt: skip
    spec = spec_from_config_file(_config_file(tmp_path, config))
    assert (spec.num_layers, spec.top_k, spec.num_experts) == (3, 4, 16)
    assert spec.layer_map == (3, 4, 5)
    assert spec.decoder_layers == 6  # the MTP layer (index 6) routes nothing of the answer


def test_mixtral(tmp_path: Path) -> None:
    config = transformers.MixtralConfig(
        num_hidden_layers=3, num_local_experts=4, num_experts_per_tok=2, **SMALL
    )
    spec = spec_from_config_file(_config_file(tmp_path, config))
    assert (spec.num_layers, spec.top_k, spec.num_experts) == (3, 2, 4)
    assert spec.layer_map is None
    assert spec.name == "mixtral"


# --- a body on standard input -------------------------------------------------------------


@pytest.mark.parametrize("path", [["-"], []], ids=["dash", "no-path"])
def test_a_piped_body_checked_against_a_config(
    path: list[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    config = transformers.DeepseekV3Config(
        num_hidden_layers=6, first_k_dense_replace=3, n_routed_experts=16,
        num_experts_per_tok=4, **SMALL,
    )  # fmt: skip
    config_path = _config_file(tmp_path, config)
    _stdin(monkeypatch, _body(spec_from_config_file(config_path)))
    status, out, err = _run(capsys, "--config", str(config_path), "--json", *path)
    assert status == EXIT_OK, err
    report = _report(out)
    assert (report["rows"], report["layers"], report["top_k"]) == (8, 3, 4)


def test_a_piped_body_of_the_wrong_model_is_refused_naming_stdin(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    config = transformers.MixtralConfig(
        num_hidden_layers=3, num_local_experts=4, num_experts_per_tok=1, **SMALL
    )
    _stdin(monkeypatch, _body(SPEC))  # top_k 2, the config says 1
    status, out, _ = _run(capsys, "--config", str(_config_file(tmp_path, config)), "--json", "-")
    assert status == EXIT_REFUSED
    report = _report(out)
    assert report["error"] == "SpecMismatch"
    assert f"at {STDIN}" in report["message"]


def test_an_empty_stdin_is_refused_as_empty(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _stdin(monkeypatch, b"  \n")
    status, out, _ = _run(capsys, *cli_spec_args(SPEC), "--json", "-")
    assert status == EXIT_REFUSED
    assert "response body is empty" in _report(out)["message"]


def test_no_path_on_a_terminal_is_a_usage_error_not_a_hang(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _stdin(monkeypatch, _body(SPEC), tty=True)
    status, out, err = _run(capsys, *cli_spec_args(SPEC))
    assert status == EXIT_USAGE
    assert "no path and a terminal on standard input" in err
    assert out == ""


# --- the size cap -------------------------------------------------------------------------


class _Endless(io.RawIOBase):
    """A stream that never ends (a body whose sender claims any size); counts reads."""

    def __init__(self) -> None:
        self.served = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer)
        view[:] = b" " * len(view)
        self.served += len(view)
        return len(view)


def test_a_body_over_the_cap_is_refused_after_reading_about_the_cap(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    endless = _Endless()
    monkeypatch.setattr(
        "sys.stdin", SimpleNamespace(buffer=io.BufferedReader(endless), isatty=lambda: False)
    )
    cap = 3 << 20
    status, out, err = _run(capsys, *cli_spec_args(SPEC), "--max-bytes", str(cap), "-")
    assert status == EXIT_USAGE
    assert f"expected at most {cap} bytes" in err
    assert "--max-bytes" in err
    assert out == ""
    assert endless.served <= cap + (2 << 20)  # stopped within a chunk of the cap


def test_a_file_over_the_cap_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "big.json"
    path.write_bytes(_body(SPEC))
    status, _, err = _run(capsys, *cli_spec_args(SPEC), "--max-bytes", "64", str(path))
    assert status == EXIT_USAGE
    assert "at big.json" in err


# --- config.json usage errors -------------------------------------------------------------


def test_a_config_without_moe_keys_is_a_usage_error_naming_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    llama = transformers.LlamaConfig(num_hidden_layers=2, **SMALL)
    path = _config_file(tmp_path, llama, name="llama.json")
    _stdin(monkeypatch, _body(SPEC))
    status, out, err = _run(capsys, "--config", str(path), "-")
    assert status == EXIT_USAGE
    assert "usage error: the model config has no MoE routing field" in err
    assert "num_experts, n_routed_experts, num_local_experts" in err
    assert "model_type 'llama'" in err
    assert "found llama.json without them" in err
    assert out == ""


def test_a_config_that_is_not_json_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "config.json"
    path.write_text("model_type: qwen3_moe\n", encoding="utf-8")
    status, _, err = _run(capsys, "--config", str(path), "-")
    assert status == EXIT_USAGE
    assert "the model config is not JSON" in err


def test_a_missing_config_file_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "nope" / "config.json"
    status, _, err = _run(capsys, "--config", str(missing), "-")
    assert status == EXIT_USAGE
    assert str(missing) in err  # the path, whole


@pytest.mark.parametrize(
    ("flags", "found"),
    [
        (["--config", "c.json", "--preset", "mixtral-8x7b"], "--config and --preset"),
        (["--config", "c.json", "--layers", "3"], "--config and --layers"),
        (["--layers", "3", "--top-k", "2"], "found --layers and --top-k"),
        ([], "none of them"),
    ],
    ids=["config-and-preset", "config-and-layers", "two-counts", "nothing"],
)
def test_geometry_from_exactly_one_place(
    flags: list[str], found: str, capsys: pytest.CaptureFixture[str]
) -> None:
    status, _, err = _run(capsys, *flags, "-")
    assert status == EXIT_USAGE
    assert "routing geometry from exactly one place" in err
    assert found in err
