"""A verl-shaped RL step on routeplay, through verl 0.9.1's own classes and batch functions.

- **Rollout** (an asyncio Ray actor, a coroutine per sample): GRPO groups of ``N``
  samples per prompt; the samples' writes of one turn go out in one shard call. Each
  sample is a two-turn tool loop, and each generation comes back as verl's own ``TokenOutput``
  (``routed_experts`` for the whole conversation so far, int16, as verl's servers send
  it). Each turn goes through ``TOKEN_OUTPUT``: it stores only the rows its history lacks,
  so turn 1's rows stay the ones turn 1 sampled (verl's loop overwrites them, verl#6054).
- **Driver**: takes every sample's lease over in one call per shard (``take_over_all``),
  puts the handles in verl's ``DataProto`` (``routing_column``), chunks it per DP rank with
  verl's ``chunk``, and ends the leases in ``finally``: also when a rank raised.
- **Trainer** (a Ray actor per DP rank): verl's ``get_tensordict`` and
  ``prepare_micro_batches`` (dynamic micro-batches), then verl's own engine class with
  ``StoreRoutedExperts`` fills each micro-batch's ``routed_experts`` from the store.
  verl's ``align_r3_router_replay_data`` and ``build_r3_replay_mask`` then run on them, as
  its R3 ``forward_step`` does.

The run ends by checking, on every rank, exact rows (each turn's own routing) and the
replay mask. It also checks that no lease and no payload is left, after a good step and
after a step whose rank raised. It reports the bytes each rank read against the int16
padded chunk verl would have shipped it.

Run: ``.venv/bin/python examples/verl_flow.py`` (starts a local Ray instance).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import numpy as np
import ray
import torch
from verl.protocol import DataProto
from verl.utils import tensordict_utils as tu
from verl.utils.megatron.router_replay_utils import (
    align_r3_router_replay_data,
    build_r3_replay_mask,
)
from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead
from verl.workers.engine.utils import prepare_micro_batches
from verl.workers.rollout.replica import TokenOutput

from routeplay.core import RouteSpec
from routeplay.integrations.verl import (
    ROUTING_KEY,
    TOKEN_OUTPUT,
    StoreRoutedExperts,
    VerlTurn,
    routing_column,
)
from routeplay.rollout import ProducerWriter, SampleRouting
from routeplay.rollout.routing_groups import discard_all, take_over_all
from routeplay.store import AsyncRoutesProducer, RouteStore, StoreConfig, producer_actor

SPEC = RouteSpec(num_layers=4, top_k=2, num_experts=16, name="toy-moe")
PROMPTS, N, DP = 4, 4, 2  # GRPO: 4 prompts x 4 samples, 2 data-parallel ranks
PROMPT, TOOL, MAX_TOKENS = 10, 3, 24  # prompt tokens, a tool answer, verl's token budget


def lengths(sample: int) -> tuple[int, int]:
    """The two generations' lengths of a sample (they differ: verl pads them all)."""
    return 3 + sample % 4, 2 + sample % 3


def routing_of(sample: int, turn: int, rows: int) -> np.ndarray:
    """What the rollout server routed on ``turn`` for the first ``rows`` rows (int16)."""
    keys = np.random.default_rng([sample, turn]).random((rows, SPEC.num_layers, 16))
    return np.argsort(keys, axis=-1)[..., : SPEC.top_k].astype(np.int16)


def truth(sample: int) -> np.ndarray:
    """A sample's rows as sampled: turn 1's, then the rows turn 2 added."""
    first, second = lengths(sample)
    kept = PROMPT + first - 1
    whole = PROMPT + first + TOOL + second - 1
    return np.concatenate([routing_of(sample, 1, kept), routing_of(sample, 2, whole)[kept:]])


class _Rollout(AsyncRoutesProducer):
    """verl's agent-loop worker: an asyncio actor, one coroutine per sample (as verl runs
    its agent loops), each sample two generations with a tool answer between. The
    samples' writes of one turn go out together (``ProducerWriter``: one shard call, the
    rows staged in this actor and owned by the store), and so do their leases."""

    def __init__(self, store: RouteStore) -> None:
        self.store = store
        self.writer = ProducerWriter(producer=self, store=store)

    async def run(self, samples: list[int]) -> list[SampleRouting]:
        return list(await asyncio.gather(*(self._sample(s) for s in samples)))

    async def _sample(self, sample: int) -> SampleRouting:
        routing = SampleRouting(sample_id=f"s{sample}")
        prompt = list(range(PROMPT))
        for turn, generated in enumerate(lengths(sample), start=1):
            rows = len(prompt) + generated - 1
            output = TokenOutput(
                token_ids=list(range(generated)), routed_experts=routing_of(sample, turn, rows)
            )
            with await routing.acontinuation() as cont:
                handle = await cont.aingest(
                    TOKEN_OUTPUT,
                    VerlTurn(prompt, output),
                    spec=SPEC,
                    writer=self.writer,
                    weight_version=1,
                )
                routing = await cont.afinish(self.store, handle)
            prompt = prompt + output.token_ids + [99] * TOOL  # the tool's answer follows
        return routing


Rollout: Any = producer_actor(_Rollout, num_cpus=0)


class RouteplayEngine(StoreRoutedExperts, MegatronEngineWithLMHead):
    """verl's Megatron engine, each micro-batch's routes read from routeplay's store."""


@dataclass(frozen=True)
class RankReport:
    """What one trainer rank saw."""

    samples: int
    micro_batches: int
    bytes_read: int
    verl_chunk_bytes: int


@ray.remote(num_cpus=0)
class Trainer:
    """One DP rank: verl's micro-batching, then its engine's model inputs."""

    def __init__(self, store: RouteStore) -> None:
        self.engine = object.__new__(RouteplayEngine)  # prepare_model_inputs needs no state
        self.engine.routeplay_store = store

    def step(self, chunk: DataProto, fail: bool = False) -> RankReport:
        if fail:
            raise RuntimeError("the rank's forward failed")
        batch = _engine_batch(chunk)
        micro_batches, _ = prepare_micro_batches(batch, same_micro_num_in_dp=False)
        read = 0
        for micro_batch in micro_batches:
            routed = self.engine.prepare_model_inputs(micro_batch)["routed_experts"]
            uids = micro_batch["uid"].tolist()
            for part, uid in zip(routed.unbind(), uids, strict=True):
                np.testing.assert_array_equal(part.numpy(), truth(uid).astype(SPEC.dtype))
                read += part.numel() * part.element_size()
            _check_replay_mask(routed, micro_batch, uids)
        verl_rows = len(chunk) * MAX_TOKENS  # int16, padded to the batch width
        return RankReport(
            samples=len(chunk),
            micro_batches=len(micro_batches),
            bytes_read=read,
            verl_chunk_bytes=verl_rows * SPEC.num_layers * SPEC.top_k * 2,
        )


def _engine_batch(chunk: DataProto) -> Any:
    """The chunk as verl's engine gets it: un-padded sequences in a TensorDict."""
    uids = chunk.batch["uid"].tolist()
    return tu.get_tensordict(
        {
            "uid": chunk.batch["uid"],
            "input_ids": torch.nested.as_nested_tensor(
                [torch.arange(_tokens(u)) for u in uids], layout=torch.jagged
            ),
            "loss_mask": torch.nested.as_nested_tensor(
                [torch.arange(_tokens(u)) >= PROMPT for u in uids], layout=torch.jagged
            ),
            ROUTING_KEY: list(chunk.non_tensor_batch[ROUTING_KEY]),
        },
        non_tensor_dict={"use_dynamic_bsz": True, "max_token_len_per_gpu": 2 * MAX_TOKENS},
    )


def _tokens(sample: int) -> int:
    first, second = lengths(sample)
    return PROMPT + first + TOOL + second


def _check_replay_mask(routed: Any, micro_batch: Any, uids: list[int]) -> None:
    """verl's R3 alignment and mask on the store's rows: every row but each sequence's last."""
    input_ids = micro_batch["input_ids"]
    response = torch.zeros(len(uids), MAX_TOKENS, dtype=torch.bool)
    for i, uid in enumerate(uids):
        response[i, : _tokens(uid) - PROMPT] = True
    aligned = align_r3_router_replay_data(routed, input_ids)
    mask = build_r3_replay_mask(input_ids, response)
    for part, keep, uid in zip(aligned.unbind(), mask.unbind(), uids, strict=True):
        assert part.shape[0] == _tokens(uid)
        assert keep.tolist() == [True] * (_tokens(uid) - 1) + [False]


@dataclass(frozen=True)
class Report:
    """The run's end state."""

    ranks: list[RankReport]
    rollout_calls: dict[str, int]
    """Shard calls the rollout of the first step made, by operation (16 samples, 2 turns)."""
    leases_after_step: int
    live_bytes_after_step: int
    failed_step_error: str
    leases_after_failed_step: int


def one_step(
    store: RouteStore, rollout: Any, trainers: list[Any], *, fail: bool = False
) -> list[RankReport]:
    """Rollout, driver, trainers; the step's leases end in ``finally``."""
    routings = ray.get(rollout.run.remote(list(range(PROMPTS * N))), timeout=120)
    batch = take_over_all(routings, "train/step", store)  # one call per shard
    try:
        data = DataProto.from_dict(
            tensors={"uid": torch.arange(len(batch))},
            non_tensors={ROUTING_KEY: routing_column([r.handle for r in batch if r.handle])},
        )
        chunks = data.chunk(DP)
        pending = [
            t.step.remote(c, fail and i == 0)
            for i, (t, c) in enumerate(zip(trainers, chunks, strict=True))
        ]
        return ray.get(pending, timeout=120)
    finally:
        discard_all(batch)


def _rollout_ops(calls: dict[str, int]) -> dict[str, int]:
    """The step's shard calls that the rollout made: its writes and its leases."""
    return {op: n for op, n in calls.items() if op in ("adopt_from_many", "lease_many") and n}


def main() -> Report:
    """Run two steps (the second one's rank 0 raises) and report the end state."""
    started = not ray.is_initialized()
    if started:
        ray.init(
            num_cpus=2,
            object_store_memory=256 * 1024**2,
            include_dashboard=False,
            log_to_driver=False,
        )
    store = StoreConfig(run="verl-flow", timeout_s=60).build()
    try:
        rollout = Rollout.remote(store)
        trainers = [Trainer.remote(store) for _ in range(DP)]
        before = dict(store.stats().calls_by_op)
        ranks = one_step(store, rollout, trainers)
        calls = {op: n - before.get(op, 0) for op, n in store.stats().calls_by_op}
        leases, live = len(store.leaks()), store.stats().live_bytes
        try:
            one_step(store, rollout, trainers, fail=True)
            error = ""
        except ray.exceptions.RayTaskError as exc:
            error = str(exc.cause)
        return Report(ranks, _rollout_ops(calls), leases, live, error, len(store.leaks()))
    finally:
        store.shutdown()
        if started:
            ray.shutdown()


if __name__ == "__main__":
    report = main()
    for rank, seen in enumerate(report.ranks):
        print(
            f"rank {rank}: {seen.samples} samples in {seen.micro_batches} micro-batches, "
            f"read {seen.bytes_read} B of routing (verl's int16 padded chunk: "
            f"{seen.verl_chunk_bytes} B, {seen.verl_chunk_bytes / seen.bytes_read:.1f}x)"
        )
    print(f"the rollout's shard calls for {PROMPTS * N} samples x 2 turns: {report.rollout_calls}")
    print(
        f"after the step: {report.leases_after_step} leases, "
        f"{report.live_bytes_after_step} live bytes; a rank that raised "
        f"({report.failed_step_error!r}): {report.leases_after_failed_step} leases after"
    )
