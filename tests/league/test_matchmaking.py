"""Matchmaking shares over many draws, PFSP concentration, verification and seat modes."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from diprl.league.config import MainRoleConfig
from diprl.league.matchmaking import (
    ANCHORS,
    PFSP,
    SELF_PLAY,
    VERIFICATION,
    fill_seats,
    league_exploiter_pick,
    main_exploiter_pick,
    main_pick,
)

ANCHOR_REFS = ["bot:random", "bot:dumbbot", "base"]
WIN_RATES = {"bot:random": 0.9, "bot:dumbbot": 0.5, "base": 0.1, "main@v3": 0.6, "main_exploiter@v2": 0.2}


def draw(n: int, config: MainRoleConfig, seed: int = 0, **kw: object) -> list:  # type: ignore[type-arg]
    rng = np.random.default_rng(seed)
    args: dict = {  # type: ignore[type-arg]
        "hero": "main",
        "anchors": ANCHOR_REFS,
        "pool": [*ANCHOR_REFS, "main@v3", "main_exploiter@v2"],
        "exploiter_snapshots": ["main_exploiter@v2"],
        "own_snapshots": ["main@v3"],
        "win_rate": WIN_RATES.__getitem__,
    } | kw
    return [main_pick(rng, config, **args) for _ in range(n)]


def test_main_mix_shares_within_tolerance() -> None:
    n = 10_000
    kinds = Counter(p.kind for p in draw(n, MainRoleConfig()))
    # anchors first (10%), then 35/50/15 of the remaining 90%
    expected = {ANCHORS: 0.10, SELF_PLAY: 0.315, PFSP: 0.45, VERIFICATION: 0.135}
    for kind, share in expected.items():
        assert kinds[kind] / n == pytest.approx(share, abs=0.015), kind  # about 3 standard errors


def test_pfsp_concentrates_on_hard_opponents() -> None:
    picks = [p for p in draw(8_000, MainRoleConfig(self_play=0.0, pfsp=1.0, verification=0.0, anchors=0.0))]
    first = Counter(p.opponents[0] for p in picks)
    weights = {m: (1 - x) ** 2 for m, x in WIN_RATES.items()}  # 0.01, 0.25, 0.81, 0.16, 0.64
    total = sum(weights.values())
    for member, w in weights.items():
        assert first[member] / len(picks) == pytest.approx(w / total, abs=0.02), member
    assert all(len(set(p.opponents)) == 1 and len(p.opponents) == 6 for p in picks)  # seats="one"


def test_verification_prefers_exploiters_it_loses_to_then_forgotten_snapshots() -> None:
    verify = MainRoleConfig(self_play=0.0, pfsp=0.0, verification=1.0, anchors=0.0)
    assert {p.opponents[0] for p in draw(200, verify)} == {"main_exploiter@v2"}  # 0.2 < 0.3
    beaten = WIN_RATES | {"main_exploiter@v2": 0.9}
    assert {p.opponents[0] for p in draw(200, verify, win_rate=beaten.__getitem__)} == {"main@v3"}  # 0.6 < 0.7
    mastered = beaten | {"main@v3": 0.95}
    picks = draw(200, verify, win_rate=mastered.__getitem__)
    assert {p.kind for p in picks} == {PFSP}  # nobody to verify: PFSP over the pool


def test_anchor_share_draws_anchors_uniformly_and_empty_pool_is_self_play() -> None:
    picks = draw(9_000, MainRoleConfig(self_play=1.0, pfsp=0.0, verification=0.0, anchors=0.5))
    anchors = Counter(p.opponents[0] for p in picks if p.kind == ANCHORS)
    assert sum(anchors.values()) / 9_000 == pytest.approx(0.5, abs=0.02)
    assert all(c / sum(anchors.values()) == pytest.approx(1 / 3, abs=0.03) for c in anchors.values())
    lonely = draw(50, MainRoleConfig(self_play=0.0, pfsp=1.0, verification=0.0, anchors=0.0), anchors=[], pool=[])
    assert {p.kind for p in lonely} == {SELF_PLAY} and lonely[0].opponents == ("main",) * 6


def test_seat_modes_and_other_roles() -> None:
    rng = np.random.default_rng(1)
    probs = np.full(3, 1 / 3)
    assert len(set(fill_seats(rng, ["a", "b", "c"], probs, "one"))) == 1
    mixed = [fill_seats(rng, ["a", "b", "c"], probs, "each") for _ in range(20)]
    assert any(len(set(s)) > 1 for s in mixed)
    with pytest.raises(ValueError, match="seat mode"):
        fill_seats(rng, ["a"], np.ones(1), "some")
    assert main_exploiter_pick("main").opponents == ("main",) * 6
    pick = league_exploiter_pick(rng, hero="league_exploiter", pool=["a", "b"], win_rate=lambda m: 1.0)
    assert pick.kind == PFSP and pick.opponents[0] in {"a", "b"}  # all beaten: uniform, never NaN
