"""radixview (pip, Apache-2.0), a KV-events consumer we did not write, reads our events as
they are: its decoder and radix tree on our frames, and the real process, which finds our
publisher through ``/server_info``, against a real ``prefixcache serve`` under the demo's
chats: the tree it shows equals what ``prefixcache tree`` prints, in the hot tier while
serving and in the SSD tier after shutdown (tools/radixview_page.py)."""

from __future__ import annotations

import os
import sys

import pytest
import zmq
from conftest import prefill, prompt
from mlx_lm.models.cache import make_prompt_cache
from radixview.tree import CacheTree
from radixview.wire import decode_multipart, format_event
from test_events import subscriber  # noqa: F401  (a fixture)

from prefixcache import CacheConfig, PrefixCache
from prefixcache.background.kv_events import block_hash
from prefixcache.hashing import chain_keys, token_bytes
from prefixcache.serve.info import detokenize_ids, kv_events_block

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "tools"))
import radixview_page

BLOCK = 16


def frames(sub: zmq.Socket) -> list[list[bytes]]:
    out = []
    while sub.poll(500):
        out.append(sub.recv_multipart())
    return out


def radix_tree(messages: list[list[bytes]], mangle=None) -> CacheTree:
    """radixview's tree from our messages, applied as its subscriber applies them."""
    tree = CacheTree()
    for message in messages:
        for event in decode_multipart(message).events:
            event = mangle(event) if mangle else event
            assert format_event(event)  # its log line
            if event["type"] == "BlockStored":
                tree.apply_stored(event)
            elif event["type"] == "BlockRemoved":
                tree.remove(event["block_hashes"])
            elif event["type"] == "AllBlocksCleared":
                tree.clear()
    return tree


def test_radixview_decoder_and_tree_on_our_frames(llama, tmp_path, subscriber):  # noqa: F811
    """Two chats on a shared 2-block prefix, then the first chat's last block evicted
    from hot to the SSD tier: radixview draws one prefix node and two branches, and
    each block's medium as it now stands (GPU: hot, STORAGE: SSD)."""
    port, sub = subscriber
    shared = prompt(1, 2 * BLOCK)
    chats = [shared + prompt(2, 2 * BLOCK), shared + prompt(3, 2 * BLOCK)]
    cfg = CacheConfig(block_size=BLOCK, ssd_dir=str(tmp_path / "ssd"), events_url=f"tcp://*:{port}")
    with PrefixCache(llama, cfg, model_id="m") as pc:
        assert pc.services.events.wait_for_subscriber(10)
        for tokens in chats:
            cache = make_prompt_cache(llama)
            prefill(llama, tokens, cache, step=BLOCK)
            pc.store(tokens, cache)
        keys = [chain_keys(pc.namespace.root_key(), token_bytes(t), BLOCK) for t in chats]
        with pc._lock:  # evict exactly the first chat's leaf: it spills to SSD
            pc.hot.evict_chain([keys[0][-1]], 0)
        pc.ssd.flush()  # its write done (the other blocks stay dirty in hot only)
        pc.services.events.flush()
        messages = frames(sub)  # before close writes the dirty blocks to SSD
    hashes = [[block_hash(k) for k in chain] for chain in keys]
    tree = radix_tree(messages)
    nodes = {n["id"]: n for n in tree.snapshot()["nodes"]}
    assert len(nodes) == 3 and not any(n["missing"] for n in nodes.values())
    prefix = f"{hashes[0][0]}..{hashes[0][1]}"
    assert nodes[prefix]["parent"] is None and nodes[prefix]["blocks"] == 2
    assert nodes[prefix]["tokens"] == 2 * BLOCK
    for chat in hashes:  # a branch each, collapsed into one node as radixview draws runs
        branch = f"{chat[2]}..{chat[3]}"
        assert nodes[branch]["parent"] == prefix and nodes[branch]["blocks"] == 2
    media = {n: [b["medium"] for b in tree.blocks_of(n)] for n in nodes}
    assert media == {
        prefix: ["GPU", "GPU"],
        f"{hashes[0][2]}..{hashes[0][3]}": ["GPU", "STORAGE"],  # its leaf spilled to SSD
        f"{hashes[1][2]}..{hashes[1][3]}": ["GPU", "GPU"],
    }

    # negative control: without parent links the same frames draw another tree
    def unlinked(event: dict) -> dict:
        return {**event, "parent_block_hash": None} if "parent_block_hash" in event else event

    unlinked_nodes = radix_tree(messages, unlinked).snapshot()["nodes"]
    assert len(unlinked_nodes) == 6 and {n["parent"] for n in unlinked_nodes} == {None}


@pytest.mark.parametrize("form", ["vllm", "sglang"])
def test_radixview_process_against_serve_under_the_demo_chats(tmp_path, form):
    """The real radixview process against a real ``prefixcache serve``: it discovers
    the publisher through /server_info and its tree, read from its JSON API, is the one
    ``prefixcache tree`` prints (tails, never published, aside), per tier; with the
    events in vLLM's form and in SGLang's (``--events-format``)."""
    report = radixview_page.run(tmp_path, turns=2, conversations=3, words=(120, 20), form=form)
    kv = report["server_info"]["kv_events"]
    assert kv["publisher"] == "zmq" and kv["endpoint_host"] == "*" and kv["block_size"] == 16
    assert report["serve_exit"] == 0 and report["requests"] == 6
    rows = radixview_page.summary(report)
    for tier in ("hot", "ssd"):
        row = rows[tier]
        assert row["same"], (tier, report[tier]["nodes"], report["ours"]["nodes"])
        assert row["placeholders"] == 0 and row["radixview_nodes"] == 4  # prefix, 3 chats
        assert row["radixview_blocks"] == row["tree_blocks"] > 0
    # the hot tier's blocks all reached the SSD tier at shutdown, each run intact
    assert report["hot"]["last"] == report["ssd"]["last"]
    # radixview read the text through /detokenize: the shared prefix is the system turn
    root = [n for n in report["hot"]["previews"] if n[1] is None]
    assert len(root) == 1 and root[0][0].startswith("<|im_start|>system")
    # negative control: the printed tree holds tails too; one node off is a difference
    assert report["ours"]["printed_blocks"] > rows["ssd"]["tree_blocks"]
    ours = set(report["ours"]["nodes"])
    assert report["hot"]["nodes"] != ours - {max(ours, key=lambda n: n[2])}


def test_server_info_block_and_detokenize_input():
    assert kv_events_block("tcp://*:5557", 64) == {
        "publisher": "zmq",
        "endpoint_host": "*",
        "endpoint_port_base": 5557,
        "topic": "",
        "block_size": 64,
        "dp_size": 1,
    }
    assert kv_events_block("tcp://10.0.0.2:6000", 16)["endpoint_host"] == "10.0.0.2"
    for url in (None, "ipc:///tmp/events", "inproc://events", "tcp://*:port", "tcp://*:70000"):
        assert kv_events_block(url, 16) is None
    assert detokenize_ids({"tokens": [1, 2, 3]}, 10) == [1, 2, 3]
    for body, named in (
        ({"tokens": [1, -2]}, "tokens[1] = -2"),
        ({"tokens": [1, 10]}, "tokens[1] = 10"),
        ({"tokens": [True]}, "tokens[0] = True"),
        ({"tokens": "12"}, "tokens must be a list"),
        ([], "tokens must be a list"),
    ):
        with pytest.raises(ValueError, match=named.replace("[", r"\[").replace("]", r"\]")):
            detokenize_ids(body, 10)
