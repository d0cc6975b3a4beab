"""``prefixcache serve``: its options, its CacheConfig, and the call into mlx-lm's server.

The server's run (mlx-lm's ``main()`` with TieredPromptCache in place) is
imported only when serving: it imports mlx-lm, which the other commands never
need.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys

import mlx.core as mx

from ..config import (
    ENV_PREFIX,
    EVENTS_FORMATS,
    EVICTIONS,
    WRITE_POLICIES,
    CacheConfig,
    parse_bytes,
)
from ..errors import SsdDirError, SsdFormatError
from ..serve.validate import MAX_BODY_BYTES, MAX_TOKENS_LIMIT, Limits
from .common import Command, UsageError, on_off, port, positive_float, positive_int

log = logging.getLogger(__name__)
TENANT_TIERS = ("hot", "ssd", "remote")  # the tiers with tenant floors and caps


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
    _add_remote_args(group)
    _add_operator_args(group)
    _add_guard_args(parser.add_argument_group("requests (docs/operating.md, bounds)"))
    group.add_argument(
        "--metrics-port", type=port, help="Prometheus text at 127.0.0.1:PORT/metrics"
    )
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


def _add_remote_args(group: argparse._ArgumentGroup) -> None:
    """The shared remote tier (docs/remote.md)."""
    group.add_argument(
        "--remote-url",
        help="shared remote tier: redis://, rediss://, unix:// or redis+cluster://host:port,...",
    )
    group.add_argument("--remote-prefix", help="key namespace on the remote server")
    group.add_argument("--remote-timeout-ms", type=int, help="give up on a remote call after")
    group.add_argument("--remote-connect-timeout-ms", type=int, help="give up connecting after")
    group.add_argument("--remote-max-bytes", type=parse_bytes, help="stop writing above, e.g. 8G")
    group.add_argument("--remote-secret-file", help="file of the hosts' shared signing secret")
    group.add_argument("--remote-tls-ca", help="CA file that verifies the server (rediss)")
    group.add_argument("--remote-tls-cert", help="client certificate file (rediss)")
    group.add_argument("--remote-tls-key", help="client certificate's key file (rediss)")


def _add_operator_args(group: argparse._ArgumentGroup) -> None:
    """Operator controls (docs/operating.md): SSD wear, warm start, KV events, pins."""
    group.add_argument(
        "--eviction",
        choices=EVICTIONS,
        help="hot eviction (docs/eviction.md); the default, adaptive, follows the reuse seen",
    )
    group.add_argument("--ssd-admit-after", type=int, help="write a block to SSD once used N times")
    group.add_argument(
        "--ssd-write-budget", type=_bytes_arg, help="SSD bytes written per day at most, e.g. 20G"
    )
    group.add_argument(
        "--warm-bytes", type=_bytes_arg, help="load this much into hot on start (default: half hot)"
    )
    group.add_argument("--events-url", help="publish KV events on ZeroMQ, e.g. tcp://*:5557")
    for tier in TENANT_TIERS:  # tenant shares
        group.add_argument(f"--{tier}-tenant-floors", help=f"{tier} bytes each tenant keeps: b=2G")
        group.add_argument(f"--{tier}-tenant-caps", help=f"{tier} bytes a tenant may hold: a=4G")
    group.add_argument(
        "--tenant-header", help="the request header naming its tenant, e.g. X-Tenant"
    )
    group.add_argument(
        "--events-format",
        choices=EVENTS_FORMATS,
        help="KV events as vLLM's structures (default) or SGLang's",
    )
    group.add_argument(
        "--explain-header",
        type=on_off,
        metavar="on|off",
        help="X-Prefixcache-Explain on every completion: where its prompt left the stored "
        "sequences, and why (default: on)",
    )
    group.add_argument(
        "--record-trace", help="append each request to FILE as a Mooncake trace (no token ids)"
    )
    group.add_argument(
        "--pin-system-prompts",
        action="store_true",
        default=None,
        help="pin every request's system prompt (its first segment)",
    )


def _add_guard_args(group: argparse._ArgumentGroup) -> None:
    """What serve accepts of a request (serve/validate.py)."""
    group.add_argument(
        "--max-body-bytes",
        type=_bytes_arg,
        default=MAX_BODY_BYTES,
        help="refuse a request body over this size with 413 (default: 32M)",
    )
    group.add_argument(
        "--max-tokens-limit",
        type=positive_int,
        default=MAX_TOKENS_LIMIT,
        help=f"refuse a max_tokens above this with 400 (default: {MAX_TOKENS_LIMIT})",
    )
    group.add_argument(
        "--client-timeout",
        type=positive_float,
        default=30.0,
        help="seconds a client may stay silent while sending a request (default: 30)",
    )


# restore_headroom by default: room for the prompt's rest and its first token, so
# the prefill and the first token write in place in the restored buffer mlx-lm's
# batch takes (serve/batch.py); the reply then grows it in mlx-lm's 256-token steps.
# More room would count in the batch's bytes, which the cache must leave free.
SERVE_HEADROOM = 1

_CONFIG_FLAGS = (
    "ssd_dir",
    "hot_max_bytes",
    "ssd_max_bytes",
    "block_size",
    "hot_cache_only",
    "write_policy",
    "remote_url",
    "remote_prefix",
    "remote_timeout_ms",
    "remote_connect_timeout_ms",
    "remote_max_bytes",
    "remote_secret_file",
    "remote_tls_ca",
    "remote_tls_cert",
    "remote_tls_key",
    "ssd_admit_after",
    "ssd_write_budget",
    "warm_bytes",
    "events_url",
    "events_format",
    "pin_system_prompts",
    "explain_header",
    "eviction",
    *(f"{tier}_tenant_{bound}" for tier in TENANT_TIERS for bound in ("floors", "caps")),
)


def serve_config(args: argparse.Namespace) -> CacheConfig:
    """CacheConfig from ``serve``'s options over ``PREFIXCACHE_*`` variables.

    ``restore_headroom`` defaults to ``SERVE_HEADROOM``.
    """
    config = CacheConfig.from_env(**{name: getattr(args, name, None) for name in _CONFIG_FLAGS})
    if ENV_PREFIX + "RESTORE_HEADROOM" not in os.environ:
        config = config.replace(restore_headroom=SERVE_HEADROOM)
    if getattr(args, "warm_bytes", None) is None and ENV_PREFIX + "WARM_BYTES" not in os.environ:
        config = config.replace(warm_bytes=config.hot_max_bytes // 2)  # serve starts warm
    return config


def _bytes_arg(text: str) -> int:
    """argparse type of a byte size: the error names the value."""
    try:
        return parse_bytes(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


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
    from ..serve.fit import MlxLmVersionError, check_mlx_lm_version

    try:
        check_mlx_lm_version()
    except MlxLmVersionError as err:
        print(f"prefixcache serve: {err}", file=sys.stderr)
        return 2
    looks_local = args.model.startswith(("/", ".", "~"))  # else maybe a Hugging Face repo id
    if looks_local and not os.path.isdir(os.path.expanduser(args.model)):
        raise UsageError(f"--model {args.model!r} is not a model directory")
    config = serve_config(args)  # checked before mlx-lm's import: a bad setting fails at once
    if not check_ssd_dir(config):
        return 2
    from ..serve.main import run_mlx_server

    set_mx_cache_limit(args)
    shared = getattr(args, "shared_prefix", False)
    limits = Limits(max_body_bytes=args.max_body_bytes, max_tokens=args.max_tokens_limit)
    tenant_header = check_header(getattr(args, "tenant_header", None))
    recorder = _recorder(args, config)  # last: the file opens once every check passed
    try:
        return run_mlx_server(
            args.model,
            args.mlx_lm_args,
            config,
            args.metrics_port,
            shared=shared,
            limits=limits,
            client_timeout=args.client_timeout,
            tenant_header=tenant_header,
            recorder=recorder,
        )
    finally:
        if recorder is not None:
            recorder.close()


def _recorder(args: argparse.Namespace, config: CacheConfig):
    """The ``--record-trace`` recorder at the cache's block size (None without it)."""
    from ..serve.recorder import TraceRecorder

    path = getattr(args, "record_trace", None)
    try:
        return None if path is None else TraceRecorder(path, config.block_size)
    except OSError as err:
        raise UsageError(f"--record-trace {path!r}: {err.strerror or err}") from None


def check_header(name: str | None) -> str | None:
    """``--tenant-header``'s value if it is an HTTP header name; else UsageError naming it."""
    if name is not None and not re.fullmatch(r"[A-Za-z0-9!#$%&'*+.^_`|~-]+", name):
        raise UsageError(f"--tenant-header {name!r} is not an HTTP header name (e.g. X-Tenant)")
    return name


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
