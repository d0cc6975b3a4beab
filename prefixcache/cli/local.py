"""``prefixcache demo`` and ``make-model``: the cache on a tiny model built here, no downloads.

The demo's own code (it imports mlx-lm) is imported only when it runs.
"""

from __future__ import annotations

import argparse
import os

from ..tiny.models import ARCHS
from .common import Command, UsageError


def positive(text: str) -> int:
    """argparse type of a count that must be at least 1."""
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"not a whole number >= 1: {text!r}")
    return int(text)


def seed(text: str) -> int:
    """argparse type of a weight seed: 0 to 2**64 - 1 (MLX's random seed)."""
    if not text.strip().isdigit() or int(text) >= 1 << 64:
        raise argparse.ArgumentTypeError(f"not a seed (0 to 2**64 - 1): {text!r}")
    return int(text)


def add_demo_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--ssd-dir", default=None, help="SSD tier directory, kept afterwards (default: a temp dir)"
    )
    p.add_argument("--conversations", type=positive, default=3, help="chats (default: 3)")
    p.add_argument("--turns", type=positive, default=3, help="turns per chat (default: 3)")
    p.add_argument(
        "--system-words", type=positive, default=500, help="shared system prompt (default: 500)"
    )
    p.add_argument(
        "--model", default=None, help="a local mlx-lm model dir (default: a tiny one built here)"
    )


def run_demo_command(args: argparse.Namespace) -> int:
    """Exit status 1 if a turn's first token differs with the cache."""
    from .demo import run_demo

    if args.model is not None and not os.path.isdir(os.path.expanduser(args.model)):
        raise UsageError(f"--model {args.model!r} is not a local model directory")

    rows = run_demo(
        model_path=args.model,
        ssd_dir=args.ssd_dir,
        num_conversations=args.conversations,
        num_turns=args.turns,
        system_words=args.system_words,
    )
    return 0 if all(r["same"] for r in rows) else 1


def add_make_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", help="directory to write (created; files of a model there replaced)")
    archs = sorted(ARCHS)
    p.add_argument(
        "--arch",
        default="llama",
        choices=archs,
        metavar="ARCH",
        help=f"one of: {', '.join(archs)} (default: llama)",
    )
    p.add_argument("--seed", type=seed, default=0, help="weight seed (default: 0)")


def run_make_model(args: argparse.Namespace) -> int:
    from ..tiny.models import save_model

    if os.path.exists(args.path) and not os.path.isdir(args.path):
        raise UsageError(f"{args.path!r} exists and is not a directory")
    path = save_model(args.path, args.arch, seed=args.seed)
    print(f"wrote {args.arch} (seed {args.seed}) to {path}")
    return 0


_MAKE_MODEL_HELP = "write a tiny random-weight model directory"
COMMANDS = (
    Command("demo", "multi-turn demo on a tiny local model", add_demo_args, run_demo_command),
    Command("make-model", _MAKE_MODEL_HELP, add_make_model_args, run_make_model),
)
