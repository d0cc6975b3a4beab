"""KV events under load: store rate, and every event received by a subscriber process.

A real PrefixCache (tiny llama, block_size 16, a hot tier of 2 blocks and an
SSD tier of 3, so every store also makes hot evictions, SSD writes and SSD
evictions) stores ``--stores`` one-block prompts, each a new block. A
subscriber in another process (a real ZeroMQ SUB socket, as a router's) counts
every batch and event. In ONE run:

  off      no ``events_url``: the store rate without events (the reference)
  max      events on, stores as fast as the caller can make them
  paced    events on, stores paced at ``--rate`` per second

Per run: stores per second, events published, events received, batches lost
(a gap in the batch sequence numbers), and whether the blocks the received
events name match the tiers' own counters (hot: blocks stored and evicted;
SSD: writes and evictions). Nothing lost: every published batch arrived.

Each round runs the three in turn (``--repeat`` rounds): rates are medians with
their range, the overhead of events a ratio to the ``off`` run of the same round.

    python tools/bench_events.py [--stores 5000 --rate 1000 --repeat 3]
"""

from __future__ import annotations

import argparse
import itertools
import multiprocessing as mp
import socket
import statistics
import tempfile
import time
from collections import Counter

import mlx.core as mx
import numpy as np

BLOCK = 16


def runs_of(rate: float) -> tuple[tuple[str, float | None, bool], ...]:
    """(name, stores per second or None: as fast as possible, events on)."""
    return (("off", None, False), ("max", None, True), ("paced", rate, True))


def subscribe(port: int, ready, out) -> None:
    """The subscriber process: every batch until ``idle`` seconds pass without one."""
    import msgspec
    import zmq

    from prefixcache.background.kv_events import MEDIUM_GPU, MEDIUM_STORAGE, KVEventBatch

    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.set_hwm(0)
    sub.connect(f"tcp://127.0.0.1:{port}")
    ready.set()
    decode = msgspec.msgpack.Decoder(type=KVEventBatch).decode
    tier = {MEDIUM_GPU: "hot", MEDIUM_STORAGE: "ssd"}  # vLLM's media, both LOCAL here
    seqs, counts, num_events = [], Counter(), 0
    while sub.poll(3000):
        _topic, seq, payload = sub.recv_multipart()
        seqs.append(int.from_bytes(seq, "big"))
        for event in decode(payload).events:
            if type(event).__name__ == "AllBlocksCleared":  # the first batch's
                num_events += 1
                continue
            counts[(type(event).__name__, tier[event.medium])] += len(event.block_hashes)
            num_events += 1
    sub.close(linger=0)
    gaps = sum(b - a - 1 for a, b in itertools.pairwise(seqs) if b != a + 1)
    missing = gaps + (seqs[0] if seqs else 0)
    out.put({"batches": len(seqs), "missing": missing, "events": num_events, "counts": counts})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(model, cache, prompts, rate: float | None, events: bool) -> dict:
    from prefixcache import CacheConfig, PrefixCache

    port = free_port()
    ctx = mp.get_context("spawn")
    ready, out = ctx.Event(), ctx.Queue()
    child = ctx.Process(target=subscribe, args=(port, ready, out)) if events else None
    with tempfile.TemporaryDirectory(prefix="bench-events-") as tmp:
        cfg = CacheConfig(
            block_size=BLOCK,
            ssd_dir=tmp,
            ssd_min_free_bytes=0,
            hot_max_bytes=2 * 8192,
            ssd_max_bytes=3 * 8192 + 3 * 1024,
            events_url=f"tcp://*:{port}" if events else None,
            counters_save_seconds=0,
        )
        with PrefixCache(model, cfg, model_id="bench-events") as pc:
            if child is not None:
                child.start()
                ready.wait(60)
                pc.services.events.wait_for_subscriber(60)
            began = time.perf_counter()
            for i, tokens in enumerate(prompts):
                if rate:
                    time.sleep(max(0.0, began + i / rate - time.perf_counter()))
                pc.store(tokens, cache)
            seconds = time.perf_counter() - began
            pc.flush()
            if child is not None:
                pc.services.events.flush()
            st = pc.stats()
    got = out.get(timeout=120) if child is not None else None
    if child is not None:
        child.join(30)
    return {"rate": len(prompts) / seconds, "stats": st, "got": got}


def expected(st: dict) -> dict[tuple[str, str], int]:
    """What the tiers' own counters say was stored and removed."""
    return {
        ("BlockStored", "hot"): st["stored_blocks"],
        ("BlockRemoved", "hot"): st["hot"]["num_evictions"],
        ("BlockStored", "ssd"): st["ssd"]["num_writes"],
        ("BlockRemoved", "ssd"): st["ssd"]["num_evictions"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--stores", type=int, default=5000)
    p.add_argument("--rate", type=float, default=1000.0, help="stores per second (paced run)")
    p.add_argument("--repeat", type=int, default=3, help="rounds of the three runs")
    args = p.parse_args()
    from mlx_lm.models.cache import make_prompt_cache

    from prefixcache.tiny.models import build_model

    model = build_model("llama")
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 512, BLOCK).tolist() for _ in range(args.stores)]
    cache = make_prompt_cache(model)
    model(mx.array([prompts[0]]), cache=cache)
    mx.eval([c.state for c in cache])
    rounds = []
    for r in range(args.repeat):
        runs = {}
        for name, rate, events in runs_of(args.rate):
            runs[name] = run(model, cache, prompts, rate, events)
            print(f"round {r + 1} " + _line(name, runs[name]))
        rounds.append(runs)
    print()
    print(_table(rounds))


def _matches(run: dict) -> bool:
    return all(run["got"]["counts"].get(k, 0) == v for k, v in expected(run["stats"]).items())


def _line(name: str, run: dict) -> str:
    line = f"{name:6s} {run['rate']:7.0f} stores/s"
    if run["got"] is None:
        return line + " (no events)"
    st, got = run["stats"], run["got"]
    return (
        f"{line}, {st['events']['num_events']} events published, {got['events']} received in "
        f"{got['batches']} batches, {got['missing']} batches lost, dropped "
        f"{st['events']['num_dropped']}, per tier as counted: {'yes' if _matches(run) else 'NO'}"
    )


def _table(rounds: list[dict[str, dict]]) -> str:
    def spread(values: list[float], digits: int) -> str:
        low, mid, high = min(values), statistics.median(values), max(values)
        return f"{mid:.{digits}f} ({low:.{digits}f}-{high:.{digits}f})"

    out = [
        "| run | stores/s | vs no events, same round | events published | received "
        "| batches lost | blocks match the tiers' counters |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for name in rounds[0]:
        runs = [r[name] for r in rounds]
        rates = spread([r["rate"] for r in runs], 0)
        ratio = spread([r[name]["rate"] / r["off"]["rate"] for r in rounds], 2)
        ratio = ratio if name == "max" else "(paced)"
        if runs[0]["got"] is None:
            out.append(f"| {name} | {rates} | 1.00 | | | | |")
            continue
        published = sum(r["stats"]["events"]["num_events"] for r in runs)
        received = sum(r["got"]["events"] for r in runs)
        lost = sum(r["got"]["missing"] for r in runs)
        match = "yes" if all(_matches(r) for r in runs) else "no"
        out.append(f"| {name} | {rates} | {ratio} | {published} | {received} | {lost} | {match} |")
    return "\n".join(out)


if __name__ == "__main__":
    main()
