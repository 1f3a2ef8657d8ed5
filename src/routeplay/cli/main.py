"""Entry point of the ``routeplay`` command.

Exit status: 0 success, 1 usage error (bad flags, unreadable file), 2 payload refused
(``inspect``) or a demo invariant broken (``demo``).
Typer (like click) reports its own usage errors with status 2, which would collide with
"refused", so ``main`` runs the app in non-standalone mode and maps them to 1.
"""

from __future__ import annotations

import sys

import typer
from rich.console import Console

from routeplay.cli.bench_command import bench_command
from routeplay.cli.demo_command import demo_command
from routeplay.cli.inspect_command import inspect_command
from routeplay.cli.soak_command import soak_command

EXIT_USAGE = 1

app = typer.Typer(
    name="routeplay",
    help="MoE routing replay: decode, store, move and replay routed experts.",
    no_args_is_help=True,
    add_completion=False,
)
app.command("inspect")(inspect_command)
app.command("demo")(demo_command)
app.command("bench")(bench_command)
app.command("soak")(soak_command)


@app.callback()
def _root() -> None:
    """MoE routing replay: decode, store, move and replay routed experts."""


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns (and, as a console script, exits with) the status code."""
    command = typer.main.get_command(app)
    try:
        result = command.main(args=argv, prog_name="routeplay", standalone_mode=False)
    except typer.Exit as done:
        return done.exit_code
    except typer.TyperException as exc:
        message = exc.format_message()
        if message:  # empty when the error was "no arguments, help shown"
            Console(stderr=True).print(f"usage error: {message}", markup=False, soft_wrap=True)
        return EXIT_USAGE
    except typer.Abort:
        Console(stderr=True).print("aborted")
        return EXIT_USAGE
    return result if isinstance(result, int) else 0


if __name__ == "__main__":
    sys.exit(main())
