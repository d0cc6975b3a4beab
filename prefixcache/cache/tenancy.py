"""Which tenant a store charges, and the per-tenant figures of ``stats()``.

A store's tenant is, in order: the ``tenant`` it names (``prefixcache serve
--tenant-header``), the owner its session was begun with (``begin_session``),
its ``cache_salt`` (``extra``), else the default tenant (the empty name). The
hot tier's :class:`~prefixcache.tiers.hot.tenants.TenantShares` charges what
the store puts there to it; without tenant shares configured nothing is
charged and this only remembers session owners.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from contextlib import AbstractContextManager

from ..tiers.hot.tenants import DEFAULT, TenantShares

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


class Tenancy:
    """Session owners and the tenant each store charges (the facade's lock held)."""

    def __init__(self, shares: TenantShares | None) -> None:
        self.shares = shares
        self._owners: dict[str, str] = {}  # session -> its tenant

    def begin(self, session: str, tenant: str) -> None:
        self._owners[session] = tenant

    def end(self, session: str) -> None:
        self._owners.pop(session, None)

    def of(self, tenant: str | None, session: str | None, extra: Mapping[str, str] | None) -> str:
        """The tenant a store with these options charges."""
        if tenant is not None:
            return tenant
        if session is not None and session in self._owners:
            return self._owners[session]
        if extra and SALT in extra:
            return extra[SALT]
        return DEFAULT

    def charging(
        self, tenant: str | None, session: str | None, extra: Mapping[str, str] | None
    ) -> AbstractContextManager[None]:
        """While inside, the hot tier charges what is put to this store's tenant."""
        if self.shares is None:
            return contextlib.nullcontext()
        return self.shares.charging(self.of(tenant, session, extra))

    def stats(self) -> dict[str, dict[str, dict[str, int]]]:
        """``{tenant: {"hot": figures}}`` (empty without tenant shares)."""
        if self.shares is None:
            return {}
        return {name: {"hot": figures} for name, figures in self.shares.stats().items()}

    def stats_of(self, tenant: str) -> dict[str, dict[str, int]]:
        """One tenant's figures by tier.

        Raises:
            ValueError: no tenant shares are configured, or no config or store
                named ``tenant``.
        """
        if self.shares is None:
            raise ValueError(
                f"unknown tenant {tenant!r}: no tenant shares are configured "
                "(hot_tenant_floors, hot_tenant_caps)"
            )
        return {"hot": self.shares.check(tenant).stats()}
