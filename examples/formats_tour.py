"""A tour of the engine wire formats: build one response body per engine endpoint, inspect
each.

Every body is built by the engine's body builder (``routeplay.core.wires``) for a 24-token
Qwen3-30B-A3B sample (routing rows drawn with a fixed seed). The SGLang turn-2 body holds
rows from the request's ``routed_experts_start_len`` (12), which no body echoes: it is
inspected with ``--start-row 12``, then once without it, which is refused with a message
naming that request field. The last body is a zero-padded payload, also refused.
Run: ``.venv/bin/python examples/formats_tour.py``.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from routeplay.cli.main import main as routeplay
from routeplay.core import RouteSpec, preset
from routeplay.core.wires import Answer, BodyOptions, engine_wire

PROMPT, COMPLETION = 16, 8


def routing(spec: RouteSpec, rows: int, seed: int = 0) -> np.ndarray:
    keys = np.random.default_rng(seed).random((rows, spec.num_layers, spec.num_experts))
    return np.argsort(keys, axis=-1)[..., : spec.top_k].astype(spec.dtype)


def bodies(spec: RouteSpec) -> list[tuple[str, str, object, int]]:
    """(file name, engine, body, --start-row) for each case of the tour."""
    full = routing(spec, PROMPT + COMPLETION - 1)
    padded = full.copy()
    padded[-1] = 0  # the zero-padding engine bug: duplicate ids in a top-k row
    ids = tuple(range(COMPLETION))
    answer = Answer(
        prompt_tokens=PROMPT,
        token_ids=ids,
        logprobs=(0.0,) * COMPLETION,
        finish_reason="length",
        routing=full,
    )
    bad = Answer(
        prompt_tokens=PROMPT,
        token_ids=ids,
        logprobs=answer.logprobs,
        finish_reason="length",
        routing=padded,
    )

    def build(engine: str, sample: Answer, endpoint: str, **options: Any) -> object:
        return engine_wire(engine).build_body(
            [sample], spec, BodyOptions(endpoint=endpoint, **options)
        )

    return [
        ("vllm-completions.json", "vllm", build("vllm", answer, "completions"), 0),
        ("sglang-chat-sglext.json", "sglang", build("sglang", answer, "chat"), 0),
        (
            "sglang-generate-turn2.json",
            "sglang",
            build("sglang", answer, "generate", start_row=12),
            12,
        ),
        (
            "sglang-generate-turn2.json",
            "sglang",
            build("sglang", answer, "generate", start_row=12),
            0,
        ),
        ("lmdeploy-messages.json", "lmdeploy", build("lmdeploy", answer, "messages"), 0),
        (
            "lmdeploy-key.json",
            "lmdeploy",
            build("lmdeploy", answer, "generate", put=lambda _rows: "5f" * 28),
            0,
        ),
        ("vllm-zero-padded.json", "vllm", build("vllm", bad, "completions"), 0),
    ]


def main() -> None:
    spec = preset("qwen3-30b-a3b")
    with tempfile.TemporaryDirectory() as folder:
        for name, engine, body, start in bodies(spec):
            path = Path(folder) / name
            path.write_text(json.dumps(body), encoding="utf-8")
            args = ["inspect", str(path), "--engine", engine, "--preset", spec.name]
            if start:
                args += ["--start-row", str(start)]
            print(f"\n$ routeplay {' '.join([*args[:1], name, *args[2:]])}")
            print(f"exit status {routeplay(args)}")


if __name__ == "__main__":
    main()
