"""A Mooncake trace slice through real servers at its arrival times: ``prefixcache
serve`` against plain ``mlx_lm.server`` (its LRUPromptCache) at the same bytes.

Each system runs alone as a subprocess on the tiny llama (``--prompt-cache-bytes
B`` for both; ours hot-only at ``--block-size``), and ``prefixcache replay --url``
sends the slice to it (``--speed`` divides the trace's timestamps; requests that
overlap run concurrently). Then ``simulate`` on the same slice at the same bytes.
Prints one line per system: hit rate, TTFT p50 / p90.

    python tools/replay_serve.py TRACE [--limit 200] [--speed 1] [--budget 16M]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from reuselib.servers import Server

from prefixcache.settings import parse_bytes
from prefixcache.tiny.models import save_model


def setup_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trace")
    p.add_argument("--limit", type=int, default=200)
    p.add_argument("--speed", type=float, default=1.0)
    p.add_argument("--budget", type=parse_bytes, default=16 << 20)
    p.add_argument("--block-tokens", type=int, default=16)
    return p


def servers(model: Path, work: Path, args: argparse.Namespace) -> dict[str, list[str]]:
    budget = ["--prompt-cache-bytes", str(args.budget)]
    ours = [sys.executable, "-m", "prefixcache", "serve", "--model", str(model), *budget]
    ours += ["--hot-cache-only", "--block-size", str(args.block_tokens)]
    plain = [sys.executable, "-m", "mlx_lm", "server", "--model", str(model), *budget]
    return {"prefixcache serve": ours, "mlx_lm.server": plain}


def run(argv: list[str]) -> list[dict]:
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {done.stderr.strip()}")
    return [json.loads(line) for line in done.stdout.splitlines()]


def main() -> None:
    args = setup_arg_parser().parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="replay-serve-") as tmp:
        work = Path(tmp)
        model = save_model(work / "llama", "llama")
        cli = [sys.executable, "-m", "prefixcache"]
        common = ["--block-tokens", str(args.block_tokens), "--limit", str(args.limit), "--json"]
        for name, argv in servers(model, work, args).items():
            server = Server(name, argv, work / f"{name.split()[0]}.log")
            try:
                server.wait_ready()
                url = ["--url", server.url, "--speed", str(args.speed)]
                (doc,) = run([*cli, "replay", args.trace, "--model", str(model), *url, *common])
            finally:
                server.stop()
            rows.append((name, doc))
        sim = [*cli, "simulate", args.trace, "--shape", str(model), "--kv-bits", "32"]
        (doc,) = run([*sim, "--hot", str(args.budget), "--eviction", "lru", *common])
        rows.append(("simulate (lru)", doc))
    print(f"{args.limit} requests at --speed {args.speed}, {args.budget >> 20} MiB each")
    for name, d in rows:
        line = f"{name:18} hit rate {100 * d['hit_rate']:5.2f}%"
        line += f" (last half {100 * d['hit_rate_last_half']:5.2f}%)"
        if "ttft_p50" in d:
            line += f", TTFT p50 {1000 * d['ttft_p50']:.0f} ms, p90 {1000 * d['ttft_p90']:.0f} ms"
        print(line)


if __name__ == "__main__":
    main()
