"""``prefixcache stats --remote-url``: what a remote tier's server holds, per model.

Blocks, tokens and payload bytes per namespace under ``--remote-prefix``, and
the server's memory use, limit and eviction policy. Reads only; the redis
client is imported when the option is given. Exit status 2 when the server
cannot be reached.
"""

from __future__ import annotations

import argparse
import os
import sys

from ..config import CacheConfig
from ..extras import require
from ..settings import env_name
from .common import Command, Doc, emit
from .report import format_bytes, table


def with_remote(command: Command) -> Command:
    """``command`` plus ``--remote-url`` / ``--remote-prefix``: given a URL (the
    flag only: the SSD directory's report stays the default), it reports the
    remote server instead."""

    def add(parser: argparse.ArgumentParser) -> None:
        command.add_args(parser)
        parser.add_argument("--remote-url", help="report this remote tier's server instead")
        parser.add_argument("--remote-prefix", help="its key namespace (default: prefixcache)")

    def run(args: argparse.Namespace) -> int:
        return cmd_remote_stats(args) if args.remote_url else command.run(args)

    return Command(command.name, command.help, add, run)


def cmd_remote_stats(args: argparse.Namespace) -> int:
    var = env_name("remote_prefix")  # of the environment, only the key namespace is read
    config = CacheConfig.from_env(
        {var: os.environ[var]} if var in os.environ else {},
        remote_url=args.remote_url,
        remote_prefix=args.remote_prefix,
    )
    redis = require("redis", extra="remote", feature="the remote tier (--remote-url)")
    from ..tiers.remote.inventory import remote_usage

    client = redis.Redis.from_url(args.remote_url, socket_timeout=10, socket_connect_timeout=5)
    try:
        usage = remote_usage(client, config.remote_prefix)
    except redis.RedisError as err:
        print(f"prefixcache stats: remote server {args.remote_url}: {err}", file=sys.stderr)
        return 2
    finally:
        client.close()
    namespaces = [
        {"root": ns.root.hex(), "model": ns.model, "num_blocks": ns.num_blocks,
         "num_tokens": ns.num_tokens, "nbytes": ns.nbytes}
        for ns in usage.namespaces
    ]  # fmt: skip
    doc = {
        "remote_url": args.remote_url,
        "remote_prefix": usage.prefix,
        "num_blocks": sum(ns["num_blocks"] for ns in namespaces),
        "num_tokens": sum(ns["num_tokens"] for ns in namespaces),
        "nbytes": sum(ns["nbytes"] for ns in namespaces),
        "num_bad_entries": usage.num_bad,
        "server": {
            "used_memory": usage.used_memory,
            "maxmemory": usage.maxmemory,
            "maxmemory_policy": usage.policy,
        },
        "namespaces": namespaces,
    }
    emit(args, doc, lambda: _text(doc))
    return 0


def _text(doc: Doc) -> str:
    server = doc["server"]
    limit = format_bytes(server["maxmemory"]) if server["maxmemory"] else "no maxmemory"
    lines = [
        f"remote tier {doc['remote_url']} (prefix {doc['remote_prefix']})",
        f"  {doc['num_blocks']} blocks, {doc['num_tokens']} tokens, {format_bytes(doc['nbytes'])}",
        f"  server: {format_bytes(server['used_memory'])} used of {limit}, "
        f"policy {server['maxmemory_policy']}",
    ]
    if doc["num_bad_entries"]:
        lines.append(f"  unreadable block entries: {doc['num_bad_entries']}")
    rows = [
        [ns["model"] or "(unrecorded)", ns["root"][:8], ns["num_blocks"], ns["num_tokens"],
         format_bytes(ns["nbytes"])]
        for ns in doc["namespaces"]
    ]  # fmt: skip
    heads = ("model", "root", "blocks", "tokens", "size")
    lines += ["", table(heads, rows, "llrrr")] if rows else ["", "(no blocks)"]
    return "\n".join(lines)
