"""Restore points (cache/points.py): every interval-th block boundary, and with
``early`` the boundaries after 1, 2, 4 ... blocks below the interval."""

from __future__ import annotations

import pytest

from prefixcache.cache.points import RestorePoints


def test_points_are_the_interval_and_the_early_powers_of_two():
    early = RestorePoints(9, early=True)
    assert [b for b in range(1, 40) if early.at(b)] == [1, 2, 4, 8, 9, 18, 27, 36]
    plain = RestorePoints(9)  # control: an interval set by hand keeps no early point
    assert [b for b in range(1, 40) if plain.at(b)] == [9, 18, 27, 36]
    assert not early.at(0)


def test_next_is_the_first_point_at_or_after():
    early = RestorePoints(9, early=True)
    assert [early.next(b) for b in range(1, 11)] == [1, 2, 4, 4, 8, 8, 8, 8, 9, 18]
    assert [RestorePoints(9).next(b) for b in (1, 9, 10)] == [9, 9, 18]


def test_between_lists_token_positions_strictly_inside():
    early = RestorePoints(9, early=True)
    assert early.between(0, 300, 16) == [16, 32, 64, 128, 144, 288]
    assert early.between(70, 300, 16) == [128, 144, 288]
    assert early.between(0, 64, 16) == [16, 32]  # 64 is the end, not inside
    assert early.between(100, 100, 16) == []
    # without early points: the interval's multiples past the start, as a range would
    plain = RestorePoints(4)
    for start in (0, 63, 64, 100):
        assert plain.between(start, 190, 16) == list(range((start // 64 + 1) * 64, 190, 64))


def test_an_interval_below_one_is_refused():
    with pytest.raises(ValueError, match="interval must be >= 1, got 0"):
        RestorePoints(0)
