"""A trace slice through one server with its prompt cache's calls logged, and what they show.

Runs ``prefixcache serve`` (hot-only, ``--block-size``) or ``mlx_lm.server`` on the
tiny llama at ``--prompt-cache-bytes B``, its prompt cache's ``fetch_nearest_cache``,
``insert_cache`` and ``trim_to`` logged (one JSON line a call: tokens, tokens cached,
the cache's bytes before and after, the bytes of the cache handed out, a trim's
target), and sends the slice with ``prefixcache replay --url``. Then per fetch:
what it could have matched (the longest prefix of any insert before it, had nothing
been trimmed) and where the rest was lost (the cache empty, or not).

    python tools/serve_calls.py TRACE --system ours [--limit 100] [--speed 1] [--budget 8M]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from reuselib.servers import Server

from prefixcache.settings import parse_bytes
from prefixcache.tiny.models import save_model


def setup_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trace")
    p.add_argument("--system", choices=("ours", "mlx_lm"), required=True)
    p.add_argument("--limit", type=int, default=100)
    p.add_argument("--speed", type=float, default=1.0)
    p.add_argument("--budget", type=parse_bytes, default=8 << 20)
    p.add_argument("--block-tokens", type=int, default=16)
    p.add_argument("--log", help="keep the calls' log here (default: a temporary file)")
    return p


def logged(cls: type, path: str) -> None:
    """Log ``cls``'s three prompt-cache calls to ``path`` (in the server's process)."""
    lock, began = threading.Lock(), time.monotonic()
    fetch, insert, trim = cls.fetch_nearest_cache, cls.insert_cache, cls.trim_to

    def log(**row: object) -> None:
        line = json.dumps({**row, "t": round(time.monotonic() - began, 4)}) + "\n"
        with lock, open(path, "a") as out:
            out.write(line)

    def fetch_logged(self, model, tokens):
        before = self.nbytes
        cache, rest = fetch(self, model, tokens)
        handed = sum(c.nbytes for c in cache) if cache else 0
        n, cached = len(tokens), len(tokens) - len(rest)
        log(op="fetch", n=n, cached=cached, before=before, handed=handed, tokens=list(tokens))
        return cache, rest

    def insert_logged(self, model, tokens, prompt_cache, *, cache_type="assistant"):
        insert(self, model, tokens, prompt_cache, cache_type=cache_type)
        log(op="insert", n=len(tokens), bytes=self.nbytes, tokens=list(tokens))

    def trim_logged(self, *, n_sequences=None, n_bytes=None):
        before = self.nbytes
        trim(self, n_sequences=n_sequences, n_bytes=n_bytes)
        log(op="trim", target=n_bytes, before=before, bytes=self.nbytes)

    cls.fetch_nearest_cache, cls.insert_cache, cls.trim_to = (
        fetch_logged,
        insert_logged,
        trim_logged,
    )


def serve_logged(system: str, path: str, argv: list[str]) -> None:
    """The server's process: its prompt cache class logged, then its main."""
    sys.argv = [sys.argv[0], *argv]
    if system == "ours":
        from prefixcache.console import main
        from prefixcache.serve.prompt_cache import TieredPromptCache

        logged(TieredPromptCache, path)
        sys.exit(main())
    from mlx_lm.models.cache import LRUPromptCache
    from mlx_lm.server import main as mlx_main

    logged(LRUPromptCache, path)
    mlx_main()


def common(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def summary(path: str) -> dict[str, int]:
    """What the calls show (tokens; ``could``: the longest prefix of an earlier insert)."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines()]
    keys = ("fetches", "prompt", "cached", "could", "lost_empty", "lost_held", "fetches_at_empty")
    out = dict.fromkeys(keys, 0)
    inserted: list[list[int]] = []
    handed = 0
    for row in rows:
        if row["op"] == "insert":
            inserted.append(row["tokens"])
        if row["op"] != "fetch":
            continue
        best = max((common(row["tokens"], t) for t in inserted), default=0)
        could = min(best, row["n"] - 1)  # a fetch leaves one token to prefill
        out["fetches"] += 1
        out["prompt"] += row["n"]
        out["cached"] += row["cached"]
        out["could"] += could
        lost = max(0, could - row["cached"])
        out["lost_empty" if row["before"] == 0 else "lost_held"] += lost
        out["fetches_at_empty"] += row["before"] == 0
        handed += row["handed"]
    trims = [r for r in rows if r["op"] == "trim" and r["target"] is not None]
    out["trims_to_zero"] = sum(r["target"] <= 0 for r in trims)
    out["trims"] = len(trims)
    out["mean_handed_bytes"] = handed // max(1, out["fetches"])
    return out


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--serve-logged":
        serve_logged(sys.argv[2], sys.argv[3], sys.argv[4:])
        return
    args = setup_arg_parser().parse_args()
    with tempfile.TemporaryDirectory(prefix="serve-calls-") as tmp:
        work = Path(tmp)
        log = args.log or str(work / "calls.jsonl")
        model = save_model(work / "llama", "llama")
        child = [sys.executable, __file__, "--serve-logged", args.system, log]
        budget = ["--prompt-cache-bytes", str(args.budget)]
        if args.system == "ours":
            block = ["--hot-cache-only", "--block-size", str(args.block_tokens)]
            child += ["serve", "--model", str(model), *budget, *block]
        else:
            child += ["--model", str(model), *budget]
        server = Server(args.system, child, work / "server.log")
        try:
            server.wait_ready()
            replay = [sys.executable, "-m", "prefixcache", "replay", args.trace]
            replay += ["--model", str(model), "--url", server.url, "--speed", str(args.speed)]
            replay += ["--block-tokens", str(args.block_tokens), "--limit", str(args.limit)]
            done = subprocess.run([*replay, "--json"], capture_output=True, text=True, check=True)
        finally:
            server.stop()
        doc = json.loads(done.stdout.splitlines()[0])
        print(json.dumps({"system": args.system, "hit_rate": doc["hit_rate"], **summary(log)}))


if __name__ == "__main__":
    main()
