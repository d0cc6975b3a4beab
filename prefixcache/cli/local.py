"""``prefixcache demo`` and ``make-model``: the cache on a tiny model built here, no downloads.

The demo itself is demo.py, imported only when it runs (it imports mlx-lm).
"""

from __future__ import annotations

import argparse

from .common import Command


def add_demo_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ssd-dir", default=None, help="SSD tier directory (default: a temp dir)")
    p.add_argument("--conversations", type=int, default=3)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--system-words", type=int, default=500)
    p.add_argument(
        "--model", default=None, help="a local mlx-lm model dir (default: a tiny one built here)"
    )


def run_demo_command(args: argparse.Namespace) -> int:
    """Exit status 1 if a turn's first token differs with the cache."""
    from .demo import run_demo

    rows = run_demo(
        model_path=args.model,
        ssd_dir=args.ssd_dir,
        num_conversations=args.conversations,
        num_turns=args.turns,
        system_words=args.system_words,
    )
    return 0 if all(r["same"] for r in rows) else 1


def add_make_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("path")
    p.add_argument("--arch", default="llama")
    p.add_argument("--seed", type=int, default=0)


def run_make_model(args: argparse.Namespace) -> int:
    from ..tiny import save_model

    path = save_model(args.path, args.arch, seed=args.seed)
    print(f"wrote {args.arch} (seed {args.seed}) to {path}")
    return 0


COMMANDS = (
    Command("demo", "multi-turn demo on a tiny local model", add_demo_args, run_demo_command),
    Command("make-model", "write a tiny random-weight model directory", add_make_model_args,
            run_make_model),
)  # fmt: skip
