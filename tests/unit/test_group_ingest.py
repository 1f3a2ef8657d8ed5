"""``ingest_routing_group``: the new rows of a whole GRPO group written as one payload.

A fresh group stores its verified-equal prompt rows once; a group of resumes stores
only the rows each history lacks; every member still holds and ends its own lease, and
the payload lives until the last of them is gone.
"""

from __future__ import annotations

import asyncio

import numpy as np
import numpy.typing as npt
import pytest

from routeplay.core import Handle, RouteSpec, read_response
from routeplay.core.wires import Engine, EngineRouting
from routeplay.errors import DuplicateExperts, MisuseError, RouteplayError
from routeplay.rollout import (
    Origin,
    RolloutState,
    SampleRouting,
    Status,
    aingest_routing_group,
    ingest_routing_group,
    sample_holder,
)
from routeplay.rollout.fake_engines import FakeLmdeployKey, FakeSglang
from routeplay.store import RouteStore, StoreConfig
from routeplay.store.remote.backend import LocalBackend

SPEC = RouteSpec(num_layers=2, top_k=2, num_experts=8)
PROMPT, FIRST, SECOND = 12, 5, 3


def truth(rows: int, seed: int) -> npt.NDArray[np.uint8]:
    keys = np.random.default_rng(seed).random((rows, SPEC.num_layers, SPEC.num_experts))
    return np.argsort(keys, axis=-1)[..., : SPEC.top_k].astype(np.uint8)


def group_truths(members: int, *, odd: int | None = None) -> list[npt.NDArray[np.uint8]]:
    """Each member's rows: one prompt's rows, then its own (``odd`` routes the prompt
    differently, as a second engine replica might)."""
    prompt = truth(PROMPT, seed=1)
    out = []
    for m in range(members):
        own = truth(FIRST + SECOND - 1, seed=10 + m)
        head = truth(PROMPT, seed=99) if m == odd else prompt
        out.append(np.concatenate([head, own]))
    return out


def members(count: int) -> list[RolloutState]:
    prompt = tuple(range(PROMPT))
    return [RolloutState(sample_id=f"m{i}", group_id="g", prompt_ids=prompt) for i in range(count)]


def step(
    store: RouteStore,
    states: list[RolloutState],
    truths: list[npt.NDArray[np.uint8]],
    new_tokens: int,
    version: int,
) -> list[RolloutState]:
    """One group request, as a rollout worker makes it: one write for all members."""
    conts = [s.routing.continuation(prompt_ids=s.prompt_ids) for s in states]
    routings = [
        read_response(
            Engine.SGLANG,
            FakeSglang(spec=SPEC).respond(
                rows, prompt_tokens=s.tokens, completion_tokens=new_tokens, start_row=c.rows
            ),
            SPEC,
            start_row=c.rows,
        )
        for s, c, rows in zip(states, conts, truths, strict=True)
    ]
    handles = ingest_routing_group(conts, routings, writer=store, weight_version=version)
    tokens = tuple(range(500, 500 + new_tokens))
    return [
        s.with_sample_routing(c.finish(store, h)).extend(tokens, (0.0,) * new_tokens, version)
        for s, c, h in zip(states, conts, handles, strict=True)
        if isinstance(h, Handle)
    ]


def test_a_fresh_group_is_one_payload_with_its_prompt_once() -> None:
    store = RouteStore.local(StoreConfig(run="group"))
    truths = group_truths(4, odd=3)
    done = step(store, members(4), [t[: PROMPT + FIRST - 1] for t in truths], FIRST, 0)
    stats = store.stats()
    assert stats.live_payloads == 1  # one write for the whole group
    # three members share the prompt; the odd one's prompt rows differ and are its own
    assert stats.shared_prefix_bytes_saved == 2 * SPEC.nbytes(PROMPT)
    assert stats.live_bytes == sum(SPEC.nbytes(PROMPT + FIRST - 1) for _ in truths) - (
        stats.shared_prefix_bytes_saved
    )
    for state, rows in zip(done, truths, strict=True):
        assert state.routing.handle is not None
        assert state.routing.origin is Origin.PRODUCED
        np.testing.assert_array_equal(store.read(state.routing.handle), rows[: PROMPT + FIRST - 1])
    assert dict(stats.leases_by_holder) == {sample_holder(f"m{i}"): 1 for i in range(4)}
    for state in done[:3]:
        state.release()
    assert store.stats().live_payloads == 1  # the last member still holds it
    done[3].release()
    assert store.stats().live_payloads == 0
    assert store.leaks() == []


def test_a_group_of_resumes_writes_only_the_rows_each_history_lacks() -> None:
    store = RouteStore.local(StoreConfig(run="resumes"))
    truths = group_truths(3)
    first = step(store, members(3), [t[: PROMPT + FIRST - 1] for t in truths], FIRST, 0)
    interrupted = [s.with_status(Status.ABORTED, "abort") for s in first]
    bytes_before = store.stats().live_bytes
    resumed = step(store, interrupted, truths, SECOND, 1)
    stats = store.stats()
    assert stats.live_payloads == 2  # the group's first payload and its resumes' one
    assert stats.live_bytes - bytes_before == 3 * SPEC.nbytes(SECOND)  # new rows only
    for state, rows in zip(resumed, truths, strict=True):
        assert state.routing.handle is not None
        np.testing.assert_array_equal(store.read(state.routing.handle), rows)
        versions = state.routing.handle.weight_versions()
        assert set(versions[: PROMPT + FIRST - 1]) == {0}
        assert set(versions[-SECOND:]) == {1}
        state.release()
    assert store.leaks() == []
    assert store.stats().live_payloads == 0


def key_step(
    store: RouteStore,
    fake: FakeLmdeployKey,
    states: list[RolloutState],
    truths: list[npt.NDArray[np.uint8]],
    new_tokens: int,
    version: int,
) -> list[RolloutState | RouteplayError]:
    """One group request on the LMDeploy key path: every answer's key holds the whole
    sequence; the group's keys are adopted in one call."""
    conts = [s.routing.continuation(prompt_ids=s.prompt_ids) for s in states]
    routings = [
        read_response(
            Engine.LMDEPLOY,
            fake.respond(rows, prompt_tokens=s.tokens, completion_tokens=new_tokens),
            SPEC,
        )
        for s, rows in zip(states, truths, strict=True)
    ]
    out = ingest_routing_group(conts, routings, writer=store, weight_version=version, spec=SPEC)
    tokens = tuple(range(500, 500 + new_tokens))
    finished: list[RolloutState | RouteplayError] = []
    for state, cont, result in zip(states, conts, out, strict=True):
        if isinstance(result, RouteplayError):
            cont.abandon()
            finished.append(result)
        else:
            done = state.with_sample_routing(cont.finish(store, result))
            finished.append(done.extend(tokens, (0.0,) * new_tokens, version))
    return finished


def key_store() -> tuple[RouteStore, FakeLmdeployKey, LocalBackend]:
    backend = LocalBackend("keys", shards=1, ttl_s=600.0)
    store = RouteStore(StoreConfig(run="keys"), backend)
    return store, FakeLmdeployKey(spec=SPEC, put=backend.engine_store().put), backend


def routed(results: list[RolloutState | RouteplayError]) -> list[RolloutState]:
    return [r for r in results if isinstance(r, RolloutState)]


def test_a_group_of_engine_keys_stores_its_prompt_once_then_only_new_rows() -> None:
    store, fake, backend = key_store()
    truths = group_truths(4)
    first = routed(
        key_step(store, fake, members(4), [t[: PROMPT + FIRST] for t in truths], FIRST, 0)
    )
    stats = store.stats()
    assert stats.live_payloads == 1  # one payload for the group
    assert stats.shared_prefix_bytes_saved == 3 * SPEC.nbytes(PROMPT)
    assert stats.live_bytes == SPEC.nbytes(PROMPT) + 4 * SPEC.nbytes(FIRST - 1)
    interrupted = [s.with_status(Status.ABORTED, "abort") for s in first]
    resumed = routed(key_step(store, fake, interrupted, truths, SECOND, 1))
    after = store.stats()
    assert after.live_payloads == 2
    assert after.live_bytes - stats.live_bytes == 4 * SPEC.nbytes(SECOND)  # new rows only
    for state, rows in zip(resumed, truths, strict=True):
        assert state.routing.handle is not None
        np.testing.assert_array_equal(
            store.read(state.routing.handle), rows[: PROMPT + FIRST + SECOND - 1]
        )
        versions = state.routing.handle.weight_versions()
        assert set(versions[: PROMPT + FIRST - 1]) == {0}
        assert set(versions[-SECOND:]) == {1}
        state.release()
    assert store.leaks() == []
    assert store.stats().live_payloads == 0
    assert backend.engine_store().stats().live_keys == 0


def test_a_bad_key_in_a_group_costs_only_its_member() -> None:
    store, fake, backend = key_store()
    truths = group_truths(4)
    rows = [t[: PROMPT + FIRST] for t in truths]
    rows[2] = rows[2].copy()
    rows[2][PROMPT + 1, 1] = rows[2][PROMPT + 1, 1, 0]  # a duplicated expert in row 13
    out = key_step(store, fake, members(4), rows, FIRST, 0)
    assert isinstance(out[2], DuplicateExperts)
    assert "row 13" in str(out[2])
    good = routed(out)
    assert [s.sample_id for s in good] == ["m0", "m1", "m3"]
    stats = store.stats()
    assert stats.live_payloads == 1  # the three others: still one payload, prompt once
    assert stats.shared_prefix_bytes_saved == 2 * SPEC.nbytes(PROMPT)
    for state in good:
        assert state.routing.handle is not None
        np.testing.assert_array_equal(
            store.read(state.routing.handle), rows[int(state.sample_id[1])][: PROMPT + FIRST - 1]
        )
        state.release()
    assert store.leaks() == []
    assert store.stats().live_payloads == 0
    assert backend.engine_store().stats().live_keys == 0  # the bad key was consumed too


def test_a_group_of_keys_needs_the_spec() -> None:
    store, fake, _ = key_store()
    [state] = members(1)
    body = fake.respond(truth(PROMPT + FIRST, 3), prompt_tokens=PROMPT, completion_tokens=FIRST)
    with pytest.raises(MisuseError, match="spec"):
        ingest_routing_group(
            [state.routing.continuation(prompt_ids=state.prompt_ids)],
            [read_response(Engine.LMDEPLOY, body, SPEC)],
            writer=store,
            weight_version=0,
        )


# -- any sample type: ingest_routing_group over SampleRouting continuations -----------


class Member:
    """A framework's own mutable sample (XTuner's is pydantic): it embeds a routing."""

    def __init__(self, sample_id: str, prompt: list[int]) -> None:
        self.sample_id, self.prompt = sample_id, prompt
        self.routing = SampleRouting(sample_id=sample_id)


def member_answers(
    fake: FakeLmdeployKey, truths: list[npt.NDArray[np.uint8]]
) -> list[EngineRouting]:
    return [
        read_response(
            Engine.LMDEPLOY,
            fake.respond(rows, prompt_tokens=PROMPT, completion_tokens=FIRST),
            SPEC,
        )
        for rows in truths
    ]


def run_group(
    *, awaited: bool, with_prompt: bool
) -> tuple[RouteStore, LocalBackend, list[Member], list[npt.NDArray[np.uint8]]]:
    """A fresh group of four own-type members on the LMDeploy key path, written with the
    blocking or the awaitable group ingest, then finished."""
    store, fake, backend = key_store()
    truths = [t[: PROMPT + FIRST] for t in group_truths(4)]
    group = [Member(f"x{i}", list(range(PROMPT))) for i in range(4)]
    conts = [m.routing.continuation(prompt_ids=m.prompt if with_prompt else ()) for m in group]
    answers = member_answers(fake, truths)
    if awaited:
        out = asyncio.run(
            aingest_routing_group(conts, answers, writer=store, weight_version=2, spec=SPEC)
        )
    else:
        out = ingest_routing_group(conts, answers, writer=store, weight_version=2, spec=SPEC)
    for member, cont, handle in zip(group, conts, out, strict=True):
        assert isinstance(handle, Handle)
        member.routing = cont.finish(store, handle).complete(
            prompt_tokens=PROMPT, response_tokens=FIRST
        )
    return store, backend, group, truths


@pytest.mark.parametrize("awaited", [False, True], ids=["blocking", "awaited"])
def test_an_own_sample_type_writes_its_group_once_with_the_prompt_once(awaited: bool) -> None:
    store, backend, group, truths = run_group(awaited=awaited, with_prompt=True)
    stats = store.stats()
    assert stats.live_payloads == 1
    assert stats.shared_prefix_bytes_saved == 3 * SPEC.nbytes(PROMPT)
    assert stats.live_bytes == SPEC.nbytes(PROMPT) + 4 * SPEC.nbytes(FIRST - 1)
    for member, rows in zip(group, truths, strict=True):
        assert member.routing.handle is not None
        np.testing.assert_array_equal(store.read(member.routing.handle), rows[:-1])
        assert set(member.routing.row_versions()) == {2}
        member.routing = member.routing.release()
    assert store.leaks() == []
    assert store.stats().live_payloads == 0
    assert backend.engine_store().stats().live_keys == 0


def test_a_group_continued_without_its_prompt_shares_no_rows() -> None:
    """The prompt given to ``continuation`` is what says the fresh members share one:
    without it each member stores its own prompt rows (still one payload)."""
    store, _, group, _ = run_group(awaited=False, with_prompt=False)
    stats = store.stats()
    assert stats.live_payloads == 1
    assert stats.shared_prefix_bytes_saved == 0
    assert stats.live_bytes == 4 * SPEC.nbytes(PROMPT + FIRST - 1)
    for member in group:
        member.routing = member.routing.release()
    assert store.leaks() == []


def test_a_key_with_nothing_new_is_freed_and_the_history_kept() -> None:
    """A resume whose key holds no row past the history is never adopted: its key is
    freed (awaited on the awaitable face) and the member keeps its history."""
    store, fake, backend = key_store()
    truths = [t[: PROMPT + FIRST] for t in group_truths(2)]
    group = [Member(f"k{i}", list(range(PROMPT))) for i in range(2)]
    conts = [m.routing.continuation(prompt_ids=m.prompt) for m in group]
    out = ingest_routing_group(
        conts, member_answers(fake, truths), writer=store, weight_version=0, spec=SPEC
    )
    done = [c.finish(store, h) for c, h in zip(conts, out, strict=True) if isinstance(h, Handle)]
    again = [r.continuation() for r in done]
    stale = member_answers(fake, truths)  # the same answer again: no row past it
    kept = asyncio.run(
        aingest_routing_group(again, stale, writer=store, weight_version=1, spec=SPEC)
    )
    assert [h == c.history for h, c in zip(kept, again, strict=True)] == [True, True]
    assert backend.engine_store().stats().live_keys == 0  # both freed, none adopted
    assert store.stats().live_payloads == 1
    for routing in done:
        routing.release()
    assert store.leaks() == []
