"""Rewards of one fork: outcome at the horizon, turn shaping on the way, and each order's own reward.

The `Rubric` scores a fork from its decision state (the game before the trained phase was stepped)
and its horizon (the same fork played on); every component is returned so it can be logged.

Units. Outcome and shaping are both counted in centre-equivalents (a centre held at the horizon and
a centre gained on the way are both worth 1.0 by default) and both divided by the same `scale`
(18, the centres of a solo, so the return is O(1)). Because the two terms share their unit,

    return = outcome_share * outcome + (1 - outcome_share) * shaping

means what it says: with the default 0.9 a centre held at the horizon moves the return nine times as
much as a centre gained during the fork. Outcome dominates because it is what the league ranks
(centres and ranks at the end); shaping is there to separate forks that end level but got there
differently (a dislodgement given, a bounce), which short horizons produce often.

Per-order rewards are not part of the return. They are in their own unit (a void support is -1, a
critical support +1) and reach the learner through `CreditAssigner`, which adds
`order_coef * order reward` to the advantage of that order's tokens only.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from itertools import pairwise
from pathlib import Path

from diprl.game.game import DiplomacyGame, PhaseRecord, UnknownPowerError
from diprl.game.mapgraph import map_graph
from diprl.game.orders import HOLD, MOVE, SUPPORT, Order, parse_order
from diprl.game.outcomes import SupportVerdict, classify_supports
from diprl.game.scoring import ranks
from diprl.rollout.credit import CreditConfig
from diprl.structured_config import load_structured


# ------------------------------------------------------------------------------------------ config
@dataclass
class OutcomeWeights:
    """Value of the position at the horizon, in centre-equivalents (before `RewardConfig.scale`)."""

    # Centres win games, set ranks and pay for units: the unit of account.
    centre: float = 1.0
    # A unit is force now, but only centres count at the end and units follow centres every winter:
    # half a centre, so keeping a unit never outweighs taking a centre.
    unit: float = 0.5
    # Being on the board at all: a survivor shares a draw, an eliminated power gets nothing.
    survival: float = 2.0
    # Bonus by rank 1..7 of centre count (ties share the average of the ranks they span, so two
    # powers tied for first get (4 + 2) / 2 = 3 each). Only the top three matter: below that the
    # centre count already says everything. Eliminated powers get no rank bonus.
    rank_bonus: list[float] = field(default_factory=lambda: [4.0, 2.0, 1.0, 0.0, 0.0, 0.0, 0.0])
    # A solo is the only outright win: on top of its 18+ centres, but not so large that the rare
    # solo fork swamps every other comparison.
    solo: float = 10.0
    # Another power's solo is a loss for everyone else whatever their centres.
    solo_conceded: float = -5.0
    # Elimination replaces the survival bonus: going from one centre to none costs
    # 1 (centre) + 0.5 (unit) + 2 (survival) + 5 = 8.5 centre-equivalents, so the last unit is defended.
    elimination: float = -5.0


@dataclass
class ShapingWeights:
    """Events between the decision state and the horizon, in centre-equivalents (signed)."""

    # Same unit as the outcome's centre, so `outcome_share` compares like with like.
    centre_gained: float = 1.0
    # Symmetric with a gain: a centre lost and retaken in the fork nets to zero.
    centre_lost: float = -1.0
    # Dislodging a rival unit costs it a tempo or the unit itself: half a centre.
    dislodgement_given: float = 0.5
    # Symmetric with giving one.
    dislodgement_suffered: float = -0.5
    # A bounced move wasted the unit's turn; small because a standoff is sometimes intended
    # (bouncing to keep a province empty).
    bounce: float = -0.1


@dataclass
class OrderWeights:
    """Each order's own reward (added to its tokens' advantage through `CreditAssigner.order_coef`)."""

    # Supports a move (or hold) the supported unit did not make: the order did nothing at all.
    void_support: float = -1.0
    # The supported order fails without it (found by re-adjudicating a fork): the best a support does.
    critical_support: float = 1.0
    # Decisive, but for another power's unit: it took a centre or held a province for a rival. No
    # reward of its own by default: whether lending a rival strength was wise shows in the outcome.
    critical_support_for_rival: float = 0.0
    # The supported order succeeds without it too. Slightly negative: the unit could have done
    # something else, but a spare support is insurance against a cut the policy cannot foresee.
    redundant_support: float = -0.1
    # Given, but the supported order failed anyway: the attack (or defence) was misjudged.
    futile_support: float = -0.25
    # Cut by an attack on the supporter (or the supporter was dislodged): often foreseeable from the
    # board, but the rival's choice, so milder than void.
    cut_support: float = -0.25
    # A move that bounced: the unit's turn was wasted (see ShapingWeights.bounce on standoffs).
    bounced_move: float = -0.25
    # A move that bounced off the power's own units only (two of its units ordered to one province, or a
    # move into a province its own unit did not leave): no standoff was intended. Its own label, so logs and
    # traces show how often the policy blocks itself; weighted as any bounce, because a heavier weight
    # (-1.0, with order_coef 0.5) taught the tiny policy to hold instead (learning benchmark, 10 minutes:
    # -0.14 centres where the same run without it gained +1.27; docs/results.md, "Before the fix").
    self_bounced_move: float = -0.25
    # Zero: a successful move is already paid for by the outcome and shaping; rewarding every move
    # that goes through would favour aimless motion over useful holds.
    successful_move: float = 0.0
    # The order that took a supply centre: in a fall movement phase, a move that succeeded onto a centre
    # the power did not own, or a hold that kept the unit on one. Outcome and shaping pay for the centre
    # too, but once for the whole completion; this says which of its orders did it (as critical_support
    # says which support decided an attack), so a group whose forks differ by several orders still
    # teaches the one that took the centre.
    captured_centre: float = 1.0


@dataclass
class RewardConfig:
    """Every reward weight (Hydra group `reward`, `conf/reward/<name>.yaml`)."""

    outcome: OutcomeWeights = field(default_factory=OutcomeWeights)
    shaping: ShapingWeights = field(default_factory=ShapingWeights)
    orders: OrderWeights = field(default_factory=OrderWeights)
    # return = outcome_share * outcome + (1 - outcome_share) * shaping; both in the same unit (see
    # the module docstring), so 0.9 means the horizon's position dominates nine to one.
    outcome_share: float = 0.9
    # Divisor of outcome and shaping (centre-equivalents -> return). 18 = the centres of a solo, so a
    # full board's worth of centres is 1.0. The same divisor for both keeps `outcome_share` honest.
    scale: float = 18.0
    credit: CreditConfig = field(default_factory=CreditConfig)

    def __post_init__(self) -> None:
        if not 0.0 <= self.outcome_share <= 1.0:
            raise ValueError(f"reward.outcome_share must be in [0, 1], got {self.outcome_share}")
        if not self.scale > 0.0:
            raise ValueError(f"reward.scale must be positive, got {self.scale}")


def register_configs() -> None:
    """Register the `base_reward` schema (group `reward`) that `conf/reward/*.yaml` extend."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(group="reward", name="base_reward", node=RewardConfig)


def load_reward_config(name: str, conf_dir: Path | None = None) -> RewardConfig:
    """Read `conf/reward/<name>.yaml` into a validated `RewardConfig` (typos and wrong types fail)."""
    return load_structured(RewardConfig, "reward", name, conf_dir)


# ----------------------------------------------------------------------------------------- outcome
OUTCOME_KEYS = ("centres", "units", "survival", "rank", "solo", "elimination")
SHAPING_KEYS = ("centres_gained", "centres_lost", "dislodgements_given", "dislodgements_suffered", "bounces")


def _scaled(raw: Mapping[str, float], scale: float) -> dict[str, float]:
    """Components divided by `scale`, plus their sum as "total" (so the logged parts add up)."""
    parts = {key: value / scale for key, value in raw.items()}
    parts["total"] = sum(parts.values())
    return parts


def tied_rank_bonus(centres: Mapping[str, int], power: str, table: Sequence[float]) -> float:
    """Rank bonus of `power`, tied powers sharing the mean bonus of the positions they span.

    Competition ranking puts k tied powers at rank r; together they fill positions r .. r+k-1, so
    each gets the mean of those positions' bonuses (positions past the table are worth 0). Sharing
    keeps the total bonus handed out fixed: a tie is neither a free win nor a loss.
    """
    rank = ranks(centres)[power]
    tied = sum(1 for n in centres.values() if n == centres[power])
    values = [table[i] if i < len(table) else 0.0 for i in range(rank - 1, rank - 1 + tied)]
    return sum(values) / len(values)


def outcome_reward(game_at_horizon: DiplomacyGame, power: str, cfg: RewardConfig) -> dict[str, float]:
    """Value of `power`'s position at the horizon: the components in `OUTCOME_KEYS` and "total"."""
    game_at_horizon.check_power(power)
    w = cfg.outcome
    centres = game_at_horizon.centre_counts()
    eliminated = game_at_horizon.is_eliminated(power)
    winner = game_at_horizon.solo_winner()
    raw = {
        "centres": w.centre * centres[power],
        "units": w.unit * len(game_at_horizon.units(power)),
        "survival": 0.0 if eliminated else w.survival,
        "rank": 0.0 if eliminated else tied_rank_bonus(centres, power, w.rank_bonus),
        "solo": 0.0 if winner is None else (w.solo if winner == power else w.solo_conceded),
        "elimination": w.elimination if eliminated else 0.0,
    }
    return _scaled(raw, cfg.scale)


# ----------------------------------------------------------------------------------------- shaping
def _owners(record: PhaseRecord) -> dict[str, str]:
    """Unit -> power for the units on the board before the record's phase ('*' marks dislodged ones)."""
    return {unit.lstrip("*"): power for power, units in record.state["units"].items() for unit in units}


def shaping_counts(records: Sequence[PhaseRecord], power: str, final_centres: Collection[str]) -> dict[str, int]:
    """Raw event counts for `power` over `records` (the phases from the decision state to the horizon).

    Centres are compared between consecutive states: each record's state (the board before that
    phase) and finally `final_centres` (the board at the horizon). Counting every change, rather than
    the net difference of the two ends, records churn: a centre lost and retaken counts one loss and
    one gain (which cancel with the default symmetric weights but show in the logs).

    A dislodgement is given when a successful move of `power` ends in the province of a rival unit
    that the engine reports dislodged; it is suffered when a unit of `power` is dislodged (by anyone).
    Bounces are `power`'s moves in movement phases that the engine reports as bounced.
    """
    counts = dict.fromkeys(SHAPING_KEYS, 0)
    if not records:
        return counts
    if power not in records[0].state["centers"]:
        raise UnknownPowerError(f"unknown power {power!r}; powers are {', '.join(sorted(records[0].state['centers']))}")
    sets = [set(record.state["centers"][power]) for record in records]
    sets.append(set(final_centres))
    for before, after in pairwise(sets):
        counts["centres_gained"] += len(after - before)
        counts["centres_lost"] += len(before - after)
    for record in records:
        if not record.name.endswith("M"):
            continue
        owners = _owners(record)
        movers: dict[str, str] = {}  # province -> power of the move that succeeded into it
        for mover_power, orders in record.orders.items():
            for text in orders:
                order = parse_order(text)
                if order.kind != MOVE:
                    continue
                codes = record.results.get(order.unit, ())
                if not codes:
                    movers[order.target_province] = mover_power
                elif mover_power == power and "bounce" in codes:
                    counts["bounces"] += 1
        for unit, codes in record.results.items():
            if "dislodged" not in codes:
                continue
            if owners.get(unit) == power:
                counts["dislodgements_suffered"] += 1
            elif movers.get(unit[2:5]) == power:
                counts["dislodgements_given"] += 1
    return counts


def shaping_reward(
    records: Sequence[PhaseRecord], power: str, cfg: RewardConfig, *, final_centres: Collection[str]
) -> dict[str, float]:
    """Weighted shaping events of `power` (see `shaping_counts`): the `SHAPING_KEYS` and "total".

    `records` are the phases played from the decision state to the horizon (a fork's history slice)
    and `final_centres` are `power`'s centres at the horizon.
    """
    w = cfg.shaping
    counts = shaping_counts(records, power, final_centres)
    raw = {
        "centres_gained": w.centre_gained * counts["centres_gained"],
        "centres_lost": w.centre_lost * counts["centres_lost"],
        "dislodgements_given": w.dislodgement_given * counts["dislodgements_given"],
        "dislodgements_suffered": w.dislodgement_suffered * counts["dislodgements_suffered"],
        "bounces": w.bounce * counts["bounces"],
    }
    return _scaled(raw, cfg.scale)


# ------------------------------------------------------------------------------------------ orders
class OrderLabel(StrEnum):
    """What one order amounted to, for its reward and the logs."""

    VOID = SupportVerdict.VOID.value
    CRITICAL = SupportVerdict.CRITICAL.value
    CRITICAL_FOR_RIVAL = "critical_for_rival"  # decisive, but the supported unit is another power's
    REDUNDANT = SupportVerdict.REDUNDANT.value
    FUTILE = SupportVerdict.FUTILE.value
    CUT = SupportVerdict.CUT.value
    BOUNCED = "bounced"
    SELF_BOUNCED = "self_bounced"  # bounced off the power's own units only
    CAPTURED = "captured"  # took a supply centre the power did not own (fall moves and holds)
    MOVED = "moved"
    OTHER = "other"  # holds, convoys, retreats, builds, disbands, waives: no order-level signal


def order_labels(before: DiplomacyGame, record: PhaseRecord, power: str) -> dict[str, OrderLabel]:
    """Label of every order `power` played in `record`, keyed by the order's text.

    Only movement phases have order-level signal; elsewhere every order is OTHER. `before` is the
    game at the record's phase, not yet stepped (a fork of it is re-adjudicated, it is not changed).
    Centres change hands after a fall, so CAPTURED is given in fall movement phases only.
    """
    before.check_power(power)
    orders = record.orders.get(power, ())
    if not record.name.endswith("M"):
        return dict.fromkeys(orders, OrderLabel.OTHER)
    verdicts = classify_supports(before, record, powers={power})
    capturable = map_graph().supply_centres - set(before.centres(power)) if record.name.startswith("F") else set()
    labels: dict[str, OrderLabel] = {}
    for text in orders:
        order = parse_order(text)
        codes = record.results.get(order.unit, ())
        if order.kind == SUPPORT and order.unit in verdicts:
            label = OrderLabel(verdicts[order.unit].value)
            if label is OrderLabel.CRITICAL and not _own_unit(before, power, order.supported_unit):
                label = OrderLabel.CRITICAL_FOR_RIVAL
            labels[text] = label
        elif order.kind == MOVE and "bounce" in codes:
            own = _bounced_off_own_units_only(record, power, order)
            labels[text] = OrderLabel.SELF_BOUNCED if own else OrderLabel.BOUNCED
        elif order.kind == MOVE and not codes:
            labels[text] = OrderLabel.CAPTURED if order.target_province in capturable else OrderLabel.MOVED
        elif order.kind == HOLD and order.loc in capturable and "dislodged" not in codes:
            labels[text] = OrderLabel.CAPTURED
        else:
            labels[text] = OrderLabel.OTHER
    return labels


def _bounced_off_own_units_only(record: PhaseRecord, power: str, move: Order) -> bool:
    """Whether the bounced `move` met nothing but its own side: no rival moved into the target province
    and no rival unit stayed there, so what stopped it was another of the power's moves into the province
    or one of its units that did not leave."""
    target = move.target_province
    rivals = [parse_order(text) for p, texts in record.orders.items() if p != power for text in texts]
    if any(o.kind == MOVE and o.target_province == target for o in rivals):
        return False  # a rival moved in too: a real standoff
    left = {o.unit for o in rivals if o.kind == MOVE and not record.results.get(o.unit, ())}
    return not any(
        owner != power and unit[2:5] == target and unit not in left for unit, owner in _owners(record).items()
    )


def _own_unit(game: DiplomacyGame, power: str, unit: str) -> bool:
    """Whether `unit` ("A BUR", "F SPA" written without its coast) is one of `power`'s units in `game`."""
    return any(own == unit or own[:5] == unit[:5] for own in game.units(power))


def order_weight(label: OrderLabel, cfg: RewardConfig) -> float:
    """The configured reward of one label (labels and weights are kept apart so logs show labels)."""
    w = cfg.orders
    return {
        OrderLabel.VOID: w.void_support,
        OrderLabel.CRITICAL: w.critical_support,
        OrderLabel.CRITICAL_FOR_RIVAL: w.critical_support_for_rival,
        OrderLabel.REDUNDANT: w.redundant_support,
        OrderLabel.FUTILE: w.futile_support,
        OrderLabel.CUT: w.cut_support,
        OrderLabel.BOUNCED: w.bounced_move,
        OrderLabel.SELF_BOUNCED: w.self_bounced_move,
        OrderLabel.CAPTURED: w.captured_centre,
        OrderLabel.MOVED: w.successful_move,
        OrderLabel.OTHER: 0.0,
    }[label]


def order_rewards(before: DiplomacyGame, record: PhaseRecord, power: str, cfg: RewardConfig) -> dict[str, float]:
    """Each of `power`'s orders in `record` -> its own reward (0 for orders with no order-level signal).

    Not divided by `scale`: these are in their own unit and enter only through the credit assigner.
    """
    return {text: order_weight(label, cfg) for text, label in order_labels(before, record, power).items()}


# ------------------------------------------------------------------------------------------ return
def _total(part: Mapping[str, float] | float) -> float:
    return float(part["total"]) if isinstance(part, Mapping) else float(part)


def trajectory_return(
    outcome: Mapping[str, float] | float, shaping: Mapping[str, float] | float, cfg: RewardConfig
) -> float:
    """`outcome_share * outcome + (1 - outcome_share) * shaping` (totals, or the component dicts)."""
    return cfg.outcome_share * _total(outcome) + (1.0 - cfg.outcome_share) * _total(shaping)


@dataclass(frozen=True)
class RubricScore:
    """Everything one fork was scored on: the return, its parts, and each decision order's reward."""

    total: float  # the trajectory return
    outcome: dict[str, float]
    shaping: dict[str, float]
    order_rewards: dict[str, float]
    order_labels: dict[str, str]

    @property
    def components(self) -> dict[str, float]:
        """Flat dict for `TrainingRecord.reward_components` and the metrics log."""
        flat = {"return": self.total}
        flat.update({f"outcome/{k}": v for k, v in self.outcome.items()})
        flat.update({f"shaping/{k}": v for k, v in self.shaping.items()})
        labels = list(self.order_labels.values())
        flat.update({f"orders/{label.value}": float(labels.count(label.value)) for label in OrderLabel})
        flat["orders/reward_sum"] = sum(self.order_rewards.values())
        return flat


class Rubric:
    """The reward functions and their weights, applied the same way to every fork of a group."""

    def __init__(self, cfg: RewardConfig | None = None) -> None:
        self.cfg = cfg if cfg is not None else RewardConfig()

    def score(self, decision: DiplomacyGame, horizon: DiplomacyGame, power: str) -> RubricScore:
        """Score one fork: `decision` is the game at the trained phase, not stepped; `horizon` is a
        fork of it played on to the horizon (its history extends `decision`'s).

        The first phase played after `decision` is the one whose orders the completion wrote, so the
        per-order rewards are of that phase.
        """
        start = len(decision.history)
        records = horizon.history[start:]
        first = records[0].name if records else horizon.phase
        if len(horizon.history) < start or first != decision.phase:
            raise ValueError(
                f"the horizon game (at {horizon.phase}, {len(horizon.history)} phases played) is not a fork of "
                f"the decision state at {decision.phase} played on ({start} phases played)"
            )
        outcome = outcome_reward(horizon, power, self.cfg)
        shaping = shaping_reward(records, power, self.cfg, final_centres=horizon.centres(power))
        labels = order_labels(decision, records[0], power) if records else {}
        rewards = {text: order_weight(label, self.cfg) for text, label in labels.items()}
        return RubricScore(
            total=trajectory_return(outcome, shaping, self.cfg),
            outcome=outcome,
            shaping=shaping,
            order_rewards=rewards,
            order_labels={text: label.value for text, label in labels.items()},
        )
