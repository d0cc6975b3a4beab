"""Which modules a fetch passes through: a hot-miss, SSD-hit ``PrefixCache.fetch``.

A chain of a tiny llama is stored on the SSD tier and flushed; a new
``PrefixCache`` on the same directory (hot tier empty) fetches it once to warm
the imports and caches, and a second new one fetches it under
``sys.setprofile``. Every Python call into a module (one file) of the
``prefixcache`` package is recorded, on every thread (the SSD readers too).
Prints the modules it entered, the calls, the distinct caller -> callee pairs
of modules, and the crossings: consecutive calls or returns on one thread that
go from one module into another (how often a reader following the fetch
changes files; it grows with the number of blocks).

    python tools/fetch_path.py [--tokens 64] [--block-size 16] [--list]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
from collections import Counter

import prefixcache
from prefixcache import CacheConfig, PrefixCache
from prefixcache.tiny.models import build_model

PACKAGE = os.path.dirname(os.path.abspath(prefixcache.__file__))


def module_of(filename: str) -> str | None:
    """``tiers.ssd.stream`` for a file of the package, else None."""
    path = os.path.abspath(filename)
    if not path.startswith(PACKAGE + os.sep):
        return None
    rel = os.path.relpath(path, PACKAGE)[: -len(".py")]
    return rel.replace(os.sep, ".")


class Trace:
    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self.hops = 0
        self.edges: set[tuple[str, str]] = set()
        self._last: dict[int, str] = {}
        self._lock = threading.Lock()

    def __call__(self, frame, event, arg) -> None:
        if event not in ("call", "return"):
            return
        module = module_of(frame.f_code.co_filename)
        if module is None:
            return
        with self._lock:
            if event == "call":
                self.calls[module] += 1
            me = threading.get_ident()
            last = self._last.get(me)
            if last is not None and last != module:
                self.hops += 1
                self.edges.add((last, module) if event == "call" else (module, last))
            self._last[me] = module


def config(block_size: int, root: str) -> CacheConfig:
    return CacheConfig(
        block_size=block_size,
        hot_max_bytes=64 << 20,
        promote=False,
        ssd_dir=root,
        ssd_min_free_bytes=0,
        write_policy="write_through",
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--list", action="store_true", help="every module with its calls")
    args = p.parse_args()
    model = build_model("llama")
    tokens = [(7 * i) % 500 + 1 for i in range(args.tokens)]
    with tempfile.TemporaryDirectory() as root:
        with PrefixCache(model, config(args.block_size, root), model_id="path") as pc:
            cache, _ = pc.fetch(tokens)
            model_run(model, tokens, cache)
            pc.store(tokens, cache)
        for traced in (False, True):
            with PrefixCache(model, config(args.block_size, root), model_id="path") as pc:
                trace = Trace()
                if traced:
                    threading.setprofile(trace)
                    sys.setprofile(trace)
                try:
                    _, n = pc.fetch([*tokens, 1])
                finally:
                    sys.setprofile(None)
                    threading.setprofile(None)  # type: ignore[arg-type]
                assert n == len(tokens), n
    print(
        f"hot-miss SSD-hit fetch of {args.tokens} tokens, block {args.block_size}: "
        f"{len(trace.calls)} modules, {sum(trace.calls.values())} calls, "
        f"{len(trace.edges)} distinct caller -> callee module pairs, "
        f"{trace.hops} crossings between modules"
    )
    if args.list:
        for module, num in sorted(trace.calls.items()):
            print(f"  {module:32s} {num}")


def model_run(model, tokens: list[int], cache) -> None:
    import mlx.core as mx

    model(mx.array([tokens]), cache=cache)
    mx.eval([c.state for c in cache])


if __name__ == "__main__":
    main()
