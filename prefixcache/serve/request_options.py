"""Per-request cache options of ``prefixcache serve``: what a request asks, and whose it is.

A request to the server may carry, besides mlx-lm's own fields:

- ``"cache_salt": "..."`` (vLLM's name): goes into the namespace (``extra``),
  so requests with different salts never share a block;
- ``"session_id": "..."`` in the JSON body, or an ``X-Session-Id`` header:
  the blocks it stores are tagged with that session (``end_session``);
- ``"cache": {"persist": false}``: its blocks stay hot only;
- the header ``serve --tenant-header`` names (e.g. ``X-Tenant``): the tenant
  its stores are charged to under tenant shares (``hot_tenant_floors``).

mlx-lm's server hands its prompt cache only tokens, so the options travel
beside them (see docs/operating.md, "How serve carries request fields"): the
HTTP handler parses them (``parse``), the generation thread registers them
with the request's prompt when it tokenizes it (``Requests.begin``), the fetch
that follows takes them (``for_fetch``), and each insert takes those of the
registered prompt its tokens continue or extend (``for_insert``). An insert
that several in-flight requests with different options could own is not
stored (never under another tenant's salt or session).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

_MAX_OPEN = 256  # registered requests kept (a request that never inserts ages out)


@dataclass(frozen=True, slots=True)
class RequestOptions:
    """What one request asks of the cache."""

    salt: str | None = None
    session: str | None = None
    persist: bool = True
    pin_tokens: int = 0  # tokens of the system prompt to pin (0: none)
    tenant: str | None = None

    @property
    def extra(self) -> dict[str, str] | None:
        return {"cache_salt": self.salt} if self.salt is not None else None

    def owner(self) -> tuple[str | None, str | None, bool, str | None]:
        return self.salt, self.session, self.persist, self.tenant


DEFAULT = RequestOptions()


MAX_NAME = 256  # characters of a cache_salt or a session_id


def check_name(field: str, value: object) -> str | None:
    """``value`` if it is None or a name serve accepts: a string of 1 to ``MAX_NAME``
    printable characters (no control characters; any script).

    Raises:
        ValueError: otherwise (the message names ``field`` and shows the value cut short).
    """
    if value is None:
        return None
    if isinstance(value, str) and 0 < len(value) <= MAX_NAME and value.isprintable():
        return value
    shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:60] + "..."
    raise ValueError(
        f"{field} must be a string of 1 to {MAX_NAME} printable characters, got {shown}"
        + (f" ({len(value)} characters)" if isinstance(value, str) else "")
    )


def parse(
    body: Mapping[str, object], headers: Mapping[str, str], tenant_header: str | None = None
) -> RequestOptions:
    """The options of a request body and its headers (``tenant_header``: the header
    naming its tenant, if the server has one).

    Raises:
        ValueError: a field has the wrong type or is out of bounds (the message names it).
    """
    salt = check_name("cache_salt", body.get("cache_salt"))
    if "session_id" in body:
        session = check_name("session_id", body["session_id"])
    else:
        session = check_name("X-Session-Id", headers.get("X-Session-Id"))
    cache = body.get("cache", {})
    if not isinstance(cache, dict):
        raise ValueError(f'cache must be an object such as {{"persist": false}}, got {cache!r}')
    unknown = sorted(k for k in cache if k != "persist")
    if unknown:
        raise ValueError(f"cache has unknown fields {unknown[:5]!r}: only persist is known")
    persist = cache.get("persist", True)
    if not isinstance(persist, bool):
        raise ValueError(f"cache.persist must be true or false, got {persist!r}")
    tenant = check_name(tenant_header, headers.get(tenant_header)) if tenant_header else None
    return RequestOptions(salt, session, persist, tenant=tenant)


@dataclass(slots=True)
class _Open:
    prompt: tuple[int, ...]
    options: RequestOptions


class Requests:
    """Requests in flight: their prompts and options (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: deque[_Open] = deque(maxlen=_MAX_OPEN)

    def begin(self, prompt: Sequence[int], options: RequestOptions) -> None:
        with self._lock:
            self._open.append(_Open(tuple(prompt), options))

    def for_fetch(self, tokens: Sequence[int]) -> RequestOptions:
        """The options of the latest request with exactly this prompt (default: none)."""
        key = tuple(tokens)
        with self._lock:
            found = next((r for r in reversed(self._open) if r.prompt == key), None)
        return found.options if found is not None else DEFAULT

    def for_insert(self, tokens: Sequence[int]) -> RequestOptions | None:
        """The options of the request ``tokens`` belong to (a prefix of its prompt, or
        its prompt and generated tokens); None if requests with different options
        could own them. An insert past a prompt's end (the finished request's last)
        closes that request."""
        key = tuple(tokens)
        with self._lock:
            mine = [r for r in self._open if _continues(r.prompt, key)]
            if not mine:
                return DEFAULT
            if len({r.options.owner() for r in mine}) > 1:
                return None
            owner = max(mine, key=lambda r: len(r.prompt))
            if len(key) > len(owner.prompt):
                self._open.remove(owner)
            return owner.options


def _continues(prompt: tuple[int, ...], tokens: tuple[int, ...]) -> bool:
    n = min(len(prompt), len(tokens))
    return n > 0 and prompt[:n] == tokens[:n]
