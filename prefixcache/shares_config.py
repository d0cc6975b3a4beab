"""Tenant shares' settings: each tier's floors and caps (``NAME=SIZE`` pairs)
checked against its budget and each other, naming the bad value (the shares
themselves are kept by tiers/hot/tenants.py, tiers/ssd/shares.py
and tiers/remote/shares.py)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .errors import ConfigError
from .settings import parse_byte_map

TIERS = ("hot", "ssd", "remote")


def tier_shares(config: Any, tier: str) -> tuple[dict[str, int], dict[str, int]]:
    """``tier``'s tenant floors and caps as bytes by tenant (checked at the config's
    construction, so they parse)."""
    floors = getattr(config, f"{tier}_tenant_floors")
    return parse_byte_map(floors), parse_byte_map(getattr(config, f"{tier}_tenant_caps"))


def any_shares(config: Any) -> bool:
    """Whether any tier has tenant floors or caps (else nothing is charged)."""
    names = [f"{t}_tenant_{kind}" for t in TIERS for kind in ("floors", "caps")]
    return any(getattr(config, name) for name in names)


def check_tenant_shares(config: Any) -> None:
    """Check every tier's tenant floors and caps (``check_shares``)."""
    check_shares(config.hot_tenant_floors, config.hot_tenant_caps, config.hot_max_bytes, "hot")
    check_shares(config.ssd_tenant_floors, config.ssd_tenant_caps, config.ssd_max_bytes, "ssd")
    remote = (config.remote_tenant_floors, config.remote_tenant_caps)
    check_shares(*remote, config.remote_max_bytes, "remote")


def check_shares(floors_text: str, caps_text: str, max_bytes: int, tier: str) -> None:
    """Check a tier's tenant floors and caps (``NAME=SIZE`` pairs) against its budget.

    Raises:
        ConfigError: a malformed pair, a floor above the budget, floors summing
            above it, or a cap below its tenant's floor, naming the value.
    """
    names = {f"{tier}_tenant_floors": floors_text, f"{tier}_tenant_caps": caps_text}
    parsed: dict[str, dict[str, int]] = {}
    for name, text in names.items():
        try:
            parsed[name] = parse_byte_map(text)
        except ValueError as err:
            raise ConfigError(f"{name}={text!r}: {err}", field=name) from None
    floors_field, caps_field = names
    floors, caps = parsed[floors_field], parsed[caps_field]
    check_names(parsed)
    budget = f"{tier}_max_bytes={max_bytes}"
    for tenant, floor in floors.items():
        if floor > max_bytes:
            message = f"{floors_field}: tenant {tenant!r} floor {floor} is above {budget}"
            raise ConfigError(message, field=floors_field)
    if sum(floors.values()) > max_bytes:
        message = f"{floors_field}={floors_text!r} sums to {sum(floors.values())}, above {budget}"
        raise ConfigError(message, field=floors_field)
    for tenant, cap in caps.items():
        if cap < floors.get(tenant, 0):
            message = (
                f"{caps_field}: tenant {tenant!r} cap {cap} is below its floor "
                f"{floors[tenant]} ({floors_field})"
            )
            raise ConfigError(message, field=caps_field)


def check_names(parsed: Mapping[str, Mapping[str, int]]) -> None:
    """ConfigError naming a tenant of these shares (setting -> tenant -> bytes) whose
    name is over 256 UTF-8 bytes: longer names are charged under a digest
    (cache/tenancy.py), so no share could name them."""
    for name, shares in parsed.items():
        for tenant in shares:
            if len(tenant.encode(errors="surrogatepass")) > 256:
                message = f"{name}: tenant {tenant[:40]!r}... is over 256 bytes"
                raise ConfigError(message, field=name)
