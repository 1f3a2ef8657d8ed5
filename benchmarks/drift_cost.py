"""Cost of live routing-drift diagnostics against one MoE layer's forward (Qwen3-30B-A3B shape).

Drift is on by default only if it costs at most 2% of one MoE layer's forward, per layer.
This measures, in one run, at E=128, K=8, hidden 2048, moe_intermediate 768, 4096 tokens:

- the baseline: transformers' own ``Qwen3MoeSparseMoeBlock`` forward (gate, top-k, the 8
  experts of every token) under ``routeplay.train.replay`` with drift off;
- what drift adds per MoE layer, timed alone (a difference of two ~seconds-long forwards
  would drown it in noise): on the HF path the comparison of the router's native ids
  (which its own forward computed anyway) with the replayed ones, a real-token mask
  included (``DriftPass.observe``); on the Megatron path also the native top-k itself,
  which Megatron skips under replay (``torch.topk`` of the ``[tokens, E]`` scores, and the
  group-limited variant through Megatron's own ``group_limited_topk`` when megatron-core
  is installed);
- the read at the end of a step (``drift()``: the one device sync), for 48 layers;
- an end-to-end check: the same block forward under replay with drift on, interleaved
  with drift off (noisy on a shared CPU; the component figures decide).

Writes a JSON result file named for what, where and when (config and versions inside).

    .venv/bin/python benchmarks/drift_cost.py [--tokens 4096] [--repeats 5] [--device cpu]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers
from rich.console import Console
from rich.table import Table

import routeplay
from routeplay.core import RouteSpec
from routeplay.train import DRIFT_BY_DEFAULT, DriftMeter, model_spec, replay

RESULTS = Path(__file__).parent / "results"
BAR = 0.02  # on by default at <= 2% of one MoE layer's forward


def timed(fn: Callable[[], Any], repeats: int, sync: Callable[[], None]) -> list[float]:
    fn()  # warm-up
    sync()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        samples.append(time.perf_counter() - start)
    return samples


class _Stack(torch.nn.Module):
    """``layers.0.mlp`` = the MoE block: the module path replay expects of a decoder."""

    def __init__(self, block: torch.nn.Module) -> None:
        super().__init__()
        holder = torch.nn.Module()
        holder.mlp = block
        self.layers = torch.nn.ModuleList([holder])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers[0].mlp(x)  # type: ignore[no-any-return]


def build_block(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> Any:
    from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    config = Qwen3MoeConfig(
        hidden_size=args.hidden,
        moe_intermediate_size=args.intermediate,
        num_experts=args.experts,
        num_experts_per_tok=args.top_k,
        norm_topk_prob=True,
    )
    block = Qwen3MoeSparseMoeBlock(config)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in block.parameters():  # some are torch.empty: give every one real values
            param.copy_(torch.randn(param.shape, generator=generator) * 0.02)
    return _Stack(block.to(device=device, dtype=dtype)).eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=768)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--layers", type=int, default=48, help="MoE layers read per step")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    tokens, experts, top_k = args.tokens, args.experts, args.top_k
    generator = torch.Generator().manual_seed(1)
    model = build_block(args, device, dtype)
    spec = model_spec(model)
    x = torch.randn(1, tokens, args.hidden, generator=generator).to(device=device, dtype=dtype)
    keys = torch.rand(tokens, experts, generator=generator)
    routes = keys.argsort(dim=-1)[:, None, :top_k].to(torch.uint8).to(device)  # [T, 1, K]
    mask = (torch.rand(tokens, generator=generator) > 0.05).to(device)  # ~5% padding
    scores = torch.softmax(torch.randn(tokens, experts, generator=generator), -1).to(device)
    native = torch.topk(scores, top_k, dim=-1).indices
    replayed = routes[:, 0].to(torch.int64)

    def forward(drift: bool) -> Callable[[], None]:
        meter = DriftMeter(spec)

        def run() -> None:
            with torch.no_grad(), replay(model, routes, drift=meter if drift else False):
                model(x)

        return run

    meter = DriftMeter(spec)
    drift_pass = meter.open_pass(mask)

    def hf_observe() -> None:
        drift_pass.observe(0, native, replayed)

    def megatron_observe() -> None:
        ids = torch.topk(scores, top_k, dim=1)[1]
        drift_pass.observe(0, ids, replayed)

    group_limited: Callable[[], None] | None = None
    try:
        from megatron.core.transformer.moe.moe_utils import group_limited_topk

        def megatron_group_limited() -> None:
            ids = group_limited_topk(scores, top_k, tokens, experts, num_groups=8, group_topk=4)[1]
            drift_pass.observe(0, ids, replayed)

        group_limited = megatron_group_limited
    except ImportError:
        pass

    big = DriftMeter(RouteSpec(num_layers=args.layers, top_k=top_k, num_experts=experts))
    with big.forward(mask) as full:
        for layer in range(args.layers):
            full.observe(layer, native, replayed)

    t_base = statistics.median(timed(forward(False), args.repeats, sync))
    parts: dict[str, Callable[[], None]] = {
        "hf: compare native vs replayed (per layer)": hf_observe,
        "megatron: native top-k + compare (per layer)": megatron_observe,
    }
    if group_limited is not None:
        parts["megatron: group-limited native top-k + compare (per layer)"] = group_limited
    parts[f"read once per step ({args.layers} layers, drift())"] = big.drift
    rows = []
    for name, fn in parts.items():
        t = statistics.median(timed(fn, max(args.repeats, 20), sync))
        rows.append(
            {
                "what": name,
                "ms": round(t * 1e3, 4),
                "over_moe_layer_forward": round(t / t_base, 6),
            }
        )
    on, off = [], []
    for _ in range(args.repeats):  # interleaved: drifts of the shared machine hit both alike
        off += timed(forward(False), 1, sync)
        on += timed(forward(True), 1, sync)
    t_on, t_off = statistics.median(on), statistics.median(off)
    per_layer = max(r["over_moe_layer_forward"] for r in rows[:-1])
    default_on = per_layer <= BAR
    report = {
        "benchmark": "drift_cost",
        "when": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "where": {
            "host": platform.node(),
            "cpu_count": os.cpu_count(),
            "machine": platform.machine(),
            "device": str(device),
        },
        "config": {
            "shape": "Qwen3-30B-A3B MoE layer",
            "tokens": tokens,
            "hidden": args.hidden,
            "moe_intermediate": args.intermediate,
            "experts": experts,
            "top_k": top_k,
            "dtype": args.dtype,
            "threads": args.threads,
            "repeats": args.repeats,
            "statistic": "median",
            "mask": "~5% padding rows",
            "baseline": "transformers Qwen3MoeSparseMoeBlock forward under replay, drift off, "
            "no grad",
        },
        "versions": {
            "python": sys.version.split()[0],
            "numpy": np.__version__,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "routeplay": routeplay.__version__,
        },
        "moe_layer_forward_ms": round(t_base * 1e3, 2),
        "results": rows,
        "end_to_end": {
            "forward_drift_off_ms": round(t_off * 1e3, 2),
            "forward_drift_on_ms": round(t_on * 1e3, 2),
            "on_over_off": round(t_on / t_off, 4),
            "note": "noisy: the component figures above decide",
        },
        "worst_per_layer_cost": per_layer,
        "bar": BAR,
        "decision": "on by default" if default_on else "off by default",
        "DRIFT_BY_DEFAULT_in_code": DRIFT_BY_DEFAULT,
    }
    _print(report)
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H%MZ")
    out = (
        args.out
        or RESULTS / f"drift-cost_{args.device}-{args.dtype}_{platform.node()}_{stamp}.json"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    Console().print(f"wrote {out}")
    if default_on != DRIFT_BY_DEFAULT:
        Console().print(f"[red]DRIFT_BY_DEFAULT={DRIFT_BY_DEFAULT} disagrees with this run[/]")


def _print(report: dict[str, Any]) -> None:
    config = report["config"]
    table = Table(
        title=f"routing drift cost vs one MoE layer forward ({report['moe_layer_forward_ms']} ms: "
        f"{config['tokens']} tokens, E={config['experts']}, K={config['top_k']}, "
        f"hidden {config['hidden']}, {config['dtype']} on {report['where']['device']})"
    )
    for column in ("what", "ms", "share of the layer forward"):
        table.add_column(column)
    for row in report["results"]:
        table.add_row(row["what"], f"{row['ms']:.3f}", f"{row['over_moe_layer_forward']:.3%}")
    Console().print(table)
    e2e = report["end_to_end"]
    Console().print(
        f"end to end: off {e2e['forward_drift_off_ms']} ms, on {e2e['forward_drift_on_ms']} ms "
        f"(x{e2e['on_over_off']}); decision at <= {report['bar']:.0%}: {report['decision']}"
    )


if __name__ == "__main__":
    main()
