"""Muse Spark on a CPU: its fused kernels written with plain MLX ops.

mlx-lm 0.32.2 serves images with one model, ``muse_spark`` (the only entry of
``mlx_lm.processors.PROCESSORS``), and that model calls seven fused Metal
kernels (``mlx_lm.kernels``) that raise "No Metal back-end" elsewhere.
``install()`` puts the functions below in their place in
``mlx_lm.models.muse_spark``: the same inputs, outputs, dtypes and roundings
the kernels' sources state, computed with MLX ops, so the real model, its
processor and mlx-lm's server run on a Linux CPU. Only the tests and tools
call it (both servers of a comparison run with it, in their own processes).

    python -m prefixcache.tiny.muse_cpu plain ARGS...   # mlx_lm.server ARGS
    python -m prefixcache.tiny.muse_cpu ours ARGS...    # prefixcache serve ARGS
"""

from __future__ import annotations

import math
import runpy
import sys
from typing import Any

import mlx.core as mx
import mlx.nn as nn

_F32 = mx.float32


def _rstd(v: mx.array, eps: float) -> mx.array:
    """1 / sqrt(mean(v**2) + eps) over the last axis, in fp32."""
    return mx.rsqrt(mx.mean(v * v, axis=-1, keepdims=True) + eps)


def _heads(qkvg: mx.array, n_heads: int, n_kv_heads: int, head_dim: int) -> mx.array:
    """The q and k heads of each qkvg row: (..., n_heads + n_kv_heads, head_dim), fp32."""
    rows = qkvg[..., : (n_heads + n_kv_heads) * head_dim].astype(_F32)
    return rows.reshape(*qkvg.shape[:-1], n_heads + n_kv_heads, head_dim)


def qk_norm(
    qkvg: mx.array,
    *,
    n_heads: int,
    n_kv_heads: int,
    head_dim: int,
    eps: float,
    query_scale: float,
) -> list[mx.array]:
    """Per head RMS norm of q and k (rounded to the input dtype), q then scaled."""
    dtype = qkvg.dtype
    v = _heads(qkvg, n_heads, n_kv_heads, head_dim)
    y = (v * _rstd(v, eps)).astype(dtype)
    q = (y[..., :n_heads, :].astype(_F32) * query_scale).astype(dtype)
    return [q, y[..., n_heads:, :]]


def qk_norm_rope(
    qkvg: mx.array,
    *,
    n_heads: int,
    n_kv_heads: int,
    head_dim: int,
    eps: float,
    query_scale: float,
    rope_base: float,
    offset: int | mx.array,
) -> list[mx.array]:
    """``qk_norm``, then the pairs (2i, 2i + 1) rotated at positions offset + t."""
    q, k = qk_norm(
        qkvg,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        head_dim=head_dim,
        eps=eps,
        query_scale=query_scale,
    )
    seq_len = qkvg.shape[-2]
    start = offset.reshape(-1, 1) if isinstance(offset, mx.array) else mx.array([[offset]])
    pos = (start.astype(_F32) + mx.arange(seq_len, dtype=_F32))[..., None, None]  # (B, L, 1, 1)
    half = mx.arange(head_dim // 2, dtype=_F32)
    inv_freq = mx.exp(-(half / (head_dim // 2)) * math.log(rope_base))
    theta = pos * inv_freq  # (B, L, 1, head_dim // 2)
    cos, sin = mx.cos(theta), mx.sin(theta)
    out = []
    for x in (q, k):
        pairs = x.astype(_F32).reshape(*x.shape[:-1], head_dim // 2, 2)
        even, odd = pairs[..., 0], pairs[..., 1]
        rotated = mx.stack([even * cos - odd * sin, odd * cos + even * sin], axis=-1)
        out.append(rotated.reshape(x.shape).astype(x.dtype))
    return out


def rms_norm_sigmoid_gate(x: mx.array, gate: mx.array, *, eps: float) -> mx.array:
    """rms_norm(x) * sigmoid(gate) per head: x (B, H, L, D), gate (B, L, H * D)."""
    B, H, L, D = x.shape
    v = x.astype(_F32)
    normed = (v * _rstd(v, eps)).transpose(0, 2, 1, 3).reshape(B, L, H * D)
    return (normed * mx.sigmoid(gate.astype(_F32))).astype(x.dtype)


def norm_add_norm(
    branch: mx.array,
    stream: mx.array,
    *,
    alpha: mx.array,
    beta: mx.array,
    post_weight: mx.array | None,
    post_eps: float,
    next_norm: nn.RMSNorm | None,
) -> tuple[mx.array, mx.array | None]:
    """Post-norm the branch, add it to the fp32 stream with the gate weights, and
    pre-norm the sum with ``next_norm`` (None without it)."""
    dtype = branch.dtype
    v = branch.astype(_F32)
    if post_weight is not None:  # the weight scales the input, rounded to the dtype
        v = (post_weight.astype(dtype).astype(_F32) * v).astype(dtype).astype(_F32)
    n = (v * _rstd(v, post_eps)).astype(dtype).astype(_F32)
    new_stream = alpha.astype(_F32) * stream.astype(_F32) + beta.astype(_F32) * n
    if next_norm is None:
        return new_stream, None
    return new_stream, pre_norm(new_stream, next_norm, dtype=dtype)


def pre_norm(stream: mx.array, norm: nn.RMSNorm, *, dtype: mx.Dtype) -> mx.array:
    """RMS norm of the fp32 stream with ``norm``'s weight, rounded to ``dtype``."""
    v = stream.astype(_F32)
    return (v * _rstd(v, norm.eps) * norm.weight.astype(_F32)).astype(dtype)


def post_expert_norm_combine(
    experts: mx.array, weights: mx.array, *, norm_weight: mx.array, eps: float
) -> mx.array:
    """Norm each expert output (``norm_weight`` scales its input) and add the experts
    with their weights in order, rounding the sum after each: (..., K, D) -> (..., D)."""
    dtype = experts.dtype
    v = experts.astype(_F32) * norm_weight.astype(_F32)
    scaled = v * _rstd(v, eps) * weights.astype(dtype).astype(_F32)[..., None]
    acc = mx.zeros(experts.shape[:-2] + experts.shape[-1:], dtype=_F32)
    for k in range(experts.shape[-2]):
        acc = (acc + scaled[..., k, :]).astype(dtype).astype(_F32)
    return acc.astype(dtype)


def expert_routing(
    logits: mx.array,
    expert_bias: mx.array,
    *,
    top_k: int,
    multiplier: float,
    score_eps: float,
    route_scale: float,
) -> list[mx.array]:
    """The top-k experts by sigmoid score plus bias, and their scores normalized."""
    score = mx.sigmoid(logits.astype(_F32) * multiplier)
    inds = mx.argsort(-(score + expert_bias.astype(_F32)), axis=-1)[..., :top_k]
    w = mx.take_along_axis(score, inds, axis=-1)
    weights = w / (mx.sum(w, axis=-1, keepdims=True) + score_eps) * route_scale
    return [inds.astype(mx.uint32), weights]


KERNELS = {
    "expert_routing": expert_routing,
    "norm_add_norm": norm_add_norm,
    "post_expert_norm_combine": post_expert_norm_combine,
    "pre_norm": pre_norm,
    "qk_norm": qk_norm,
    "qk_norm_rope": qk_norm_rope,
    "rms_norm_sigmoid_gate": rms_norm_sigmoid_gate,
}


def install() -> None:
    """Point ``mlx_lm.models.muse_spark``'s kernel names at the functions above."""
    from mlx_lm.models import muse_spark

    for name, fn in KERNELS.items():
        if not hasattr(muse_spark, name):
            raise RuntimeError(f"mlx_lm.models.muse_spark has no {name}: another mlx-lm?")
        setattr(muse_spark, name, fn)


def main(argv: list[str]) -> Any:
    """``plain ARGS``: ``mlx_lm.server ARGS``; ``ours ARGS``: ``prefixcache serve ARGS``;
    both with ``install()`` done first."""
    if not argv or argv[0] not in ("plain", "ours"):
        raise SystemExit("usage: python -m prefixcache.tiny.muse_cpu plain|ours ARGS...")
    install()
    if argv[0] == "plain":
        sys.argv = ["mlx_lm.server", *argv[1:]]
        return runpy.run_module("mlx_lm.server", run_name="__main__")
    sys.argv = ["prefixcache", "serve", *argv[1:]]
    return runpy.run_module("prefixcache", run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
