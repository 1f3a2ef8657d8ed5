"""The adoption flow's decisions (``routeplay.store.shard.adoption``), without Ray.

Fake steps answer each remote step with a settled value or error (what a Ray task would
come to) and record what the flow sent; a resolver answers each ``Wait`` from those and
records it. Every test pins one decision: what is waited for, what is validated again,
what is adopted, and which keys are refused with which error.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from routeplay.core import EngineKey, RouteSpec
from routeplay.core.degenerate import DegenerateCheck
from routeplay.core.handle import StoreRef
from routeplay.errors import (
    DuplicateExperts,
    ExpertOutOfRange,
    RoutesLost,
    SpecMismatch,
    StoreTimeout,
)
from routeplay.store.engine.ingest import Prepared, Validated
from routeplay.store.flow import Wait, drive
from routeplay.store.remote.backend import Settled, settled_answers
from routeplay.store.shard.adoption import (
    IngestVerdict,
    KeyBatch,
    adopt_in_rounds,
    adopt_keys,
    adopt_round,
    in_batch_order,
    key_rounds,
    refuse_after_ingest,
)
from routeplay.store.shard.group_answers import GroupAnswer, LaidOut
from routeplay.store.shard.shard import StoredPayload
from routeplay.store.write_plan import Part

SPEC = RouteSpec(num_layers=2, top_k=2, num_experts=8)
ROWS = 10


def key(name: str, rows: int = ROWS, actor: str = "shared_store", trailing: int = 0) -> EngineKey:
    return EngineKey(key=name * 28, rows=rows, actor=actor, trailing_rows=trailing)


def ingest(status: Settled, rows: int = ROWS) -> Prepared:
    return Prepared(spec=SPEC, rows=rows, status=status, canonical=[f"ingest-block-{rows}"])


@dataclass
class Steps:
    """``AdoptionSteps`` with every remote answer given up front."""

    taken: dict[str, tuple[list[Any], list[Any]]]
    """Engine store name -> (per key: [raw] / Validated / error, per key: Prepared or None)."""
    verdicts: dict[str, Settled] = field(default_factory=dict)
    """Raw payload -> the status its validation comes to (default: valid)."""
    dead: set[str] = field(default_factory=set)
    """Engine stores whose cached handle is of an actor that died (restarted since)."""
    failed_groups: dict[tuple[Any, ...], Exception] = field(default_factory=dict)
    """A group's payloads -> the error its validator fails that whole group with."""
    sent: list[tuple[Any, ...]] = field(default_factory=list)
    adopted: list[tuple[list[Any], int]] = field(default_factory=list)

    def engines(self, wheres: Any, *, fresh: bool = False) -> Any:
        self.sent.append(
            ("engines", tuple(name for name, _ in wheres)) + (("fresh",) if fresh else ())
        )
        yield from ()
        return {where: where[0] for where in wheres}

    def send_take(self, engine: Any, keys: Any, spec: Any, starts: Any) -> Any:
        self.sent.append(("take", engine, tuple(starts)))
        if engine in self.dead:
            self.dead.discard(engine)  # restarted: the next look-up finds the new actor
            return Settled(error=RoutesLost("the actor serving this call died"))
        taken, waits = self.taken[engine]
        return Settled(value=(taken, "node-1", waits))

    def send_validate(self, node: str, raw: Any, key: Any, spec: Any, start: int) -> Any:
        self.sent.append(("validate", raw, start))
        return self.verdicts.get(raw, Settled()), f"block-of-{raw}"

    def send_rows_of(self, node: str, canonical: Any, start: int, stop: int) -> Any:
        self.sent.append(("rows_of", canonical, start, stop))
        return f"{canonical}[{start}:{stop}]"

    def send_groups(self, node: str, spec: Any, requests: Any, raws: Any) -> Any:
        at, answers = 0, []
        for request in requests:
            mine = tuple(raws[at : at + len(request.keys)])
            at += len(request.keys)
            self.sent.append(
                ("group", mine, request.shared_prefix, request.pack, request.validated)
            )
            answers.append(self._group_answer(mine))
        assert at == len(raws)
        return Settled(value=LaidOut(token="token", groups=tuple(answers)))

    def _group_answer(self, raws: tuple[Any, ...]) -> Any:
        if raws in self.failed_groups:
            return self.failed_groups[raws]
        outcomes: list[Any] = []
        samples: list[tuple[Part, ...]] = []
        for raw in raws:
            bad = self.verdicts.get(raw, Settled()).error
            if bad is not None:
                outcomes.append(bad)
            else:  # the shared prompt (array 0, rows [0, 4)) then the member's own rows
                outcomes.append(len(samples))
                samples.append(
                    (
                        Part(array=0, start=0, stop=4),
                        Part(array=len(samples) + 1, start=0, stop=ROWS - 4),
                    )
                )
        payloads = [StoredPayload(blocks=1, rows=4, nbytes=16, block_rows=0)] * (len(samples) + 1)
        return GroupAnswer(
            outcomes=tuple(outcomes), samples=tuple(samples), payloads=payloads, saved_bytes=48
        )

    def take_group(self, node: str, token: Any, count: int) -> list[Any]:
        self.sent.append(("take_group", token, count))
        return [f"group-block-{i}" for i in range(count)]

    def adopt(self, blocks: list[Any], rows: int, nbytes: int) -> StoreRef:
        self.adopted.append((blocks, rows))
        return StoreRef(payload_id=f"p{len(self.adopted)}", run="r", rows=rows)

    def adopt_many(self, blocks: list[Any], payloads: Any, saved: int) -> list[StoreRef]:
        self.adopted.extend((block, p.rows) for block, p in zip(blocks, payloads, strict=True))
        return [StoreRef(payload_id=f"g{i}", run="r", rows=p.rows) for i, p in enumerate(payloads)]


class Resolver:
    """Answers settled waits and records each ``Wait`` the flow yielded."""

    def __init__(self) -> None:
        self.waits: list[Wait] = []

    def resolve(self, wait: Wait) -> list[Any]:
        self.waits.append(wait)
        return settled_answers(wait)

    async def aresolve(self, wait: Wait) -> list[Any]:
        return self.resolve(wait)


def run(steps: Steps, keys: list[EngineKey], starts: list[int] | None = None,
        **group: Any) -> tuple[list[Any], Resolver]:  # fmt: skip
    resolver = Resolver()
    flow = adopt_keys(
        keys,
        SPEC,
        starts or [0] * len(keys),
        shared_prefix=group.get("shared_prefix", 0),
        pack=group.get("pack", False),
        steps=steps,
        timeout_s=8.0,
    )
    return drive(flow, resolver), resolver


# -- the verdict of a validation at ingest -------------------------------------------------


@pytest.mark.parametrize(
    ("answer", "ready_rows", "start", "verdict"),
    [
        (None, ROWS, 0, IngestVerdict.VALID),
        (None, ROWS + 1, 3, IngestVerdict.VALID),  # valid rows are valid whatever the key keeps
        (DuplicateExperts("dup"), ROWS, 0, IngestVerdict.REFUSED),  # exactly the key's rows
        (ExpertOutOfRange("id 9"), ROWS, 0, IngestVerdict.REFUSED),
        (DuplicateExperts("dup"), ROWS + 1, 0, IngestVerdict.RAW),  # maybe the trailing row
        (DuplicateExperts("dup"), ROWS, 4, IngestVerdict.RAW),  # maybe in the history
        (RoutesLost("validator died"), ROWS, 0, IngestVerdict.RAW),  # proves nothing
        (StoreTimeout("late"), ROWS, 0, IngestVerdict.RAW),
    ],
)
def test_a_validation_at_ingest_stands_for_the_key_only_where_it_proves_something(
    answer: Any, ready_rows: int, start: int, verdict: IngestVerdict
) -> None:
    ready = ingest(Settled(), rows=ready_rows)
    assert refuse_after_ingest(answer, ready, key("a"), start) is verdict


# -- single keys ---------------------------------------------------------------------------


def test_a_raw_payload_is_validated_and_waited_for_before_it_is_adopted() -> None:
    steps = Steps(taken={"shared_store": ([["raw-a"], ["raw-b"]], [None, None])})
    out, resolver = run(steps, [key("a"), key("b")])
    assert out == [StoreRef(payload_id="p1", run="r", rows=ROWS),
                   StoreRef(payload_id="p2", run="r", rows=ROWS)]  # fmt: skip
    assert steps.sent == [
        ("engines", ("shared_store",)),  # every engine store asked before any key is taken
        ("take", "shared_store", (0, 0)),
        ("validate", "raw-a", 0),
        ("validate", "raw-b", 0),  # both sent before the one wait for both
    ]
    assert [w.what for w in resolver.waits] == [
        "lmdeploy/shared_store: take 2 keys",
        "validate 2 engine keys",
    ]
    verdicts = resolver.waits[1]
    assert verdicts.each
    assert verdicts.timeout_s == 4.0  # half the deadline
    assert steps.adopted == [(["block-of-raw-a"], ROWS), (["block-of-raw-b"], ROWS)]


def test_a_refused_or_late_raw_validation_refuses_only_its_key() -> None:
    steps = Steps(
        taken={"shared_store": ([["raw-a"], ["raw-b"], ["raw-c"]], [None] * 3)},
        verdicts={
            "raw-a": Settled(error=ExpertOutOfRange("id 9 out of range", where="row 3")),
            "raw-b": Settled(error=StoreTimeout("a store call did not answer in time")),
        },
    )
    out, _ = run(steps, [key("a"), key("b"), key("c")])
    assert isinstance(out[0], ExpertOutOfRange)
    assert out[0].where == "row 3"
    assert isinstance(out[1], StoreTimeout)
    assert out[1].summary == "the validation of an adopted engine key did not end in time"
    assert out[1].where == f"engine key {'b' * 28} (lmdeploy/shared_store)"
    assert out[2] == StoreRef(payload_id="p1", run="r", rows=ROWS)
    assert steps.adopted == [(["block-of-raw-c"], ROWS)]  # refused blocks are never adopted


def test_a_key_refused_by_its_metadata_is_neither_validated_nor_adopted() -> None:
    refusal = SpecMismatch("routing shape does not match the model spec")
    steps = Steps(taken={"shared_store": ([refusal], [None])})
    out, resolver = run(steps, [key("a")])
    assert out == [refusal]
    assert [s[0] for s in steps.sent] == ["engines", "take"]
    assert len(resolver.waits) == 1  # the take only
    assert steps.adopted == []


def test_a_validation_that_ended_valid_at_ingest_is_adopted_without_any_wait() -> None:
    ready = Validated(canonical=["ingest-block"], rows=ROWS)
    steps = Steps(taken={"shared_store": ([ready], [None])})
    out, resolver = run(steps, [key("a")])
    assert out == [StoreRef(payload_id="p1", run="r", rows=ROWS)]
    assert len(resolver.waits) == 1  # the take: nothing else waited for
    assert steps.adopted == [(["ingest-block"], ROWS)]


def test_a_running_validation_at_ingest_is_waited_for_and_decides() -> None:
    refusal = DuplicateExperts("an expert appears twice", where="engine key, row 7, layer 1")
    valid, refused = ingest(Settled()), ingest(Settled(error=refusal))
    steps = Steps(taken={"shared_store": ([["raw-a"], ["raw-b"]], [valid, refused])})
    out, resolver = run(steps, [key("a"), key("b")])
    assert out[0] == StoreRef(payload_id="p1", run="r", rows=ROWS)
    assert out[1] is refusal  # it covered exactly the key's rows: its refusal stands
    assert [w.what for w in resolver.waits] == [
        "lmdeploy/shared_store: take 2 keys",
        "validations at ingest",
    ]
    assert resolver.waits[1].each
    assert resolver.waits[1].timeout_s == 4.0
    assert [s[0] for s in steps.sent] == ["engines", "take"]  # no raw validation
    assert steps.adopted == [(["ingest-block-10"], ROWS)]


@pytest.mark.parametrize(
    "status",
    [
        Settled(error=DuplicateExperts("in the trailing row")),
        Settled(error=RoutesLost("validator died")),
        Settled(error=StoreTimeout("late")),
    ],
)
def test_an_ingest_validation_that_proves_nothing_sends_the_key_to_its_raw_payload(
    status: Settled,
) -> None:
    trailing = key("a", trailing=1)
    steps = Steps(taken={"shared_store": ([["raw-a"]], [ingest(status, rows=ROWS + 1)])})
    out, _ = run(steps, [trailing])
    assert out == [StoreRef(payload_id="p1", run="r", rows=ROWS)]
    assert ("validate", "raw-a", 0) in steps.sent
    assert steps.adopted == [(["block-of-raw-a"], ROWS)]


def test_a_valid_ingest_block_gives_a_resume_its_new_rows_and_leaves_a_trailing_row() -> None:
    resume = Validated(canonical=["ingest-a"], rows=ROWS)
    trailing = Validated(canonical=["ingest-b"], rows=ROWS + 1)
    steps = Steps(taken={"shared_store": ([resume, trailing], [None, None])})
    out, _ = run(steps, [key("a"), key("b", trailing=1)], starts=[6, 0])
    assert out[0] == StoreRef(payload_id="p1", run="r", rows=ROWS - 6)
    assert ("rows_of", "ingest-a", 6, ROWS) in steps.sent  # copied out, not re-validated
    assert out[1] == ((StoreRef(payload_id="p2", run="r", rows=ROWS + 1), 0, ROWS),)
    assert steps.adopted == [(["ingest-a[6:10]"], ROWS - 6), (["ingest-b"], ROWS + 1)]


def test_keys_of_two_engine_stores_are_taken_from_each_after_asking_both() -> None:
    steps = Steps(
        taken={
            "shared_store": ([["raw-a"]], [None]),
            "other": ([["raw-b"]], [None]),
        }
    )
    out, _ = run(steps, [key("a"), key("b", actor="other")])
    assert all(isinstance(one, StoreRef) for one in out)
    assert steps.sent[0] == ("engines", ("shared_store", "other"))
    assert [s[1] for s in steps.sent if s[0] == "take"] == ["shared_store", "other"]


# -- groups --------------------------------------------------------------------------------


def test_a_group_is_validated_together_and_a_bad_member_costs_only_itself() -> None:
    bad = DuplicateExperts("zero padding", where="row 2")
    meta = RoutesLost("expired")
    steps = Steps(
        taken={"shared_store": ([["raw-a"], meta, ["raw-c"], ["raw-d"]], [None] * 4)},
        verdicts={"raw-c": Settled(error=bad)},
    )
    keys = [key("a"), key("b"), key("c"), key("d")]
    out, resolver = run(steps, keys, shared_prefix=4)
    assert ("take", "shared_store", (0, 0, 0, 0)) in steps.sent
    assert ("group", ("raw-a", "raw-c", "raw-d"), 4, False, (False,) * 3) in steps.sent
    assert out[1] is meta
    assert out[2] is bad
    prompt = StoreRef(payload_id="g0", run="r", rows=4)
    assert out[0] == ((prompt, 0, 4), (StoreRef(payload_id="g1", run="r", rows=4), 0, 6))
    assert out[3] == ((prompt, 0, 4), (StoreRef(payload_id="g2", run="r", rows=4), 0, 6))
    assert [w.what for w in resolver.waits][-1] == "validate a group of 3 engine keys"
    assert resolver.waits[-1].timeout_s == 8.0  # no wait at ingest: the whole deadline


def test_a_group_lays_out_the_blocks_validated_at_ingest_and_waits_for_those_running() -> None:
    """Members validated at ingest go to the group's layout as their blocks (flagged: not
    validated again); a validation still running is waited for first and decides; a
    member with none, or one whose validation proves nothing, goes raw."""
    refusal = DuplicateExperts("an expert appears twice", where="engine key, row 7, layer 1")
    done = Validated(canonical=["ingest-a"], rows=ROWS)
    running, refused = ingest(Settled()), ingest(Settled(error=refusal))
    lost = ingest(Settled(error=RoutesLost("validator died")))
    taken = [done, ["raw-b"], ["raw-c"], ["raw-d"], ["raw-e"]]
    steps = Steps(taken={"shared_store": (taken, [None, running, refused, None, lost])})
    keys = [key(name) for name in "abcde"]
    out, resolver = run(steps, keys, shared_prefix=4, pack=True)
    assert [w.what for w in resolver.waits] == [
        "lmdeploy/shared_store: take 5 keys",
        "validations at ingest",
        "validate a group of 4 engine keys",
    ]
    # The layout gets what the ingest wait left of the caller's two deadlines.
    assert [w.timeout_s for w in resolver.waits[1:]] == [4.0, 4.0]
    group = ("group", ("ingest-a", "ingest-block-10", "raw-d", "raw-e"), 4, True)
    assert (*group, (True, True, False, False)) in steps.sent
    assert out[2] is refusal  # its own rows refused at ingest: set aside, not laid out
    assert all(isinstance(out[i], tuple) for i in (0, 1, 3, 4))
    assert not [s for s in steps.sent if s[0] == "validate"]  # nothing validated alone


def test_an_engine_store_restarted_since_its_lookup_is_looked_up_again_once() -> None:
    steps = Steps(taken={"shared_store": ([["raw-a"]], [None])}, dead={"shared_store"})
    out, _ = run(steps, [key("a")])
    assert out == [StoreRef(payload_id="p1", run="r", rows=ROWS)]
    assert [s[:3] for s in steps.sent[:4]] == [
        ("engines", ("shared_store",)),
        ("take", "shared_store", (0,)),
        ("engines", ("shared_store",), "fresh"),
        ("take", "shared_store", (0,)),
    ]


# -- many groups at once (``adopt_key_batches``: a rollout worker's concurrent groups) -----


def group_of(names: str, *, prefix: int = 4, actor: str = "shared_store") -> KeyBatch:
    return KeyBatch(keys=tuple(key(n, actor=actor) for n in names), spec=SPEC, shared_prefix=prefix)


def run_round(steps: Steps, batches: list[KeyBatch]) -> tuple[list[Any], Resolver]:
    resolver = Resolver()
    return drive(adopt_round(batches, steps=steps, timeout_s=8.0), resolver), resolver


def test_a_round_of_groups_shares_one_take_one_layout_call_and_one_hand_over() -> None:
    bad = DuplicateExperts("zero padding", where="row 2")
    meta = RoutesLost("expired")
    taken = [["raw-a"], ["raw-b"], meta, ["raw-d"], ["raw-e"], ["raw-f"]]
    steps = Steps(
        taken={"shared_store": (taken, [None] * 6)}, verdicts={"raw-e": Settled(error=bad)}
    )
    out, resolver = run_round(steps, [group_of("ab"), group_of("cd"), group_of("ef")])
    assert [s[0] for s in steps.sent] == [
        "engines",
        "take",
        "group",
        "group",
        "group",
        "take_group",
    ]
    assert ("take", "shared_store", (0,) * 6) in steps.sent
    assert ("take_group", "token", 7) in steps.sent  # 3 prompts + 4 accepted members' rows
    assert [w.what for w in resolver.waits] == [
        "lmdeploy/shared_store: take 6 keys",
        "validate 3 groups of 5 engine keys",
    ]
    first, second, third = out
    assert second[0] is meta  # each refusal costs its member only
    assert third[0] is bad
    prompts = {first[0][0][0], first[1][0][0], second[1][0][0], third[1][0][0]}
    assert len(prompts) == 3  # a prompt each group, shared by its own members only
    assert first[0][0][0] == first[1][0][0]
    assert all(member[1][1:] == (0, ROWS - 4) for member in (*first, second[1], third[1]))


@pytest.mark.parametrize("failed", [0, 1, 2])
def test_a_group_its_validator_fails_costs_that_group_alone(failed: int) -> None:
    """Whichever group fails (first, middle, last), the others get exactly their own
    stored payloads: the prompt first, then each member's own rows."""
    broken = SpecMismatch("the group's keys disagree on the spec")
    names = ["ab", "cd", "ef"]
    taken = [[f"raw-{n}"] for n in "abcdef"]
    steps = Steps(
        taken={"shared_store": (taken, [None] * 6)},
        failed_groups={tuple(f"raw-{n}" for n in names[failed]): broken},
    )
    out, _ = run_round(steps, [group_of(n) for n in names])
    assert out[failed] is broken
    assert ("take_group", "token", 6) in steps.sent  # two groups: a prompt and two members
    ids = iter(f"g{i}" for i in range(6))
    for index, group in enumerate(out):
        if index == failed:
            continue
        prompt, first, second = next(ids), next(ids), next(ids)
        assert [(m[0][0].payload_id, m[1][0].payload_id) for m in group] == [
            (prompt, first),
            (prompt, second),
        ]


def test_a_group_whose_members_were_all_refused_asks_the_validator_nothing() -> None:
    gone = [RoutesLost("expired"), RoutesLost("consumed")]
    steps = Steps(taken={"shared_store": ([*gone, ["raw-c"], ["raw-d"]], [None] * 4)})
    out, _ = run_round(steps, [group_of("ab"), group_of("cd")])
    assert out[0] == gone
    assert [s[1] for s in steps.sent if s[0] == "group"] == [("raw-c", "raw-d")]


def test_an_error_of_the_shared_take_fails_every_group_of_the_round() -> None:
    steps = Steps(taken={})
    lost = RoutesLost("the actor serving this call died")

    def take(engine: Any, keys: Any, spec: Any, starts: Any) -> Any:
        return Settled(error=lost)

    steps.send_take = take  # type: ignore[method-assign]
    out, _ = run_round(steps, [group_of("ab"), group_of("cd")])
    assert [type(e) for e in out] == [RoutesLost, RoutesLost]
    assert [str(e) for e in out] == [str(lost)] * 2
    assert out[0] is not out[1]  # each caller raises its own: a raised error collects frames
    assert all(e.__traceback__ is None for e in out)  # its frames hold the round's references


def test_a_round_waits_once_for_the_validations_still_running_at_ingest() -> None:
    running = ingest(Settled())
    done = Validated(canonical=["ingest-a"], rows=ROWS)
    taken = [done, ["raw-b"], ["raw-c"], ["raw-d"]]
    steps = Steps(taken={"shared_store": (taken, [None, running, None, running])})
    out, resolver = run_round(steps, [group_of("ab"), group_of("cd")])
    assert [w.what for w in resolver.waits][1:] == [
        "validations at ingest",
        "validate 2 groups of 4 engine keys",
    ]
    assert len(resolver.waits[1].pending) == 2
    assert resolver.waits[2].timeout_s == 4.0  # the other half of the deadline
    flagged = [s[4] for s in steps.sent if s[0] == "group"]
    assert flagged == [(True, True), (False, True)]
    assert all(isinstance(m, tuple) for group in out for m in group)


def test_key_rounds_puts_groups_of_one_store_and_spec_together_and_the_rest_alone() -> None:
    other_spec = RouteSpec(num_layers=3, top_k=2, num_experts=8)
    batches = [
        group_of("ab"),
        KeyBatch(keys=(key("c"),), spec=SPEC),  # single keys: alone
        group_of("de", actor="other_store"),
        group_of("fg"),
        KeyBatch(keys=(key("h"), key("i", actor="other_store")), spec=SPEC, pack=True),
        KeyBatch(keys=(key("j"), key("k")), spec=other_spec, shared_prefix=4),
        group_of("lm"),
    ]
    strict = RouteSpec(
        num_layers=2, top_k=2, num_experts=8, degenerate=DegenerateCheck(fill_rows=2)
    )
    assert strict == SPEC  # equal specs, but validated with other thresholds
    batches.append(KeyBatch(keys=(key("n"), key("o")), spec=strict, shared_prefix=4))
    rounds = key_rounds(batches, size=2)
    assert sorted(i for r in rounds for i in r) == list(range(len(batches)))
    alone = [[1], [2], [4], [5], [6], [7]]  # single keys, a store, two stores, specs
    assert sorted(r for r in rounds if len(r) == 1) == alone
    assert [0, 3] in rounds  # a round fills at two; the last group waits for no other
    assert in_batch_order(3, [[2], [0, 1]], [["c"], ["a", "b"]]) == ["a", "b", "c"]


_WHERES = st.sampled_from(["shared_store", "other_store"])
_BATCHES = st.lists(
    st.tuples(
        st.lists(_WHERES, min_size=1, max_size=3),  # each key's engine store
        st.booleans(),  # a group's (pack) or single keys
        st.sampled_from([SPEC, RouteSpec(num_layers=3, top_k=2, num_experts=8)]),
    ),
    max_size=40,
)


@given(described=_BATCHES, size=st.integers(min_value=1, max_value=5))
def test_rounds_cover_every_batch_once_and_only_join_groups_of_one_store_and_spec(
    described: list[tuple[list[str], bool, RouteSpec]], size: int
) -> None:
    batches = [
        KeyBatch(
            keys=tuple(key(chr(97 + n % 26), actor=actor) for n, actor in enumerate(actors)),
            spec=spec,
            pack=pack,
        )
        for actors, pack, spec in described
    ]
    rounds = key_rounds(batches, size=size)
    assert sorted(i for round_ in rounds for i in round_) == list(range(len(batches)))
    for round_ in rounds:
        assert 1 <= len(round_) <= size
        assert round_ == sorted(round_)  # a round keeps its callers' order
        if len(round_) > 1:
            picked = [batches[i] for i in round_]
            assert all(b.grouped for b in picked)
            assert len({(k.actor, k.namespace) for b in picked for k in b.keys}) == 1
            assert len({(b.spec, b.spec.degenerate) for b in picked}) == 1
    # Each round's answers come back at their batches' positions, rounds run in any order.
    answered = adopt_in_rounds(batches, lambda picked: [id(b) for b in picked], threads=3)
    assert answered == [id(b) for b in batches]
