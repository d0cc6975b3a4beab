"""Write a tiny random-weight model directory that mlx-lm loads offline.

python tools/make_model.py /tmp/tiny --arch llama --seed 0
mlx_lm.server --model /tmp/tiny
"""

from __future__ import annotations

import argparse

from prefixcache.tiny.models import ARCHS, save_model


def setup_arg_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", help="directory to write (created if missing)")
    parser.add_argument("--arch", default="llama", choices=sorted(ARCHS), help="preset")
    parser.add_argument("--seed", type=int, default=0, help="weight seed")
    return parser


def main() -> None:
    args = setup_arg_parser().parse_args()
    path = save_model(args.path, args.arch, seed=args.seed)
    print(f"wrote {args.arch} (seed {args.seed}) to {path}")


if __name__ == "__main__":
    main()
