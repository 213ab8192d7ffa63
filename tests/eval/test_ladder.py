"""The ladder covers every bot against both opponents and renders one table row per matchup."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from diprl.bots import BOT_NAMES
from diprl.eval import ladder


def test_ladder_runs_every_matchup_and_prints_its_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "ladder.json"
    assert ladder.main(["--games", "7", "--max-year", "1901", "--workers", "1", "--json", str(out)]) == 0
    printed = capsys.readouterr().out.splitlines()
    rows = [line for line in printed if line.startswith("| ") and not line.startswith("| hero")]
    assert len(rows) == 2 * len(BOT_NAMES)
    assert {(r.split(" | ")[0][2:], r.split(" | ")[1]) for r in rows} == {
        (h, o) for h in BOT_NAMES for o in ladder.OPPONENTS
    }
    data = json.loads(out.read_text())
    assert all(row["games"] == 7 for row in data)
    # Nobody can solo by winter 1901, so every "any solo" count must be zero.
    assert all(row["any_solo"]["count"] == 0 for row in data)


def test_ladder_draws_a_bar_on_stderr_and_keeps_stdout_for_the_table(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from diprl import console

    monkeypatch.setattr(console, "_is_terminal", lambda stream: True)  # as on a terminal
    argv = ["--games", "1", "--max-year", "1901", "--workers", "1"]
    assert ladder.main(argv) == 0
    out, err = capsys.readouterr()
    total = len(BOT_NAMES) * len(ladder.OPPONENTS)
    assert f"0/{total}" in err and "dumbbot vs random" in err  # one bar over all rows, naming the row
    assert "\r" not in out and "|" in out
    assert out.splitlines()[-1].startswith("order issues over all games: 0")
    table = [line for line in out.splitlines() if line.startswith("| ") and not line.startswith("| hero")]
    assert len(table) == total

    assert ladder.main([*argv, "--quiet"]) == 0
    quiet_out, quiet_err = capsys.readouterr()
    assert quiet_err == ""
    assert [line for line in quiet_out.splitlines() if line.startswith("| ")] == [
        line for line in out.splitlines() if line.startswith("| ")
    ]
