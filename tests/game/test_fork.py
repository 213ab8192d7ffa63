"""Forks: independent of their parent, and adjudicating exactly like it."""

from __future__ import annotations

import copy
import dataclasses
import random

from diprl.game import DiplomacyGame, PhaseKind, PhaseRecord, compute_legal_orders, random_orders

from .positions import burgundy_retreat, without_timestamp


def comparable(record: PhaseRecord) -> PhaseRecord:
    """The record without the wall-clock timestamp of its state."""
    return dataclasses.replace(record, state=without_timestamp(record.state))


def test_stepping_a_fork_leaves_the_parent_alone() -> None:
    game = DiplomacyGame()
    game.step({"FRANCE": ["A PAR - BUR"]})
    fork = game.fork()
    assert fork.history == game.history
    assert fork.phase == game.phase == "F1901M"

    fork.step({"FRANCE": ["A BUR - MUN", "A MAR - SPA"]})
    assert fork.phase == "W1901A"
    assert fork.units("FRANCE") == ("A BUR", "A SPA", "F BRE")  # BUR - MUN bounced off A MUN
    assert (game.phase, len(game.history), len(fork.history)) == ("F1901M", 1, 2)
    assert game.units("FRANCE") == ("A BUR", "A MAR", "F BRE")
    assert game.centres("FRANCE") == ("BRE", "MAR", "PAR")
    assert fork.centres("FRANCE") == ("BRE", "MAR", "PAR", "SPA")


def test_stepping_the_parent_leaves_a_fork_alone() -> None:
    game = DiplomacyGame()
    fork = game.fork()
    game.step({"GERMANY": ["A MUN - BUR"]})
    assert game.units("GERMANY") == ("A BER", "A BUR", "F KIE")
    assert (fork.phase, fork.history) == ("S1901M", ())
    assert fork.units("GERMANY") == ("A BER", "A MUN", "F KIE")
    # The fork still plays its own game.
    fork.step({"GERMANY": ["A MUN - TYR"]})
    assert fork.units("GERMANY") == ("A BER", "A TYR", "F KIE")
    assert game.units("GERMANY") == ("A BER", "A BUR", "F KIE")


def test_forks_share_the_legal_orders_of_their_phase() -> None:
    game = DiplomacyGame()
    france = game.legal_orders("FRANCE")
    fork = game.fork()
    assert fork.legal_orders("FRANCE") is france
    fork.step({})
    assert fork.legal_orders("FRANCE").phase == "F1901M"
    assert game.legal_orders("FRANCE") is france


def test_fork_keeps_the_year_cap() -> None:
    fork = DiplomacyGame(max_year=1901).fork()
    assert fork.max_year == 1901
    fork.step({})
    fork.step({})
    assert fork.is_done


def test_fork_in_a_retreat_phase() -> None:
    game = burgundy_retreat()
    fork = game.fork()
    assert fork.phase == "S1901R"
    assert fork.dislodged("FRANCE") == {"A BUR": ("GAS", "MAR", "PIC")}
    # Asked of the fork's own engine, not read from the cache it shares with its parent.
    assert compute_legal_orders(fork.engine) == game.all_legal_orders()
    # A disband is reported the same way by both (the engine keeps dislodged units outside its state).
    assert fork.step({"FRANCE": ["A BUR D"]}).results == {"A BUR": ("disband",)}
    assert game.step({"FRANCE": ["A BUR D"]}).results == {"A BUR": ("disband",)}
    assert fork.units("FRANCE") == game.units("FRANCE") == ("A PAR",)


def test_fork_equals_parent_over_a_whole_random_game() -> None:
    game = DiplomacyGame()
    rng = random.Random(0)
    kinds: set[PhaseKind] = set()
    n_phases = 0
    while not game.is_done:
        kinds.update(po.kind for po in game.all_legal_orders().values())
        fork = game.fork()
        assert compute_legal_orders(fork.engine) == game.all_legal_orders(), game.phase
        assert without_timestamp(fork.state()) == without_timestamp(game.state())
        orders = random_orders(game.all_legal_orders(), rng)
        record, fork_record = game.step(orders), fork.step(orders)
        assert comparable(fork_record) == comparable(record), record.name
        assert without_timestamp(fork.state()) == without_timestamp(game.state()), record.name
        assert fork.history[:-1] == game.history[:-1]
        assert (fork.history[-1], game.history[-1]) == (fork_record, record)
        n_phases += 1
    assert game.phase == "S1936M"
    assert n_phases > 70  # 35 years of at least two movement phases
    # The game went through every kind of phase, so every kind was forked and compared.
    assert kinds == set(PhaseKind)


def test_fork_applies_orders_where_a_deepcopy_of_the_engine_does_not() -> None:
    game = DiplomacyGame()
    fork = game.fork()
    assert fork.engine is not game.engine
    fork.step({"FRANCE": ["A PAR - BUR"]})
    assert "A BUR" in fork.units("FRANCE")
    # Why fork() rebuilds an engine from its state: a deep copy keeps a stale unit-owner cache and
    # silently ignores every order (diplomacy 1.1.2).
    copied = copy.deepcopy(game.engine)
    copied.set_orders("FRANCE", ["A PAR - BUR"])
    copied.process()
    assert sorted(copied.get_power("FRANCE").units) == ["A MAR", "A PAR", "F BRE"]
