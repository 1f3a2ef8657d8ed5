"""Progress of a demo run: a protocol the loop reports to, a silent default, and rich bars."""

from __future__ import annotations

from types import TracebackType
from typing import Protocol

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)

__all__ = ["DemoProgress", "RichProgress", "Silent"]


class DemoProgress(Protocol):
    """What the demo loop tells whoever watches."""

    def phase(self, step: int, name: str, total: int) -> None:
        """A phase of ``step`` starts with ``total`` units of work."""

    def advance(self) -> None:
        """One unit of the current phase is done."""

    def step_done(self, step: int, summary: str) -> None:
        """``step`` finished; ``summary`` is one short line."""


class Silent:
    """Reports nowhere (tests, library use)."""

    def phase(self, step: int, name: str, total: int) -> None:
        """Ignored."""

    def advance(self) -> None:
        """Ignored."""

    def step_done(self, step: int, summary: str) -> None:
        """Ignored."""


class RichProgress:
    """Two rich bars: steps, and the current phase's samples; a context manager."""

    def __init__(self, steps: int, console: Console | None = None) -> None:
        self._bars = Progress(
            TextColumn("{task.description:<22}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=console,
            transient=False,
        )
        self._steps: TaskID = self._bars.add_task("RL steps", total=steps)
        self._phase: TaskID = self._bars.add_task("starting", total=None)

    def phase(self, step: int, name: str, total: int) -> None:
        """Reset the phase bar."""
        self._bars.reset(self._phase, total=total, description=f"step {step}: {name}")

    def advance(self) -> None:
        """Advance the phase bar."""
        self._bars.advance(self._phase)

    def step_done(self, step: int, summary: str) -> None:
        """Advance the step bar and print the step's line above the bars."""
        self._bars.advance(self._steps)
        self._bars.console.print(f"step {step}: {summary}", highlight=False)

    def __enter__(self) -> RichProgress:
        self._bars.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._bars.stop()
