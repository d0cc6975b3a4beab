"""``prefixcache verify``, ``gc`` and ``clear``: the commands that may remove blocks.

Each opens the directory for writing only when it will remove something
(``verify --quarantine``, ``gc`` without ``--dry-run``, ``clear``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from ..config import parse_bytes
from ..tiers.ssd.admin.inventory import Inventory
from ..tiers.ssd.admin.maintenance import (
    GcPlan,
    VerifyReport,
    plan_gc,
    reconcile,
    remove,
    stray_files,
    verify,
)
from ..tiers.ssd.admin.view import SsdView
from .common import Doc, UsageError, duration, emit, model_roots, ssd_command
from .remote import cmd_remote_gc, with_remote
from .report import format_bytes


def add_verify_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quarantine", action="store_true", help="remove bad blocks")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def add_gc_args(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Remove orphan payload files, dangling index entries and detached blocks; then the "
        "blocks the criteria select. --model is a filter: it scopes the other criteria to one "
        "model (alone it removes only that model's detached blocks); --all selects every block "
        "of the scope (gc --all --model M removes all of M)."
    )
    p.add_argument("--model", help="only this model (or 4+ hex digits of a root key)")
    what = p.add_mutually_exclusive_group()
    what.add_argument("--all", action="store_true", help="every block (of --model, if given)")
    what.add_argument("--older-than", type=duration, help="blocks last used before, e.g. 7d")
    p.add_argument("--max-bytes", type=parse_bytes, help="evict LRU leaves down to this size")
    p.add_argument("--dry-run", action="store_true", help="report, remove nothing")


def add_clear_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="only this model (or 4+ hex digits of a root key)")
    p.add_argument("--yes", action="store_true", help="do not ask for confirmation")


# -- verify -------------------------------------------------------------------


def cmd_verify(view: SsdView, args: argparse.Namespace) -> int:
    show_bar = not (args.json or args.no_progress) and sys.stderr.isatty()
    with _progress(show_bar) as step:
        report = verify(view, quarantine=args.quarantine, progress=step)
    doc = _verify_doc(view, report)
    emit(args, doc, lambda: _verify_text(doc))
    return 0 if report.ok else 1


@contextmanager
def _progress(enabled: bool) -> Iterator[Callable[[int, int], None] | None]:
    if not enabled:
        yield None
        return
    from rich.console import Console
    from rich.progress import Progress

    with Progress(console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task("verifying", total=None)
        yield lambda done, total: bar.update(task, completed=done, total=total)


def _verify_doc(view: SsdView, r: VerifyReport) -> Doc:
    quarantined = set(r.quarantined)
    return {
        "ssd_dir": view.path,
        "ok": r.ok,
        "num_blocks": r.num_blocks,
        "num_checked": r.num_checked,
        "num_bad": len(r.bad),
        "bad": [
            {"key": k.hex(), "reason": why, "quarantined": k in quarantined}
            for k, why in r.bad.items()
        ],
        "num_unreadable": len(r.unreadable),
        "unreadable": [{"key": k.hex(), "reason": why} for k, why in r.unreadable.items()],
        "num_detached": len(r.detached),
        "detached": [{"key": k.hex(), "reason": why} for k, why in r.detached.items()],
        "num_unreachable": r.num_unreachable,
        "num_quarantined": len(r.quarantined),
        "other_pids": r.other_pids,
    }


def _verify_text(doc: Doc) -> str:
    lines = [f"checked {doc['num_checked']} blocks in {doc['ssd_dir']}"]
    for item in doc["bad"]:
        mark = "  (quarantined)" if item["quarantined"] else ""
        lines.append(f"  BAD        {item['key']}  {item['reason']}{mark}")
    lines += [f"  UNREADABLE {i['key']}  {i['reason']}" for i in doc["unreadable"]]
    lines += [f"  DETACHED   {i['key']}  {i['reason']}" for i in doc["detached"]]
    if doc["detached"]:
        lines.append(f"  {doc['num_unreachable']} blocks cannot be reached from their root")
        if doc["other_pids"]:
            pids = ", ".join(map(str, doc["other_pids"]))
            lines.append(f"  (not an error: pid {pids} has the cache open; parents may be in RAM)")
    if doc["bad"] and not doc["num_quarantined"]:
        lines.append("  run `prefixcache verify --quarantine` to remove the bad blocks")
    lines.append("OK" if doc["ok"] else "PROBLEMS FOUND")
    return "\n".join(lines)


# -- gc -----------------------------------------------------------------------


def cmd_gc(view: SsdView, args: argparse.Namespace) -> int:
    others = view.records.other_pids()
    inv = Inventory.load(view)
    model_roots(inv, args.model)  # a --model that matches nothing changes nothing
    if args.dry_run:
        orphans, dangling = stray_files(view, inv)
    else:
        orphans, dangling = reconcile(view.index)
        inv = Inventory.load(view)
    before = sum(e.file_bytes for e in inv.entries.values())
    plan = plan_gc(
        inv,
        model=args.model,
        older_than=args.older_than,
        max_bytes=args.max_bytes,
        select_all=args.all,
        drop_detached=not others,
    )
    if not args.dry_run:
        remove(view, plan.remove)
    doc = _gc_doc(view, plan, args.dry_run, orphans, dangling, before, others)
    emit(args, doc, lambda: _gc_text(doc))
    if args.model and not (args.all or args.older_than is not None or args.max_bytes is not None):
        print(
            "prefixcache gc: --model is a filter; add --all to remove every block of "
            f"{args.model!r}, or --older-than / --max-bytes",
            file=sys.stderr,
        )
    return 0


def _gc_doc(
    view: SsdView,
    plan: GcPlan,
    dry_run: bool,
    orphans: int,
    dangling: int,
    before: int,
    others: list[int],
) -> Doc:
    return {
        "ssd_dir": view.path,
        "dry_run": dry_run,
        "num_orphan_files": orphans,
        "num_dangling_entries": dangling,
        "num_blocks": len(plan.remove),
        "nbytes": plan.nbytes,
        "num_tokens": plan.num_tokens,
        "num_selected": plan.num_selected,
        "num_descendants": plan.num_below,
        "num_evicted": plan.num_evicted,
        "num_detached": plan.num_detached,
        "nbytes_before": before,
        "nbytes_after": before - plan.nbytes,
        "other_pids": others,
        "keys": [k.hex() for k in plan.remove],
    }


def _gc_text(doc: Doc) -> str:
    verb = "would remove" if doc["dry_run"] else "removed"
    lines = [
        f"{verb} {doc['num_blocks']} blocks ({format_bytes(doc['nbytes'])}, "
        f"{doc['num_tokens']} tokens): {doc['num_selected']} selected, "
        f"{doc['num_descendants']} below them, {doc['num_evicted']} evicted for size, "
        f"{doc['num_detached']} detached",
        f"{verb} {doc['num_orphan_files']} orphan files, "
        f"{doc['num_dangling_entries']} dangling entries",
        f"size {format_bytes(doc['nbytes_before'])} -> {format_bytes(doc['nbytes_after'])}",
    ]
    if doc["other_pids"]:
        pids = ", ".join(map(str, doc["other_pids"]))
        lines.append(f"detached blocks kept: pid {pids} has the cache open")
    return "\n".join(lines)


# -- clear --------------------------------------------------------------------


def cmd_clear(view: SsdView, args: argparse.Namespace) -> int:
    inv = Inventory.load(view)
    roots = model_roots(inv, args.model)
    blocks = sorted(inv.blocks(roots), key=lambda e: (-e.index, e.key))
    keys = [e.key for e in blocks] + ([] if args.model else inv.bad)
    nbytes = sum(e.file_bytes for e in blocks)
    what = f"model {args.model}" if args.model else "every model"
    if not args.yes:
        if not sys.stdin.isatty():
            raise UsageError("refusing without --yes (stdin is not a terminal)")
        answer = input(
            f"Remove {len(keys)} blocks ({format_bytes(nbytes)}) of {what} from {view.path}? [y/N] "
        )
        if answer.strip().lower() not in ("y", "yes"):
            print("nothing removed")
            return 1
    num = remove(view, keys)
    orphans = 0 if args.model else reconcile(view.index)[0]
    view.records.drop_counters(roots)
    doc = {
        "ssd_dir": view.path,
        "model": args.model,
        "num_blocks": num,
        "nbytes": nbytes,
        "num_orphan_files": orphans,
    }
    emit(args, doc, lambda: f"removed {num} blocks ({format_bytes(nbytes)}) of {what}")
    return 0


COMMANDS = (
    ssd_command(
        "verify",
        "check every payload checksum and every chain",
        cmd_verify,
        add_verify_args,
        writable=lambda args: args.quarantine,
    ),
    with_remote(
        ssd_command(
            "gc",
            "remove orphans, dangling entries, by model, age or size",
            cmd_gc,
            add_gc_args,
            writable=lambda args: not args.dry_run,
        ),
        remote_run=cmd_remote_gc,
    ),
    ssd_command(
        "clear",
        "remove every block, or one model's",
        cmd_clear,
        add_clear_args,
        writable=lambda args: True,
    ),
)
