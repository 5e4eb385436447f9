"""The `kvindex` command line: one subcommand per module in this package.

Each command module exposes `add_parser(subparsers)`, which registers its subparser and sets
`run` (a function of the parsed arguments returning the exit code) as a default. To add a
command (`serve`, `demo`, `simulate`, `record`, `analyze`, ...), write `cli/NAME.py` with
those two pieces and list it in `COMMANDS`.

Usage errors are one line on stderr and exit code 2, never a traceback: argparse's own
multi-line usage dump is replaced (see `CliParser.error`), and commands raise `UsageError`
for problems argparse can't see (a malformed endpoint, a socket that can't be opened).
A reader that closes stdout early (`| head`) ends a command quietly, exit 0.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import NoReturn

from kvindex import __version__
from kvindex.cli.common import EXIT_USAGE, UsageError, silence_stdout

__all__ = ["EXIT_USAGE", "CliParser", "UsageError", "build_parser", "main"]


class CliParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line (`kvindex watch: error: ...`)."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


# The command modules (kvindex/cli/NAME.py), in `--help` order. Add new commands here:
# serve, demo, simulate, record, analyze, ...
COMMANDS = (
    "watch",
    "serve",
    "demo",
    "simulate",
    "record",
    "replay",
    "analyze",
    "relay",
    "keys",
    "export",
    "stats",
    "store",
    "bench",
    "doctor",
)


def _commands(names: Sequence[str] = COMMANDS) -> list[ModuleType]:
    # Imported only when a parser is built, so that importing `kvindex.cli` does not pull in
    # every command's dependencies (zmq, rich, ...).
    return [importlib.import_module(f"kvindex.cli.{name}") for name in names]


def build_parser(only: str | None = None) -> CliParser:
    """The parser of every command, or with `only`, of that one command alone (what a
    command line naming it needs: the others' modules are not imported, which a `serve`
    start would wait for)."""
    parser = CliParser(
        prog="kvindex",
        description="An exact, fast index of vLLM's KV-cache events.",
    )
    parser.add_argument("--version", action="version", version=f"kvindex {__version__}")
    sub = parser.add_subparsers(title="commands", dest="command", metavar="COMMAND")
    for module in _commands(COMMANDS if only is None else (only,)):
        module.add_parser(sub)
    return parser


def _named_command(argv: Sequence[str]) -> str | None:
    """The command `argv` starts with, if it starts with one (else every parser is built:
    `--help`, `--version`, a mistyped command's error listing them all)."""
    return argv[0] if argv and argv[0] in COMMANDS else None


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `kvindex` console script; returns the process exit code."""
    parser = build_parser(_named_command(sys.argv[1:] if argv is None else argv))
    args = parser.parse_args(argv)
    run: Callable[[argparse.Namespace], int] | None = getattr(args, "run", None)
    if run is None:
        parser.error("a command is required")
    try:
        code = run(args)
        sys.stdout.flush()  # here, where a closed pipe can still be caught
        return code
    except UsageError as exc:
        print(f"kvindex {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except BrokenPipeError:
        # The reader went away (`kvindex export ... | head`): it had all it wanted.
        silence_stdout()
        return 0
