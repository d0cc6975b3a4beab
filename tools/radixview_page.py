"""radixview, a KV-events consumer we did not write, against a real ``prefixcache serve``.

    python tools/radixview_page.py [--screenshot docs/radixview.png] [--json]

Starts ``prefixcache serve`` on a tiny offline model with ``--events-url``, then
``radixview --server URL`` (pip, Apache-2.0), which finds our publisher through
``GET /server_info``, subscribes, and rebuilds a radix tree of the server's
cache from the events alone (text from ``POST /detokenize``). It sends the
demo's chats (``prefixcache demo``: conversations sharing a system prompt,
interleaved turn by turn) and reads radixview's tree from its JSON API twice:
while serving (every block in the hot tier: medium ``GPU``) and after SIGTERM
(the hot tier flushed to the SSD tier: medium ``STORAGE``). Each is compared
with what ``prefixcache tree --json`` prints of the SSD directory afterwards:
the same prefixes (chains of full blocks, collapsed between forks as both
draw them, by block hash), the same block and token counts (``--events-format
sglang``: the same in SGLang's form, its ``DISK`` read as ``STORAGE``). ``--screenshot``
takes radixview's page in headless Chromium (Debian's ``chromium``) while
serving. One summary line per tier, a table, exit 1 if a tree differs.
"""

from __future__ import annotations

import argparse
import json
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests

from prefixcache.background.kv_events import block_hash
from prefixcache.cli.demo import demo_turns
from prefixcache.tiny.models import save_model

BLOCK_SIZE = 16
MEDIA = {"DISK": "STORAGE"}  # SGLang's name of the SSD tier's medium, as vLLM's
WAIT = 60.0  # seconds for a process or a tree to be ready
# first hash, last hash (None: not compared), blocks, tokens, parent node's first hash
Node = tuple[int, int | None, int, int, int | None]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for(what: str, check, timeout: float = WAIT):
    """Poll ``check()`` until it returns a true value (returned); raise after ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if out := check():
                return out
        except requests.RequestException:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{what}: not ready in {timeout:g}s")


def start_serve(
    model: Path, ssd: Path, log: Path, form: str = "vllm"
) -> tuple[subprocess.Popen, str, int]:
    """``prefixcache serve`` with KV events in ``form``; (process, URL, metrics port)."""
    port, events, metrics = free_port(), free_port(), free_port()
    argv = [sys.executable, "-m", "prefixcache", "serve", "--model", str(model)]
    argv += ["--ssd-dir", str(ssd), "--block-size", str(BLOCK_SIZE)]
    argv += ["--events-url", f"tcp://*:{events}", "--events-format", form]
    argv += ["--metrics-port", str(metrics)]
    argv += ["--host", "127.0.0.1", "--port", str(port)]
    proc = subprocess.Popen(argv, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    wait_for("prefixcache serve", lambda: proc.poll() is None and requests.get(url + "/health"))
    return proc, url, metrics


def start_radixview(server: str, log: Path) -> tuple[subprocess.Popen, str]:
    """radixview watching ``server``; (process, its page URL)."""
    port = free_port()
    exe = Path(sys.executable).with_name("radixview")
    argv = [str(exe), "--server", server, "--view-port", str(port)]
    proc = subprocess.Popen(argv, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    view = f"http://127.0.0.1:{port}"
    wait_for("radixview", lambda: proc.poll() is None and requests.get(view + "/api/tree"))
    return proc, view


def metric(metrics_port: int, name: str) -> float:
    """One value of the server's Prometheus text (``--metrics-port``)."""
    text = requests.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).text
    for line in text.splitlines():
        if line.startswith(f"prefixcache_{name} "):
            return float(line.split()[-1])
    raise KeyError(name)


def events_seen(log: Path) -> int:
    """Events radixview has applied to its tree: it logs one line per event after."""
    return log.read_text(errors="replace").count("radixview.subscribe: dp=")


def chat_demo(url: str, turns: int, conversations: int, words: tuple[int, int]) -> int:
    """The demo's chats through the server (greedy, 8 tokens a reply); requests sent.

    A last request of a few tokens (no full block: nothing to publish) follows: the
    server stores a request's cache after answering it, before it takes the next."""
    system, order = demo_turns(conversations, turns, *words)
    chats = [[{"role": "system", "content": system}] for _ in range(conversations)]
    for conv, text in order:
        chats[conv].append({"role": "user", "content": text})
        body = {"messages": chats[conv], "temperature": 0, "max_tokens": 8}
        reply = requests.post(url + "/v1/chat/completions", json=body, timeout=120)
        reply.raise_for_status()
        content = reply.json()["choices"][0]["message"]["content"] or ""
        chats[conv].append({"role": "assistant", "content": content})
    barrier = {"prompt": "hi", "max_tokens": 1, "temperature": 0}  # fewer tokens than a block
    requests.post(url + "/v1/completions", json=barrier, timeout=120).raise_for_status()
    return len(order)


def their_tree(view: str) -> dict:
    """radixview's tree from its API: nodes as ``Node`` tuples, and its stats."""
    doc = requests.get(view + "/api/tree", timeout=5).json()
    present = [n for n in doc["nodes"] if not n["missing"]]
    first = {n["id"]: int(n["id"].split("..")[0]) for n in present}
    nodes, lasts, previews = set(), {}, []
    for n in present:
        parent = first.get(n["parent"]) if n["parent"] is not None else None
        nodes.add((first[n["id"]], None, n["blocks"], n["tokens"], parent))
        lasts[first[n["id"]]] = int(n["id"].split("..")[-1])
        previews.append((n["preview"], parent))
    media = {MEDIA.get(n["medium"], n["medium"]) for n in present}
    out = {"nodes": nodes, "last": lasts, "media": media, "stats": doc["stats"]}
    return out | {"previews": previews}


def settled(view: str, log: Path, media: set[str], events: int = 0, *, more: str = "") -> dict:
    """radixview's tree once it applied at least ``events`` events and the count held
    still for a second, with every node in ``media`` (or in ``more``, a medium a
    background write may have moved a block to meanwhile: write_back spills a
    block's ancestors with it)."""
    seen: list[int] = []

    def check() -> dict | None:
        seen.append(events_seen(log))
        done = seen[-1] >= events and seen[-10:].count(seen[-1]) == 10
        tree = their_tree(view)
        return tree if done and media <= tree["media"] <= media | {more} - {""} else None

    return wait_for(f"radixview's tree in {media}", check)


def our_tree(ssd: Path) -> dict:
    """What ``prefixcache tree --json`` prints of ``ssd``, as ``Node`` tuples with no
    last hash: a tail (shorter than a block: never published) may end a run, and
    ends a segment or forks one; dropped, the runs it split are rejoined."""
    argv = [sys.executable, "-m", "prefixcache", "tree", "--ssd-dir", str(ssd), "--json"]
    doc = json.loads(subprocess.run(argv, check=True, capture_output=True, text=True).stdout)
    nodes: set[Node] = set()
    for ns in doc["namespaces"]:
        for seg in ns["tree"]:
            if _full_blocks(seg):
                _collect(seg, None, nodes)
    return {"nodes": nodes, "printed_blocks": sum(ns["num_blocks"] for ns in doc["namespaces"])}


def _full_blocks(seg: dict) -> int:
    """The segment's full blocks (a tail, if it ends it, has fewer tokens than one)."""
    return (seg["end_token"] - seg["start_token"]) // BLOCK_SIZE


def _collect(seg: dict, parent: int | None, out: set[Node]) -> None:
    first = block_hash(bytes.fromhex(seg["first_key"]))
    blocks = _full_blocks(seg)
    kids = [c for c in seg["children"] if _full_blocks(c)]
    while len(kids) == 1:  # a tail was the fork: the one full child continues the run
        blocks += _full_blocks(kids[0])
        kids = [c for c in kids[0]["children"] if _full_blocks(c)]
    out.add((first, None, blocks, blocks * BLOCK_SIZE, parent))
    for kid in kids:
        _collect(kid, first, out)


def screenshot(view: str, path: Path) -> None:
    """radixview's page in headless Chromium (its script draws the tree from /api/tree)."""
    argv = ["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars"]
    argv += [f"--screenshot={path}", "--window-size=1400,800", "--virtual-time-budget=8000"]
    subprocess.run([*argv, view], check=True, capture_output=True, timeout=120)


def stop(proc: subprocess.Popen) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


def run(
    workdir: Path,
    *,
    turns: int = 3,
    conversations: int = 3,
    words: tuple[int, int] = (500, 60),
    shot: Path | None = None,
    form: str = "vllm",
) -> dict:
    """The whole comparison in ``workdir`` (events in ``form``); returns the report."""
    model = save_model(workdir / "model", "llama")
    ssd = workdir / "ssd"
    serve, url, metrics = start_serve(model, ssd, workdir / "serve.log", form)
    viewer = None
    try:
        info = requests.get(url + "/server_info", timeout=5).json()
        viewer, view = start_radixview(url, workdir / "radixview.log")
        rvlog = workdir / "radixview.log"
        wait_for("radixview subscribed", lambda: metric(metrics, "events_subscribers") >= 1)
        num_requests = chat_demo(url, turns, conversations, words)
        published = int(metric(metrics, "events_events"))
        hot = settled(view, rvlog, {"GPU"}, published, more="STORAGE")
        if shot is not None:
            screenshot(view, shot)
        serve_rc = stop(serve)  # SIGTERM: the hot tier is flushed to SSD, then it exits
        ssd_tree = settled(view, rvlog, {"STORAGE"})
    finally:
        stop(serve)
        if viewer is not None:
            stop(viewer)
    ours = our_tree(ssd)
    return {
        "server_info": info,
        "requests": num_requests,
        "serve_exit": serve_rc,
        "published_while_serving": published,
        "form": form,
        "hot": hot,
        "ssd": ssd_tree,
        "ours": ours,
    }


def summary(report: dict) -> dict:
    ours = report["ours"]["nodes"]
    out = {}
    disk = "DISK" if report["form"] == "sglang" else "STORAGE"
    for tier, medium in (("hot", "GPU"), ("ssd", disk)):
        theirs = report[tier]["nodes"]
        out[tier] = {
            "medium": medium,
            "radixview_nodes": len(theirs),
            "radixview_blocks": report[tier]["stats"]["blocks"],
            "radixview_tokens": report[tier]["stats"]["tokens"],
            "placeholders": report[tier]["stats"]["missing"],
            "tree_nodes": len(ours),
            "tree_blocks": sum(n[2] for n in ours),
            "tree_tokens": sum(n[3] for n in ours),
            "same": theirs == ours,
        }
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--screenshot", type=Path, help="write radixview's page here (PNG)")
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--conversations", type=int, default=3)
    p.add_argument("--system-words", type=int, default=500, help="the demo's: 500")
    p.add_argument("--turn-words", type=int, default=60, help="the demo's: 60")
    p.add_argument("--events-format", choices=("vllm", "sglang"), default="vllm")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="radixview-page-") as tmp:
        words = (args.system_words, args.turn_words)
        shape = {"turns": args.turns, "conversations": args.conversations, "words": words}
        report = run(Path(tmp), **shape, shot=args.screenshot, form=args.events_format)
    rows = summary(report)
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        for tier, r in rows.items():
            print(
                f"{tier:<4} radixview ({r['medium']}): {r['radixview_nodes']} nodes, "
                f"{r['radixview_blocks']} blocks, {r['radixview_tokens']} tokens | prefixcache "
                f"tree: {r['tree_nodes']} nodes, {r['tree_blocks']} blocks, {r['tree_tokens']} "
                f"tokens | same tree: {'yes' if r['same'] else 'NO'}"
            )
    return 0 if all(r["same"] for r in rows.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
