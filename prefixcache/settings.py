"""Settings as text: ``PREFIXCACHE_*`` variables read and checked by each field's type.

:class:`~prefixcache.config.CacheConfig` declares its fields; this module
reads and checks them generically, so a field added later is parsed, checked
and named in errors without more code:

- a field's type decides how its text is read: ``bool`` (1/0, true/false,
  yes/no, on/off), ``int`` (a ``*_bytes`` field also takes sizes such as
  ``8G``), ``float``, ``str``, a ``Literal`` (one of its values), ``X | None``
  (``none`` or nothing: None);
- every value, from text or from code, must fit its field's type: no bool for
  an int, no ``inf`` or ``nan`` for a number;
- an error names where the bad value came from: ``PREFIXCACHE_X='...'`` for a
  variable; for a keyword the :class:`~prefixcache.errors.ConfigError` carries
  the field (the CLI names the matching ``--flag``);
- a ``PREFIXCACHE_*`` variable that names no setting is logged at warning
  once, with the closest known name.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import logging
import math
import os
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any, Literal, TypeVar, Union

from .errors import ConfigError

log = logging.getLogger(__name__)

ENV_PREFIX = "PREFIXCACHE_"
# Variables read outside CacheConfig (known, so not reported as misspelt).
OTHER_VARIABLES = ("PREFIXCACHE_HUGE_PAGES",)  # restore_buffers.py: 0 turns huge-page advice off
TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off", "")
_SIZE_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_WORDS = {int: "an int", float: "a finite number", str: "a string", bool: "a boolean"}
_warned: set[str] = set()  # misspelt variables already reported by this process

C = TypeVar("C")


def parse_bytes(text: str | int) -> int:
    """Parse a size such as ``8G``, ``512MiB``, ``1048576`` into bytes.

    Raises:
        ValueError: not a finite size >= 0.
    """
    if isinstance(text, int):
        return text
    raw = text.strip().lower().removesuffix("ib").removesuffix("b")
    num = raw.rstrip("kmgt")
    unit = raw[len(num) :]
    try:
        value = float(num)
    except ValueError:
        value = math.nan
    if unit not in _SIZE_UNITS or not math.isfinite(value) or value < 0:
        raise ValueError(f"not a byte size: {text!r} (e.g. 512M, 8G, 1048576)")
    return int(value * _SIZE_UNITS[unit])


def parse_byte_map(text: str) -> dict[str, int]:
    """Parse ``NAME=SIZE`` pairs separated by commas (``b=64M,c=1G``) into bytes by name;
    an empty text is an empty map.

    Raises:
        ValueError: a pair without ``=``, an empty or repeated name, or a bad size,
            naming the pair.
    """
    out: dict[str, int] = {}
    for pair in text.split(",") if text.strip() else ():
        name, eq, size = (part.strip() for part in pair.partition("="))
        if not eq or not name or name in out:
            why = "a repeated name" if name in out else "not NAME=SIZE"
            raise ValueError(f"{why}: {pair.strip()!r} (e.g. b=64M,c=1G)")
        try:
            out[name] = parse_bytes(size)
        except ValueError as err:
            raise ValueError(f"{pair.strip()!r}: {err}") from None
    return out


def env_name(field: str) -> str:
    """The variable of a field: ``block_size`` -> ``PREFIXCACHE_BLOCK_SIZE``."""
    return ENV_PREFIX + field.upper()


@functools.cache
def field_types(cls: type) -> dict[str, Any]:
    """Each dataclass field of ``cls`` and its resolved type."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _choices(hint: Any) -> tuple[Any, ...]:
    """The alternatives of a union (``int | None``: int, NoneType), else just ``hint``."""
    if typing.get_origin(hint) in (Union, types.UnionType):
        return typing.get_args(hint)
    return (hint,)


def _fits(kind: Any, value: object) -> bool:
    if typing.get_origin(kind) is Literal:
        return value in typing.get_args(kind)
    if kind is bool:
        return isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        return ok and math.isfinite(value)  # type: ignore[arg-type]
    if kind is str:
        return isinstance(value, str | os.PathLike)
    if kind is type(None):
        return value is None
    return True  # a type this module does not know: the field's own checks decide


def is_size(name: str) -> bool:
    """Whether a field is a number of bytes (``*_bytes``, ``*_budget``): its variable
    takes sizes such as ``8G``."""
    return name.endswith(("_bytes", "_budget"))


def describe(name: str, hint: Any, *, text: bool = False) -> str:
    """What a field takes, in words (``an int``, ``one of 'a', 'b'``, ``... or none``);
    ``text``: as written in a variable (sizes as ``8G``)."""
    words = []
    for kind in _choices(hint):
        if typing.get_origin(kind) is Literal:
            words.append("one of " + ", ".join(map(repr, typing.get_args(kind))))
        elif kind is int and is_size(name):
            words.append("a byte size (e.g. 512M, 8G)" if text else "an int (bytes)")
        elif kind is type(None):
            words.append("none")
        elif kind is bool and text:
            words.append("a boolean (1/0, true/false, yes/no, on/off)")
        else:
            words.append(_WORDS.get(kind, getattr(kind, "__name__", str(kind))))
    return " or ".join(words)


def check_types(config: object) -> None:
    """Check every field of a dataclass instance against its declared type.

    Raises:
        ConfigError: naming the first field whose value does not fit (and the value).
    """
    for name, hint in field_types(type(config)).items():
        value = getattr(config, name)
        if not any(_fits(kind, value) for kind in _choices(hint)):
            raise ConfigError(f"{name} must be {describe(name, hint)}, got {value!r}", field=name)


def parse_text(name: str, hint: Any, raw: str) -> object:
    """The value of the text ``raw`` for the field ``name`` of type ``hint``.

    Raises:
        ValueError: ``raw`` is not of that type (the message says what is).
    """
    choices = _choices(hint)
    text = raw.strip()
    if type(None) in choices and text.lower() in ("", "none"):
        return None
    for kind in choices:
        if kind is bool and text.lower() in (*TRUE_WORDS, *FALSE_WORDS):
            return text.lower() in TRUE_WORDS
        if typing.get_origin(kind) is Literal and text in typing.get_args(kind):
            return text
        if kind is str:
            return raw
        try:
            if kind is int:
                return parse_bytes(text) if is_size(name) else int(text)
            if kind is float and math.isfinite(value := float(text)):
                return value
        except ValueError:
            continue
    raise ValueError(f"not {describe(name, hint, text=True)}")


def unknown_variables(environ: Mapping[str, str], cls: type) -> list[str]:
    """A warning for each ``PREFIXCACHE_*`` variable that names no setting of ``cls``."""
    known = [env_name(name) for name in field_types(cls)] + list(OTHER_VARIABLES)
    names = [k.removeprefix(ENV_PREFIX) for k in known]  # compared without the common prefix
    out = []
    for var in sorted(v for v in environ if v.startswith(ENV_PREFIX) and v not in known):
        close = difflib.get_close_matches(var.removeprefix(ENV_PREFIX), names, n=1, cutoff=0.7)
        hint = f"did you mean {ENV_PREFIX}{close[0]}?" if close else "see CacheConfig's fields"
        out.append(f"{var} is not a prefixcache setting and is ignored; {hint}")
    return out


def warn_unknown(environ: Mapping[str, str], cls: type) -> None:
    """Log :func:`unknown_variables` at warning, each once per process."""
    for message in unknown_variables(environ, cls):
        if message not in _warned:
            _warned.add(message)
            log.warning("%s", message)


def check_env(environ: Mapping[str, str], cls: type) -> None:
    """Read every ``PREFIXCACHE_*`` variable of ``cls``'s fields once, whether or not
    the caller uses that setting; an unknown one is logged at warning.

    Raises:
        ConfigError: a value that does not parse, its variable named.
    """
    warn_unknown(environ, cls)
    for name, hint in field_types(cls).items():
        var = env_name(name)
        if var in environ:
            try:
                parse_text(name, hint, environ[var])
            except ValueError as err:
                message = f"{var}={environ[var]!r}: {err}"
                raise ConfigError(message, field=name, source=var) from None


def from_env(cls: type[C], environ: Mapping[str, str], overrides: Mapping[str, object]) -> C:
    """``cls`` from ``PREFIXCACHE_*`` variables, with ``overrides`` (not None) winning.

    Raises:
        ConfigError: a value is unusable; the message starts with the variable
            (``PREFIXCACHE_X='...': ...``), or ``field`` names the keyword.
    """
    warn_unknown(environ, cls)
    values: dict[str, object] = {}
    sources: dict[str, str] = {}  # field -> the variable its value came from
    for name, hint in field_types(cls).items():
        var = env_name(name)
        if var not in environ:
            continue
        try:
            values[name] = parse_text(name, hint, environ[var])
        except ValueError as err:
            raise ConfigError(f"{var}={environ[var]!r}: {err}", field=name, source=var) from None
        sources[name] = var
    for name, value in overrides.items():
        if value is not None:
            values[name] = value
            sources.pop(name, None)
    return build(cls, values, sources, environ)


def build(
    make: Callable[..., C],
    values: dict[str, object],
    sources: Mapping[str, str] | None = None,
    environ: Mapping[str, str] | None = None,
) -> C:
    """``make(**values)`` (a config class, or ``replace`` on one), its ``ValueError``
    turned into a :class:`ConfigError` that names the value at fault.

    The value at fault is the field a ConfigError names, else the first value
    that fails alone (each tried with the others left out); ``sources`` maps a
    field to the variable its value came from (``environ[variable]`` is the text).
    """
    try:
        return make(**values)
    except ValueError as err:
        raise _blame(make, err, values, sources or {}, environ or {}) from None


def _blame(
    make: Callable[..., object],
    err: ValueError,
    values: dict[str, object],
    sources: Mapping[str, str],
    environ: Mapping[str, str],
) -> ConfigError:
    culprit = err.field if isinstance(err, ConfigError) and err.field in values else None
    alone: ValueError = err
    for name in [culprit] if culprit else values:
        try:
            make(**{name: values[name]})
        except ValueError as failed:
            culprit, alone = name, failed
            break
    if culprit is None:
        given = ", ".join(sources.values())
        return ConfigError(f"{err} (with {given})" if given else str(err))
    var = sources.get(culprit)
    if var is None:
        return ConfigError(str(alone), field=culprit)
    return ConfigError(f"{var}={environ[var]!r}: {alone}", field=culprit, source=var)
