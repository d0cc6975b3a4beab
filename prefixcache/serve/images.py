"""Images in the server's prompts: chain tokens for their patches, and where a restore may end.

mlx-lm's server hands the prompt cache a key in which every patch token of an
image is ``-1 - int(sha256(data URL)[:15], 16)``: a digest of the image's
bytes (an http(s) image is inlined as a data URL first), the same for all of
its patch tokens. The chain hashes uint32 token ids, so ``chain_tokens``
turns patch ``j`` of an image into ``2**31 + 31 bits of splitmix64(image id,
j)``: never a vocabulary id (those stay below 2**31), equal only for the same
image at the same place in its run, and an image of n patches spreads its
60-bit id over n tokens. A prompt that differs in one image thus leaves the
chain at that image's first patch.

A restore must not end inside an image: mlx-lm re-embeds only the images that
start after the cached tokens, so the rest of a cut image would be prefilled
as plain ``<|patch|>`` tokens. ``image_start`` says where to end instead, and
``fetch_whole_images`` ends a fetch there.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ..cache.prefix_cache import PrefixCache

IMAGE_BASE = 1 << 31  # chain tokens of image patches are at or above it
_LOW_31 = np.uint64((1 << 31) - 1)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX_1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX_2 = np.uint64(0x94D049BB133111EB)


def chain_tokens(key: Sequence[int]) -> Sequence[int]:
    """``key`` with each image patch (a negative id) as a uint32 chain token."""
    if not key or min(key) >= 0:  # no image: one C-level pass
        return key
    ids = np.asarray(key, dtype=np.int64)
    if int(ids.max()) >= IMAGE_BASE:
        raise ValueError(f"token id {int(ids.max())} >= 2**31 in a prompt with images")
    patch = ids < 0
    index = np.arange(len(ids))
    new_run = patch & np.concatenate([[True], ids[1:] != ids[:-1]])
    start = np.maximum.accumulate(np.where(new_run, index, 0))
    with np.errstate(over="ignore"):  # the mix wraps around 2**64 on purpose
        z = (-ids).astype(np.uint64) + (index - start + 1).astype(np.uint64) * _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * _MIX_1
        z = (z ^ (z >> np.uint64(27))) * _MIX_2
        z = z ^ (z >> np.uint64(31))
    mapped = np.uint64(IMAGE_BASE) + (z & _LOW_31)
    return np.where(patch, mapped, ids.astype(np.uint64)).tolist()


def image_start(key: Sequence[int], num_cached: int) -> int:
    """``num_cached``, or the first patch of the image it falls inside (mlx-lm's key)."""
    if not 0 < num_cached < len(key):
        return num_cached
    image = key[num_cached]
    if image >= 0 or key[num_cached - 1] != image:
        return num_cached
    start = num_cached - 1
    while start > 0 and key[start - 1] == image:
        start -= 1
    return start


def fetch_whole_images(
    cache: PrefixCache,
    key: Sequence[int],
    extra: Mapping[str, str] | None,
    shared: bool,
    headroom: int | None = None,
) -> tuple[list[Any] | None, int]:
    """``cache.fetch`` of mlx-lm's ``key`` (as ``chain_tokens``; ``headroom``: the
    fetch's), ending before any image it would cut: where ``match`` (which restores
    nothing) ends inside one, the fetch ends at its first patch."""
    text = chain_tokens(key)
    end = len(text)
    if text is not key:  # images: where the fetch may end (match restores nothing)
        while (cut := image_start(key, num := cache.match(text[:end], extra=extra))) < num:
            end = cut + 1  # fetch leaves the last token to prefill
    restored, num_cached = cache.fetch(text[:end], extra=extra, shared=shared, headroom=headroom)
    while (cut := image_start(key, num_cached)) < num_cached:  # blocks gone meanwhile
        fetched = cache.fetch(text[: cut + 1], extra=extra, shared=shared, headroom=headroom)
        restored, num_cached = fetched
    return restored, num_cached
