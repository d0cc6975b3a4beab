"""What every ``prefixcache`` subcommand shares: the registry entry, options, output.

Each command module lists its subcommands as :class:`Command` entries in
``COMMANDS``, from which the CLI builds its parser and dispatches. A command
module imports nothing heavy at the top (mlx-lm, transformers): the
inspection commands start fast, serve and demo import what they run when run.

The commands on an SSD tier directory (:func:`ssd_command`) open an existing
one (``--ssd-dir``, else ``PREFIXCACHE_SSD_DIR``, else CacheConfig's default)
as an :class:`SsdView` and never create one: read-only unless the command
removes blocks, and without any thread either way. ``--json`` prints one JSON
object with stable keys: sizes are bytes (``nbytes``: payload file bytes on
disk), times are Unix seconds, keys are 32 hex digits; the human text never
holds a control character (escaped as ``\\x1b``).

Exit status, the same for every command (``EXIT_*``; docs/cli.md): 0 done (an
empty listing too), 1 the command ran and the answer is no (verify found
damage, the demo's cached run differed, clear was not confirmed), 2 a usage or
input error (one line on stderr naming the bad value and where it came from),
130 interrupted, 141 the output was closed early (``| head``, quietly).
"""

from __future__ import annotations

import argparse
import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn

from ..config import CacheConfig
from ..errors import CacheDirError, SsdFormatError
from ..settings import env_name
from ..tiers.ssd.admin.inventory import Inventory
from ..tiers.ssd.admin.view import SsdView

Doc = dict[str, Any]  # a --json document
Args = argparse.Namespace
_DURATION = re.compile(r"(\d+(?:\.\d+)?)([smhdw])")
SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


EXIT_OK = 0
EXIT_NO = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130
EXIT_CLOSED_PIPE = 141  # 128 + SIGPIPE: what a shell tool cut off by ``| head`` reports


class UsageError(Exception):
    """The command's input names nothing usable (a key, a model, a path): one line, exit 2.

    The message names the bad value and where it came from (the flag or argument).
    """


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line (``prefixcache CMD: ...``), exit 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: {message} (see {self.prog} --help)\n")


@dataclass(frozen=True, slots=True)
class Command:
    """One subcommand: its name, one-line help, its options and what it runs.

    ``run`` returns the exit status.
    """

    name: str
    help: str
    add_args: Callable[[argparse.ArgumentParser], None]
    run: Callable[[Args], int]


def ssd_command(
    name: str,
    help: str,
    run: Callable[[SsdView, Args], int],
    add_args: Callable[[argparse.ArgumentParser], None] | None = None,
    *,
    writable: Callable[[Args], bool] = lambda args: False,
) -> Command:
    """A command on an SSD tier directory: ``--ssd-dir`` and ``--json``, then ``add_args``.

    ``run`` gets the directory opened by :func:`open_view` (for writing if
    ``writable(args)``); a missing or foreign directory is a user error (exit 2).
    """

    def add(parser: argparse.ArgumentParser) -> None:
        add_common(parser)
        if add_args is not None:
            add_args(parser)

    def run_on_dir(args: Args) -> int:
        path, source = ssd_dir_source(args)
        try:
            view = open_view(path, writable=writable(args))
        except (CacheDirError, SsdFormatError) as err:
            raise UsageError(f"{source}: {err}" if source else f"{err} ({DEFAULT_DIR})") from None
        with view:
            return run(view, args)

    return Command(name, help, add, run_on_dir)


def open_view(path: str, *, writable: bool = False) -> SsdView:
    """The one place the CLI opens an SSD tier directory."""
    return SsdView(path, writable=writable)


def add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--ssd-dir",
        help="SSD tier directory (default: $PREFIXCACHE_SSD_DIR, else ~/.cache/prefixcache)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def ssd_dir(args: Args) -> str:
    """--ssd-dir, else PREFIXCACHE_SSD_DIR, else CacheConfig's default."""
    return ssd_dir_source(args)[0]


DEFAULT_DIR = "the default: give --ssd-dir or set PREFIXCACHE_SSD_DIR"


def ssd_dir_source(args: Args) -> tuple[str, str | None]:
    """:func:`ssd_dir` and where it came from (``--ssd-dir X``, the variable; None: the default)."""
    if args.ssd_dir:
        return os.path.abspath(os.path.expanduser(args.ssd_dir)), f"--ssd-dir {args.ssd_dir}"
    var = env_name("ssd_dir")
    if os.environ.get(var):
        return CacheConfig(ssd_dir=os.environ[var]).ssd_path, f"{var}={os.environ[var]}"
    return CacheConfig().ssd_path, None


def model_roots(inv: Inventory, model: str | None) -> list[bytes]:
    """The namespaces ``--model`` selects (all without it).

    Raises:
        UsageError: ``--model`` matches no namespace (the models stored are listed).
    """
    roots = inv.roots(model)
    if model is not None and not roots:
        known = sorted({inv.namespaces[r].label for r in inv.roots()})
        stored = ", ".join(map(repr, known[:8])) + (", ..." if len(known) > 8 else "")
        raise UsageError(
            f"no model matches --model {model!r} (stored: {stored or 'none'}; "
            "or give 4+ hex digits of a namespace root key)"
        )
    return roots


def emit(args: Args, doc: Doc, human: Callable[[], str]) -> None:
    """Print ``doc`` as JSON (--json, ASCII) or the human text with :func:`printable` lines."""
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        print("\n".join(printable(line) for line in human().split("\n")))


def printable(text: str) -> str:
    """``text`` with control and other unprintable characters escaped as ``repr`` does.

    What a cache recorded (model ids, decoded tokens) never reaches the terminal
    raw: an ESC sequence is printed as ``\\x1b[...``, not obeyed.
    """
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def parse_duration(text: str) -> float:
    """Seconds in ``7d``, ``12h``, ``1h30m``, ``90s``, ``2w`` or a bare number of seconds.

    Raises:
        ValueError: not a duration.
    """
    raw = text.strip().lower()
    if re.fullmatch(r"\d+(\.\d+)?", raw):
        return float(raw)
    pos, total = 0, 0.0
    for match in _DURATION.finditer(raw):
        if match.start() != pos:
            break
        total += float(match.group(1)) * SECONDS[match.group(2)]
        pos = match.end()
    if pos != len(raw) or not raw:
        raise ValueError(f"not a duration (e.g. 7d, 12h, 30m): {text!r}")
    return total


def duration(text: str) -> float:
    """argparse type of --older-than / --newer-than."""
    try:
        return parse_duration(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def count(text: str) -> int:
    """argparse type of --limit: an int >= 0."""
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"not a count: {text!r}")
    return int(text)


def on_off(text: str) -> bool:
    """argparse type of a switch: on or off."""
    if text not in ("on", "off"):
        raise argparse.ArgumentTypeError(f"expected on or off, got {text!r}")
    return text == "on"


def positive_int(text: str) -> int:
    """argparse type of an integer >= 1."""
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"not a positive integer: {text!r}")
    return int(text)


def positive_float(text: str) -> float:
    """argparse type of a finite number of seconds > 0."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"not a positive number of seconds: {text!r}")
    return value


def port(text: str) -> int:
    """argparse type of a TCP port: 0 (any free one) to 65535."""
    if not text.strip().isdigit() or int(text) > 65535:
        raise argparse.ArgumentTypeError(f"not a port (0-65535): {text!r}")
    return int(text)
