"""`bench search-cost`: the greedy and the searched side play the same seats, and the searched side's extra
requests are exactly those of its searches."""

from __future__ import annotations

from pathlib import Path

import pytest

from diprl.bench.search_cost import main, measure, summary
from diprl.rollout.search import SearchConfig
from tests.eval.conftest import RecordingClient


def test_each_side_counts_its_decisions_and_the_searched_side_its_searches() -> None:
    search = SearchConfig(candidates=2, opponent_samples=1)
    totals = measure("base", RecordingClient(), games=7, max_year=1901, search=search, rounds=2)
    greedy, searched = totals["greedy"], totals["search"]
    assert greedy.games == searched.games == 14
    assert greedy.decisions == searched.decisions == 28  # spring and fall of 1901, each game twice
    # one request a hero phase greedily; a searched movement phase is 1 + 2 candidates + 6 others x 1 sample,
    # and each game has at most two other phases (a retreat, the winter's adjustment), one request each
    assert 28 <= greedy.requests <= 28 + 28
    assert 28 * 9 <= searched.requests <= 28 * 9 + 28
    assert greedy.seconds > 0 and searched.seconds > 0
    figures = summary(totals)
    assert figures["search_requests_per_decision"] == searched.requests / 28
    assert figures["search_cost_ratio"] == pytest.approx((searched.seconds / 28) / (greedy.seconds / 28))


def test_a_side_without_search_or_a_rule_bot_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match=r"needs search\.candidates >= 1"):
        measure("base", RecordingClient(), games=7, max_year=1901, search=SearchConfig(), rounds=1)
    with pytest.raises(SystemExit) as stop:
        main(["--policy", "bot:dumbbot", "--adapters", str(tmp_path)])
    assert stop.value.code == 2 and "only an LLM policy searches" in capsys.readouterr().err
