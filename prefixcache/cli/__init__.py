"""The ``prefixcache`` command: serve, inspect the SSD tier, demo, make-model.

Inspection: ``stats``, ``ls``, ``show``, ``tree`` (show.py), ``verify``,
``gc``, ``clear`` (maintain.py); see inspect.py for what they share.
"""

from __future__ import annotations

import argparse
import sys

from . import inspect, maintain, show

_INSPECT = (inspect, show, maintain)
COMMANDS = {name: fn for module in _INSPECT for name, fn in module.COMMANDS.items()}


def setup_arg_parser(*, serve: bool = True) -> argparse.ArgumentParser:
    """The parser of every subcommand (``serve=False``: all but serve, no mlx-lm import)."""
    parser = argparse.ArgumentParser(
        prog="prefixcache", description="A tiered prefix cache for MLX: serve, inspect, maintain."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="multi-turn demo on a tiny local model")
    demo.add_argument("--ssd-dir", default=None, help="SSD tier directory (default: a temp dir)")
    demo.add_argument("--conversations", type=int, default=3)
    demo.add_argument("--turns", type=int, default=3)
    demo.add_argument("--system-words", type=int, default=500)
    demo.add_argument(
        "--model", default=None, help="a local mlx-lm model dir (default: a tiny one built here)"
    )

    make = sub.add_parser("make-model", help="write a tiny random-weight model directory")
    make.add_argument("path")
    make.add_argument("--arch", default="llama")
    make.add_argument("--seed", type=int, default=0)
    if serve:
        from .serve import add_serve_args

        add_serve_args(sub.add_parser("serve", help="mlx-lm's server with the tiered cache"))
    for module in _INSPECT:
        module.add_parsers(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    inspecting = bool(argv) and argv[0] in COMMANDS  # starts fast: mlx-lm is not imported
    args = setup_arg_parser(serve=not inspecting).parse_args(argv)
    if args.command in COMMANDS:
        return inspect.run_with_tier(args, COMMANDS[args.command])
    if args.command == "demo":
        from .demo import run_demo

        rows = run_demo(
            model_path=args.model,
            ssd_dir=args.ssd_dir,
            num_conversations=args.conversations,
            num_turns=args.turns,
            system_words=args.system_words,
        )
        return 0 if all(r["same"] for r in rows) else 1
    if args.command == "serve":
        from .serve import run_serve

        return run_serve(args)
    if args.command == "make-model":
        from ..tiny import save_model

        path = save_model(args.path, args.arch, seed=args.seed)
        print(f"wrote {args.arch} (seed {args.seed}) to {path}")
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
