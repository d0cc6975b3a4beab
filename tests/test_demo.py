"""The README's demo runs end to end: hits after the first chat, same first tokens, SSD restart."""

from prefixcache.cli.demo import run_demo


def test_demo_hits_and_matches_cold_runs(tmp_path):
    lines: list[str] = []
    rows = run_demo(
        ssd_dir=str(tmp_path / "ssd"),
        num_conversations=2,
        num_turns=2,
        system_words=80,
        turn_words=20,
        reply_tokens=4,
        print_fn=lines.append,
    )
    assert len(rows) == 5 and all(r["same"] for r in rows)
    assert rows[0]["cached"] == 0
    assert all(r["cached"] >= 64 for r in rows[1:])  # the shared system prompt at least
    assert rows[-1]["cached"] > rows[0]["prompt"] // 64 * 64  # restart: history from SSD
    assert "served from it" in lines[-1] and not lines[-1].endswith("served from it: 0 blocks")
