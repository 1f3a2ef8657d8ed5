"""A tour of the engine wire formats: build one response body per engine, inspect each.

Every body is what the engine's HTTP server returns for a 24-token Qwen3-30B-A3B sample
(routing rows drawn with a fixed seed); the last one is a zero-padded payload, which
``routeplay inspect`` refuses. Run: ``.venv/bin/python examples/formats_tour.py``.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import numpy as np

from routeplay.cli.main import main as routeplay
from routeplay.core import RouteSpec, preset
from routeplay.core.formats import lmdeploy, sglang, vllm

PROMPT, COMPLETION = 16, 8


def routing(spec: RouteSpec, rows: int, seed: int = 0) -> np.ndarray:
    keys = np.random.default_rng(seed).random((rows, spec.num_layers, spec.num_experts))
    return np.argsort(keys, axis=-1)[..., : spec.top_k].astype(spec.dtype)


def bodies(spec: RouteSpec) -> dict[str, tuple[str, object]]:
    full = routing(spec, PROMPT + COMPLETION - 1)
    usage = {"prompt_tokens": PROMPT, "completion_tokens": COMPLETION}
    meta = {"prompt_tokens": PROMPT, "completion_tokens": COMPLETION}
    padded = full.copy()
    padded[-1] = 0  # the zero-padding engine bug: duplicate ids in a top-k row
    return {
        "vllm-completion.json": (
            "vllm",
            {"choices": [{"routed_experts": vllm.encode(full, spec)}], "usage": usage},
        ),
        "sglang-generate-turn2.json": (
            "sglang",
            {
                "meta_info": {
                    **meta,
                    "routed_experts": sglang.encode(full, start_row=12),
                    "routed_experts_start_len": 12,
                }
            },
        ),
        "lmdeploy-inline.json": (
            "lmdeploy",
            {"meta_info": {**meta, "routed_experts": lmdeploy.encode_lists(full)}},
        ),
        "lmdeploy-key.json": ("lmdeploy", {"meta_info": {**meta, "routed_experts": "5f" * 28}}),
        "vllm-zero-padded.json": (
            "vllm",
            {"choices": [{"routed_experts": vllm.encode(padded, spec)}], "usage": usage},
        ),
    }


def main() -> None:
    spec = preset("qwen3-30b-a3b")
    with tempfile.TemporaryDirectory() as folder:
        for name, (engine, body) in bodies(spec).items():
            path = Path(folder) / name
            path.write_text(json.dumps(body), encoding="utf-8")
            print(f"\n$ routeplay inspect {name} --engine {engine} --preset {spec.name}")
            status = routeplay(["inspect", str(path), "--engine", engine, "--preset", spec.name])
            print(f"exit status {status}")


if __name__ == "__main__":
    main()
