"""``TrainingBatch``: the hand-off from the replay buffer to one training step.

The batch *takes over* its samples' leases under the holder ``train/step-<n>`` (no data
moves, the payloads never reach zero leases on the way), all or nothing: it first clones
every lease for itself; if any clone fails (a lease already released, a dead shard), the
clones made so far are released again and the error is raised, leaving every sample
exactly as the caller passed it. Only when every clone exists do the buffer's leases
end; one whose release fails rides along in the sample's ``unreleased`` and is retried
when the batch closes.

It is a context manager: on exit, normal or by exception, it releases its leases and
then tells its trace sessions. With ``sessions`` (a ``SessionLedger``) each sample is
*done*, and a session is released only when its last waiting sample is; with
``release_session`` every session the samples consumed is released at once (right only
when no other waiting sample shares one). The samples are any ``RoutedSample``: the
take-over is ``take_over_all`` (``routeplay.rollout.routing_groups``: ``claim`` for every
sample, then ``hand_over``, one call per store shard each), the release ``discard_failures``.
Every release is attempted even if another fails; the first failure is raised after
all of them ran, and the samples whose release failed stay in ``release_failed()`` (the
next ``close()`` retries them).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Generic

from routeplay.errors import MisuseError
from routeplay.rollout.buffer import Group, S, _taken_over, release_samples
from routeplay.rollout.releasing import attempt_each, raise_first
from routeplay.rollout.sample_routing import RoutedSample
from routeplay.rollout.sessions import SessionLedger

__all__ = ["TrainingBatch"]


class TrainingBatch(Generic[S]):
    """A step's samples, holding their routing until the step is over."""

    def __init__(
        self,
        step: int,
        groups: Sequence[Group[S]],
        *,
        release_session: Callable[[str], object] | None = None,
        sessions: SessionLedger | None = None,
    ) -> None:
        """Take the groups' leases over (all or nothing).

        Example:
            >>> groups = buffer.sample(2, current_version=3)  # doctest: +SKIP
            >>> with TrainingBatch(3, groups, sessions=ledger) as batch:
            ...     trainer.step(batch)
        """
        if release_session is not None and sessions is not None:
            raise MisuseError(
                "a batch tells its sessions one way",
                expected="release_session or sessions",
                found="both",
                where=f"batch {step}",
                hint="Prefer sessions: a session then lives while a sample still waits on it.",
            )
        self.step = step
        self.holder = f"train/step-{step}"
        states = [state for group in groups for state in group.states]
        _refuse_unstamped(states, step)  # before any lease moves: nothing to undo
        self.states: tuple[S, ...] = self._take_all(states)
        self.sessions = sorted(
            {sid for s in self.states if (sid := s.sample_routing.session_id) is not None}
        )
        self._release_session = release_session
        self._ledger = sessions
        self._failed: list[S] = []
        self._closed = False

    def _take_all(self, states: Sequence[S]) -> tuple[S, ...]:
        """Clone every live lease for the batch (one call per shard, all or none: on a
        failure nothing moved and the caller keeps every lease), then end the originals
        (one call per shard)."""
        return _taken_over(states, self.holder, None)

    def close(self) -> None:
        """Release the batch's leases, then its sessions (idempotent once all released;
        samples whose release failed are retried by every call)."""
        if self._closed:
            pending, self._failed = self._failed, []
            raise_first(self._release(pending), f"closing batch {self.step} again")
            return
        self._closed = True
        errors = self._release(self.states)
        if self._ledger is not None:
            try:
                self._ledger.done(*self.states)
            except Exception as exc:  # the ledger keeps the session for its close()
                errors.append(exc)
        if self._release_session is not None:
            errors.extend(e for _, e in attempt_each(self.sessions, self._release_session))
        raise_first(errors, f"closing batch {self.step}")

    def release_failed(self) -> tuple[S, ...]:
        """Samples whose release failed at ``close()`` (their live leases in
        ``unreleased``), until a later ``close()`` releases them."""
        return tuple(self._failed)

    def _release(self, states: Sequence[S]) -> list[Exception]:
        failed, errors = release_samples(states)
        self._failed.extend(failed)
        return errors

    def __enter__(self) -> TrainingBatch[S]:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __len__(self) -> int:
        return len(self.states)


def _refuse_unstamped(states: Sequence[RoutedSample], step: int) -> None:
    """Rows still ``Handle.UNSTAMPED`` never reach a step: their weight version, which
    staleness and drift count, was never recorded (XTuner's buffer stamps it at ``put``)."""
    unstamped = [
        r.sample_id
        for s in states
        if (r := s.sample_routing).handle is not None and r.handle.unstamped
    ]
    if unstamped:
        raise MisuseError(
            "a training batch got rows whose weight version was never stamped",
            expected="handles stamped with the version that generated them",
            found=f"{len(unstamped)} unstamped samples: {unstamped[:5]}",
            where=f"batch {step}",
            hint="Stamp each handle where its version is known (handle.stamped(version),"
            " as the XTuner recipe does in update_sample_version) before the buffer.",
        )
