"""``prefixcache serve``: its options, its CacheConfig, and the call into mlx-lm's server.

The server itself (mlx-lm's ``main()`` with TieredPromptCache in place) is
serve_main.py, imported only when serving: it imports mlx-lm, which the
other commands never need.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

import mlx.core as mx

from ..config import ENV_PREFIX, WRITE_POLICIES, CacheConfig, parse_bytes
from ..errors import SsdDirError, SsdFormatError
from .common import Command

log = logging.getLogger(__name__)


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    """Add ``serve``'s options; every option it does not know goes to mlx_lm.server."""
    parser.description = "mlx-lm's OpenAI-compatible server with the tiered prefix cache."
    parser.epilog = (
        "Every other option is mlx_lm.server's and is passed to it unchanged (--host, "
        "--port, --max-tokens, --prompt-cache-bytes, --kv-bits, ...: see `mlx_lm.server "
        "--help`). --prompt-cache-bytes trims the hot tier as it trims mlx-lm's cache; "
        "--prompt-cache-size has no effect (blocks are shared, not counted per sequence). "
        "SIGINT/SIGTERM flush the hot tier to SSD before exiting."
    )
    parser.add_argument("--model", required=True, help="model path or repo (mlx_lm.server's)")
    group = parser.add_argument_group("prefix cache (defaults from PREFIXCACHE_* variables)")
    group.add_argument("--ssd-dir", help="SSD tier directory")
    group.add_argument("--hot-max-bytes", type=parse_bytes, help="RAM budget, e.g. 8G")
    group.add_argument("--ssd-max-bytes", type=parse_bytes, help="SSD budget, e.g. 64G")
    group.add_argument("--block-size", type=int, help="tokens per block")
    group.add_argument("--hot-cache-only", action="store_true", default=None, help="no SSD tier")
    group.add_argument("--write-policy", choices=WRITE_POLICIES)
    group.add_argument("--remote-url", help="shared remote tier: redis://, rediss:// or unix://")
    group.add_argument("--remote-prefix", help="key namespace on the remote server")
    group.add_argument("--remote-timeout-ms", type=int, help="give up on a remote call after")
    group.add_argument("--remote-connect-timeout-ms", type=int, help="give up connecting after")
    group.add_argument("--remote-max-bytes", type=parse_bytes, help="stop writing above, e.g. 8G")
    group.add_argument("--metrics-port", type=int, help="Prometheus text at 127.0.0.1:PORT/metrics")
    group.add_argument(
        "--shared-prefix",
        action="store_true",
        help="concurrent requests on one prefix hold its K/V once and decode against it "
        "together (fetch(tokens, shared=True); see docs/shared-prefix.md)",
    )
    group.add_argument(
        "--mx-cache-limit",
        type=parse_bytes,
        help="MLX's buffer cache limit, e.g. 4G: restores then reuse freed cache buffers "
        "instead of faulting in fresh memory (MLX's CPU default is 32 MiB)",
    )
    parser.allow_abbrev = False  # "--host" must not be taken for a prefix of ours
    parse_known = parser.parse_known_args

    def keep_unknown(args=None, namespace=None):
        # argparse would reject unknown options at the top level: keep them for mlx-lm.
        ns, rest = parse_known(args, namespace)
        ns.mlx_lm_args = [*getattr(ns, "mlx_lm_args", []), *rest]
        return ns, []

    parser.parse_known_args = keep_unknown  # type: ignore[method-assign]


_CONFIG_FLAGS = (
    "ssd_dir", "hot_max_bytes", "ssd_max_bytes", "block_size", "hot_cache_only", "write_policy",
    "remote_url", "remote_prefix", "remote_timeout_ms", "remote_connect_timeout_ms",
    "remote_max_bytes",
)  # fmt: skip


def serve_config(args: argparse.Namespace) -> CacheConfig:
    """CacheConfig from ``serve``'s options over ``PREFIXCACHE_*`` variables.

    ``restore_headroom`` defaults to 0: the batch path copies a restored cache
    into its batch at once, so headroom would only be allocated and dropped.
    """
    config = CacheConfig.from_env(**{name: getattr(args, name, None) for name in _CONFIG_FLAGS})
    if ENV_PREFIX + "RESTORE_HEADROOM" not in os.environ:
        config = config.replace(restore_headroom=0)
    return config


def set_mx_cache_limit(args: argparse.Namespace) -> int | None:
    """Apply ``--mx-cache-limit``; returns the previous limit (None if not given)."""
    limit = getattr(args, "mx_cache_limit", None)
    if limit is None:
        return None
    previous = mx.set_cache_limit(limit)
    log.info("MLX buffer cache limit %d MiB (was %d MiB)", limit >> 20, previous >> 20)
    return previous


def run_serve(args: argparse.Namespace) -> int:
    """Run mlx-lm's server (its ``main()``) with a TieredPromptCache in place."""
    from ..mlx_fit import MlxLmVersionError, check_mlx_lm_version

    try:
        check_mlx_lm_version()
    except MlxLmVersionError as err:
        print(f"prefixcache serve: {err}", file=sys.stderr)
        return 2
    from .serve_main import run_mlx_server

    config = serve_config(args)
    if not check_ssd_dir(config):
        return 2
    set_mx_cache_limit(args)
    shared = getattr(args, "shared_prefix", False)
    return run_mlx_server(args.model, args.mlx_lm_args, config, args.metrics_port, shared=shared)


def check_ssd_dir(config: CacheConfig) -> bool:
    """Whether the SSD directory is usable (before listening); else one line on stderr."""
    if config.hot_cache_only:
        return True
    from ..tiers.ssd.directory import check_dir

    try:
        check_dir(config.ssd_path)
    except (SsdDirError, SsdFormatError) as err:
        print(f"prefixcache serve: {err}", file=sys.stderr)
        return False
    return True


COMMANDS = (Command("serve", "mlx-lm's server with the tiered cache", add_serve_args, run_serve),)
