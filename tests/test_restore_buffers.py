"""restore_buffers.empty: restore buffers MLX allocates without writing; a restore's
headroom left so changes no logit."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import time

import mlx.core as mx
import numpy as np
import pytest
from conftest import live_logits, max_diff, prefill, prompt, tiny_model
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache

from prefixcache import CacheConfig, PrefixCache
from prefixcache.memory import restore_buffers

MiB = 1 << 20


def rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32, mx.uint32, mx.int8])
def test_empty_has_the_shape_and_dtype_and_takes_writes(dtype):
    a = restore_buffers.empty((1, 3, 5, 7), dtype)
    mx.eval(a)
    assert a.shape == (1, 3, 5, 7) and a.dtype == dtype
    view = np.asarray(memoryview(a).cast("B"))
    view[...] = 1
    assert np.all(np.asarray(memoryview(a).cast("B")) == 1)


def test_empty_of_nothing_or_an_unknown_dtype_is_zeros():
    assert restore_buffers.empty((1, 0, 4), mx.float16).shape == (1, 0, 4)
    c = restore_buffers.empty((2, 2), mx.complex64)
    assert c.dtype == mx.complex64 and not mx.any(c).item()


def _rss_growth(make) -> int:
    """How much RSS an evaluated ``make()`` adds, from an empty MLX buffer cache."""
    mx.clear_cache()
    before = rss()
    a = make()
    mx.eval(a)
    grown = rss() - before
    del a
    mx.clear_cache()
    return grown


def test_empty_leaves_fresh_pages_untouched():
    """The point of it: 256 MiB of fresh memory is not faulted in (mx.zeros, the
    control, faults in all of it)."""
    shape, size = (1, 8, 128 * 1024, 128), 256 * MiB
    grown_empty = _rss_growth(lambda: restore_buffers.empty(shape, mx.bfloat16))
    grown_zeros = _rss_growth(lambda: mx.zeros(shape, mx.bfloat16))
    assert grown_empty < 16 * MiB, grown_empty
    assert grown_zeros > 0.9 * size, grown_zeros


def test_empty_keeps_a_reused_buffers_bytes(keep_freed_buffers):
    """A buffer MLX hands back from its cache is not rewritten: the old bytes show.
    (A restore buffer is ``ALIGN`` bytes longer than its shape: the old one was too.)"""
    shape = (1, 4, 1024, 64)
    old = mx.full((4 * 1024 * 64 + restore_buffers.ALIGN,), 7, mx.int8)
    mx.eval(old)
    del old
    a = restore_buffers.empty(shape, mx.int8)
    mx.eval(a)
    assert np.all(np.asarray(a) == 7)


WIDE = {"num_attention_heads": 8, "num_key_value_heads": 8, "head_dim": 128}
NAN_BITS = 0x7FC00000  # a float32 NaN


def _dirty_buffers(shape: tuple[int, ...], count: int) -> None:
    """Leave ``count`` freed buffers of ``shape`` (float32) full of NaN in MLX's cache
    (``ALIGN`` bytes longer, as a restore buffer of that shape)."""
    size = int(np.prod(shape)) + restore_buffers.ALIGN // 4
    junk = [mx.full((size,), NAN_BITS, mx.uint32) for _ in range(count)]
    mx.eval(junk)
    del junk


def _greedy(model, cache, tokens: list[int], kv) -> tuple[list[int], mx.array]:
    quant = {} if kv is None else dict(kv_bits=kv[0], kv_group_size=kv[1], quantized_kv_start=kv[2])
    steps = generate_step(
        mx.array(tokens), model, prompt_cache=cache, prefill_step_size=32, max_tokens=6, **quant
    )
    out = list(steps)
    return [int(t) for t, _ in out], mx.stack([lp for _, lp in out])


@pytest.mark.parametrize(
    "arch, kv",
    [("llama", None), ("llama", (8, 32, 180)), ("gemma3_text", None)],
    ids=["plain", "quantized-later", "sliding-window"],
)
def test_unwritten_headroom_over_nan_memory_changes_no_logit(keep_freed_buffers, arch, kv):
    """The headroom is left unwritten: restore buffers (1.9 MiB each: unwritten, not
    zeros) take freed memory full of NaN, and their headroom shows it. Continuing
    the prompt (past ``quantized_kv_start``, where mlx-lm quantizes the whole
    buffer; a sliding window's buffer too) and generating from restored caches
    give the live run's logits bit for bit. The control: a cache that reads one
    headroom row (its offset one too far) gives other logits, so a read of the
    headroom would be seen."""
    window = {"sliding_window": 512} if arch == "gemma3_text" else {}  # >= the buffer
    model = tiny_model(arch, num_hidden_layers=2, **WIDE, **window)
    shared = prompt(1, 160)
    a, b = shared + prompt(2, 30), shared + prompt(3, 40)
    with PrefixCache(model, CacheConfig(block_size=32, hot_cache_only=True), model_id="t") as pc:
        stored = make_prompt_cache(model)
        prefill(model, a, stored, step=32)
        pc.store(a, stored)
        del stored
        _dirty_buffers((1, 8, 456, 128), 12)  # 200 tokens + 256 of headroom
        (cache, num), (gen, _), (peek, _) = pc.fetch(b), pc.fetch(b), pc.fetch(b)
    assert num == 160
    for c in (cache, gen, peek):
        assert c[0].keys.shape[2] == 456
        assert np.isnan(np.array(c[0].keys[..., 160:, :])).any()  # dirty: the test tests
    live = live_logits(model, b, num, step=32, kv=kv)
    assert max_diff(prefill(model, b[num:], cache, step=32, kv=kv), live) == 0.0
    live_cache = make_prompt_cache(model)
    prefill(model, b[:num], live_cache, step=32)
    got, want = _greedy(model, gen, b[num:], kv), _greedy(model, live_cache, b[num:], kv)
    assert got[0] == want[0] and max_diff(got[1], want[1]) == 0.0
    for c in peek:  # the control: one headroom row read as a token
        c.offset += 1
    diff = max_diff(prefill(model, b[num + 1 :], peek, step=32, kv=kv), live)
    assert diff != 0.0, diff


_EXIT_CHILD = """
import mlx.core as mx
from prefixcache.memory import restore_buffers
buffers = [restore_buffers.empty((1, 8, 4352, 128), mx.float32) for _ in range(48)]
mx.eval(buffers)
del buffers
"""


def test_processes_that_made_restore_buffers_exit_cleanly():
    """16 processes at once each make 48 restore buffers (``mx.load`` of an
    unwritten Python stream) and exit at once: every one exits 0. Without the wait
    at exit (``EXIT_WAIT_MAX = 0``), 16 of 48 such processes aborted (status 134), so
    16 clean exits by chance would be about 1%."""
    runs = [
        subprocess.Popen([sys.executable, "-c", _EXIT_CHILD], stderr=subprocess.PIPE)
        for _ in range(16)
    ]
    codes = [(p.wait(timeout=120), p.stderr.read().decode()[-200:]) for p in runs]
    assert all(code == 0 for code, _ in codes), codes


def test_the_exit_waits_for_the_streams_mlx_has_not_freed(monkeypatch):
    """The exit waits while a stream is alive (up to ``EXIT_WAIT_MAX``) and not
    at all once MLX has freed every one."""
    monkeypatch.setattr(restore_buffers, "EXIT_WAIT_MAX", 10.0)  # a slow IO thread has time
    with restore_buffers.batched() as batch:
        slots = [batch.add((1, 2, 64, 16), mx.float32) for _ in range(3)]
    mx.eval([restore_buffers.resolve(s) for s in slots])
    start = time.monotonic()
    restore_buffers._wait_for_readers()  # the IO thread frees the batch's stream
    assert restore_buffers.pending_readers() == 0
    assert time.monotonic() - start < 10.0
    monkeypatch.setattr(restore_buffers, "EXIT_WAIT_MAX", 0.2)
    held = restore_buffers._Unwritten([((2,), mx.float32)])  # one not freed
    assert restore_buffers.pending_readers() == 1
    start = time.monotonic()
    restore_buffers._wait_for_readers()
    assert time.monotonic() - start >= 0.2
    del held
    assert restore_buffers.pending_readers() == 0


def _thp_mode() -> str | None:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[")[1].split("]")[0]
    except OSError:
        return None


_HUGE_CHILD = """
import mlx.core as mx, numpy as np, sys
sys.path.insert(0, {tools!r})
from benchlib import huge_bytes_in
from prefixcache.codecs.buffer import TokenBuffer
from prefixcache.memory.host import HostArray
rows = np.zeros((1, 16, 256, 128), np.uint16)
buf = TokenBuffer(8448)
buf.add(0, HostArray(rows.reshape(-1).view(np.uint8), mx.bfloat16, rows.shape))
host = np.asarray(memoryview(buf.finish()).cast("B"))
host[...] = 1  # as the readers' copies would
print(huge_bytes_in(host.ctypes.data, host.nbytes))
"""


@pytest.mark.skipif(_thp_mode() != "madvise", reason="needs Linux THP in madvise mode")
@pytest.mark.parametrize("advise", [True, False])
def test_restore_buffers_get_huge_pages_when_advised(advise):
    """A 34 MiB restore buffer opened by TokenBuffer lies on 2 MiB pages once
    written; with PREFIXCACHE_HUGE_PAGES=0 (the control) it does not. In a fresh
    process: memory another allocation advised before keeps its advice."""
    env = {**os.environ, "PREFIXCACHE_HUGE_PAGES": "1" if advise else "0"}
    tools = os.path.join(os.path.dirname(os.path.dirname(__file__)), "tools")
    code = _HUGE_CHILD.format(tools=tools)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    huge = int(out.stdout.strip())
    assert (huge >= 16 * MiB) if advise else huge == 0, huge


_EDGES_CHILD = """
import ctypes, mmap, resource
import mlx.core as mx
from prefixcache.memory import huge_pages, restore_buffers
from prefixcache.memory.host import host_view
HUGE, PAGE = 2 << 20, 4096
libc = ctypes.CDLL(None, use_errno=True)
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
shape = (1, 8, 4353, 64)  # a layer of a 4,096-token restore of Llama-3.2-1B (bf16, 4.25 MiB)

def restore_buffers_of(n):  # allocated together, as a restore's
    with restore_buffers.batched(mx.cpu) as batch:
        slots = [batch.add(shape, mx.bfloat16) for _ in range(n)]
    arrays = [slot.array for slot in slots]
    mx.eval(arrays)
    return arrays, [host_view(a) for a in arrays]

def inner(hosts):  # per buffer, whether both its end regions lie in one mapping with
    # another of the buffers: regions of their own, not shared with another mapping
    with open("/proc/self/maps") as f:
        maps = [[int(x, 16) for x in line.split()[0].split("-")] for line in f]
    spans = [(h.ctypes.data, h.ctypes.data + h.nbytes) for h in hosts]
    def shared(region, me):
        return any(lo <= region and region + HUGE <= hi for lo, hi in maps) and any(
            o != me and o[0] < region + HUGE and region < o[1] for o in spans)
    return [shared(d // HUGE * HUGE, (d, e)) and shared((e - 1) // HUGE * HUGE, (d, e))
            for d, e in spans]

def faults_writing(host):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    host[...] = 1
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

def edge_pages(host):  # the buffer's pages in its two end regions
    data, stop = host.ctypes.data, host.ctypes.data + host.nbytes
    return ((-(-data // HUGE) * HUGE - data) + stop % HUGE) // PAGE

ours, hosts = restore_buffers_of(6)
mine = inner(hosts)
for host in hosts:
    huge_pages.advise_huge(host)
print([(faults_writing(h), h.nbytes // HUGE + 1) for h, m in zip(hosts, mine) if m])
control, hosts = restore_buffers_of(6)
mine = inner(hosts)
for host in hosts:  # the regions inside advised alone
    data = host.ctypes.data
    start, end = -(-data // HUGE) * HUGE, (data + host.nbytes) // HUGE * HUGE
    libc.madvise(start, end - start, mmap.MADV_HUGEPAGE)
print([(faults_writing(h), edge_pages(h)) for h, m in zip(hosts, mine) if m])
"""


@pytest.mark.skipif(_thp_mode() != "madvise", reason="needs Linux THP in madvise mode")
@pytest.mark.skipif(
    tuple(int(v) for v in os.uname().release.split("-")[0].split(".")[:2]) < (6, 1),
    reason="MADV_COLLAPSE needs Linux 6.1",
)
def test_a_restores_buffers_are_on_huge_pages_to_their_edges():
    """Restore buffers of 4.25 MiB made together (a restore's six) and advised by
    ``advise_huge`` are written with one fault per 2 MiB: their end regions,
    which they share with each other and where the allocator wrote its headers,
    are huge pages too. (Measured on the buffers whose both end regions lie in
    one mapping with another of them; a region shared with another mapping
    may stay on small pages.) The control: advising the regions inside alone
    leaves the end regions on 4 KiB pages, one fault each (a small page was
    mapped there, the header, before any advice). In a fresh process, whose big
    allocations are fresh memory."""
    env = {**os.environ, "PREFIXCACHE_HUGE_PAGES": "1"}
    out = subprocess.run(
        [sys.executable, "-c", _EDGES_CHILD], env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    ours, control = (ast.literal_eval(line) for line in out.stdout.split("\n")[:2])
    assert ours and control, out.stdout  # buffers side by side in one mapping, as a restore's
    assert all(faults <= regions + 2 for faults, regions in ours), ours
    assert all(faults >= edges - 2 for faults, edges in control), control
    assert sum(edges for _, edges in control) >= 512, control
