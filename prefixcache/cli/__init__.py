"""The ``prefixcache`` command: one registry of subcommands, one parser, one dispatch.

Every command module (local.py: demo, make-model; serve.py: serve; inspect.py:
stats, ls; show.py: show, tree; maintain.py: verify, gc, clear; pin.py: pin,
unpin) lists its subcommands as :class:`~prefixcache.cli.common.Command`
entries in ``COMMANDS``; none imports mlx-lm at the top, so ``prefixcache
stats`` starts fast.
"""

from __future__ import annotations

import argparse
import sys

from . import inspect, local, maintain, pin, serve, show
from .common import Command

COMMANDS: dict[str, Command] = {
    command.name: command
    for module in (local, serve, inspect, show, maintain, pin)
    for command in module.COMMANDS
}


def setup_arg_parser() -> argparse.ArgumentParser:
    """The parser of every subcommand in :data:`COMMANDS`."""
    parser = argparse.ArgumentParser(
        prog="prefixcache", description="A tiered prefix cache for MLX: serve, inspect, maintain."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS.values():
        command.add_args(sub.add_parser(command.name, help=command.help))
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run ``prefixcache ARGV`` (default: the process's arguments); returns the exit status."""
    args = setup_arg_parser().parse_args(argv)
    return COMMANDS[args.command].run(args)


if __name__ == "__main__":
    sys.exit(main())
