"""``PrefixCache.stats()`` is what ``CacheStats`` declares, and type-checks as such.

A real cache with every tier on (an SSD directory and a real redis-server)
returns exactly the declared keys at every level; a hot-only cache has no
lower-tier dicts. mypy accepts ``pc.stats()["hot"]["nbytes"]`` and rejects a
misspelt key (the control: the checker really sees the TypedDicts).
"""

from __future__ import annotations

import re
import subprocess
import sys
import typing
from pathlib import Path

import mlx.core as mx
from conftest import prompt
from mlx_lm.models.cache import make_prompt_cache

from prefixcache import CacheConfig, PrefixCache
from prefixcache.errors import MissReason
from prefixcache.shared import release
from prefixcache.stats_types import (
    CacheStats,
    EventStats,
    HotStats,
    RamStats,
    RemoteStats,
    SsdStats,
    TenantStats,
    TenantTierStats,
    WarmStats,
)

ROOT = Path(__file__).resolve().parents[1]
MYPY_CONFIG = """
[mypy]
follow_imports = silent
ignore_missing_imports = True

[mypy-mlx.*,mlx_lm.*,numpy.*,lmdb.*,xxhash.*,safetensors.*,redis.*,transformers.*,tokenizers.*]
follow_imports = skip
"""
USES = """
from prefixcache import CacheStats, PrefixCache


def hot_bytes(pc: PrefixCache) -> int:
    return pc.stats()["hot"]["nbytes"]


def ssd_writes(stats: CacheStats) -> int:
    return stats["ssd"]["num_writes"] if "ssd" in stats else 0


def missed(pc: PrefixCache) -> int:
    return sum(pc.stats()["miss_reasons"].values()) + pc.stats()["num_misses"]


def misspelt(pc: PrefixCache) -> int:
    return pc.stats()["hot"]["nbytez"]
"""


def test_stats_holds_exactly_the_declared_keys_with_every_tier(llama, tmp_path, redis_server):
    url = redis_server.url
    config = CacheConfig(
        block_size=16,
        ssd_dir=str(tmp_path / "ssd"),
        remote_url=url,
        warm_bytes=1 << 20,
        events_url="tcp://127.0.0.1:0",
        hot_tenant_floors="b=1M",
        remote_tenant_caps="b=1G",
    )
    tokens = prompt(0, 40)
    cache = make_prompt_cache(llama)
    llama(mx.array([tokens]), cache=cache)
    with PrefixCache(llama, config, model_id="m") as pc:
        pc.store(tokens, cache, tenant="b")
        pc.fetch(tokens)
        shared, _ = pc.fetch(tokens, shared=True)
        stats = pc.stats()
        release(shared)
    declared = typing.get_type_hints(CacheStats)
    optional = {"ssd", "remote", "warm", "events", "shared", "tenants"}
    assert set(stats) == set(declared) == CacheStats.__required_keys__ | optional
    for name in [n for n, kind in declared.items() if kind is int]:
        assert type(stats[name]) is int, name
    parts = (("hot", HotStats), ("ram", RamStats), ("ssd", SsdStats), ("remote", RemoteStats))
    for tier, typed in parts:
        assert set(stats[tier]) == set(typing.get_type_hints(typed)), tier
        assert all(type(v) is int for v in stats[tier].values()), (tier, stats[tier])
    tenant = stats["tenants"]["b"]["hot"]
    assert set(stats["tenants"]["b"]) == set(typing.get_type_hints(TenantStats))
    assert set(tenant) == set(typing.get_type_hints(TenantTierStats))
    assert all(type(v) is int for v in tenant.values()) and tenant["num_blocks"] > 0
    for service, typed in (("warm", WarmStats), ("events", EventStats)):
        hints = typing.get_type_hints(typed)
        assert set(stats[service]) == set(hints), service
        assert all(type(stats[service][k]) is hints[k] for k in hints), stats[service]
    assert set(stats["miss_reasons"]) == {r.value for r in MissReason}
    assert stats["num_fetches"] >= 1 and stats["hot"]["num_blocks"] > 0  # real traffic
    assert stats["shared"]["num_fetches"] == 1


def test_a_hot_only_cache_has_no_lower_tier_keys(llama):
    with PrefixCache(llama, CacheConfig(hot_cache_only=True), model_id="m") as pc:
        stats = pc.stats()
    assert set(stats) == CacheStats.__required_keys__
    assert set(CacheStats.__optional_keys__) == {
        "ssd",
        "remote",
        "warm",
        "events",
        "shared",
        "tenants",
    }


def test_stats_type_checks_with_mypy(tmp_path):
    (tmp_path / "uses.py").write_text(USES)
    (tmp_path / "mypy.ini").write_text(MYPY_CONFIG)
    mypy = [sys.executable, "-m", "mypy", "--config-file", "mypy.ini", "--cache-dir", "cache"]
    done = subprocess.run(
        [*mypy, "uses.py"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
        env={"MYPYPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )
    errors = [line for line in done.stdout.splitlines() if ": error:" in line]
    line = next(i for i, text in enumerate(USES.splitlines(), 1) if "nbytez" in text)
    misspelt = f'uses.py:{line}: error: TypedDict "HotStats" has no key "nbytez"  [typeddict-item]'
    assert errors == [misspelt], done.stdout + done.stderr


def documented_keys() -> dict[str, list[str]]:
    """The keys of each table in docs/stats.md, by section (``Top level``, ``hot``, ...)."""
    sections: dict[str, list[str]] = {}
    current = ""
    for line in (ROOT / "docs" / "stats.md").read_text().splitlines():
        if line.startswith("## "):
            current = line[3:].strip("` ")
        elif match := re.match(r"\| `(\w+)` \|", line):
            sections.setdefault(current, []).append(match.group(1))
    return sections


def test_docs_list_every_key_and_no_other():
    docs = documented_keys()
    typed = {
        "Top level": CacheStats,
        "hot": HotStats,
        "ram": RamStats,
        "ssd": SsdStats,
        "remote": RemoteStats,
        "warm": WarmStats,
        "events": EventStats,
        "tenants": TenantTierStats,
    }
    for section, declared in typed.items():
        assert sorted(docs[section]) == sorted(typing.get_type_hints(declared)), section
