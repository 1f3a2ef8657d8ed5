"""Entry point of the ``routeplay`` command.

Exit status: 0 success, 1 usage error (bad flags, unreadable file), 2 payload refused
(``inspect``) or a demo invariant broken (``demo``).
Typer (like click) reports its own usage errors with status 2, which would collide with
"refused", so ``main`` runs the app in non-standalone mode and maps them to 1.
"""

from __future__ import annotations

import sys
from importlib.metadata import PackageNotFoundError, version
from typing import Annotated

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


def _print_version(asked: bool) -> None:
    # Eager: runs while the flags are parsed, before any command is looked up, so
    # ``routeplay --version`` needs no command and exits 0.
    if not asked:
        return
    try:
        installed = version("routeplay")
    except PackageNotFoundError:  # a source tree on sys.path, never installed
        from routeplay import __version__

        installed = f"{__version__} (not installed: from the source tree)"
    Console().out(f"routeplay {installed}", highlight=False)
    raise typer.Exit(0)


@app.callback()
def _root(
    _version: Annotated[
        bool,
        typer.Option(
            "--version",
            callback=_print_version,
            is_eager=True,
            help="Print the installed routeplay version and exit.",
        ),
    ] = False,
) -> None:
    """MoE routing replay: decode, store, move and replay routed experts.

    Example: ``routeplay --version``
    """


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
