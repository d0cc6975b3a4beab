"""Scenario corrupt: damage the SSD tier on disk; nothing damaged is ever served.

Each round damages one block of every prompt group (groups share no block, so
no damaged block hides another), with a random kind: a flipped byte anywhere
in a payload file, a truncation, a deleted payload, another block's valid
payload copied under its name, a flipped byte or garbage in its LMDB index
value. Then a fresh PrefixCache serves every prompt (each restore checked
against the live run) and stores them again, which rewrites what was dropped.
Every damaged block must be counted (``stats()["ssd"]["num_corrupt"]``). Some
rounds also plant a stale temp file (ignored, then removed by ``prefixcache
gc``) or mark the directory as written by a newer format (refused on open).
Payloads are written one file per block (``ssd_run_tokens=0``), so that a damage
is one block's.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import tempfile
import time
from collections import Counter
from dataclasses import dataclass

import lmdb

from .common import Result, Tally, Workload, cli, make_prompts, open_cache

BLOCK_KINDS = ("flip_payload", "truncate", "delete", "copy_other", "index_flip", "index_garbage")
SUFFIX = ".safetensors"


@dataclass(frozen=True, slots=True)
class CorruptSetup:
    corruptions: int = 1000
    seed: int = 0
    groups: int = 6
    per_group: int = 3
    dir_every: int = 10  # every N-th round also plants a stale temp or a newer format


def payload_keys(ssd_dir: str) -> dict[str, str]:
    """key hex -> payload path of every payload file."""
    out = {}
    for d, _, files in os.walk(os.path.join(ssd_dir, "blocks")):
        for f in files:
            if f.endswith(SUFFIX) and not f.startswith("."):
                out[f[: -len(SUFFIX)]] = os.path.join(d, f)
    return out


def serve_all(work: Workload, ssd_dir: str, tally: Tally, groups=None) -> dict:
    """Serve (check + store) every prompt (of ``groups``) on a fresh cache; its stats."""
    # one payload file per block: each damage hits one block, counted once (run files'
    # damage, all of a file's blocks missed and counted: tests/test_ssd_run_files.py)
    pc = open_cache(work.model, ssd_dir, hot_max_bytes=1, promote=False, ssd_run_tokens=0)
    try:
        for i in range(len(work.prompts)):
            if groups is None or i in groups:
                work.serve(pc, i, tally)
        pc.flush()
        return pc.stats()
    finally:
        pc.close()


def map_groups(work: Workload, ssd_dir: str, setup: CorruptSetup, tally: Tally) -> list[list[str]]:
    """Store the prompts group by group; the block keys (hex) each group owns."""
    owned, seen = [], set()
    for g in range(setup.groups):
        members = set(range(g * setup.per_group, (g + 1) * setup.per_group))
        serve_all(work, ssd_dir, tally, members)
        now = set(payload_keys(ssd_dir))
        owned.append(sorted(now - seen))
        seen = now
    return owned


def edit_index(ssd_dir: str, key_hex: str, how: str, rng: random.Random) -> None:
    env = lmdb.open(os.path.join(ssd_dir, "index"), max_dbs=16)
    try:
        db = env.open_db(b"blocks")
        with env.begin(write=True, db=db) as txn:
            value = bytearray(txn.get(bytes.fromhex(key_hex)))
            if how == "index_flip":
                value[rng.randrange(len(value))] ^= rng.randrange(1, 256)
            else:
                value = bytearray(rng.randbytes(rng.randrange(0, 2 * len(value))))
            txn.put(bytes.fromhex(key_hex), bytes(value))
    finally:
        env.close()


def damage(ssd_dir: str, key_hex: str, how: str, rng: random.Random, donor: bytes) -> None:
    path = payload_keys(ssd_dir)[key_hex]
    size = os.path.getsize(path)
    if how == "flip_payload":
        with open(path, "r+b") as f:
            f.seek(offset := rng.randrange(size))
            byte = f.read(1)[0]
            f.seek(offset)
            f.write(bytes([byte ^ rng.randrange(1, 256)]))
    elif how == "truncate":
        os.truncate(path, rng.randrange(size))
    elif how == "delete":
        os.unlink(path)
    elif how == "copy_other":
        with open(path, "wb") as f:  # another block's valid payload under this name
            f.write(donor)
    else:
        edit_index(ssd_dir, key_hex, how, rng)


def set_version(ssd_dir: str, version: bytes) -> bytes:
    env = lmdb.open(os.path.join(ssd_dir, "index"), max_dbs=16)
    try:
        with env.begin(write=True, db=env.open_db(b"meta")) as txn:
            old = txn.get(b"version")
            txn.put(b"version", version)
    finally:
        env.close()
    return old


def newer_format(work: Workload, ssd_dir: str, tally: Tally, seen: Counter) -> None:
    """A directory of a newer format: the cache and the CLI must refuse it."""
    old = set_version(ssd_dir, b"0")
    set_version(ssd_dir, b"%d" % (int(old) + 1))
    try:
        open_cache(work.model, ssd_dir).close()
        tally.errors += 1
        tally.findings.append("a directory of a newer format version was opened")
    except ValueError as e:  # SsdFormatError
        seen["newer format refused by PrefixCache"] += "version" in str(e)
    refused = cli("verify", "--ssd-dir", ssd_dir).returncode == 2
    seen["newer format refused by CLI verify"] += refused
    set_version(ssd_dir, old)


def stale_temp(ssd_dir: str, rng: random.Random) -> None:
    """A temp file of a dead writer, holding a valid payload's bytes."""
    dead = subprocess.Popen(["true"])
    dead.wait()
    key_hex, path = rng.choice(sorted(payload_keys(ssd_dir).items()))
    temp = os.path.join(os.path.dirname(path), f".{key_hex}.{dead.pid}.1.tmp")
    shutil.copyfile(path, temp)


def one_round(work, ssd_dir, owned, rng, tally, seen) -> int:
    applied = Counter()
    keys = payload_keys(ssd_dir)
    donors = {}  # read before any damage: a donor may be another group's victim
    for g in range(len(owned)):
        with open(keys[rng.choice(owned[(g + 1) % len(owned)])], "rb") as f:
            donors[g] = f.read()
    for g, group_keys in enumerate(owned):
        victim = rng.choice(group_keys)
        donor = donors[g]
        applied[how := rng.choice(BLOCK_KINDS)] += 1
        damage(ssd_dir, victim, how, rng, donor)
    stats = serve_all(work, ssd_dir, tally)
    counted = stats["ssd"]["num_corrupt"]
    seen.update(applied)
    seen["counted corrupt"] += counted
    if counted != sum(applied.values()):
        tally.findings.append(f"{sum(applied.values())} damaged, {counted} counted: {applied}")
        tally.errors += 1
    return sum(applied.values())


def run(setup: CorruptSetup, base_dir: str | None = None) -> Result:
    start = time.perf_counter()
    work = Workload(make_prompts(setup.groups, setup.per_group, seed=1))
    rng = random.Random(setup.seed)
    tally, seen = Tally(), Counter()
    with tempfile.TemporaryDirectory(dir=base_dir, prefix="soak-corrupt-") as tmp:
        ssd_dir = os.path.join(tmp, "ssd")
        owned = map_groups(work, ssd_dir, setup, tally)
        done, rounds = 0, 0
        while done < setup.corruptions:
            rounds += 1
            if rounds % setup.dir_every == 0:
                stale_temp(ssd_dir, rng)
                seen["stale temps planted"] += 1
            if rounds % (2 * setup.dir_every) == 0:
                newer_format(work, ssd_dir, tally, seen)
                seen["newer format planted"] += 1
            done += one_round(work, ssd_dir, owned, rng, tally, seen)
        out = cli("gc", "--ssd-dir", ssd_dir, "--json")
        seen["stale temps removed by gc"] = json.loads(out.stdout)["num_orphan_files"]
    notes = ", ".join(f"{k}: {v}" for k, v in sorted(seen.items()))
    return tally.result("corrupt", start, f"{done} damaged blocks in {rounds} rounds; {notes}")
