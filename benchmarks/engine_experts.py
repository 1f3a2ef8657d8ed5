"""The reference engine's bf16 prefill: torch's own bf16 experts against routeplay's
float32-accumulating ones (``routeplay.engine.wide_experts``), with float32 alongside.

On the default demo recipe's model (Qwen3-MoE, 24 layers, 128 experts, top-8, hidden
64), one prefill of ``--tokens`` tokens, one torch thread (as the engine runs), medians
of ``--repeats`` runs after a warm-up, in one process; and a decode step (the engine's
``generate`` of ``--decode`` tokens after a prompt whose prefill it kept, per token).
For each bf16 variant it also
reports the share of (token, layer) routes that differ from the float32 model's (the
gap routing replay exists for: it must stay about the same) and from each other.

Writes a JSON result file named for what, where and when (config and versions inside).

    .venv/bin/python benchmarks/engine_experts.py [--tokens 640] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
import transformers
from rich.console import Console
from rich.table import Table

import routeplay
from routeplay.engine import ReferenceEngine, build_model
from routeplay.engine.wide_experts import WIDE_EXPERTS
from routeplay.pipeline.config import recipe

RESULTS = Path(__file__).parent / "results"


def prefill(model: Any, ids: torch.Tensor, top_k: int) -> tuple[float, torch.Tensor]:
    """Seconds of one forward, and its routes ``[layers, tokens, K]`` (sorted ids)."""
    start = time.perf_counter()
    with torch.inference_mode():
        out = model(input_ids=ids, output_router_logits=True, logits_to_keep=1)
    elapsed = time.perf_counter() - start
    routes = [
        logits.float().topk(top_k, dim=-1).indices.sort(-1).values for logits in out.router_logits
    ]
    return elapsed, torch.stack(routes)


def measure(model: Any, ids: torch.Tensor, top_k: int, repeats: int) -> tuple[float, torch.Tensor]:
    _, routes = prefill(model, ids, top_k)  # warm-up
    return statistics.median(prefill(model, ids, top_k)[0] for _ in range(repeats)), routes


def decode_step(config: Any, experts: str, ids: torch.Tensor, tokens: int, repeats: int) -> float:
    """Seconds per decode step of the reference engine on ``config``'s model (same seed,
    same weights) with the ``experts`` implementation."""
    engine = ReferenceEngine(config)
    engine.model.set_experts_implementation(experts)
    prompt = ids[0].tolist()
    engine.generate(prompt, max_new_tokens=tokens, seed=0)  # keeps the prompt's prefill

    def once() -> float:
        start = time.perf_counter()
        engine.generate(prompt, max_new_tokens=tokens, seed=1)
        return (time.perf_counter() - start) / tokens

    return statistics.median(once() for _ in range(repeats))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=640)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--decode", type=int, default=6)
    args = parser.parse_args()
    torch.set_num_threads(1)
    config = recipe("default").engine
    ids = torch.randint(
        0, config.vocab_size, (1, args.tokens), generator=torch.Generator().manual_seed(0)
    )
    fp32 = build_model(config, dtype="float32")
    fp32_s, fp32_routes = measure(fp32, ids, config.top_k, args.repeats)
    fp32_step = decode_step(
        replace(config, dtype="float32"), "grouped_mm", ids, args.decode, args.repeats
    )
    model = build_model(config, dtype="bfloat16")
    wide_s, wide_routes = measure(model, ids, config.top_k, args.repeats)
    wide_step = decode_step(config, WIDE_EXPERTS, ids, args.decode, args.repeats)
    model.set_experts_implementation("grouped_mm")  # transformers' default: torch's bf16 kernels
    native_s, native_routes = measure(model, ids, config.top_k, args.repeats)
    native_step = decode_step(config, "grouped_mm", ids, args.decode, args.repeats)

    def differ(a: torch.Tensor, b: torch.Tensor) -> float:
        return round((a != b).any(-1).float().mean().item(), 4)

    result = {
        "benchmark": "engine-experts",
        "tokens": args.tokens,
        "repeats": args.repeats,
        "decode_tokens": args.decode,
        "torch_threads": torch.get_num_threads(),
        "model": {
            "layers": config.num_layers,
            "experts": config.num_experts,
            "top_k": config.top_k,
            "hidden": config.hidden_size,
        },
        "prefill_s": {
            "bf16_torch": round(native_s, 4),
            f"bf16_{WIDE_EXPERTS}": round(wide_s, 4),
            "float32": round(fp32_s, 4),
        },
        "decode_step_s": {
            "bf16_torch": round(native_step, 4),
            f"bf16_{WIDE_EXPERTS}": round(wide_step, 4),
            "float32": round(fp32_step, 4),
        },
        "speedup_over_bf16_torch": {
            "prefill": round(native_s / wide_s, 2),
            "decode_step": round(native_step / wide_step, 2),
        },
        "routes_differing_from_float32": {
            "bf16_torch": differ(native_routes, fp32_routes),
            f"bf16_{WIDE_EXPERTS}": differ(wide_routes, fp32_routes),
        },
        "routes_differing_between_bf16_variants": differ(native_routes, wide_routes),
        "versions": {
            "routeplay": routeplay.__version__,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "python": platform.python_version(),
        },
        "host": platform.node(),
    }
    table = Table(title=f"bf16 prefill of {args.tokens} tokens (median of {args.repeats})")
    for column in ("experts", "prefill s", "decode step s", "routes differing from float32"):
        table.add_column(column)
    for name in ("bf16_torch", f"bf16_{WIDE_EXPERTS}", "float32"):
        table.add_row(
            name,
            f"{result['prefill_s'][name]:.3f}",
            f"{result['decode_step_s'][name]:.4f}",
            str(result["routes_differing_from_float32"].get(name, "-")),
        )
    Console().print(table)
    print(f"speed-up over torch's bf16 experts: {result['speedup_over_bf16_torch']}")
    stamp = datetime.now(UTC).strftime("%Y-%m-%dT%H%MZ")
    out = RESULTS / f"engine-experts_vm_{stamp}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"results: {out}")


if __name__ == "__main__":
    main()
