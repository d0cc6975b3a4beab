"""Which modules a fetch passes through: a hot-miss, SSD-hit fetch, by the library or the server.

A chain of a tiny llama is stored on the SSD tier and flushed; a new cache on
the same directory (hot tier empty) fetches it once to warm the imports and
caches, and a second new one fetches it under ``sys.setprofile``: the
library's ``PrefixCache.fetch``, or with ``--server`` the server adapter's
``TieredPromptCache.fetch_nearest_cache`` (what mlx-lm's server calls). Every
Python call into a module (one file) of the ``prefixcache`` package is
recorded, on every thread (the SSD readers too). Prints the modules it
entered, the calls, the distinct caller -> callee pairs of modules, the
crossings (consecutive calls or returns on one thread that go from one module
into another: they grow with the number of blocks), the wings (folders of the
package) in the order the fetch first enters them, and the climbs: calls from
a module into one of a wing above its own (the wings' order, top-down, is
``WINGS``).

    python tools/fetch_path.py [--server] [--tokens 64] [--block-size 16] [--list]
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
from prefixcache.serve.fit import model_id_of
from prefixcache.tiny.models import build_model

PACKAGE = os.path.dirname(os.path.abspath(prefixcache.__file__))
# the package's wings, top-down: a call goes down this list or stays in its wing
WINGS = ["serve", "cache", "shared", "background", "tiers", "codecs", "memory", "(top)"]


KEY = ("path", None, None)  # mlx-lm's model key: (model, adapter, draft)


def wing_of(module: str) -> str:
    head = module.split(".", 1)[0]
    return head if head in WINGS else "(top)"


def module_of(filename: str) -> str | None:
    """``tiers.ssd.stream`` for a file of the package, else None."""
    path = os.path.abspath(filename)
    if not path.startswith(PACKAGE + os.sep):
        return None
    rel = os.path.relpath(path, PACKAGE)[: -len(".py")]
    return rel.replace(os.sep, ".")


class Trace:
    def __init__(self) -> None:
        self.wings: list[str] = []  # first entries, in order
        self.climbs: set[tuple[str, str]] = set()
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
                if wing_of(module) not in self.wings:
                    self.wings.append(wing_of(module))
                caller = module_of(frame.f_back.f_code.co_filename) if frame.f_back else None
                if caller is not None and climbs(caller, module):
                    self.climbs.add((caller, module))
            me = threading.get_ident()
            last = self._last.get(me)
            if last is not None and last != module:
                self.hops += 1
                self.edges.add((last, module) if event == "call" else (module, last))
            self._last[me] = module


def climbs(caller: str, callee: str) -> bool:
    """Whether a call from ``caller`` into ``callee`` goes up the wings."""
    return WINGS.index(wing_of(callee)) < WINGS.index(wing_of(caller))


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
    p.add_argument("--server", action="store_true", help="through the server adapter")
    p.add_argument("--list", action="store_true", help="every module with its calls")
    args = p.parse_args()
    model = build_model("llama")
    tokens = [(7 * i) % 500 + 1 for i in range(args.tokens)]
    with tempfile.TemporaryDirectory() as root:
        cfg = config(args.block_size, root)
        with PrefixCache(model, cfg, model_id=model_id_of(KEY, model)) as pc:
            cache, _ = pc.fetch(tokens)
            model_run(model, tokens, cache)
            pc.store(tokens, cache)
        for traced in (False, True):
            trace = Trace()
            n = traced_fetch(model, cfg, [*tokens, 1], trace if traced else None, args.server)
            assert n == len(tokens), n
    what = "TieredPromptCache.fetch_nearest_cache" if args.server else "PrefixCache.fetch"
    print(
        f"{what}, hot miss and SSD hit of {args.tokens} tokens, block {args.block_size}: "
        f"{len(trace.calls)} modules, {sum(trace.calls.values())} calls, "
        f"{len(trace.edges)} distinct caller -> callee module pairs, "
        f"{trace.hops} crossings between modules, {len(trace.climbs)} climbs"
    )
    print("wings in order: " + " > ".join(trace.wings))
    for caller, callee in sorted(trace.climbs):
        print(f"  climb: {caller} -> {callee}")
    if args.list:
        for module, num in sorted(trace.calls.items()):
            print(f"  {module:32s} {num}")


def traced_fetch(model, cfg: CacheConfig, tokens: list[int], trace, server: bool) -> int:
    """Tokens a fresh cache on ``cfg`` restores of ``tokens``, under ``trace`` if given."""
    if server:
        from prefixcache.serve.prompt_cache import TieredPromptCache

        cache = TieredPromptCache(lambda key: model, cfg)
        fetch = lambda t=tokens: len(t) - len(cache.fetch_nearest_cache(KEY, t)[1])  # noqa: E731
    else:
        cache = PrefixCache(model, cfg, model_id=model_id_of(KEY, model))
        fetch = lambda t=tokens: cache.fetch(t)[1]  # noqa: E731
    with cache:
        fetch([499, 498])  # opened (the server opens its cache at the first request): a miss
        if trace is not None:
            threading.setprofile(trace)
            sys.setprofile(trace)
        try:
            return fetch()
        finally:
            sys.setprofile(None)
            threading.setprofile(None)  # type: ignore[arg-type]


def model_run(model, tokens: list[int], cache) -> None:
    import mlx.core as mx

    model(mx.array([tokens]), cache=cache)
    mx.eval([c.state for c in cache])


if __name__ == "__main__":
    main()
