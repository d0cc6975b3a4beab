"""What ``prefixcache serve`` tells tools about itself: ``GET /server_info`` and
``POST /detokenize``, in SGLang's forms.

Tools built for SGLang (its model gateway, radixview) find a server's KV-event
publisher in the ``kv_events`` block of ``/server_info``: ``publisher``,
``endpoint_host`` (a wildcard such as ``*`` is dialed at the server URL's
host), ``endpoint_port_base`` (rank r publishes on base + r), ``topic``,
``block_size`` (the tokens of a published block) and ``dp_size`` (one rank
here). Without ``--events-url``, or with an address a subscriber cannot
dial (``ipc://``, ``inproc://``), the block is absent, as SGLang leaves it.
``/detokenize`` turns the token ids of a published block back into text
with the served model's tokenizer (``{"tokens": [...]}`` -> ``{"text": ...}``).
``GET /v1/models`` lists the served model and the mlx models in the Hugging
Face cache, an empty list of the latter where there is no such cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..config import CacheConfig

MAX_DETOKENIZE = 1 << 16  # token ids in one /detokenize body at most
MLX_FILES = frozenset({"config.json", "model.safetensors.index.json", "tokenizer_config.json"})


def kv_events_block(url: str | None, block_size: int) -> dict[str, object] | None:
    """SGLang's ``kv_events`` descriptor of the publisher at ``url`` (None: no
    publisher a subscriber can dial)."""
    if url is None or not url.startswith("tcp://"):
        return None
    host, sep, port = url.removeprefix("tcp://").rpartition(":")
    if not sep or not port.isdigit() or not 1 <= int(port) <= 65535:
        return None
    return {
        "publisher": "zmq",
        "endpoint_host": host,
        "endpoint_port_base": int(port),
        "topic": "",
        "block_size": block_size,
        "dp_size": 1,
    }


def server_info(config: CacheConfig, model: str) -> dict[str, object]:
    """The body of ``GET /server_info``: the fields SGLang's consumers read."""
    info: dict[str, object] = {
        "model_path": model,
        "page_size": config.block_size,
        "dp_size": 1,
        "dcp_size": 1,
    }
    block = kv_events_block(config.events_url, config.block_size)
    if block is not None:
        info["kv_events"] = block
    return info


def detokenize_ids(body: Any, vocab_size: int) -> list[int]:
    """The token ids of a ``/detokenize`` body.

    Raises:
        ValueError: the body is not ``{"tokens": [ids...]}`` with ids in the vocabulary.
    """
    tokens = body.get("tokens") if isinstance(body, dict) else None
    if not isinstance(tokens, list) or len(tokens) > MAX_DETOKENIZE:
        raise ValueError(f"tokens must be a list of at most {MAX_DETOKENIZE} token ids")
    bad = _first_bad(tokens, vocab_size)
    if bad is not None:
        raise ValueError(f"tokens[{bad}] = {tokens[bad]!r} is not a token id below {vocab_size}")
    return tokens


def _first_bad(tokens: Sequence[object], vocab_size: int) -> int | None:
    for i, t in enumerate(tokens):
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
            return i
    return None


def models_listing(model: str | None, created: int, only: str | None = None) -> dict[str, object]:
    """The body of ``GET /v1/models[/REPO]``: the served model (a local path by its
    resolved path) and the Hugging Face cache's mlx models (``only``: that repo)."""
    ids = [r for r in cached_mlx_repos() if only is None or r == only]
    if model is not None and Path(model).exists():
        ids.append(str(Path(model).resolve()))
    data = [{"id": i, "object": "model", "created": created} for i in ids]
    return {"object": "list", "data": data}


def cached_mlx_repos() -> list[str]:
    """Repos in the Hugging Face cache whose main revision has an mlx model's files;
    none where the cache directory does not exist (or cannot be read)."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    try:
        info = scan_cache_dir()
    except (CacheNotFound, OSError):
        return []
    found = []
    for repo in info.repos:
        main = repo.refs.get("main") if repo.repo_type == "model" else None
        if main is not None and {f.file_path.name for f in main.files} >= MLX_FILES:
            found.append(repo.repo_id)
    return found
