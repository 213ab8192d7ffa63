"""Board text for prompts, saved-game export and SVG rendering."""

from __future__ import annotations

import json

import pytest
from diplomacy.utils.export import from_saved_game_format

from diprl.game import DiplomacyGame, IssueKind
from diprl.game.board_text import board_text, last_phase_text, phase_title
from diprl.game.replay import render_svg, to_saved_game

from .positions import POWERS, burgundy_retreat, position


# ---------------------------------------------------------------- board text
def test_opening_board_text() -> None:
    lines = board_text(DiplomacyGame()).splitlines()
    assert lines[0] == "Phase: S1901M (spring 1901 movement)"
    assert [line.split()[0] for line in lines[1:8]] == list(POWERS)
    assert lines[3] == "FRANCE (3 centres: BRE MAR PAR) units: A MAR, A PAR, F BRE"
    assert lines[6] == "RUSSIA (4 centres: MOS SEV STP WAR) units: A MOS, A WAR, F SEV, F STP/SC"
    # 34 centres - 22 home centres = 12 neutral ones.
    assert lines[8] == "Unowned centres: BEL BUL DEN GRE HOL NWY POR RUM SER SPA SWE TUN"
    assert len(lines) == 9


def test_board_text_is_deterministic_and_shared_by_forks() -> None:
    game = DiplomacyGame()
    game.step({"FRANCE": ["A PAR - BUR"], "RUSSIA": ["A WAR - GAL"]})
    text = board_text(game)
    assert text == board_text(game)
    assert text == board_text(game.fork())
    assert board_text(DiplomacyGame.from_state(game.state())) == text
    for power in POWERS:
        assert f"\n{power} (" in text
    assert "Phase: F1901M (fall 1901 movement)" in text
    assert "units: A BUR, A MAR, F BRE" in text
    assert "A GAL" in text


def test_board_text_of_a_retreat_phase() -> None:
    game = burgundy_retreat()
    text = board_text(game)
    assert text.splitlines()[0] == "Phase: S1901R (spring 1901 retreats)"
    assert "FRANCE (3 centres: BRE MAR PAR) units: A PAR; dislodged: A BUR (may retreat to GAS MAR PIC)" in text
    assert "GERMANY (3 centres: BER KIE MUN) units: A BUR, A HOL, A RUH\n" in text
    assert "AUSTRIA (3 centres: BUD TRI VIE) units: none" in text


def test_phase_title_of_an_adjustment() -> None:
    game = DiplomacyGame.from_state({"name": "W1901A"})
    assert phase_title(game) == "W1901A (winter 1901 adjustments)"


def test_last_phase_text() -> None:
    game = DiplomacyGame()
    assert last_phase_text(game) == "Previous phase: none"
    game.step({"FRANCE": ["A PAR - BUR"], "GERMANY": ["A MUN - BUR"]})
    lines = last_phase_text(game).splitlines()
    assert lines[0] == "Previous phase: S1901M"
    assert len(lines) == 1 + len(POWERS)
    france = next(line for line in lines if line.startswith("FRANCE: "))
    assert "A PAR - BUR [bounce]" in france
    assert "F BRE H" in france and "F BRE H [" not in france
    germany = next(line for line in lines if line.startswith("GERMANY: "))
    assert "A MUN - BUR [bounce]" in germany


# ------------------------------------------------------------------ replays
def _played() -> DiplomacyGame:
    game = burgundy_retreat()  # S1901M (from a hand-made position), then S1901R
    game.step({"FRANCE": ["A BUR R PIC"]})
    record = game.step({"GERMANY": ["A BUR - PIC"], "ENGLAND": ["F ENG S A BUR - PIC"]})
    assert {i.kind for i in record.issues} == {IssueKind.MISSING}  # holds for the other units
    assert game.phase == "F1901R"
    assert game.dislodged("FRANCE") == {"A PIC": ("BEL", "BRE")}  # not BUR, PAR nor ENG
    return game


def test_saved_game_loads_in_the_engine() -> None:
    game = _played()
    saved = to_saved_game(game, game_id="g1")
    assert [p["name"] for p in saved["phases"]] == ["S1901M", "S1901R", "F1901M", "F1901R"]
    loaded = from_saved_game_format(json.loads(json.dumps(saved)))
    assert loaded.game_id == "g1"
    assert loaded.get_current_phase() == "F1901R"
    assert [str(p) for p in loaded.state_history] == ["S1901M", "S1901R", "F1901M"]
    assert loaded.order_history["F1901M"]["GERMANY"] == ["A BUR - PIC", "A HOL H", "A RUH H"]
    for power in POWERS:
        assert sorted(loaded.get_power(power).units) == list(game.units(power))
    assert loaded.get_power("FRANCE").retreats == {"A PIC": ["BEL", "BRE"]}


def test_saved_game_of_a_fork_is_complete() -> None:
    parent = _played()
    fork = parent.fork()
    fork.step({"FRANCE": ["A PIC R BRE"]})
    saved = to_saved_game(fork)
    assert [p["name"] for p in saved["phases"]] == ["S1901M", "S1901R", "F1901M", "F1901R", "W1901A"]
    loaded = from_saved_game_format(saved)
    assert loaded.get_current_phase() == fork.phase == "W1901A"
    assert sorted(loaded.get_power("FRANCE").units) == ["A BRE", "A PAR"]
    assert len(loaded.state_history) == 4
    assert len(to_saved_game(parent)["phases"]) == 4  # the parent's export did not grow


def test_render_svg() -> None:
    game = DiplomacyGame()
    game.step({"FRANCE": ["A PAR - BUR"]})
    past = render_svg(game, "S1901M")
    assert past.startswith("<?xml") and "<svg" in past
    assert render_svg(game, "S1901M", incl_orders=False) != past  # the orders are drawn
    current = render_svg(game)
    assert "<svg" in current and current != past
    with pytest.raises(KeyError, match="S1850M"):
        render_svg(game, "S1850M")


# ------------------------------------------- what the engine decides on its own is in the record
def _winter_with_civil_disorder_and_a_waive() -> DiplomacyGame:
    """W1901A: Russia (4 units, 2 centres) orders no disband; Germany (3 centres, 1 unit) waives one build."""
    game = position(
        {"RUSSIA": ["A MOS", "A WAR", "F SEV", "F STP/SC"], "GERMANY": ["A MUN"]},
        {"RUSSIA": ["MOS", "WAR"], "GERMANY": ["BER", "KIE", "MUN"]},
        phase="W1901A",
    )
    game.step({"GERMANY": ["A BER B", "WAIVE"]})
    return game


def test_saved_game_shows_civil_disorder_disbands_and_waives() -> None:
    game = _winter_with_civil_disorder_and_a_waive()
    saved = to_saved_game(game)
    winter = saved["phases"][0]
    assert winter["name"] == "W1901A"
    assert winter["orders"]["RUSSIA"] == ["F SEV D", "F STP/SC D"]
    assert winter["orders"]["GERMANY"] == ["A BER B", "WAIVE"]
    assert "WAIVE" not in winter["results"]
    loaded = from_saved_game_format(saved)
    assert loaded.order_history["W1901A"]["RUSSIA"] == ["F SEV D", "F STP/SC D"]
    assert sorted(loaded.get_power("RUSSIA").units) == ["A MOS", "A WAR"]
    # The engine renders that winter with the recorded orders (WAIVE and civil-disorder disbands included).
    assert render_svg(game, "W1901A") != render_svg(game, "W1901A", incl_orders=False)


def test_replaying_the_record_reproduces_the_game() -> None:
    """The recorded orders are complete: stepping them on the pre-phase state gives the same board."""
    game = _winter_with_civil_disorder_and_a_waive()
    record = game.history[-1]
    again = DiplomacyGame.from_state(record.state)
    replayed = again.step({p: list(o) for p, o in record.orders.items()})
    assert replayed.issues == ()  # nothing missing: no default and no civil disorder this time
    assert replayed.orders == record.orders
    for power in POWERS:
        assert again.units(power) == game.units(power)


def test_last_phase_text_shows_civil_disorder_disbands_and_waives() -> None:
    text = last_phase_text(_winter_with_civil_disorder_and_a_waive())
    assert "RUSSIA: F SEV D; F STP/SC D" in text
    assert "GERMANY: A BER B; WAIVE" in text
