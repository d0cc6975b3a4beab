"""The remote tier against a real redis-server: format, parts, misses, budget, breaker."""

from __future__ import annotations

import time
from contextlib import contextmanager

import numpy as np
import pytest
from redis_server import RedisServer
from ssd_child import LAYOUT, ROOT, block_key, check_block, expected_bits, make_block

from prefixcache.config import CacheConfig
from prefixcache.errors import MissReason, PayloadError
from prefixcache.memory.host import MX_DTYPES, UNNEEDED, HostArray, Placed
from prefixcache.tiers.remote import RemoteTier
from prefixcache.tiers.remote.format import (
    PART_BYTES,
    PART_HEAD_BYTES,
    Names,
    check_part,
    decode_meta,
    spec_bytes,
)
from prefixcache.tiers.remote.seal import Forged

NAMES = Names("prefixcache")


def part_key(prefix: str, key: bytes, n: int) -> str:
    return Names(prefix).part(key, n)


def meta_key(prefix: str, key: bytes) -> str:
    return Names(prefix).meta(key)


def tier_for(url: str, **changes) -> RemoteTier:
    return RemoteTier(CacheConfig(remote_url=url, **changes))


def stored(tier: RemoteTier, blocks) -> list[bytes]:
    for block in blocks:
        assert tier.put(block)
    tier.flush()
    return [b.key for b in blocks]


def load_all(tier: RemoteTier, keys: list[bytes], place=None, misses=None):
    """held + a planned read of every held block, as a restore does (blocks or None);
    the reader's reason for an unusable block is appended to ``misses``."""
    metas = tier.held(keys, 0)
    reader = tier.reader(keys)
    order = list(range(len(metas)))
    reader.prepare(order, place)
    out = []
    try:
        for i in order:
            loaded = reader.load(i)
            if place is not None and loaded is not None:  # placed, but for the one without
                kinds = {n: type(a) for n, a in loaded.arrays.items()}
                assert kinds == {n: HostArray if n == UNPLACED else Placed for n in kinds}
            out.append(_block(loaded))
            if out[-1] is None:  # a restore stops at its first unusable block
                if misses is not None:
                    misses.append(reader.miss(i))
                break
        return out
    finally:
        reader.close()


UNPLACED = "0.values"


def placer(buffers: dict):
    """A restore's ``place``: each tensor but one into a region of its own buffer,
    a token range of each (batch, head) row as in a restore buffer (so parts start
    and end inside runs); ``buffers`` collects (buffer, region)."""

    def place(index, name, dtype, shape):
        if name == UNPLACED:
            return None  # no place: the reader's host buffer
        b, h, n, d = shape
        buf = np.zeros((b, h, n + 3, d * dtype.size), np.uint8)
        region = buf[:, :, 1 : n + 1, :]
        buffers[index, name] = (buf, region)
        return region

    return place


def _block(loaded):
    return None if loaded is None else loaded.to_block()


SECRET = "a secret shared by the hosts"


@pytest.mark.parametrize("secret", [None, SECRET], ids=["unsigned", "signed"])
@pytest.mark.parametrize("placed", [False, True])
def test_blocks_larger_than_a_part_round_trip_bit_exactly(tmp_path, placed, secret):
    server = RedisServer(str(tmp_path), unix=True)  # the unix:// scheme too
    try:
        tier = tier_for(server.url, remote_secret=secret)
        blocks = [make_block(1, i, scale=4000) for i in range(2)]  # ~12 MiB each: 3 parts
        keys = stored(tier, blocks)
        client, names = server.client(), tier.names
        assert client.exists(names.part(keys[0], 2))
        assert not client.exists(names.part(keys[0], 3))
        assert max(len(client.get(names.part(keys[0], n))) for n in range(3)) > (
            PART_BYTES
        )  # the data of a full part plus its header
        buffers: dict = {}
        got = load_all(tier, keys, placer(buffers) if placed else None)
        for block in got:
            check_block(block, scale=4000)
        assert tier.stats()["num_loads"] == 2 and tier.stats()["num_corrupt"] == 0
        for (index, name), (buf, region) in buffers.items():  # straight into place
            want = expected_bits(keys[index], 4000)[name]
            assert region.tobytes() == want.tobytes() and want.any()
            assert not buf[:, :, 0].any() and not buf[:, :, -2:].any()  # nothing outside
        tier.close()
    finally:
        server.stop()


@pytest.mark.parametrize("secret", [None, SECRET], ids=["unsigned", "signed"])
def test_a_tensor_no_layer_reads_is_verified_and_left_out(redis_server, secret):
    """A tensor the restore does not read (``UNNEEDED``: a window layer's block before
    its window) is received, hashed and dropped: the block comes without it, the
    others in place. Its bytes still count for the part's checksum: one of them
    changed on the server makes the block a miss (the control)."""
    tier = tier_for(redis_server.url, remote_secret=secret)
    keys = stored(tier, [make_block(6, i, scale=3000) for i in range(2)])  # 2+ parts each
    skipped = "1.values"
    buffers: dict = {}
    place = placer(buffers)

    def skipping(index, name, dtype, shape):
        return UNNEEDED if name == skipped else place(index, name, dtype, shape)

    got = load_all(tier, keys, skipping)
    for key, block in zip(keys, got, strict=True):
        assert list(block.arrays) == [n for n in LAYOUT if n != skipped]
        want = expected_bits(key, 3000)
        for name, array in block.arrays.items():
            dtype, udtype, _ = LAYOUT[name]
            bits = np.array(array.view(udtype) if dtype != udtype else array)
            np.testing.assert_array_equal(bits, want[name], err_msg=name)
    client, names = redis_server.client(), tier.names
    meta = decode_meta(names.name(keys[0]), client.get(names.meta(keys[0])), names, keys[0])
    sizes = [spec_bytes(spec) for spec in meta.specs]
    names_in_order = [name for name, *_ in meta.specs]
    offset = sum(sizes[: names_in_order.index(skipped)])  # the skipped tensor's first byte
    part = names.part(keys[0], offset // PART_BYTES)
    value = bytearray(client.get(part))
    value[PART_HEAD_BYTES + offset % PART_BYTES] ^= 1
    client.set(part, bytes(value))
    misses: list = []
    again = load_all(tier, keys, skipping, misses)
    assert again[0] is None and misses
    tier.close()


def test_a_chain_is_looked_up_in_one_round_trip(redis_server):
    tier = tier_for(redis_server.url)
    keys = stored(tier, [make_block(2, i) for i in range(8)])
    client = redis_server.client()
    client.config_resetstat()
    chain = [*keys, block_key(2, 8)]
    with count_round_trips(tier) as trips:
        metas = tier.held(chain, 0)
    assert [m.key for m in metas] == keys and trips == [1]
    calls = client.info("commandstats")  # every meta, no listing
    assert calls["cmdstat_get"]["calls"] == 9 and set(calls) <= {
        "cmdstat_get",
        "cmdstat_config|resetstat",
    }
    with count_round_trips(tier) as trips:
        assert tier.held(chain, 3) == metas[3:]  # the rest of the same prompt: no round trip
    assert trips == [0]
    near = (np.arange(16, dtype="<u4") + 4 * 16).tobytes()  # block 4's tokens
    with count_round_trips(tier) as trips:  # the names; the metas came with the chain
        assert [m.key for m in tier.children(keys[7], near)] == []
        assert [m.key for m in tier.children(keys[3], near)] == [keys[4]]
    assert trips == [2]
    tier.close()


@contextmanager
def count_round_trips(tier: RemoteTier):
    """Count the pipelines (one write, then the replies) ``tier`` sends to its shards."""
    trips = [0]
    shards = tier.client.shards.all()
    originals = {id(s): s.redis.pipeline for s in shards}

    def counting(original):
        def pipeline(*args, **kwargs):
            trips[0] += 1
            return original(*args, **kwargs)

        return pipeline

    for shard in shards:
        shard.redis.pipeline = counting(shard.redis.pipeline)
    try:
        yield trips
    finally:
        for shard in shards:
            shard.redis.pipeline = originals[id(shard)]


def test_evicted_part_is_a_counted_miss(redis_server):
    tier = tier_for(redis_server.url)
    keys = stored(tier, [make_block(3, i, scale=3000) for i in range(3)])  # 2 parts each
    redis_server.client().delete(part_key("prefixcache", keys[1], 1))
    misses: list = []
    got = load_all(tier, keys, misses=misses)
    check_block(got[0], scale=3000)
    assert got[1] is None  # the stream stops at the first unusable block
    assert misses == [MissReason.EVICTED]
    assert tier.stats()["num_missing_parts"] == 1
    check_block(load_all(tier, keys[:1])[0], scale=3000)  # no reply of the miss left unread
    tier.close()


@pytest.mark.parametrize("secret", [None, SECRET], ids=["unsigned", "signed"])
@pytest.mark.parametrize("placed", [False, True])
@pytest.mark.parametrize("damage", ["flip", "other_block", "other_number", "short", "not_a_string"])
def test_a_wrong_part_is_never_restored(redis_server, damage, placed, secret):
    tier = tier_for(redis_server.url, remote_secret=secret)
    keys = stored(tier, [make_block(4, i, scale=3000) for i in range(2)])
    client, names = redis_server.client(), tier.names
    name = names.part(keys[0], 1)
    if damage == "flip":
        value = bytearray(client.get(name))
        value[-1] ^= 1
    elif damage == "other_block":  # same size, checksum in its own header is right
        value = client.get(names.part(keys[1], 1))
    elif damage == "other_number":
        value = client.get(names.part(keys[0], 0))[: len(client.get(name))]
    elif damage == "short":  # a torn write: the header is right, the bytes stop early
        value = client.get(name)[:-1000]
    if damage == "not_a_string":
        client.delete(name)
        client.rpush(name, b"x")  # GET answers an error reply
    else:
        client.set(name, bytes(value))
    buffers: dict = {}
    misses: list = []
    assert load_all(tier, keys, placer(buffers) if placed else None, misses) == [None]
    forged = secret is not None and damage == "flip"  # the bytes fail their MAC
    st = tier.stats()
    assert misses == [MissReason.CORRUPT]
    assert (st["num_forged"], st["num_corrupt"]) == ((1, 0) if forged else (0, 1))
    if placed and damage == "flip":  # where the failing part's bytes belong
        reached = _part_bytes_in(buffers, tier.reads.meta_of(keys, 0), 1)
        # with a secret not one byte reached the restore buffers; without, they did
        assert reached == 0 if secret else reached > 0
    if damage != "not_a_string":
        name0 = names.name(keys[0])
        meta = decode_meta(name0, client.get(names.meta(keys[0])), names, keys[0])
        with pytest.raises(Forged if forged else PayloadError):
            check_part(meta, names, 1, client.get(name))
    client.delete(name)  # the block's other part and the next block still read cleanly
    assert load_all(tier, keys[1:])[0] is not None
    tier.close()


def _part_bytes_in(buffers: dict, meta, n: int) -> int:
    """Nonzero bytes of part ``n`` of block 0 found in the restore buffers."""
    lo, hi, at, found = n * PART_BYTES, (n + 1) * PART_BYTES, 0, 0
    for name, dtype, shape in meta.specs:
        size = int(np.prod(shape)) * MX_DTYPES[dtype].size
        if (0, name) in buffers:
            _, region = buffers[0, name]
            flat = np.ascontiguousarray(region).reshape(-1)  # the tensor's bytes in order
            found += int(np.count_nonzero(flat[max(lo - at, 0) : max(min(hi - at, size), 0)]))
        at += size
    return found


def test_a_bad_meta_ends_the_chain_and_is_counted(redis_server):
    tier = tier_for(redis_server.url)
    keys = stored(tier, [make_block(5, i) for i in range(4)])
    client = redis_server.client()
    name = meta_key("prefixcache", keys[2])
    client.set(name, client.get(name)[:-1] + bytes([client.get(name)[-1] ^ 1]))
    assert [m.key for m in tier.held(keys, 0)] == keys[:2]
    assert tier.stats()["num_corrupt"] == 1
    tier.close()


def test_namespaces_keep_apart_and_survive_server_lru_eviction(tmp_path):
    """The server evicts under its own maxmemory: every block then either restores
    exactly or is a counted miss (parts and metas are evicted independently)."""
    server = RedisServer(str(tmp_path), maxmemory="8mb")
    try:
        tier = tier_for(server.url, remote_prefix="a")
        other = tier_for(server.url, remote_prefix="b")
        keys = stored(tier, [make_block(6, i, scale=300) for i in range(40)])  # ~1 MiB each
        assert other.held(keys, 0) == []  # another namespace sees nothing
        assert server.client().info("stats")["evicted_keys"] > 0
        exact = 0
        for key in keys:
            got = load_all(tier, [key])  # one-block chains: each block on its own
            if got and got[0] is not None:
                check_block(got[0], scale=300)
                exact += 1
        st = tier.stats()
        assert 0 < exact < len(keys) and st["num_corrupt"] == 0
        tier.close()
        other.close()
    finally:
        server.stop()


def test_client_side_budget_refuses_writes(redis_server):
    tier = tier_for(redis_server.url, remote_max_bytes=1 << 10)  # below the server's own use
    assert tier.put(make_block(7, 0))
    tier.flush()
    st = tier.stats()
    assert st["num_no_room"] == 1 and st["num_writes"] == 0
    assert redis_server.client().dbsize() == 0
    tier.close()


def test_unreachable_server_gives_up_opens_the_breaker_and_recovers(redis_server):
    tier = tier_for(redis_server.url, remote_breaker_failures=2, remote_breaker_ms=300)
    keys = stored(tier, [make_block(8, i) for i in range(2)])
    redis_server.kill()
    for _ in range(2):
        assert tier.held(keys, 0) == []
        assert tier.miss_reason(keys[0]) is MissReason.REMOTE_UNAVAILABLE
    st = tier.stats()
    assert st["breaker_open"] == 1 and st["num_breaker_trips"] == 1 and st["num_errors"] == 2
    assert not tier.put(make_block(8, 2))  # the breaker is open: dropped, not queued
    assert tier.held(keys, 0) == [] and tier.stats()["num_skipped"] == 1
    redis_server.start()  # same port, empty (no persistence)
    time.sleep(0.35)
    assert tier.held(keys, 0) == []  # reachable again: a plain absence
    assert tier.miss_reason(keys[0]) is None and tier.stats()["breaker_open"] == 0
    assert tier.put(make_block(8, 2))
    tier.flush()
    assert tier.stats()["num_writes"] == 3
    tier.close()


def test_config_checks_remote_settings():
    with pytest.raises(ValueError, match="ftp://x"):
        CacheConfig(remote_url="ftp://x")
    with pytest.raises(ValueError, match="a:b"):
        CacheConfig(remote_prefix="a:b")
    with pytest.raises(ValueError, match="remote_timeout_ms"):
        CacheConfig(remote_timeout_ms=0)
    env = {"PREFIXCACHE_REMOTE_URL": "unix:///tmp/r.sock", "PREFIXCACHE_REMOTE_MAX_BYTES": "1G"}
    cfg = CacheConfig.from_env(env)
    assert cfg.remote_url == "unix:///tmp/r.sock" and cfg.remote_max_bytes == 1 << 30
    assert ROOT == b"\0" * 16  # the blocks above are one namespace's chains
