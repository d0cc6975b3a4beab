"""``prefixcache stats --remote-url``: what a remote tier's server holds, per model.

Blocks, tokens and payload bytes per namespace under ``--remote-prefix``, and
the server's memory use, limit and eviction policy. Reads only; the redis
client is imported when the option is given. Exit status 2 when the server
cannot be reached.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..config import CacheConfig
from ..extras import require
from .common import Command, Doc, emit

if TYPE_CHECKING:
    from ..tiers.remote.inventory import RemoteUsage
from .report import format_bytes, table


def with_remote(
    command: Command, remote_run: Callable[[argparse.Namespace], int] | None = None
) -> Command:
    """``command`` plus ``--remote-url`` / ``--remote-prefix``: given a URL (the
    flag only: the SSD directory's stays the default), ``remote_run`` (the
    server's report by default) runs on the remote server instead."""

    def add(parser: argparse.ArgumentParser) -> None:
        command.add_args(parser)
        parser.add_argument("--remote-url", help="work on this remote tier's server instead")
        parser.add_argument("--remote-prefix", help="its key namespace (default: prefixcache)")

    def run(args: argparse.Namespace) -> int:
        if not args.remote_url:
            return command.run(args)
        return (remote_run or cmd_remote_stats)(args)

    return Command(command.name, command.help, add, run)


def remote_config(args: argparse.Namespace) -> CacheConfig:
    """The remote settings of a command: ``--remote-url`` / ``--remote-prefix`` over
    the ``PREFIXCACHE_REMOTE_*`` variables (TLS files, secret), generous timeouts.

    Raises:
        ValueError: a bad setting (named).
        MissingExtraError: the ``remote`` extra is not installed.
    """
    require("redis", extra="remote", feature="the remote tier (--remote-url)")
    # the command reports a server it cannot reach in its own one line
    logging.getLogger("prefixcache.tiers.remote").setLevel(logging.ERROR)
    return CacheConfig.from_env(
        remote_url=args.remote_url,
        remote_prefix=args.remote_prefix,
        remote_timeout_ms=10_000,
        remote_connect_timeout_ms=5_000,
        remote_breaker_failures=1,
    )


def cmd_remote_stats(args: argparse.Namespace) -> int:
    config = remote_config(args)  # a bad setting: one line naming the flag (cli/__init__)
    from ..tiers.remote.client import RemoteClient, RemoteUnavailable
    from ..tiers.remote.inventory import remote_usage

    client = RemoteClient(config)
    try:
        usage = remote_usage(client, config.remote_prefix)
    except RemoteUnavailable as err:
        print(f"prefixcache stats: remote server {client.url}: {err}", file=sys.stderr)
        return 2
    finally:
        client.close()
    doc = _stats_doc(client.url, client.cluster, usage)
    emit(args, doc, lambda: _text(doc))
    return 0


def _stats_doc(url: str, cluster: bool, usage: RemoteUsage) -> Doc:
    """``stats --remote-url``'s document (``url`` with its password redacted)."""
    namespaces = [
        {
            "root": ns.root.hex(),
            "model": ns.model,
            "num_blocks": ns.num_blocks,
            "num_tokens": ns.num_tokens,
            "nbytes": ns.nbytes,
        }
        for ns in usage.namespaces
    ]
    shards = [
        {
            "node": s.name,
            "used_memory": s.used_memory,
            "maxmemory": s.maxmemory,
            "maxmemory_policy": s.policy,
            "num_keys": s.num_keys,
        }
        for s in usage.shards
    ]
    server = {
        "used_memory": sum(s["used_memory"] for s in shards),
        "maxmemory": sum(s["maxmemory"] for s in shards),
        "maxmemory_policy": ",".join(sorted({s["maxmemory_policy"] for s in shards})),
    }
    return {
        "remote_url": url,
        "remote_prefix": usage.prefix,
        "cluster": cluster,
        "num_blocks": sum(ns["num_blocks"] for ns in namespaces),
        "num_tokens": sum(ns["num_tokens"] for ns in namespaces),
        "nbytes": sum(ns["nbytes"] for ns in namespaces),
        "num_bad_entries": usage.num_bad,
        **usage.counters,
        "server": server,
        "shards": shards,
        "namespaces": namespaces,
        "tenants": usage.tenants,
    }


def cmd_remote_gc(args: argparse.Namespace) -> int:
    """``gc --remote-url``: a model's blocks, idle ones, and leftovers on the server."""
    if args.max_bytes is not None:
        print("prefixcache gc: --max-bytes is the server's maxmemory here", file=sys.stderr)
        return 2
    config = remote_config(args)  # a bad setting: one line naming the flag (cli/__init__)
    from ..tiers.remote.client import RemoteClient, RemoteUnavailable
    from ..tiers.remote.gc import plan_gc, run_gc
    from ..tiers.remote.names import Names

    client = RemoteClient(config)
    names = Names(config.remote_prefix)  # names as stored: no secret is needed to remove
    try:
        plan = plan_gc(client, names, model=args.model, older_than=args.older_than)
        num = 0 if args.dry_run else run_gc(client, names, plan)
    except RemoteUnavailable as err:
        print(f"prefixcache gc: remote server {client.url}: {err}", file=sys.stderr)
        return 2
    finally:
        client.close()
    doc = {
        "remote_url": client.url,
        "remote_prefix": config.remote_prefix,
        "dry_run": args.dry_run,
        "num_blocks": len(plan.remove) if args.dry_run else num,
        "nbytes": plan.nbytes,
        "num_tokens": plan.num_tokens,
        "num_selected": plan.num_selected,
        "num_descendants": plan.num_below,
        "num_stray_keys": len(plan.stray_keys),
        "num_dangling_names": len(plan.dangling),
    }
    emit(args, doc, lambda: _gc_text(doc))
    return 0


def _gc_text(doc: Doc) -> str:
    verb = "would remove" if doc["dry_run"] else "removed"
    return (
        f"{verb} {doc['num_blocks']} blocks ({format_bytes(doc['nbytes'])}, "
        f"{doc['num_tokens']} tokens) from {doc['remote_url']}: "
        f"{doc['num_selected']} selected, {doc['num_descendants']} below them; "
        f"{doc['num_stray_keys']} stray keys, {doc['num_dangling_names']} dangling names "
        "in children listings"
    )


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
    lines.append(
        f"  blocks the hosts refused: {doc['num_forged']} forged (fail their MAC), "
        f"{doc['num_corrupt']} corrupt, {doc['num_missing_parts']} with missing parts"
    )
    if doc["cluster"]:
        lines += [
            "",
            table(
                ("shard", "used", "maxmemory", "policy", "keys"),
                [
                    [
                        s["node"],
                        format_bytes(s["used_memory"]),
                        format_bytes(s["maxmemory"]),
                        s["maxmemory_policy"],
                        s["num_keys"],
                    ]
                    for s in doc["shards"]
                ],
                "lrrlr",
            ),
        ]
    rows = [
        [
            ns["model"] or "(unrecorded)",
            ns["root"][:8],
            ns["num_blocks"],
            ns["num_tokens"],
            format_bytes(ns["nbytes"]),
        ]
        for ns in doc["namespaces"]
    ]
    heads = ("model", "root", "blocks", "tokens", "size")
    lines += ["", table(heads, rows, "llrrr")] if rows else ["", "(no blocks)"]
    return "\n".join(lines + _tenant_lines(doc["tenants"]))


def _tenant_lines(tenants: Doc) -> list[str]:
    """The table of the tenants' figures (tenant shares: every host's, on the server)."""
    if not tenants:
        return []
    keys = ("num_blocks", "nbytes", "num_stored", "num_evicted", "num_cap_evictions")
    keys += ("num_removed", "num_refused")
    heads = ("tenant", "held", "bytes", "stored", "evicted", "for its cap", "removed", "refused")
    rows = [[repr(t), *(f[k] for k in keys)] for t, f in tenants.items()]
    return ["", "remote tier per tenant (blocks):", table(heads, rows, "lrrrrrrr")]
