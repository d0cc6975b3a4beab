"""A block's tenant on the remote server: the key ``{prefix}:{name}:t``.

It holds the name of the tenant the block is charged to (UTF-8; with
``remote_secret`` sealed with AES-GCM, the block's name as associated data),
so that a host that restores the block and promotes it into its hot and SSD
tiers charges it to that tenant there. A key of its own rather than a field
of the meta's body: the meta stays format 2, its head's flags saying only
that the key exists (``TENANT``, a bit the previous release ignores: it reads
such metas as before and never looks at the key). A block of the default
tenant has neither (no command more on its fetch), and a block whose meta
lacks the flag (of the default tenant, or written by a host of the previous
release) is charged to the default tenant. The key is fetched in the
pipeline of the block's parts (same hash tag, same round trip), written
before the meta, removed with the block and by ``gc`` once its meta is gone.
"""

from __future__ import annotations

import logging

from ...errors import PayloadError
from .names import Names
from .wire import Replies

logger = logging.getLogger(__name__)

TENANT_BYTES = 1024 + 64  # a name of at most 256 characters (cache/tenancy.py), sealed


def encode_tenant(key: bytes, tenant: str, names: Names) -> bytes:
    """The value of block ``key``'s tenant key: the name, sealed with a secret."""
    raw = tenant.encode()
    return raw if names.seal is None else names.seal.seal(raw, b"t" + names.name(key))


def decode_tenant(key: bytes, value: bytes | None, names: Names) -> str:
    """The tenant block ``key``'s tenant key holds ("" for none).

    Raises:
        Forged: with a secret, not sealed with it for this block.
        PayloadError: too long, or not UTF-8.
    """
    if value is None:
        return ""
    what = f"remote tenant of {key.hex()}"
    if len(value) > TENANT_BYTES:
        raise PayloadError(f"{what} is {len(value)} bytes long")
    if names.seal is not None:
        value = names.seal.open(value, b"t" + names.name(key), what)
    try:
        return value.decode()
    except UnicodeDecodeError:
        raise PayloadError(f"{what} is not UTF-8") from None


def read_tenant(replies: Replies, key: bytes, names: Names) -> str:
    """The tenant the next reply names: the default tenant when there is none, or
    when it is unusable (it only says whom to charge; the block is verified apart).

    Raises:
        PayloadError: the reply is too long to be a tenant (its bytes are left unread).
    """
    length = replies.length()
    if length is None:
        return ""
    if length > TENANT_BYTES:
        raise PayloadError(f"remote tenant of {key.hex()} is {length} bytes long")
    value = replies.read(length)
    replies.end()
    try:
        return decode_tenant(key, value, names)
    except PayloadError as e:
        logger.debug("remote tier: %s: charged to the default tenant", e)
        return ""
