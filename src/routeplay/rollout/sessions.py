"""``SessionLedger``: a trace session lives as long as one of its samples still waits.

Several samples can borrow prefixes from one session (a group of turns, a stale sample
retried later). Releasing the session when the *first* batch that trained one of them
closes would leave the others' retries without their prefix. The ledger counts the
samples still waiting on each session and releases a session when its last waiting
sample is *done*: trained (``TrainingBatch`` with ``sessions=``), discarded (a
``ReplayBuffer`` built with ``sessions=``) or failed (the caller says so).

The ledger reads only a sample's ``SampleRouting`` (its sample and session ids), so any
``RoutedSample`` (or a bare ``SampleRouting``) can be held and done.

Rules:
- ``hold(state)`` registers a sample (idempotent: a retry of the same sample id changes
  nothing); samples without a session are ignored;
- ``done(*states)`` ends the samples' waits; a session whose waiting set becomes empty
  is released once (the ledger remembers released session ids, so a late or repeated
  ``done`` never releases again; a new ``hold`` revives the id). A sample the ledger
  never held counts as the session's last one when no held sample waits on that
  session (an unregistered session is released instead of leaking), and changes
  nothing otherwise;
- every release is attempted even if one raises; the first error is raised afterwards
  (``releasing.first_error``), and a session whose release failed stays listed in
  ``failed`` until ``close()`` retries it.
"""

from __future__ import annotations

from collections.abc import Callable

from routeplay.rollout.releasing import attempt_each, raise_first
from routeplay.rollout.sample_routing import RoutedSample

__all__ = ["SessionLedger"]


class SessionLedger:
    """Waiting samples per trace session, and the call that releases a session.

    Example:
        >>> ledger = SessionLedger(traces.release_session)  # doctest: +SKIP
        >>> ledger.hold(a, b)  # two samples borrowing from session "s"
        >>> ledger.done(a)  # trained: b still waits
        []
        >>> ledger.done(b)  # discarded: the last one, so "s" is released
        ['s']
    """

    def __init__(self, release_session: Callable[[str], object]) -> None:
        """``release_session(session_id)`` ends the session's leases (e.g.
        ``TraceStore.release_session``, or a call to the trace store actor)."""
        self._release = release_session
        self._waiting: dict[str, set[str]] = {}
        self._failed: list[str] = []
        self._released: set[str] = set()

    def hold(self, *states: RoutedSample) -> None:
        """Register samples that may still borrow from their session."""
        for sample in states:
            state = sample.sample_routing
            if state.session_id is not None:
                self._released.discard(state.session_id)
                self._waiting.setdefault(state.session_id, set()).add(state.sample_id)

    def done(self, *states: RoutedSample) -> list[str]:
        """The samples are trained, discarded or failed; returns the sessions released."""
        ending: list[str] = []
        for sample in states:
            state = sample.sample_routing
            session = state.session_id
            if session is None:
                continue
            waiting = self._waiting.get(session)
            if waiting is None:
                if session not in ending and session not in self._released:
                    ending.append(session)  # nobody registered: nobody else waits on it
                continue
            if state.sample_id not in waiting:
                continue  # unknown here, while registered samples still wait
            waiting.discard(state.sample_id)
            if not waiting:
                del self._waiting[session]
                ending.append(session)
        self._release_all(ending)
        return ending

    def waiting(self, session: str) -> int:
        """Samples still waiting on ``session``."""
        return len(self._waiting.get(session, ()))

    def sessions(self) -> list[str]:
        """Sessions some sample still waits on, in order of their first hold."""
        return list(self._waiting)

    @property
    def failed(self) -> tuple[str, ...]:
        """Sessions whose release raised; ``close()`` retries them."""
        return tuple(self._failed)

    def close(self) -> None:
        """Release every session still held or failed (teardown: nothing will train)."""
        ending = list(dict.fromkeys([*self._failed, *self._waiting]))
        self._waiting.clear()
        self._failed = []
        self._release_all(ending)

    def _release_all(self, sessions: list[str]) -> None:
        self._released.update(sessions)
        failures = attempt_each(sessions, self._release)
        self._failed.extend(session for session, _ in failures)
        raise_first([exc for _, exc in failures], f"releasing {len(sessions)} sessions")
