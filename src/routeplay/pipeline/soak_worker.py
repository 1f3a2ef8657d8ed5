"""The soak's rollout worker: the demo's worker plus one fault, a corrupted engine answer.

``TamperingWorkerShell`` is ``WorkerShell`` whose next ``n`` engine answers (``arm``) are
corrupted by ``faults.tamper`` after they left the engine and before the adapter reads
them: what a broken proxy or a truncated transfer would deliver. Everything else is the
demo's worker, so the adapter's refusal path is the one production runs.
"""

from __future__ import annotations

from typing import Any

from routeplay.pipeline.faults import tamper
from routeplay.pipeline.rollout_worker import WorkerShell
from routeplay.store import producer_actor

__all__ = ["TamperingWorker", "TamperingWorkerShell"]


class TamperingWorkerShell(WorkerShell):
    """A rollout worker that can corrupt its next engine answers."""

    _armed: int = 0
    _tampered: int = 0

    def arm(self, answers: int) -> None:
        """Corrupt the next ``answers`` engine answers."""
        self._armed += answers

    def take_tampered(self) -> int:
        """Answers corrupted since the last call."""
        count, self._tampered = self._tampered, 0
        return count

    def _post(self, path: str, body: dict[str, Any], where: str) -> Any:
        answer = super()._post(path, body, where)
        if self._armed <= 0:
            return answer
        corrupted, hit = tamper(answer)
        if hit:
            self._armed -= 1
            self._tampered += 1
        return corrupted


# The Ray actor class (typed Any: ray.remote's result has no useful static type).
TamperingWorker: Any = producer_actor(TamperingWorkerShell, num_cpus=0)
