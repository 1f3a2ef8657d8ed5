"""Options more than one command takes, defined once."""

from __future__ import annotations

from typing import Any

import typer

from routeplay.core.wires import WIRE_NAMES

__all__ = ["engine_format_option"]


def _wire_name(value: str) -> str:
    # The names come from the wire registry, so the CLI never lists them itself.
    if value not in WIRE_NAMES:
        raise typer.BadParameter(f"{value!r} is not one of {', '.join(WIRE_NAMES)}")
    return value


def engine_format_option(help_text: str) -> Any:
    """``--engine-format``: one of the registry's wire names (checked, listed in help).

    Example:
        >>> Fmt = Annotated[str | None, engine_format_option("Wire format.")]  # doctest: +SKIP
        >>> def command(engine_format: Fmt = None) -> None: ...  # doctest: +SKIP
    """
    return typer.Option(
        "--engine-format",
        parser=_wire_name,
        metavar="[" + "|".join(WIRE_NAMES) + "]",
        help=help_text,
    )
