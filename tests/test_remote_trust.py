"""Signed blocks and private prompts (``remote_secret``) against a real redis-server.

The attack of the issue, reproduced: a client with write access to Redis but
without the secret rewrites one block of an 8-block chain (valid format, the
payload of another prompt's block, recomputed checksums). With the secret the
other host never serves it (``remote.num_forged``); without it (the negative
control) the forged block is restored and the logits are wrong.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
from conftest import live_logits, max_diff, prefill, prompt

from prefixcache import CacheConfig, PrefixCache
from prefixcache.hashing import chain_keys, token_bytes
from prefixcache.memory.host import ITEMSIZE, Tensor
from prefixcache.tiers.remote.format import PART_HEAD_BYTES, decode_meta, encode_meta, encode_parts
from prefixcache.tiers.remote.names import Names
from prefixcache.tiers.remote.seal import load_secret

BLOCK = 16
SECRET = "correct horse battery staple 42"


def cache_for(tmp_path, name: str, url: str, model, secret: str | None) -> PrefixCache:
    config = CacheConfig(
        block_size=BLOCK,
        ssd_dir=str(tmp_path / name),
        ssd_min_free_bytes=0,
        remote_url=url,
        remote_secret=secret,
        prefill_tokens_per_s=1,
    )
    return PrefixCache(model, config, model_id="tiny")


def run(pc: PrefixCache, model, tokens: list[int]):
    """Fetch, prefill the rest, store: (tokens restored, last logits)."""
    cache, cached = pc.fetch(tokens)
    logits = prefill(model, tokens[cached:], cache, step=BLOCK)
    pc.store(tokens, cache)
    pc.flush()
    return cached, logits


class AttackerNames(Names):
    """What a client without the secret can do: see key names, write plain values."""

    def __init__(self, prefix: str, seen: Names):
        super().__init__(prefix)
        self.seen = seen

    def name(self, key: bytes) -> bytes:
        return self.seen.name(key)  # the names are on the server for anyone to list


def forge(client, names: Names, victim: bytes, donor: bytes, *, keep_meta: bool) -> None:
    """Rewrite block ``victim`` with ``donor``'s payload, as an attacker without the
    secret would: parts with valid headers and recomputed xxh3 digests, and (unless
    ``keep_meta``) a fresh plain meta listing them, with its checksum.

    The attacker is granted everything but the secret: the prompt's tokens and
    the model's tensor specs (here read with the test's own view of the secret).
    """
    attacker = AttackerNames(names.prefix, names)
    meta = decode_meta(names.name(victim), client.get(names.meta(victim)), names, victim)
    data = b"".join(
        client.get(names.part(donor, n))[PART_HEAD_BYTES:] for n in range(meta.num_parts)
    )
    tensors = _tensors(meta, data)
    parts, digests = encode_parts(victim, tensors, attacker)
    for n, part in enumerate(parts):
        if keep_meta:  # the digest the signed meta lists, copied into the header
            old = client.get(names.part(victim, n))
            digest = slice(PART_HEAD_BYTES - 16, PART_HEAD_BYTES)
            part[digest] = old[digest]
        client.set(names.part(victim, n), bytes(part))
    if not keep_meta:
        forged = type(meta)(
            meta.key,
            meta.parent,
            meta.root,
            meta.index,
            meta.tokens,
            meta.nbytes,
            tuple(digests),
            meta.specs,
        )
        client.set(names.meta(victim), encode_meta(forged, attacker))


def _tensors(meta, data: bytes) -> list[Tensor]:
    out, at = [], 0
    for name, dtype, shape in meta.specs:
        size = int(np.prod(shape)) * ITEMSIZE[dtype]
        out.append(Tensor(name, dtype, shape, memoryview(data[at : at + size])))
        at += size
    return out


@pytest.mark.parametrize(
    ("secret", "keep_meta"),
    [(SECRET, False), (SECRET, True), (None, False)],
    ids=["signed-forged-meta", "signed-forged-parts", "unsigned-control"],
)
def test_a_forged_block_is_never_served_with_the_secret(
    tmp_path, llama, redis_server, caplog, secret, keep_meta
):
    caplog.set_level(logging.DEBUG)
    a = cache_for(tmp_path, "a", redis_server.url, llama, secret)
    victim, donor = prompt(81, 8 * BLOCK + 1), prompt(82, 8 * BLOCK + 1)
    run(a, llama, victim)
    run(a, llama, donor)
    names = a.tiers.named("remote").names
    root = a.namespace.root_key()
    vkeys, dkeys = (chain_keys(root, token_bytes(t), BLOCK) for t in (victim, donor))
    forge(redis_server.client(), names, vkeys[3], dkeys[3], keep_meta=keep_meta)
    b = cache_for(tmp_path, "b", redis_server.url, llama, secret)
    cached, logits = run(b, llama, victim)
    st = b.stats()["remote"]
    if secret is not None:
        assert cached == 3 * BLOCK and st["num_forged"] == 1  # stops before the forged block
        assert max_diff(logits, live_logits(llama, victim, cached)) == 0.0
    else:  # the negative control: served, and wrong
        assert cached == 8 * BLOCK and st["num_forged"] == 0 and st["num_corrupt"] == 0
        assert max_diff(logits, live_logits(llama, victim, cached)) > 0.01
    for pc in (a, b):
        pc.close()
    assert all(SECRET not in r.getMessage() for r in caplog.records)


def test_token_ids_and_chain_keys_are_not_readable_from_the_server(tmp_path, llama, redis_server):
    tokens = prompt(91, 5 * BLOCK + 7)
    runs = {token_bytes(tokens[i : i + 4]) for i in range(len(tokens) - 3)}
    for secret in (None, SECRET):  # None: the control, where they are readable
        redis_server.client().flushall()
        with cache_for(tmp_path, f"h{secret is None}", redis_server.url, llama, secret) as pc:
            run(pc, llama, tokens)
            keys = chain_keys(pc.namespace.root_key(), token_bytes(tokens), BLOCK)
        client = redis_server.client()
        names = client.keys("*")
        values = [client.get(n) for n in names if client.type(n) == b"string"]
        leaking = sum(any(r in v for r in runs) for v in values)
        named = sum(any(k.hex().encode() in n for k in keys) for n in names)
        if secret is None:
            assert leaking >= 6 and named >= 5  # every block's meta and name shows the prompt
        else:
            assert leaking == 0 and named == 0


def test_hosts_with_the_same_secret_share_and_others_see_nothing(tmp_path, llama, redis_server):
    tokens = prompt(95, 3 * BLOCK + 1)
    with cache_for(tmp_path, "a", redis_server.url, llama, SECRET) as a:
        run(a, llama, tokens)
    for name, secret, want in (("b", SECRET, 3 * BLOCK), ("c", None, 0), ("d", "x" * 16, 0)):
        with cache_for(tmp_path, name, redis_server.url, llama, secret) as pc:
            cached, logits = run(pc, llama, tokens)
            assert cached == want, name
            assert max_diff(logits, live_logits(llama, tokens, cached)) == 0.0


def test_the_secret_is_checked_and_never_shown(tmp_path):
    with pytest.raises(ValueError, match="at least 16 characters, got 5 characters") as err:
        CacheConfig(remote_url="redis://h:1", remote_secret="short")
    assert "short" not in str(err.value)
    config = CacheConfig(remote_url="redis://:pw@h:1", remote_secret=SECRET)
    assert SECRET not in repr(config) and ":pw@" not in repr(config)
    path = tmp_path / "secret"
    path.write_text(SECRET + "\n")
    config = CacheConfig.from_env({"PREFIXCACHE_REMOTE_SECRET_FILE": str(path)})
    assert load_secret(config) == SECRET.encode()
    path.write_text("tiny\n")
    with pytest.raises(ValueError, match="holds 4 bytes") as err:
        load_secret(config)
    assert "tiny" not in str(err.value)
    with pytest.raises(ValueError, match="remote_secret_file"):
        CacheConfig(remote_secret_file=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="both set"):
        CacheConfig(remote_secret=SECRET, remote_secret_file=str(path))
