"""Device profiles: what a cache hit saves in time to first token, estimated.

A hit saves prefilling its tokens (``prefill_flops_saved`` at the device's
effective prefill FLOP/s) and costs loading their bytes from the tier that
held them (a hot hit is one copy in memory: its bytes at half the memory
bandwidth, read and written; an SSD hit reads them at the SSD's bandwidth; a
remote hit at the link's). Bytes per token come from the model shape (K/V
of a full block; a hybrid's recurrent checkpoints are not counted).

Profiles: ``this`` (measured here, in a few seconds: a float32 matmul, an
array copy, a file read back after its pages were dropped), or an Apple
M-series preset from published figures (``PRESETS``; sources in
docs/capacity.md).
"""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import asdict, dataclass

from .shapes import ModelShape

LLAMA_7B_FLOPS_PER_TOKEN = 2 * 6.74e9  # the model of llama.cpp's Apple-silicon table
LINK_10G = 1.25e9  # bytes/s of a 10 Gb/s link (the remote tier of every profile)


@dataclass(frozen=True, slots=True)
class DeviceProfile:
    """Speeds of one machine.

    Attributes:
        name: preset name, or ``this``.
        prefill_flops_per_s: effective FLOP/s of a prefill.
        memory_bytes_per_s: memory bandwidth (a copy moves its bytes twice).
        ssd_bytes_per_s: sequential read bandwidth of the SSD.
        remote_bytes_per_s: the remote tier's link.
    """

    name: str
    prefill_flops_per_s: float
    memory_bytes_per_s: float
    ssd_bytes_per_s: float
    remote_bytes_per_s: float = LINK_10G

    def load_seconds(self, tier: str, nbytes: float) -> float:
        """Seconds to restore ``nbytes`` held by ``tier``."""
        rate = {
            "hot": self.memory_bytes_per_s / 2,
            "ssd": self.ssd_bytes_per_s,
            "remote": self.remote_bytes_per_s,
        }[tier]
        return nbytes / rate


def _apple(name: str, pp512_f16: float, memory_gbs: float) -> DeviceProfile:
    """A preset from llama.cpp's prompt rate (LLaMA-7B F16, 512 tokens) and Apple's
    memory bandwidth; SSD at the 7.4 GB/s Apple gives for its 2021 MacBook Pro."""
    return DeviceProfile(name, pp512_f16 * LLAMA_7B_FLOPS_PER_TOKEN, memory_gbs * 1e9, 7.4e9)


PRESETS: dict[str, DeviceProfile] = {
    "m1-max": _apple("m1-max", 599.53, 400),
    "m2-ultra": _apple("m2-ultra", 1401.85, 800),
    "m3-max": _apple("m3-max", 779.17, 400),
    "m4-max": _apple("m4-max", 922.83, 546),
}


def profile_named(name: str) -> DeviceProfile:
    """A preset, or ``this`` (measured now).

    Raises:
        ValueError: no such preset.
    """
    if name == "this":
        return measure_this()
    if name not in PRESETS:
        raise ValueError(f"unknown device {name!r} (this, {', '.join(PRESETS)})")
    return PRESETS[name]


def measure_this(directory: str | None = None, nbytes: int = 128 << 20) -> DeviceProfile:
    """This machine's profile: a float32 matmul's FLOP/s, an array copy's bytes/s
    (x2: read and written), ``nbytes`` read back from a file in ``directory``
    (the temp dir by default) after its pages were dropped."""
    import mlx.core as mx

    n = 512  # MLX's CPU matmul runs at under a GFLOP/s on some machines: keep it short
    a = mx.random.normal((n, n))
    mx.eval(a @ a)  # warm up
    start = time.perf_counter()
    for _ in range(2):
        mx.eval(a @ a)
    flops = 2 * 2 * n**3 / (time.perf_counter() - start)
    big = mx.zeros((nbytes // 4,))
    mx.eval(big)
    start = time.perf_counter()
    mx.eval(mx.array(big * 1))  # one read, one write
    memory = 2 * nbytes / (time.perf_counter() - start)
    return DeviceProfile("this", flops, memory, _read_rate(directory, nbytes))


def _read_rate(directory: str | None, nbytes: int) -> float:
    """Bytes/s of reading a ``nbytes`` file whose pages were dropped after writing."""
    with tempfile.NamedTemporaryFile(dir=directory) as f:
        chunk = os.urandom(1 << 20)
        for _ in range(nbytes >> 20):
            f.write(chunk)
        f.flush()
        os.fdatasync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        start = time.perf_counter()
        with open(f.name, "rb", buffering=0) as r:
            while r.read(8 << 20):
                pass
        return nbytes / (time.perf_counter() - start)


def ttft_saved(doc: dict, shape: ModelShape, block_tokens: int, device: DeviceProfile) -> dict:
    """``ttft_saved_seconds`` (over the trace) and ``..._per_request`` for a simulate
    document (``None`` for the offline optimum, which counts no FLOPs)."""
    flops = doc.get("prefill_flops_saved")
    out: dict[str, object] = {"device": device.name, "device_profile": asdict(device)}
    if flops is None or doc.get("cached_tokens") is None:
        return out | {"ttft_saved_seconds": None}
    per_token = shape.block_bytes(block_tokens) / block_tokens
    cached = doc["cached_tokens"]
    load = sum(
        device.load_seconds(tier, share * cached * per_token)
        for tier, share in doc["hit_share"].items()
    )
    saved = flops / device.prefill_flops_per_s - load
    return out | {
        "ttft_saved_seconds": saved,
        "ttft_saved_per_request": saved / max(1, doc["requests"]),
    }
