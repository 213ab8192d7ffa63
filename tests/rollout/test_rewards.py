"""Rewards on hand-built positions a reader can check on the map.

Map facts used: BUR borders PAR, PIC, BEL, RUH, MUN, MAR and GAS; RUH borders BEL, HOL, KIE and MUN;
BEL is a supply centre, BUR and RUH are not. Centres change hands when the fall turn ends (the engine
updates ownership as it enters the winter adjustment phase). A move of strength 1 + supports
dislodges a holder only if stronger than 1 + its hold supports.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path

import pytest

from diprl.game import DiplomacyGame, PhaseRecord, UnknownPowerError
from diprl.rollout.credit import CreditConfig
from diprl.rollout.rewards import (
    OUTCOME_KEYS,
    SHAPING_KEYS,
    OrderLabel,
    OrderWeights,
    OutcomeWeights,
    RewardConfig,
    Rubric,
    ShapingWeights,
    load_reward_config,
    order_labels,
    order_rewards,
    outcome_reward,
    shaping_counts,
    shaping_reward,
    tied_rank_bonus,
    trajectory_return,
)
from tests.game.positions import position

# Distinct weights, so a label mixed up with another shows as a wrong number.
DISTINCT = RewardConfig(
    orders=OrderWeights(
        void_support=-1.0,
        critical_support=2.0,
        critical_support_for_rival=0.9,
        redundant_support=-0.3,
        futile_support=-0.4,
        cut_support=-0.5,
        bounced_move=-0.6,
        self_bounced_move=-0.65,
        successful_move=0.7,
        captured_centre=0.8,
    ),
    scale=1.0,
)


def _play(
    units: Mapping[str, Sequence[str]],
    orders: Mapping[str, Sequence[str]],
    centres: Mapping[str, Sequence[str]] | None = None,
    phase: str = "S1901M",
) -> tuple[DiplomacyGame, DiplomacyGame, PhaseRecord]:
    """(decision state, the game after one step, the step's record)."""
    game = position(units, centres, phase)
    before = game.fork()
    record = game.step(orders)
    assert record.issues == (), record.issues
    return before, game, record


# --------------------------------------------------------------------------------------- per order
ORDER_CASES = {
    # A MUN holds, so the support of a move MUN - BUR supports nothing.
    "void": (
        {"GERMANY": ["A MUN", "A RUH"], "FRANCE": ["A BUR"]},
        {"GERMANY": ["A MUN H", "A RUH S A MUN - BUR"], "FRANCE": ["A BUR H"]},
        {"GERMANY": {"A MUN H": 0.0, "A RUH S A MUN - BUR": -1.0}, "FRANCE": {"A BUR H": 0.0}},
    ),
    # 2 v 1: the support is the difference; the supported move succeeds and dislodges A BUR.
    "critical": (
        {"GERMANY": ["A MUN", "A RUH"], "FRANCE": ["A BUR"]},
        {"GERMANY": ["A MUN - BUR", "A RUH S A MUN - BUR"], "FRANCE": ["A BUR H"]},
        {"GERMANY": {"A MUN - BUR": 0.7, "A RUH S A MUN - BUR": 2.0}, "FRANCE": {"A BUR H": 0.0}},
    ),
    # Germany lends Italy the decisive support into TYR (held by Austria): critical, but for a rival.
    # Italy's own move has no order reward of its own beyond moving (0.7).
    "critical_for_rival": (
        {"GERMANY": ["A MUN"], "ITALY": ["A VEN"], "AUSTRIA": ["A TYR"]},
        {"GERMANY": ["A MUN S A VEN - TYR"], "ITALY": ["A VEN - TYR"], "AUSTRIA": ["A TYR H"]},
        {"GERMANY": {"A MUN S A VEN - TYR": 0.9}, "ITALY": {"A VEN - TYR": 0.7}},
    ),
    # 3 v 1: either support alone still makes 2 v 1.
    "redundant": (
        {"GERMANY": ["A MUN", "A RUH", "A BEL"], "FRANCE": ["A BUR"]},
        {"GERMANY": ["A MUN - BUR", "A RUH S A MUN - BUR", "A BEL S A MUN - BUR"], "FRANCE": ["A BUR H"]},
        {"GERMANY": {"A MUN - BUR": 0.7, "A RUH S A MUN - BUR": -0.3, "A BEL S A MUN - BUR": -0.3}},
    ),
    # A BEL attacks the supporter from a third province: the support is cut, MUN bounces 1 v 1 off
    # BUR and BEL bounces off RUH.
    "cut": (
        {"GERMANY": ["A MUN", "A RUH"], "FRANCE": ["A BUR", "A BEL"]},
        {"GERMANY": ["A MUN - BUR", "A RUH S A MUN - BUR"], "FRANCE": ["A BUR H", "A BEL - RUH"]},
        {
            "GERMANY": {"A MUN - BUR": -0.6, "A RUH S A MUN - BUR": -0.5},
            "FRANCE": {"A BUR H": 0.0, "A BEL - RUH": -0.6},
        },
    ),
    # 2 v 2: the supported move bounces anyway (futile); France's hold support is what saved BUR.
    "futile": (
        {"GERMANY": ["A MUN", "A RUH"], "FRANCE": ["A BUR", "A PAR"]},
        {"GERMANY": ["A MUN - BUR", "A RUH S A MUN - BUR"], "FRANCE": ["A BUR H", "A PAR S A BUR"]},
        {
            "GERMANY": {"A MUN - BUR": -0.6, "A RUH S A MUN - BUR": -0.4},
            "FRANCE": {"A BUR H": 0.0, "A PAR S A BUR": 2.0},
        },
    ),
    # Both move to BUR with equal strength: both bounce.
    "bounce": (
        {"GERMANY": ["A MUN"], "FRANCE": ["A PAR"]},
        {"GERMANY": ["A MUN - BUR"], "FRANCE": ["A PAR - BUR"]},
        {"GERMANY": {"A MUN - BUR": -0.6}, "FRANCE": {"A PAR - BUR": -0.6}},
    ),
}


@pytest.mark.parametrize("case", list(ORDER_CASES))
def test_order_rewards(case: str) -> None:
    units, orders, expected = ORDER_CASES[case]
    before, _, record = _play(units, orders)
    for power, rewards in expected.items():
        assert order_rewards(before, record, power, DISTINCT) == pytest.approx(rewards)


def test_order_rewards_with_default_weights() -> None:
    units, orders, _ = ORDER_CASES["void"]
    before, _, record = _play(units, orders)
    assert order_rewards(before, record, "GERMANY", RewardConfig())["A RUH S A MUN - BUR"] == -1.0
    units, orders, _ = ORDER_CASES["critical"]
    before, _, record = _play(units, orders)
    assert order_rewards(before, record, "GERMANY", RewardConfig())["A RUH S A MUN - BUR"] == 1.0


def test_order_labels() -> None:
    units, orders, _ = ORDER_CASES["cut"]
    before, _, record = _play(units, orders)
    assert order_labels(before, record, "GERMANY") == {"A MUN - BUR": OrderLabel.BOUNCED, "A RUH S A MUN - BUR": "cut"}
    assert order_labels(before, record, "FRANCE") == {"A BUR H": OrderLabel.OTHER, "A BEL - RUH": "bounced"}
    assert order_labels(before, record, "ITALY") == {}


# Germany owns BER, KIE, MUN; HOL, DEN and BEL are neutral, RUH and BOH are no centres, and France's
# A PIC bounces Germany's A BUR out of BEL.
CENTRE_UNITS = {"GERMANY": ["A RUH", "F DEN", "A KIE", "A BUR", "A BOH"], "FRANCE": ["A PIC"]}
CENTRE_ORDERS = {
    "GERMANY": ["A RUH - HOL", "F DEN H", "A KIE H", "A BUR - BEL", "A BOH - SIL"],
    "FRANCE": ["A PIC - BEL"],
}


@pytest.mark.parametrize(
    ("phase", "expected"),
    [
        # Fall: the move onto neutral HOL and the hold on neutral DEN take centres; holding an own centre
        # (KIE), a bounced move and a move to a non-centre do not.
        ("F1901M", {"A RUH - HOL": 0.8, "F DEN H": 0.8, "A KIE H": 0.0, "A BUR - BEL": -0.6, "A BOH - SIL": 0.7}),
        # Spring: nothing changes hands yet, so the same orders only move and hold.
        ("S1901M", {"A RUH - HOL": 0.7, "F DEN H": 0.0, "A KIE H": 0.0, "A BUR - BEL": -0.6, "A BOH - SIL": 0.7}),
    ],
)
def test_the_order_that_takes_a_centre_in_the_fall_is_rewarded(phase: str, expected: dict[str, float]) -> None:
    centres = {"GERMANY": ["BER", "KIE", "MUN"], "FRANCE": ["BRE", "MAR", "PAR"]}
    before, after, record = _play(CENTRE_UNITS, CENTRE_ORDERS, centres, phase)
    assert order_rewards(before, record, "GERMANY", DISTINCT) == pytest.approx(expected)
    if phase.startswith("F"):
        assert {"HOL", "DEN"} <= set(after.centres("GERMANY")) and "BEL" not in after.centres("GERMANY")


SELF_BOUNCE_CASES = {
    # Two of Germany's armies ordered into BOH: both bounce off each other and nobody else.
    "two_into_one": (
        {"GERMANY": ["A MUN", "A SIL"]},
        {"GERMANY": ["A MUN - BOH", "A SIL - BOH"]},
        {"A MUN - BOH": -0.65, "A SIL - BOH": -0.65},
    ),
    # A swap without a convoy: each bounces off the other, which did not leave.
    "swap": (
        {"GERMANY": ["A MUN", "A BER"]},
        {"GERMANY": ["A MUN - BER", "A BER - MUN"]},
        {"A MUN - BER": -0.65, "A BER - MUN": -0.65},
    ),
    # Into a province its own unit holds: only its own side stopped it.
    "into_own_hold": (
        {"GERMANY": ["A MUN", "A BER"]},
        {"GERMANY": ["A MUN - BER", "A BER H"]},
        {"A MUN - BER": -0.65, "A BER H": 0.0},
    ),
    # Germany's own unit leaves BER, so the move goes through.
    "own_unit_leaves": (
        {"GERMANY": ["A MUN", "A BER"]},
        {"GERMANY": ["A MUN - BER", "A BER - PRU"]},
        {"A MUN - BER": 0.7, "A BER - PRU": 0.7},
    ),
    # A rival's move into BOH too: a real three-way standoff, an ordinary bounce for every side.
    "rival_joins": (
        {"GERMANY": ["A MUN", "A SIL"], "AUSTRIA": ["A VIE"]},
        {"GERMANY": ["A MUN - BOH", "A SIL - BOH"], "AUSTRIA": ["A VIE - BOH"]},
        {"A MUN - BOH": -0.6, "A SIL - BOH": -0.6},
    ),
    # Austria's A BOH leaves for VIE, and Germany's two armies bounce off each other in the emptied BOH.
    "rival_left": (
        {"GERMANY": ["A MUN", "A SIL"], "AUSTRIA": ["A BOH"]},
        {"GERMANY": ["A MUN - BOH", "A SIL - BOH"], "AUSTRIA": ["A BOH - VIE"]},
        {"A MUN - BOH": -0.65, "A SIL - BOH": -0.65},
    ),
    # A rival unit holds TYR: Germany's move bounces off it, not off its own side.
    "rival_holds": (
        {"GERMANY": ["A MUN"], "AUSTRIA": ["A TYR"]},
        {"GERMANY": ["A MUN - TYR"], "AUSTRIA": ["A TYR H"]},
        {"A MUN - TYR": -0.6},
    ),
}


@pytest.mark.parametrize("case", list(SELF_BOUNCE_CASES))
def test_a_move_that_bounces_off_its_own_side_only_is_self_bounced(case: str) -> None:
    units, orders, expected = SELF_BOUNCE_CASES[case]
    before, _, record = _play(units, orders)
    assert order_rewards(before, record, "GERMANY", DISTINCT) == pytest.approx(expected)


def test_a_hold_on_a_centre_that_is_dislodged_takes_nothing() -> None:
    units = {"GERMANY": ["F DEN"], "RUSSIA": ["F SWE", "F BAL"]}
    orders = {"GERMANY": ["F DEN H"], "RUSSIA": ["F SWE - DEN", "F BAL S F SWE - DEN"]}
    before, _, record = _play(units, orders, {"GERMANY": ["BER"], "RUSSIA": ["MOS"]}, "F1901M")
    assert record.results["F DEN"] == ("dislodged",)
    assert order_labels(before, record, "GERMANY") == {"F DEN H": OrderLabel.OTHER}
    assert order_labels(before, record, "RUSSIA")["F SWE - DEN"] is OrderLabel.CAPTURED


def test_non_movement_phase_orders_score_zero() -> None:
    units, orders, _ = ORDER_CASES["critical"]
    _, game, _ = _play(units, orders)
    assert game.phase == "S1901R"
    before = game.fork()
    record = game.step({"FRANCE": ["A BUR R PIC"]})
    assert order_rewards(before, record, "FRANCE", DISTINCT) == {"A BUR R PIC": 0.0}


def test_order_rewards_need_the_unstepped_decision_state() -> None:
    units, orders, _ = ORDER_CASES["critical"]
    _, game, record = _play(units, orders)
    with pytest.raises(ValueError, match="fork taken before"):
        order_rewards(game, record, "GERMANY", DISTINCT)
    with pytest.raises(UnknownPowerError):
        order_rewards(game, record, "PRUSSIA", DISTINCT)


# ----------------------------------------------------------------------------------------- shaping
# F1901M: Germany's A RUH - BEL, supported by A BUR (neither RUH nor BUR is a centre), dislodges
# France's A BEL, which owns the BEL centre. France retreats to PIC; entering W1901A, BEL is German.
CAPTURE_UNITS = {"GERMANY": ["A RUH", "A BUR"], "FRANCE": ["A BEL"]}
CAPTURE_CENTRES = {"GERMANY": ["BER", "KIE", "MUN"], "FRANCE": ["BRE", "MAR", "PAR", "BEL"]}
CAPTURE_ORDERS = {"GERMANY": ["A RUH - BEL", "A BUR S A RUH - BEL"], "FRANCE": ["A BEL H"]}


def _capture_through_winter() -> tuple[DiplomacyGame, DiplomacyGame]:
    """(decision state at F1901M, the fork played through the retreat and the winter builds)."""
    decision = position(CAPTURE_UNITS, CAPTURE_CENTRES, phase="F1901M")
    game = decision.fork()
    assert game.step(CAPTURE_ORDERS).results["A BEL"] == ("dislodged",)
    assert game.phase == "F1901R"
    game.step({"FRANCE": ["A BEL R PIC"]})
    assert game.phase == "W1901A"
    assert game.centres("GERMANY") == ("BEL", "BER", "KIE", "MUN")
    assert game.centres("FRANCE") == ("BRE", "MAR", "PAR")
    assert game.step({"GERMANY": ["A BER B", "A KIE B"], "FRANCE": ["A PAR B", "A MAR B"]}).issues == ()
    assert game.phase == "S1902M"
    return decision, game


def test_capture_and_dislodgement_show_in_shaping_for_both_sides() -> None:
    decision, game = _capture_through_winter()
    records = game.history[len(decision.history) :]
    assert [r.name for r in records] == ["F1901M", "F1901R", "W1901A"]
    germany = shaping_counts(records, "GERMANY", game.centres("GERMANY"))
    france = shaping_counts(records, "FRANCE", game.centres("FRANCE"))
    assert germany == {
        "centres_gained": 1,
        "centres_lost": 0,
        "dislodgements_given": 1,
        "dislodgements_suffered": 0,
        "bounces": 0,
    }
    assert france == {
        "centres_gained": 0,
        "centres_lost": 1,
        "dislodgements_given": 0,
        "dislodgements_suffered": 1,
        "bounces": 0,
    }
    cfg = RewardConfig()  # gained +1, given +0.5, divided by scale 18
    shaping = shaping_reward(records, "GERMANY", cfg, final_centres=game.centres("GERMANY"))
    assert shaping["centres_gained"] == pytest.approx(1 / 18)
    assert shaping["dislodgements_given"] == pytest.approx(0.5 / 18)
    assert shaping["total"] == pytest.approx(1.5 / 18)
    assert set(shaping) == {*SHAPING_KEYS, "total"}
    france_total = shaping_reward(records, "FRANCE", cfg, final_centres=game.centres("FRANCE"))["total"]
    assert france_total == pytest.approx(-1.5 / 18)


def test_shaping_counts_bounces_of_the_power_only() -> None:
    _, game, record = _play(*ORDER_CASES["cut"][:2])
    counts = shaping_counts([record], "GERMANY", game.centres("GERMANY"))
    assert counts["bounces"] == 1  # A MUN - BUR; A RUH supported, which is not a move
    assert shaping_counts([record], "FRANCE", game.centres("FRANCE"))["bounces"] == 1  # A BEL - RUH
    assert shaping_counts([record], "ITALY", game.centres("ITALY"))["bounces"] == 0


def _record(name: str, centres: Sequence[str]) -> PhaseRecord:
    return PhaseRecord(
        name=name, state={"centers": {"GERMANY": list(centres)}, "units": {}}, orders={}, results={}, issues=()
    )


def test_shaping_counts_centre_churn_between_consecutive_states() -> None:
    # BEL taken, lost, then HOL taken: two gains and one loss, though only HOL is new at the end.
    records = [_record("W1901A", ["MUN"]), _record("W1902A", ["MUN", "BEL"]), _record("W1903A", ["MUN"])]
    counts = shaping_counts(records, "GERMANY", ["MUN", "HOL"])
    assert (counts["centres_gained"], counts["centres_lost"]) == (2, 1)
    assert shaping_counts([], "GERMANY", ["MUN"]) == dict.fromkeys(SHAPING_KEYS, 0)
    with pytest.raises(UnknownPowerError):
        shaping_counts(records, "PRUSSIA", [])


# ----------------------------------------------------------------------------------------- outcome
RAW = replace(RewardConfig(), scale=1.0)  # default weights, undivided: the numbers below are by hand


def test_tied_ranks_share_the_bonus() -> None:
    # Germany and France tie for first (5 each), England is third, Italy alone fourth.
    centres = {
        "GERMANY": ["BER", "KIE", "MUN", "HOL", "DEN"],
        "FRANCE": ["BRE", "MAR", "PAR", "SPA", "POR"],
        "ENGLAND": ["EDI", "LON", "LVP"],
        "ITALY": ["ROM"],
    }
    units = {"GERMANY": ["A BER"], "FRANCE": ["A PAR", "A MAR"], "ENGLAND": ["F LON"], "ITALY": ["A ROM"]}
    game = position(units, centres, phase="S1905M")
    germany = outcome_reward(game, "GERMANY", RAW)
    assert germany["rank"] == pytest.approx((4.0 + 2.0) / 2)
    assert outcome_reward(game, "FRANCE", RAW)["rank"] == pytest.approx(3.0)
    assert outcome_reward(game, "ENGLAND", RAW)["rank"] == pytest.approx(1.0)
    assert outcome_reward(game, "ITALY", RAW)["rank"] == 0.0
    # 5 centres + 1 unit * 0.5 + survival 2 + rank 3, no solo, not eliminated
    assert germany == pytest.approx(
        {"centres": 5.0, "units": 0.5, "survival": 2.0, "rank": 3.0, "solo": 0.0, "elimination": 0.0, "total": 10.5}
    )
    assert set(germany) == {*OUTCOME_KEYS, "total"}


def test_tied_rank_bonus_arithmetic() -> None:
    table = [4.0, 2.0, 1.0]
    assert tied_rank_bonus({"A": 3, "B": 3, "C": 3, "D": 1}, "A", table) == pytest.approx(7.0 / 3)
    assert tied_rank_bonus({"A": 3, "B": 1, "C": 1, "D": 1}, "B", table) == pytest.approx((2.0 + 1.0 + 0.0) / 3)
    assert tied_rank_bonus({"A": 3, "B": 1}, "A", table) == 4.0


SOLO_CENTRES_OF_GERMANY = [
    "BER", "KIE", "MUN", "HOL", "DEN", "BEL", "PAR", "BRE", "MAR",
    "SPA", "POR", "LON", "EDI", "LVP", "NWY", "SWE", "WAR", "VIE",
]  # fmt: skip


def test_solo_bonus_and_conceded_solo() -> None:
    centres = {"GERMANY": SOLO_CENTRES_OF_GERMANY, "ITALY": ["ROM", "NAP"]}
    game = position({"GERMANY": ["A BER", "A MUN"], "ITALY": ["A ROM"]}, centres, phase="S1910M")
    assert game.solo_winner() == "GERMANY"
    germany = outcome_reward(game, "GERMANY", RAW)
    assert germany["solo"] == 10.0
    assert germany["total"] == pytest.approx(18 + 2 * 0.5 + 2.0 + 4.0 + 10.0)
    italy = outcome_reward(game, "ITALY", RAW)
    assert italy["solo"] == -5.0
    assert italy["total"] == pytest.approx(2 + 0.5 + 2.0 + 2.0 - 5.0)


def test_elimination_penalty_replaces_survival_and_rank() -> None:
    # Italy has nothing left; Austria has a unit but no centre, so it survives (and ties last).
    game = position({"GERMANY": ["A BER"], "AUSTRIA": ["A BUD"]}, {"GERMANY": ["BER"]}, phase="S1905M")
    assert game.is_eliminated("ITALY") and not game.is_eliminated("AUSTRIA")
    italy = outcome_reward(game, "ITALY", RAW)
    assert italy == pytest.approx(
        {"centres": 0.0, "units": 0.0, "survival": 0.0, "rank": 0.0, "solo": 0.0, "elimination": -5.0, "total": -5.0}
    )
    austria = outcome_reward(game, "AUSTRIA", RAW)
    assert (austria["survival"], austria["elimination"], austria["rank"]) == (2.0, 0.0, 0.5)  # ranks 2..7 share 2+1
    assert austria["total"] == pytest.approx(0.5 + 2.0 + 0.5)


def test_scale_divides_every_component() -> None:
    game = position({"GERMANY": ["A BER"]}, {"GERMANY": ["BER", "KIE"]}, phase="S1905M")
    raw = outcome_reward(game, "GERMANY", RAW)
    scaled = outcome_reward(game, "GERMANY", RewardConfig())
    assert scaled == pytest.approx({k: v / 18 for k, v in raw.items()})
    with pytest.raises(UnknownPowerError):
        outcome_reward(game, "PRUSSIA", RAW)


# ------------------------------------------------------------------------------------------ return
def test_trajectory_return_mixes_outcome_and_shaping() -> None:
    cfg = RewardConfig()
    assert trajectory_return(1.0, 0.5, cfg) == pytest.approx(0.9 * 1.0 + 0.1 * 0.5)
    assert trajectory_return({"total": 2.0}, {"total": -1.0}, replace(cfg, outcome_share=0.5)) == pytest.approx(0.5)


def test_rubric_scores_a_fork_and_logs_every_component() -> None:
    decision, game = _capture_through_winter()
    rubric = Rubric(replace(DISTINCT, outcome=OutcomeWeights(), shaping=ShapingWeights(), scale=1.0))
    score = rubric.score(decision, game, "GERMANY")
    assert score.order_rewards == {"A RUH - BEL": 0.8, "A BUR S A RUH - BEL": 2.0}
    assert score.order_labels == {"A RUH - BEL": "captured", "A BUR S A RUH - BEL": "critical"}
    assert score.shaping["total"] == pytest.approx(1.5)
    assert score.total == pytest.approx(0.9 * score.outcome["total"] + 0.1 * 1.5)
    components = score.components
    assert components["return"] == score.total
    assert components["orders/critical"] == 1.0 and components["orders/captured"] == 1.0
    assert components["orders/void"] == 0.0
    assert components["orders/reward_sum"] == pytest.approx(2.8)
    assert {f"outcome/{k}" for k in OUTCOME_KEYS} | {f"shaping/{k}" for k in SHAPING_KEYS} <= set(components)


def test_rubric_rejects_a_horizon_that_is_not_a_fork_of_the_decision() -> None:
    decision, game = _capture_through_winter()
    with pytest.raises(ValueError, match="not a fork"):
        Rubric().score(game, decision, "GERMANY")
    other = position(CAPTURE_UNITS, CAPTURE_CENTRES, phase="S1901M")
    with pytest.raises(ValueError, match="not a fork"):
        Rubric().score(other, game, "GERMANY")


def test_rubric_at_the_decision_state_itself_has_no_shaping_or_order_rewards() -> None:
    decision = position(CAPTURE_UNITS, CAPTURE_CENTRES, phase="F1901M")
    score = Rubric().score(decision, decision.fork(), "GERMANY")
    assert score.shaping["total"] == 0.0 and score.order_rewards == {}


# ------------------------------------------------------------------------------------------ config
def test_default_yaml_matches_the_dataclass_defaults() -> None:
    assert load_reward_config("default") == RewardConfig()


def _conf(tmp_path: Path, text: str) -> Path:
    (tmp_path / "reward").mkdir()
    (tmp_path / "reward" / "custom.yaml").write_text(text)
    return tmp_path


def test_config_overrides_merge_onto_the_defaults(tmp_path: Path) -> None:
    conf = _conf(tmp_path, "defaults: [base_reward, _self_]\noutcome_share: 0.8\norders:\n  void_support: -2.0\n")
    cfg = load_reward_config("custom", conf)
    assert (cfg.outcome_share, cfg.orders.void_support, cfg.orders.critical_support) == (0.8, -2.0, 1.0)
    assert cfg.credit == CreditConfig()


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("orders:\n  void_suport: -2.0\n", "void_suport"),  # typo
        ("outcome:\n  centre: lots\n", "centre"),  # wrong type
        ("outcome_share: 1.5\n", "outcome_share"),  # out of range
        ("credit:\n  eps: 0.0\n", "eps"),
        ("- a list\n", "mapping"),
    ],
)
def test_bad_config_is_a_clear_value_error(tmp_path: Path, text: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        load_reward_config("custom", _conf(tmp_path, text))


def test_unknown_config_name_lists_the_known_ones() -> None:
    with pytest.raises(KeyError, match="known: default"):
        load_reward_config("nope")
    with pytest.raises(KeyError):
        load_reward_config("../reward/default")
