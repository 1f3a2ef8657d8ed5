"""The reference engine's bf16 prefill: torch's own bf16 experts against routeplay's
float32-accumulating ones (``routeplay.engine.wide_experts``), with float32 alongside.

On the default demo recipe's model (Qwen3-MoE, 24 layers, 128 experts, top-8, hidden
64), one prefill of ``--tokens`` tokens, one torch thread (as the engine runs), medians
of ``--repeats`` runs after a warm-up, in one process. For each bf16 variant it also
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
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
import transformers
from rich.console import Console
from rich.table import Table

import routeplay
from routeplay.engine import build_model
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=640)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    config = recipe("default").engine
    ids = torch.randint(
        0, config.vocab_size, (1, args.tokens), generator=torch.Generator().manual_seed(0)
    )
    fp32_s, fp32_routes = measure(
        build_model(config, dtype="float32"), ids, config.top_k, args.repeats
    )
    model = build_model(config, dtype="bfloat16")
    wide_s, wide_routes = measure(model, ids, config.top_k, args.repeats)
    model.set_experts_implementation("grouped_mm")  # transformers' default: torch's bf16 kernels
    native_s, native_routes = measure(model, ids, config.top_k, args.repeats)

    def differ(a: torch.Tensor, b: torch.Tensor) -> float:
        return round((a != b).any(-1).float().mean().item(), 4)

    result = {
        "benchmark": "engine-experts",
        "tokens": args.tokens,
        "repeats": args.repeats,
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
        "speedup_over_bf16_torch": round(native_s / wide_s, 2),
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
    for column in ("experts", "prefill s", "routes differing from float32"):
        table.add_column(column)
    for name in ("bf16_torch", f"bf16_{WIDE_EXPERTS}", "float32"):
        table.add_row(
            name,
            f"{result['prefill_s'][name]:.3f}",
            str(result["routes_differing_from_float32"].get(name, "-")),
        )
    Console().print(table)
    print(f"speed-up over torch's bf16 experts: {result['speedup_over_bf16_torch']}x")
    stamp = datetime.now(UTC).strftime("%Y-%m-%dT%H%MZ")
    out = RESULTS / f"engine-experts_vm_{stamp}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"results: {out}")


if __name__ == "__main__":
    main()
