"""Which tenant a store charges, and the per-tenant figures of ``stats()``.

A store's tenant is, in order: the ``tenant`` it names (``prefixcache serve
--tenant-header``), the owner its session was begun with (``begin_session``),
its ``cache_salt`` (``extra``), else the default tenant (the empty name). Its
new blocks carry the name (``Block.tenant``) into every tier: the hot tier's
:class:`~prefixcache.tiers.hot.tenants.TenantShares` charges what the store
puts there to it, the SSD tier records it in each block's index entry
(tiers/ssd/shares.py). Without tenant shares configured on any tier nothing is
charged (blocks carry the default tenant) and this only remembers session owners.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from contextlib import AbstractContextManager

import xxhash

from ..shares_config import any_shares
from ..tiers.base import SharesTenants
from ..tiers.hot.tenants import COUNTERS, DEFAULT
from ..tiers.stack import TierStack

_NOTHING = {"num_blocks": 0, "nbytes": 0, "floor_bytes": 0, "cap_bytes": -1} | dict.fromkeys(
    COUNTERS, 0
)  # a tenant's figures on a tier where it holds nothing and has no share
SALT = "cache_salt"  # the ``extra`` key a request's salt is kept under (serve's request options)
MAX_NAME = 256


def check_tenant(tenant: str | None) -> str | None:
    """``tenant`` if None or a str of 1 to 256 characters; else TypeError/ValueError naming it."""
    if tenant is None:
        return None
    if not isinstance(tenant, str):
        raise TypeError(f"tenant must be a str, got {tenant!r}")
    if not tenant or len(tenant) > MAX_NAME:
        raise ValueError(f"tenant must be 1 to {MAX_NAME} characters, got {tenant!r}")
    return tenant


def bounded(name: str) -> str:
    """``name``, or for one over ``MAX_NAME`` UTF-8 bytes (a long salt) ``#`` and its
    digest: the SSD index keeps tenants' names in its keys, which LMDB bounds."""
    raw = name.encode(errors="surrogatepass")
    return name if len(raw) <= MAX_NAME else "#" + xxhash.xxh3_128_hexdigest(raw)


class Tenancy:
    """Session owners and the tenant each store charges (the facade's lock held)."""

    def __init__(self, tiers: TierStack) -> None:
        self.shares = tiers.hot.tenants
        self.on = any_shares(tiers.config)  # any tier has floors or caps
        self.lower = [t for t in tiers.lower if isinstance(t, SharesTenants) and t.charges_tenants]
        self._owners: dict[str, str] = {}  # session -> its tenant

    def begin(self, session: str, tenant: str) -> None:
        self._owners[session] = tenant

    def end(self, session: str) -> None:
        self._owners.pop(session, None)

    def of(self, tenant: str | None, session: str | None, extra: Mapping[str, str] | None) -> str:
        """The tenant a store with these options charges (``bounded``)."""
        if tenant is not None:
            return bounded(tenant)
        if session is not None and session in self._owners:
            return bounded(self._owners[session])
        if extra and SALT in extra:
            return bounded(extra[SALT])
        return DEFAULT

    def owner(
        self, tenant: str | None, session: str | None, extra: Mapping[str, str] | None
    ) -> str:
        """The tenant a store's new blocks carry: :meth:`of`, or the default tenant
        without tenant shares (no salt is written into a lower tier's records)."""
        return self.of(tenant, session, extra) if self.on else DEFAULT

    def charging(
        self, tenant: str | None, session: str | None, extra: Mapping[str, str] | None
    ) -> AbstractContextManager[None]:
        """While inside, the hot tier charges what is put to this store's tenant."""
        if self.shares is None:
            return contextlib.nullcontext()
        return self.shares.charging(self.of(tenant, session, extra))

    def stats(self) -> dict[str, dict[str, dict[str, int]]]:
        """``{tenant: {tier: figures}}`` (empty without tenant shares)."""
        if not self.on:
            return {}
        out: dict[str, dict[str, dict[str, int]]] = {}
        if self.shares is not None:
            for name, figures in self.shares.stats().items():
                out.setdefault(name, {})["hot"] = figures
        lower = {tier.name: tier.tenant_stats() for tier in self.lower}
        names = sorted({*out, *(name for figures in lower.values() for name in figures)})
        for name in names:  # every tenant on every lower tier that charges tenants
            for tier, figures in lower.items():
                out.setdefault(name, {})[tier] = figures.get(name) or dict(_NOTHING)
        return {name: out[name] for name in names}

    def stats_of(self, tenant: str) -> dict[str, dict[str, int]]:
        """One tenant's figures by tier.

        Raises:
            ValueError: no tenant shares are configured, or no config or store
                named ``tenant``.
        """
        if not self.on:
            raise ValueError(
                f"unknown tenant {tenant!r}: no tenant shares are configured "
                "(hot_, ssd_ or remote_tenant_floors and _caps)"
            )
        out = self.stats()
        if tenant not in out:
            known = ", ".join(repr(n) for n in out) or "none"
            raise ValueError(f"unknown tenant {tenant!r}: known tenants are {known}")
        return out[tenant]
