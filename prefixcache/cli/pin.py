"""``prefixcache pin`` and ``unpin``: keep a prompt's blocks in an SSD tier directory.

``pin`` loads the model directory (mlx-lm's ``load``: its tokenizer and
weights), tokenizes the prompt as ``prefixcache serve`` does (``--system``:
the first segment mlx-lm's server cuts from a chat request with this system
prompt), opens a :class:`~prefixcache.PrefixCache` on the directory under the
model id serve gives the same ``--model`` (``path@fp:...``), prefills what is
not stored yet, and pins it (``PrefixCache.pin``): the pin is kept in the SSD
index, so a server opening the directory holds the blocks in hot and on SSD
until the pin ends (``--ttl``). ``unpin`` ends it. A server that already has
the directory open keeps the blocks on SSD at once; its hot tier learns of the
pin at its next start.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Sequence
from typing import Any

from ..config import CacheConfig
from ..errors import CacheDirError, SsdDirError, SsdFormatError
from .common import Command, Doc, UsageError, add_common, duration, emit, ssd_dir
from .report import format_bytes

_USER_ERRORS = (ValueError, CacheDirError, SsdDirError, SsdFormatError, FileNotFoundError)


def add_prompt_args(p: argparse.ArgumentParser) -> None:
    """The prompt and the model (and the settings that shape the chain's keys)."""
    add_common(p)
    p.add_argument("file", nargs="?", help="a text file holding the prompt ('-': stdin)")
    p.add_argument("--text", help="the prompt itself (instead of FILE)")
    p.add_argument(
        "--model", required=True, help="the model directory, spelt as `prefixcache serve --model`"
    )
    p.add_argument(
        "--system",
        action="store_true",
        help="the text is a system prompt: pin what serve's chat requests with it start with",
    )
    p.add_argument("--block-size", type=int, help="tokens per block (as the server's)")
    p.add_argument("--kv-bits", type=int, help="KV quantization bits (as the server's)")
    p.add_argument("--kv-group-size", type=int, help="KV quantization group size")


def add_pin_args(p: argparse.ArgumentParser) -> None:
    add_prompt_args(p)
    p.add_argument("--ttl", type=duration, help="end the pin after, e.g. 12h, 7d (default: never)")


def run_pin(args: argparse.Namespace) -> int:
    return _guarded(args, _pin)


def run_unpin(args: argparse.Namespace) -> int:
    return _guarded(args, _unpin)


def _guarded(args: argparse.Namespace, command: Any) -> int:
    """Run ``command``; a user error becomes the CLI's one line naming the value, exit 2."""
    try:
        return command(args)
    except _USER_ERRORS as err:
        raise UsageError(str(err)) from None


def _pin(args: argparse.Namespace) -> int:
    if args.ttl is not None and args.ttl <= 0:
        raise ValueError(f"--ttl must be more than 0 seconds, got {args.ttl:g}")
    text, source = read_prompt(args)
    with PinSession(args) as session:
        tokens = session.tokenize(text, source)
        num_cached = session.pc.match(tokens) if len(tokens) > 1 else 0
        session.pc.prefill(tokens)  # stores what was not stored yet
        num_pinned = session.pc.pin(tokens, args.ttl)
        doc = session.doc(tokens, num_pinned)
        doc["num_computed_tokens"] = len(tokens) - num_cached
        doc["until"] = session.until(tokens)
    emit(args, doc, lambda: _pin_text(doc))
    return 0


def _unpin(args: argparse.Namespace) -> int:
    text, source = read_prompt(args)
    with PinSession(args) as session:
        tokens = session.tokenize(text, source)
        num_blocks = session.pc.unpin(tokens)
        doc = session.doc(tokens, 0) | {"num_unpinned_blocks": num_blocks}
    emit(args, doc, lambda: _unpin_text(doc))
    return 0 if num_blocks else 1


def read_prompt(args: argparse.Namespace, purpose: str = "pin") -> tuple[str, str]:
    """The prompt's text and where it came from (``FILE x``, ``--text``, stdin).

    Raises:
        ValueError: neither or both given, the file is unreadable, or the text is empty.
    """
    if (args.file is None) == (args.text is None):
        raise ValueError("give the prompt as FILE or --text TEXT (one of them)")
    if args.text is not None:
        text, source = args.text, "--text"
    elif args.file == "-":
        text, source = sys.stdin.read(), "stdin"
    else:
        source = f"FILE {args.file!r}"
        try:
            with open(args.file, encoding="utf-8") as f:
                text = f.read()
        except OSError as err:
            raise ValueError(f"{source}: cannot read it: {err.strerror or err}") from None
        except UnicodeDecodeError as err:
            raise ValueError(f"{source}: cannot read it as UTF-8: {err}") from None
    if not text.strip():
        raise ValueError(f"the prompt is empty ({source}): nothing to {purpose}")
    return text, source


class PinSession:
    """The model, its tokenizer and a PrefixCache on the SSD directory, as serve opens them."""

    def __init__(self, args: argparse.Namespace) -> None:
        from mlx_lm import load

        from .. import PrefixCache
        from ..serve.fit import model_id_of
        from ..tiers.ssd.tier import SsdTier

        if not os.path.isdir(os.path.expanduser(args.model)):
            raise ValueError(f"--model {args.model!r} is not a model directory")
        self.args = args
        self.model, self.tokenizer = load(os.path.expanduser(args.model))[:2]
        config = CacheConfig.from_env(
            ssd_dir=ssd_dir(args),
            block_size=args.block_size,
            kv_bits=args.kv_bits,
            kv_group_size=args.kv_group_size,
        ).replace(hot_cache_only=False, remote_url=None, warm_bytes=0, events_url=None)
        self.model_id = model_id_of((args.model, None, None), self.model)
        ssd = SsdTier(config, record_limits=False)  # the server's limits stay recorded
        limits = ssd.records.limits() or {}
        ssd.max_bytes = limits.get("max_bytes", ssd.max_bytes)  # pins count against its cap
        try:
            self.pc = PrefixCache(self.model, config, model_id=self.model_id, tiers=[ssd])
        except BaseException:
            ssd.close()
            raise

    def tokenize(self, text: str, source: str) -> list[int]:
        """Token ids of the prompt as serve makes them (``--system``: the system segment)."""
        if not self.args.system:
            return list(self.tokenizer.encode(text))
        return system_segment(self.tokenizer, text, source)

    def keys(self, tokens: Sequence[int]) -> list[bytes]:
        """Keys of ``tokens``' blocks under the model's base namespace: its full
        blocks', then its tail's (fewer tokens than a block) if it has one."""
        from ..hashing import chain_keys, token_bytes
        from ..tiers.controls import tail_keys

        root, data, size = (
            self.pc.namespace.root_key(),
            token_bytes(tokens),
            self.pc.config.block_size,
        )
        keys = chain_keys(root, data, size)
        return [*keys, *tail_keys(root, keys, data, size)]

    def doc(self, tokens: Sequence[int], num_pinned: int) -> Doc:
        keys = self.keys(tokens)
        return {
            "ssd_dir": self.pc.config.ssd_path,
            "model": self.model_id,
            "num_tokens": len(tokens),
            "num_pinned_tokens": num_pinned,
            "keys": [k.hex() for k in keys],
            "pinned_bytes": self.pc.stats()["ssd"].get("pinned_bytes", 0),
        }

    def until(self, tokens: Sequence[int]) -> float | None:
        """When the pin of ``tokens``' first block ends (None: never)."""
        keys = self.keys(tokens)
        end = self.pc.tiers.pins.until(keys[0]) if keys else None
        return None if end is None or math.isinf(end) else end

    def __enter__(self) -> PinSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.pc.close()


def system_segment(tokenizer: Any, text: str, source: str) -> list[int]:
    """The tokens mlx-lm's server cuts as the first segment of a chat request whose
    system prompt is ``text`` (its ``_tokenize``: where the system-only rendering
    and the request's prompt part ways)."""
    if not tokenizer.has_chat_template:
        raise ValueError(f"--system: the model's tokenizer has no chat template ({source})")
    system = [{"role": "system", "content": text}]
    alone = tokenizer.apply_chat_template(
        [*system, {"role": "user", "content": ""}], add_generation_prompt=False, tokenize=True
    )
    request = tokenizer.apply_chat_template(
        [*system, {"role": "user", "content": "?"}], add_generation_prompt=True, tokenize=True
    )
    end = next((i for i, (a, b) in enumerate(zip(alone, request, strict=False)) if a != b), 0)
    if end == 0:
        raise ValueError(f"--system: the chat template keeps no system segment ({source})")
    return list(request[:end])


def _pin_text(doc: Doc) -> str:
    until = "never" if doc["until"] is None else f"at Unix time {doc['until']:.0f}"
    return (
        f"pinned {doc['num_pinned_tokens']} of {doc['num_tokens']} tokens "
        f"({len(doc['keys'])} blocks; {doc['num_computed_tokens']} tokens computed now) "
        f"of {doc['model']} in {doc['ssd_dir']}; the pin ends {until}\n"
        f"pinned in the directory: {format_bytes(doc['pinned_bytes'])}"
    )


def _unpin_text(doc: Doc) -> str:
    if not doc["num_unpinned_blocks"]:
        return f"nothing of these {doc['num_tokens']} tokens was pinned ({doc['model']})"
    return f"unpinned {doc['num_unpinned_blocks']} blocks of {doc['model']} in {doc['ssd_dir']}"


_PIN_HELP = "keep a prompt's blocks in the cache (hot and SSD) until unpinned"
_UNPIN_HELP = "end a prompt's pin (its blocks stay, evictable again)"
COMMANDS = (
    Command("pin", _PIN_HELP, add_pin_args, run_pin),
    Command("unpin", _UNPIN_HELP, add_prompt_args, run_unpin),
)
