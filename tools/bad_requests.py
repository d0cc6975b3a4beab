"""Send a server every bad request of ``badlib.BAD``, one at a time, each followed by
``GET /health``: one row per request with the status it got and whether the
server still answers.

Against a running server (``--url``), or against fresh ones started here on a
tiny llama built offline (``--systems``: ``ours`` is ``prefixcache serve`` with
an SSD tier, ``plain`` is ``mlx_lm.server``), side by side in one table; a
server found dead after a request is replaced by a fresh one (the row says it
died), so each request meets a working server. After the list, a good request
shows whether the server still generates.

    python tools/bad_requests.py                      # ours and plain, side by side
    python tools/bad_requests.py --url http://127.0.0.1:8080
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import urllib.request
from pathlib import Path

from badlib import BAD, HI, health, send
from reuselib.servers import Server

from prefixcache.tiny.models import save_model

SYSTEMS = ("ours", "plain")


def setup_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--url", help="a running server (else fresh ones are started)")
    p.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    p.add_argument("--model", type=Path, help="model directory (default: a tiny llama)")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds per request")
    return p


def run_all(url: str, timeout: float, restart=None) -> list[tuple[str, str, str]]:
    """(status, health after, first characters of the reply) per request of BAD, then
    one good request (its status; ``health`` column: whether it generated).

    ``restart``: called with the dead server's URL when one stops answering, returns
    the URL of a fresh one (so each request meets a working server).
    """
    rows = []
    for bad in BAD:
        status, text = send(url, bad, timeout)
        after = health(url)
        rows.append((status, after, text))
        if after != "200" and restart is not None:
            url = restart(url)
    rows.append(_good(url, timeout))
    return rows


def _good(url: str, timeout: float) -> tuple[str, str, str]:
    body = json.dumps({"messages": HI, "max_tokens": 2, "temperature": 0}).encode()
    request = urllib.request.Request(url + "/v1/chat/completions", data=body)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            doc = json.load(reply)
        return str(reply.status), health(url), str(doc["usage"]["completion_tokens"])
    except OSError as err:
        return type(err).__name__, health(url), str(err)[:120]


def start(system: str, model: Path, workdir: Path) -> Server:
    py = sys.executable
    argv = {
        "ours": [py, "-m", "prefixcache", "serve", "--model", str(model),
                 "--ssd-dir", str(workdir / "ssd"), "--block-size", "16"],
        "plain": [py, "-m", "mlx_lm", "server", "--model", str(model)],
    }[system]  # fmt: skip
    server = Server(system, argv, workdir / f"{system}.log")
    server.wait_ready()
    return server


def table(names: list[str], results: dict[str, list[tuple[str, str, str]]]) -> str:
    systems = list(results)
    head = "| # | request | " + " | ".join(f"{s}: status | {s}: alive" for s in systems) + " |"
    lines = [head, "|" + "---|" * (2 + 2 * len(systems))]
    for i, name in enumerate([*names, "good request after all"]):
        cells = []
        for s in systems:
            status, after, _ = results[s][i]
            cells += [status, "yes" if after == "200" else f"no ({after})"]
        lines.append(f"| {i + 1} | {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    args = setup_arg_parser().parse_args()
    names = [bad.name for bad in BAD]
    if args.url:
        results = {"server": run_all(args.url, args.timeout)}
    else:
        results = {}
        with tempfile.TemporaryDirectory(prefix="bad-requests-") as tmp:
            model = args.model or save_model(Path(tmp) / "llama", "llama")
            for system in args.systems:
                servers = [start(system, model, Path(tmp))]

                def fresh(_url: str, system=system, servers=servers) -> str:
                    servers[-1].stop()  # dead: a new one on the same directory
                    servers.append(start(system, model, Path(tmp)))
                    return servers[-1].url

                try:
                    results[system] = run_all(servers[0].url, args.timeout, fresh)
                finally:
                    servers[-1].stop()
    print(table(names, results))
    for system, rows in results.items():
        for name, (status, _, text) in zip([*names, "good"], rows, strict=True):
            print(f"{system:6} {status:>8} {name}: {text!r}", file=sys.stderr)


if __name__ == "__main__":
    main()
