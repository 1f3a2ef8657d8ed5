"""The replay buffer: groups of completed samples waiting for training.

The buffer holds one lease per sample, as holder ``buffer/<group id>``; it never
releases anyone else's. Staleness is measured from per-token weight versions. When a
group goes stale: if its samples may still be retried, each sample releases the
*buffer's* lease and is reset for regeneration (routing borrowed from a trace session
stays valid, because the session holds its own lease); otherwise the group is
discarded with the buffer's leases. ``sample`` hands groups out still leased; a
``TrainingBatch`` then takes those leases over.

Staleness (``SampleRouting.staleness``) counts, by default (``StalenessBasis.EVERY_ROW``),
the weight versions of the response tokens *and* of the routing rows, prompt rows
borrowed from a trace session included: a retry at version 2 that reuses prompt rows
stored at version 0 is 2 versions stale. ``BufferConfig(staleness=RESPONSE_TOKENS)``
counts the response tokens only, as XTuner does (that retry is then 0 versions stale).

The buffer holds any ``RoutedSample`` (routeplay's ``RolloutState``, or a framework's own
sample embedding a ``SampleRouting``): every lease move is a step of the sample's
``SampleRouting`` (``claim`` + ``hand_over`` to take over, ``expire_retryably`` for a
stale sample, ``discard`` for a dropped one), so the buffer never reaches into a sample.

Releases on error paths: ``discard``, ``refresh`` and ``close`` attempt every sample's
release, then raise the first error (``releasing.first_error``). A sample whose release
failed (a dead shard) is never forgotten: it moves to the *release-failed* set
(``release_failed()``, counted by ``stats()``); every ``close()`` retries that set (a
second ``close()`` is a retry, not a silent no-op) and ``take_release_failed()`` hands
its samples, with their live leases, to whoever can revoke them. A stale sample whose
release failed is still retried: the buffer keeps the stuck lease, the retry starts
clean. With ``sessions`` (a ``SessionLedger``), every discarded sample is *done* for its
trace session.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from routeplay.errors import MisuseError
from routeplay.rollout.releasing import raise_first
from routeplay.rollout.routing_groups import (
    ManyLeaseSource,
    discard_failures,
    expire_all,
    take_over_all,
)
from routeplay.rollout.routing_terms import StalenessBasis
from routeplay.rollout.sample_routing import RoutedSample
from routeplay.rollout.sessions import SessionLedger

if TYPE_CHECKING:  # the client loads Ray; the buffer only calls it
    from routeplay.store.client.lease import Holders
    from routeplay.store.client.route_store import RouteStore

__all__ = [
    "BufferConfig",
    "BufferStats",
    "Group",
    "ReplayBuffer",
    "SamplingPolicy",
    "release_samples",
]

S = TypeVar("S", bound=RoutedSample)


def release_samples(samples: Iterable[S]) -> tuple[list[S], list[Exception]]:
    """``discard`` every sample's routing (all attempted, one call per store shard for
    all of them: ``discard_failures``); returns the samples whose release failed, released
    (their live leases in ``unreleased``), and the errors.

    Example:
        >>> failed, errors = release_samples(group.states)  # doctest: +SKIP
    """
    samples = list(samples)
    failures = discard_failures([sample.sample_routing for sample in samples])
    failed = [samples[at].with_sample_routing(after) for at, after, _ in failures]
    return failed, [error for _, _, error in failures]


class SamplingPolicy(Enum):
    """Which groups ``sample`` takes first."""

    FIFO = "fifo"
    """Oldest added first."""
    STALENESS_FIRST = "staleness_first"
    """Most stale first (use samples before they age out), ties by age."""


@dataclass(frozen=True, slots=True, kw_only=True)
class BufferConfig:
    """Staleness and sampling rules of a replay buffer."""

    max_staleness: int = 1
    """A group whose oldest token is more versions behind than this is stale."""
    max_retries: int = 1
    """How often a stale sample may be regenerated before its group is discarded."""
    policy: SamplingPolicy = SamplingPolicy.FIFO
    """Order in which groups are sampled."""
    staleness: StalenessBasis = StalenessBasis.EVERY_ROW
    """Which weight versions staleness counts: every routing row and response token
    (default), or the response tokens only (XTuner's rule)."""

    def build(
        self, store: RouteStore, *, sessions: SessionLedger | None = None
    ) -> ReplayBuffer[Any]:
        """An empty buffer over ``store`` (``sessions``: told of every discarded sample).

        Example:
            >>> buffer = BufferConfig(max_staleness=1).build(store)  # doctest: +SKIP
        """
        return ReplayBuffer(store, self, sessions=sessions)


@dataclass(frozen=True, slots=True, kw_only=True)
class Group(Generic[S]):
    """The samples of one prompt, trained together."""

    group_id: str
    """Group id (also the buffer's holder suffix)."""
    states: tuple[S, ...]
    """The samples, each holding its own lease."""
    added: int = 0
    """Insertion order (FIFO)."""

    def staleness(
        self, current_version: int, basis: StalenessBasis = StalenessBasis.EVERY_ROW
    ) -> int:
        """Staleness of the stalest sample (``basis``: which versions count)."""
        return max(
            (s.sample_routing.staleness(current_version, basis) for s in self.states), default=0
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class BufferStats:
    """Counts since the buffer was created."""

    groups: int
    samples: int
    retried_samples: int
    discarded_groups: int
    sampled_groups: int
    waiting_retries: int
    release_failed: int = 0
    """Samples whose release failed, kept until a ``close()`` retry or a take-over."""
    stuck_leases: int = 0
    """Leases still live after a failed release, over every sample the buffer holds."""


@dataclass(slots=True)
class _Counters(Generic[S]):
    retried: int = 0
    discarded: int = 0
    sampled: int = 0
    order: int = 0
    retry_queue: list[S] = field(default_factory=list)
    release_failed: list[S] = field(default_factory=list)


class ReplayBuffer(Generic[S]):
    """Completed groups, their leases, staleness retries and discards."""

    def __init__(
        self, store: RouteStore, config: BufferConfig, *, sessions: SessionLedger | None = None
    ) -> None:
        self.store = store
        self.config = config
        self._sessions = sessions
        self._groups: dict[str, Group[S]] = {}
        self._counts: _Counters[S] = _Counters()

    @staticmethod
    def holder(group_id: str) -> str:
        """The lease holder name the buffer uses for a group."""
        return f"buffer/{group_id}"

    def add(self, group_id: str, states: Sequence[S]) -> None:
        """Take over the samples: each sample's lease moves to the buffer (no data moves),
        the whole group at once (``take_over_all``: one atomic call when its leases live
        on one shard, else the buffer's leases first, all or none, then the callers'
        end; a failed end rides in that sample's ``unreleased``).

        Example:
            buffer.add("step-3/g-7", group_states)
        """
        self.add_all({group_id: states})

    def add_all(self, groups: Mapping[str, Sequence[S]]) -> None:
        """``add`` for many groups at once (a rollout worker's whole output): every
        sample's lease moves to its group's holder ``buffer/<group id>`` in the same
        calls (one per store shard for all of them, not one per group), all or none.

        Example:
            buffer.add_all({"step-3/g-0": group_0, "step-3/g-1": group_1})
        """
        for group_id in groups:
            if group_id in self._groups:
                raise MisuseError("group already in the buffer", where=f"group {group_id}")
        flat = [state for states in groups.values() for state in states]
        holders = [self.holder(gid) for gid, states in groups.items() for _ in states]
        taken = iter(_taken_over(flat, holders, self.store))
        for group_id, states in groups.items():
            mine = tuple(next(taken) for _ in states)
            self._groups[group_id] = Group(group_id=group_id, states=mine, added=self._counts.order)
            self._counts.order += 1

    def refresh(self, current_version: int) -> tuple[list[str], list[str]]:
        """Retry or discard stale groups; returns (retried sample ids, discarded group ids).

        Every stale group is handled even if a release fails; the first failure is then
        raised (the retried and discarded samples are queued and counted all the same).
        """
        retried: list[str] = []
        discarded: list[str] = []
        errors: list[Exception] = []
        for group in list(self._groups.values()):
            if group.staleness(current_version, self.config.staleness) <= self.config.max_staleness:
                continue
            del self._groups[group.group_id]
            if all(s.sample_routing.retries < self.config.max_retries for s in group.states):
                errors.extend(self._retry(group.states))
                retried.extend(state.sample_routing.sample_id for state in group.states)
            else:
                errors.extend(self._end(group.states))
                discarded.append(group.group_id)
        self._counts.retried += len(retried)
        self._counts.discarded += len(discarded)
        raise_first(errors, f"refreshing the buffer at version {current_version}")
        return retried, discarded

    def requeue(self, states: Sequence[S]) -> None:
        """Put samples (holding no lease) on the retry queue, e.g. after a restore."""
        for state in states:
            routing = state.sample_routing
            if routing.holds_lease:
                raise MisuseError("a queued retry must not hold a lease", where=routing.sample_id)
        self._counts.retry_queue.extend(states)

    def pending_retries(self) -> tuple[S, ...]:
        """Samples waiting for regeneration (not removed)."""
        return tuple(self._counts.retry_queue)

    def take_retries(self) -> list[S]:
        """Samples reset for regeneration (they hold no lease)."""
        out, self._counts.retry_queue = self._counts.retry_queue, []
        return out

    def sample(self, groups: int, current_version: int) -> list[Group[S]]:
        """Up to ``groups`` fresh groups, removed from the buffer, still holding its leases."""
        self.refresh(current_version)
        order = sorted(self._groups.values(), key=lambda g: self._rank(g, current_version))
        picked = order[:groups]
        for group in picked:
            del self._groups[group.group_id]
        self._counts.sampled += len(picked)
        return picked

    def discard(self, group_id: str) -> bool:
        """Drop a group and the buffer's leases on it; False if it is not here.

        Every sample's release is attempted; the first failure is raised afterwards and
        the samples it concerns stay in ``release_failed()``.
        """
        group = self._groups.pop(group_id, None)
        if group is None:
            return False
        self._counts.discarded += 1
        raise_first(self._end(group.states), f"discarding group {group_id}")
        return True

    def groups(self) -> list[Group[S]]:
        """Groups waiting, in insertion order (for checkpoints and inspection)."""
        return sorted(self._groups.values(), key=lambda g: g.added)

    def stats(self) -> BufferStats:
        """Counts of groups, samples, retries and discards."""
        return BufferStats(
            groups=len(self._groups),
            samples=sum(len(g.states) for g in self._groups.values()),
            retried_samples=self._counts.retried,
            discarded_groups=self._counts.discarded,
            sampled_groups=self._counts.sampled,
            waiting_retries=len(self._counts.retry_queue),
            release_failed=len(self._counts.release_failed),
            stuck_leases=sum(
                len(s.sample_routing.unreleased)
                for s in self._everything()
                if s.sample_routing.stuck
            ),
        )

    def release_failed(self) -> tuple[S, ...]:
        """Samples whose release failed: they hold no own lease, their live leases are
        in ``unreleased`` (``close()`` retries them)."""
        return tuple(self._counts.release_failed)

    def take_release_failed(self) -> list[S]:
        """Hand the release-failed samples (and their live leases) to the caller, e.g.
        to revoke them once the dead holder is known; the buffer forgets them."""
        out, self._counts.release_failed = self._counts.release_failed, []
        return out

    def close(self) -> None:
        """Release every lease the buffer holds, then retry the release-failed samples.

        Idempotent once everything is released; while releases keep failing, every call
        retries them and raises the first error again.

        Example:
            >>> with BufferConfig().build(store) as buffer:  # doctest: +SKIP
            ...     buffer.add("g", states)
        """
        failed, self._counts.release_failed = self._counts.release_failed, []
        errors = self._end(failed, done=False)  # earlier failures; done for their sessions
        for group_id in list(self._groups):
            self._counts.discarded += 1
            errors.extend(self._end(self._groups.pop(group_id).states))
        raise_first(errors, "closing the replay buffer")

    def __enter__(self) -> ReplayBuffer[S]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __len__(self) -> int:
        return len(self._groups)

    def _end(self, states: Iterable[S], *, done: bool = True) -> list[Exception]:
        """Release each sample; keep the ones that failed; tell the session ledger."""
        states = list(states)
        failed, errors = release_samples(states)
        self._counts.release_failed.extend(failed)
        if done and self._sessions is not None:
            try:
                self._sessions.done(*states)
            except Exception as exc:  # the ledger keeps the session for its close()
                errors.append(exc)
        return errors

    def _retry(self, states: Sequence[S]) -> list[Exception]:
        """Queue a stale group's samples for regeneration (their releases in one call
        per shard); a stuck lease stays with the buffer."""
        errors: list[Exception] = []
        expiries = expire_all([state.sample_routing for state in states])
        for state, (retry, stuck, error) in zip(states, expiries, strict=True):
            if stuck is not None:
                self._counts.release_failed.append(state.with_sample_routing(stuck))
            self._counts.retry_queue.append(state.reset_for_retry(retry))
            if error is not None:
                errors.append(error)
        return errors

    def _everything(self) -> Iterable[S]:
        for group in self._groups.values():
            yield from group.states
        yield from self._counts.retry_queue
        yield from self._counts.release_failed

    def _rank(self, group: Group[S], current_version: int) -> tuple[int, int]:
        if self.config.policy is SamplingPolicy.STALENESS_FIRST:
            return (-group.staleness(current_version, self.config.staleness), group.added)
        return (0, group.added)


def _taken_over(
    states: Sequence[S], holder: Holders, store: ManyLeaseSource | None
) -> tuple[S, ...]:
    """The samples with ``holder``'s leases (or each its own holder's) in place of their
    own (``take_over_all``); a sample with nothing to claim is kept as it is."""
    routings = take_over_all([state.sample_routing for state in states], holder, store)
    return tuple(
        state if routing is state.sample_routing else state.with_sample_routing(routing)
        for state, routing in zip(states, routings, strict=True)
    )
