"""CacheConfig's settings read from PREFIXCACHE_* variables and checked by each field's type.

Every field is read from its variable; a bad value is refused with the variable
(or the field) and the value named; non-finite numbers are refused; a misspelt
variable is warned about with the closest known name; and a field added later
gets all of it without code (a subclass adds fields here).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Literal

import pytest

from prefixcache.config import CacheConfig, parse_bytes
from prefixcache.errors import ConfigError
from prefixcache.settings import env_name, field_types


def as_text(value: object) -> str:
    """How a value is written in a variable."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def test_every_field_reads_its_variable():
    """Each field's default written as text comes back equal from its variable; a changed
    value too (the control: a variable that were not read would leave the default)."""
    base = CacheConfig()
    for field in dataclasses.fields(CacheConfig):
        value = getattr(base, field.name)
        var = env_name(field.name)
        assert getattr(CacheConfig.from_env({var: as_text(value)}), field.name) == value
    changed = {
        "PREFIXCACHE_BLOCK_SIZE": "32",
        "PREFIXCACHE_HOT_MAX_BYTES": "512MiB",
        "PREFIXCACHE_HOT_CACHE_ONLY": "yes",
        "PREFIXCACHE_WRITE_POLICY": "write_through",
        "PREFIXCACHE_KV_BITS": "4",
        "PREFIXCACHE_SNAPSHOT_RATIO": "0.5",
        "PREFIXCACHE_COUNTERS_SAVE_SECONDS": "0",
        "PREFIXCACHE_REMOTE_URL": "unix:///tmp/s",
        "PREFIXCACHE_PROMOTE": "off",
    }
    cfg = CacheConfig.from_env(changed)
    assert (cfg.block_size, cfg.hot_max_bytes, cfg.hot_cache_only) == (32, 512 << 20, True)
    assert (cfg.write_policy, cfg.kv_bits, cfg.snapshot_ratio) == ("write_through", 4, 0.5)
    assert (cfg.counters_save_seconds, cfg.remote_url, cfg.promote) == (0.0, "unix:///tmp/s", False)
    assert CacheConfig.from_env(changed, block_size=64).block_size == 64  # a keyword wins


@pytest.mark.parametrize(
    ("var", "raw", "says"),
    [
        ("BLOCK_SIZE", "abc", "not an int"),
        ("BLOCK_SIZE", "0", "must be a positive int"),
        ("BLOCK_SIZE", "1.5", "not an int"),
        ("HOT_MAX_BYTES", "10Q", "not a byte size"),
        ("HOT_MAX_BYTES", "-1G", "not a byte size"),
        ("PROMOTE", "maybe", "not a boolean"),
        ("WRITE_POLICY", "sometimes", "not one of 'write_back', 'write_through'"),
        ("KV_BITS", "7", "one of 2,3,4,5,6,8"),
        ("REMOTE_URL", "ftp://x", "must start with one of"),
        ("REMOTE_PREFIX", "a b", "non-empty name"),
        ("SNAPSHOT_RATIO", "0", "number > 0"),
    ],
)
def test_a_bad_variable_is_named_with_its_value(var, raw, says):
    name = "PREFIXCACHE_" + var
    with pytest.raises(ConfigError) as caught:
        CacheConfig.from_env({"PREFIXCACHE_RESTORE_HEADROOM": "16", name: raw})
    err = caught.value
    assert str(err).startswith(f"{name}={raw!r}: ") and says in str(err), str(err)
    assert (err.source, err.field) == (name, var.lower())


def test_non_finite_numbers_are_refused_in_every_number_field():
    """inf and nan for every float and every size field, from a variable and from code;
    the control: a finite value of the same field is accepted."""
    types = field_types(CacheConfig)
    numbers = [n for n, t in types.items() if t is float or n.endswith("_bytes")]
    assert {"snapshot_ratio", "counters_save_seconds", "hot_max_bytes"} <= set(numbers)
    for name in numbers:
        var = env_name(name)
        for raw in ("inf", "-inf", "nan", "1e999"):
            with pytest.raises(ConfigError, match=var):
                CacheConfig.from_env({var: raw})
        with pytest.raises(ConfigError, match=name) as caught:
            CacheConfig(**{name: math.inf})
        assert caught.value.field == name
        assert getattr(CacheConfig.from_env({var: "2"}), name) == 2


def test_keywords_are_checked_against_their_types():
    for kwargs, says in [
        ({"counters_save_seconds": float("inf")}, "counters_save_seconds must be a finite"),
        ({"block_size": True}, "block_size must be an int, got True"),
        ({"hot_max_bytes": 1.5}, "hot_max_bytes must be an int (bytes), got 1.5"),
        ({"promote": 1}, "promote must be a boolean, got 1"),
        ({"queue_full": "later"}, "queue_full must be one of 'drop', 'inline'"),
    ]:
        with pytest.raises(ConfigError, match=says.replace("(", r"\(").replace(")", r"\)")):
            CacheConfig(**kwargs)
    CacheConfig(counters_save_seconds=3, kv_bits=None, ssd_dir="x")  # the control: all fit


def test_an_error_of_a_keyword_names_the_field_and_not_a_variable():
    with pytest.raises(ConfigError) as caught:
        CacheConfig.from_env({"PREFIXCACHE_BLOCK_SIZE": "16"}, block_size=0)
    assert (caught.value.field, caught.value.source) == ("block_size", None)
    assert "PREFIXCACHE" not in str(caught.value) and "got 0" in str(caught.value)


def test_the_bad_one_of_several_variables_is_named():
    env = {
        "PREFIXCACHE_BLOCK_SIZE": "16",
        "PREFIXCACHE_REMOTE_TIMEOUT_MS": "0",
        "PREFIXCACHE_HOT_MAX_BYTES": "1G",
    }
    with pytest.raises(ConfigError) as caught:
        CacheConfig.from_env(env)
    assert caught.value.source == "PREFIXCACHE_REMOTE_TIMEOUT_MS"
    assert str(caught.value).startswith("PREFIXCACHE_REMOTE_TIMEOUT_MS='0': remote_timeout_ms")
    env["PREFIXCACHE_REMOTE_TIMEOUT_MS"] = "5"  # the control
    assert CacheConfig.from_env(env).remote_timeout_ms == 5


def test_a_misspelt_variable_is_warned_with_the_closest_name(caplog):
    caplog.set_level(logging.WARNING, logger="prefixcache.settings")
    CacheConfig.from_env({"PREFIXCACHE_BLOCKSIZE": "16", "PREFIXCACHE_SSD_DIR": "/x"})
    CacheConfig.from_env({"PREFIXCACHE_BLOCKSIZE": "16"})  # warned once per process
    CacheConfig.from_env({"PREFIXCACHE_XYZZY_QUUX": "1", "PREFIXCACHE_HUGE_PAGES": "0"})
    messages = [r.getMessage() for r in caplog.records]
    assert messages == [
        "PREFIXCACHE_BLOCKSIZE is not a prefixcache setting and is ignored; "
        "did you mean PREFIXCACHE_BLOCK_SIZE?",
        "PREFIXCACHE_XYZZY_QUUX is not a prefixcache setting and is ignored; "
        "see CacheConfig's fields",
    ]  # the known names (SSD_DIR, HUGE_PAGES) are not reported


@dataclasses.dataclass(frozen=True, slots=True)
class _Later(CacheConfig):
    """Fields added after the machinery was written: no code for them anywhere."""

    later_seconds: float = 1.0
    later_mode: Literal["on", "off"] = "on"
    later_max_bytes: int = 0
    later_name: str | None = None


def test_a_field_added_later_is_read_and_checked_without_more_code():
    cfg = _Later.from_env(
        {
            "PREFIXCACHE_LATER_SECONDS": "2.5",
            "PREFIXCACHE_LATER_MODE": "off",
            "PREFIXCACHE_LATER_MAX_BYTES": "1K",
            "PREFIXCACHE_LATER_NAME": "n",
        }
    )
    assert (cfg.later_seconds, cfg.later_mode, cfg.later_max_bytes, cfg.later_name) == (
        2.5,
        "off",
        1024,
        "n",
    )
    for var, raw in [("LATER_SECONDS", "inf"), ("LATER_MODE", "auto"), ("LATER_MAX_BYTES", "9Q")]:
        with pytest.raises(ConfigError, match=f"PREFIXCACHE_{var}='{raw}'"):
            _Later.from_env({f"PREFIXCACHE_{var}": raw})
    with pytest.raises(ConfigError, match="later_seconds must be a finite number, got nan"):
        _Later(later_seconds=math.nan)


def test_parse_bytes():
    assert [parse_bytes(t) for t in ("8G", "512MiB", "1048576", "1.5k", " 2 t ")] == [
        8 << 30,
        512 << 20,
        1 << 20,
        1536,
        2 << 40,
    ]
    for bad in ("10Q", "inf", "nan", "-1", "", "G", "1e999"):
        with pytest.raises(ValueError, match="not a byte size"):
            parse_bytes(bad)


def test_replace_names_the_field_at_fault():
    base = CacheConfig(block_size=16)
    with pytest.raises(ConfigError) as caught:
        base.replace(kv_bits=7, restore_headroom=8)
    assert caught.value.field == "kv_bits" and "got 7" in str(caught.value)
    assert base.replace(kv_bits=4, restore_headroom=8).kv_bits == 4  # the control
