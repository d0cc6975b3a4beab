"""A Mooncake trace through the tiny llama in process: ``PrefixCache`` against mlx-lm's
``LRUPromptCache`` at the same bytes, and ``simulate`` on the same slice.

Writes the tiny llama (hidden 64, 2 layers, float32) to a temporary directory
and runs ``prefixcache replay`` on it; every other option is replay's.

    python tools/replay_library.py TRACE [--limit 1000] [--hot 32M] [--eviction lru]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

from prefixcache.tiny.models import save_model


def setup_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trace")
    p.add_argument("--limit", default="1000")
    p.add_argument("--hot", default="32M")
    p.add_argument("--block-tokens", default="16")
    p.add_argument("--eviction", default="cost", choices=("cost", "lru"))
    p.add_argument("--json", action="store_true")
    return p


def main() -> None:
    args = setup_arg_parser().parse_args()
    with tempfile.TemporaryDirectory(prefix="replay-library-") as tmp:
        model = save_model(Path(tmp) / "llama", "llama")
        argv = [sys.executable, "-m", "prefixcache", "replay", args.trace, "--model", str(model)]
        argv += ["--limit", args.limit, "--hot", args.hot, "--block-tokens", args.block_tokens]
        argv += ["--eviction", args.eviction, *(["--json"] if args.json else [])]
        sys.exit(subprocess.run(argv, check=False).returncode)


if __name__ == "__main__":
    main()
