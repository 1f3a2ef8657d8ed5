"""``TrainingBatch``: the hand-off from the replay buffer to one training step.

The batch *takes over* its samples' leases (a transfer: no data moves, the payloads
never reach zero leases on the way) under the holder ``train/step-<n>``. It is a context
manager: on exit, normal or by exception, it releases its leases and then the trace
sessions its samples consumed. Each release runs even if an earlier one fails; the
first failure is raised after all of them ran.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import TracebackType

from routeplay.rollout.buffer import Group
from routeplay.rollout.state import RolloutState

__all__ = ["TrainingBatch"]


class TrainingBatch:
    """A step's samples, holding their routing until the step is over."""

    def __init__(
        self,
        step: int,
        groups: Sequence[Group],
        *,
        release_session: Callable[[str], object] | None = None,
    ) -> None:
        self.step = step
        self.holder = f"train/step-{step}"
        self.states: tuple[RolloutState, ...] = tuple(
            self._take(state) for group in groups for state in group.states
        )
        self.sessions = sorted({s.session_id for s in self.states if s.session_id is not None})
        self._release_session = release_session
        self._closed = False

    def _take(self, state: RolloutState) -> RolloutState:
        if state.holds_lease:
            assert state.lease is not None
            return state.with_lease(state.lease.transfer(self.holder))
        return state

    def close(self) -> None:
        """Release the batch's leases, then its sessions (idempotent)."""
        if self._closed:
            return
        self._closed = True
        errors: list[BaseException] = []
        for state in self.states:
            _collect(errors, state.release)
        if self._release_session is not None:
            for session in self.sessions:
                _collect(errors, self._release_session, session)
        if errors:
            raise errors[0]

    def __enter__(self) -> TrainingBatch:
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


def _collect(errors: list[BaseException], call: Callable[..., object], *args: object) -> None:
    try:
        call(*args)
    except Exception as exc:  # keep releasing the rest; the first failure is re-raised
        errors.append(exc)
