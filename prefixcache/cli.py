"""The ``prefixcache`` command: demo, make-model (and inspection commands)."""

from __future__ import annotations

import argparse
import sys

from .server import add_serve_args, run_serve


def setup_arg_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="prefixcache", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="multi-turn demo on a tiny local model")
    demo.add_argument("--ssd-dir", default=None, help="SSD tier directory (default: a temp dir)")
    demo.add_argument("--conversations", type=int, default=3)
    demo.add_argument("--turns", type=int, default=3)
    demo.add_argument("--system-tokens", type=int, default=768)

    make = sub.add_parser("make-model", help="write a tiny random-weight model directory")
    make.add_argument("path")
    make.add_argument("--arch", default="llama")
    make.add_argument("--seed", type=int, default=0)
    add_serve_args(sub.add_parser("serve", help="mlx-lm's server with the tiered cache"))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = setup_arg_parser().parse_args(argv)
    if args.command == "demo":
        from .demo import run_demo

        rows = run_demo(
            ssd_dir=args.ssd_dir,
            num_conversations=args.conversations,
            num_turns=args.turns,
            system_tokens=args.system_tokens,
        )
        return 0 if all(r["same"] for r in rows) else 1
    if args.command == "serve":
        return run_serve(args)
    if args.command == "make-model":
        from .tiny import save_model

        path = save_model(args.path, args.arch, seed=args.seed)
        print(f"wrote {args.arch} (seed {args.seed}) to {path}")
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
