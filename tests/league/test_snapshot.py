"""The snapshot rule at its three boundaries (N = 10)."""

from __future__ import annotations

import pytest

from diprl.league.snapshot import should_snapshot


def test_never_before_n_always_at_2n_in_between_on_win_rate() -> None:
    assert not should_snapshot(9, 1.0, 10)  # too early even when winning everything
    assert should_snapshot(20, 0.0, 10)  # 2N: always, even when losing
    assert not should_snapshot(10, 0.7, 10)  # between: needs strictly more than 0.7
    assert should_snapshot(10, 0.71, 10)
    assert not should_snapshot(19, 0.5, 10)


def test_bad_input() -> None:
    with pytest.raises(ValueError):
        should_snapshot(5, 0.5, 0)
    with pytest.raises(ValueError):
        should_snapshot(-1, 0.5, 10)
    with pytest.raises(ValueError):
        should_snapshot(5, 1.5, 10)
