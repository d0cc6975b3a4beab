"""The ``prefixcache`` command: one registry of subcommands, one parser, one dispatch.

The registry gathers the ``COMMANDS`` (:class:`~prefixcache.cli.common.Command`
entries) of every command module of this package into one table, by name.

Errors are handled here, once, for every command: a user error (a bad flag or
``PREFIXCACHE_*`` value, a key or model that matches nothing, an unusable
directory, file or port, a missing optional dependency) is one line on stderr
naming the bad value and where it came from, exit 2, never a traceback; a
closed pipe is a quiet exit; Ctrl-C exits 130. Exit codes: common.py.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import logging
import os
import platform
import sys
from collections.abc import Callable

from .. import __version__
from ..config import CacheConfig
from ..errors import CacheDirError, ConfigError, MissingExtraError, SsdFormatError
from ..settings import check_env
from . import explain, inspect, local, maintain, pin, replay, serve, show, simulate
from .common import EXIT_CLOSED_PIPE, EXIT_INTERRUPTED, EXIT_USAGE, Command, Parser, UsageError

log = logging.getLogger(__name__)

COMMANDS: dict[str, Command] = {
    command.name: command
    for module in (local, serve, inspect, show, maintain, pin, explain, simulate, replay)
    for command in module.COMMANDS
}
# What a command's input can be wrong with: one line and exit 2, no traceback.
USER_ERRORS = (ConfigError, UsageError, MissingExtraError, CacheDirError, SsdFormatError, OSError)


def version_text() -> str:
    """``prefixcache X (mlx A, mlx-lm B, Python C)``, without importing mlx."""

    def installed(name: str) -> str:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"

    deps = ", ".join(f"{name} {installed(name)}" for name in ("mlx", "mlx-lm"))
    return f"prefixcache {__version__} ({deps}, Python {platform.python_version()})"


def setup_arg_parser() -> argparse.ArgumentParser:
    """The parser of every subcommand in :data:`COMMANDS`."""
    parser = Parser(
        prog="prefixcache",
        description="A tiered prefix cache for MLX: serve, inspect, maintain.",
        epilog="Exit status: 0 done (an empty listing too), 1 the answer is no (verify found "
        "damage, the demo differed, clear was not confirmed), 2 a usage or input error, "
        "130 interrupted, 141 output closed early (| head).",
    )
    parser.add_argument("--version", action="version", version=version_text())
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS.values():
        command_parser = sub.add_parser(command.name, help=command.help)
        command.add_args(command_parser)
        for action in command_parser._actions:  # argparse keeps no public list of them
            action.type = _one_line_type(action.type)
    return parser


def _one_line_type(convert: Callable[[str], object] | None) -> Callable[[str], object] | None:
    """An argparse ``type`` whose error is its own message (``not a byte size: '10Q'``),
    not argparse's ``invalid parse_bytes value``; also for an OverflowError."""
    if convert is None or convert in (int, float, str) or isinstance(convert, type):
        return convert  # argparse's words fit these: "invalid int value: 'x'"

    def checked(text: str) -> object:
        try:
            return convert(text)
        except (ValueError, OverflowError) as err:
            raise argparse.ArgumentTypeError(str(err) or f"invalid value: {text!r}") from None

    checked.__name__ = getattr(convert, "__name__", "value")
    return checked


def main(argv: list[str] | None = None) -> int:
    """Run ``prefixcache ARGV`` (default: the process's arguments); returns the exit status."""
    argv = sys.argv[1:] if argv is None else argv
    parser = setup_arg_parser()
    args, rest = parser.parse_known_args(argv)
    name = f"prefixcache {args.command}"
    if rest:  # named after the command they were given to
        unknown = " ".join(rest)
        parser.exit(EXIT_USAGE, f"{name}: unrecognized arguments: {unknown} (see {name} --help)\n")
    try:
        check_env(os.environ, CacheConfig)  # every command: a bad variable is named at once
        status = COMMANDS[args.command].run(args)
        sys.stdout.flush()  # here, so that a closed pipe is caught below, not at exit
        return status
    except BrokenPipeError:
        # the reader is gone (``| head``): stop quietly; nothing more can be written
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_CLOSED_PIPE
    except KeyboardInterrupt:
        print(f"{name}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except USER_ERRORS as err:
        log.debug("%s failed", name, exc_info=True)
        print(f"{name}: {_where(err, args, argv)}{err}", file=sys.stderr)
        return EXIT_USAGE


def _where(err: BaseException, args: argparse.Namespace, argv: list[str]) -> str:
    """``--flag: `` when a ConfigError's field was given as that flag (ours or mlx-lm's)."""
    if not isinstance(err, ConfigError) or err.source or not err.field:
        return ""  # a variable is named in the message already
    flag = "--" + err.field.replace("_", "-")
    given = getattr(args, err.field, None) is not None
    if given or any(a == flag or a.startswith(flag + "=") for a in argv):
        return f"{flag}: "
    return ""


if __name__ == "__main__":
    sys.exit(main())
