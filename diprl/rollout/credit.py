"""Credit assignment: rewards of a GRPO group become one advantage per completion token.

A token's advantage is

    A(token) = A_group(completion) + order_coef * r_order(order the token belongs to)

    A_group(i) = (R_i - mean(R)) / max(std(R), std_floor)
                 (population std, ddof = 0; `normalise=False` drops the division, as in Dr. GRPO)

where R are the trajectory returns of the G forks of one decision state and `r_order` is the
order's own reward from the `Rubric` (0 for tokens outside any order: tags, EOS, reasoning).

Why both terms: the group advantage says whether this whole completion led to a better game than
its siblings, but it is one number for every order in it, so a useless order inside a winning
completion is reinforced with the rest. The order term moves each order's tokens relative to the
other tokens of the same completion: a void support always ends up `order_coef` below its
neighbours and a critical support `order_coef` above, whatever the game's outcome.

Why a floor in return units: dividing by the group's own std gives a group whose returns differ by
one bounce (5.6e-4) the same advantages as one whose returns differ by five centres, so opponent noise
would be trained on at full weight. Below `std_floor` (about one centre's worth of return by default)
advantages shrink in proportion to the real difference; above it they are ordinary GRPO advantages.

A group whose returns are all equal (std < eps) carries no comparison, so it is skipped and counted
rather than trained on with an all-zero group advantage; its order rewards are dropped with it, so
the per-order term only ever refines a real group comparison and never trains on its own.

Pure Python and numpy: no torch or ray here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

TRAIN_TURNS = ("fork", "all")
OPEN_TAG = "<orders>"
CLOSE_TAG = "</orders>"


@dataclass
class CreditConfig:
    """How rewards become token advantages (Hydra: the `credit` section of `conf/reward/*.yaml`)."""

    # Scale of an order's own reward in its tokens' advantage. Group advantages are std-normalised
    # (|A| is about 1), so 0.2 moves a void (-1) or critical (+1) support's tokens a fifth of a group
    # standard deviation against the rest of its completion: enough to rank orders inside one
    # completion every time, too little to flip the sign of a clearly good or bad completion.
    order_coef: float = 0.2
    # A group whose returns' population std is below this is skipped (no comparison to learn from).
    eps: float = 1e-6
    # The smallest std a group is divided by, in return units. A centre held at the horizon is
    # outcome_share / scale = 0.9 / 18 = 0.05 of return with the default rewards: groups that differ by
    # less than about a centre (a bounce, a dislodgement in one fork) get proportionally small advantages.
    std_floor: float = 0.05
    # Divide by the group's std (GRPO). False keeps r - mean (Dr. GRPO): advantages are then in
    # return units, so `order_coef` must shrink with them.
    normalise: bool = True
    # Which hero turns yield TrainingRecords. "fork": the forked decision only (every record of a group
    # is on the same state: the exact GRPO comparison). "all": every hero turn of each fork up to the
    # horizon, each carrying its fork's group advantage (the seed design's broadcast: more tokens per
    # group, credit spread over the turns that led to the return). The learner cannot tell them apart.
    train_turns: str = "fork"

    def __post_init__(self) -> None:
        if self.train_turns not in TRAIN_TURNS:
            raise ValueError(f"credit.train_turns must be one of {', '.join(TRAIN_TURNS)}, got {self.train_turns!r}")
        if not self.eps > 0:
            raise ValueError(f"credit.eps must be positive, got {self.eps}")
        if not (np.isfinite(self.std_floor) and self.std_floor >= 0):
            raise ValueError(f"credit.std_floor must be finite and >= 0, got {self.std_floor}")
        if not np.isfinite(self.order_coef):
            raise ValueError(f"credit.order_coef must be finite, got {self.order_coef}")


def group_advantages(
    returns: Sequence[float], eps: float = 1e-6, normalise: bool = True, std_floor: float = 0.0
) -> tuple[list[float] | None, float]:
    """GRPO advantages of one group and the group's population std; None when the group is flat.

    With `normalise`, the centred returns are divided by `max(std, std_floor)` (see the module doc).

    Population std (ddof = 0) because the group is the whole population being compared, not a
    sample of a larger one, and it keeps a group of two well defined: [0, 1] gives [-1, +1].
    """
    values = np.asarray(returns, dtype=np.float64)
    if values.ndim != 1 or values.size == 0:
        raise ValueError(f"a group needs a flat, non-empty list of returns, got {list(returns)!r}")
    if not np.all(np.isfinite(values)):
        raise ValueError(f"non-finite return in group: {values.tolist()}")
    std = float(values.std())
    if std < eps:
        return None, std
    centred = values - values.mean()
    return (centred / max(std, std_floor) if normalise else centred).tolist(), std


def _order_block(text: str) -> tuple[int, int]:
    """Character range that holds the order lines: after `<orders>` (if written) and before `</orders>`.

    The open tag is in the completion only when free reasoning comes first (otherwise the prompt is
    primed with it); reasoning may contain order-like lines, which must not take an order's credit.
    """
    open_at = text.find(OPEN_TAG)
    start = 0 if open_at < 0 else open_at + len(OPEN_TAG)
    end = text.find(CLOSE_TAG, start)
    return start, len(text) if end < 0 else end


def order_token_spans(
    completion_ids: Sequence[int], texts: Sequence[str | None], orders: Sequence[str]
) -> list[str | None]:
    """The order each completion token belongs to (None for tags, EOS, reasoning and unknown lines).

    Tokens are matched to orders by character offsets on the decoded text (each token's text from
    `TokenTable.texts`), never by token ids, because BPE may merge an order's last letters with its
    newline or with the next order's first letters. Rules:

    - an order owns its whole line plus the newline that ends it: the newline is the decision that
      the order is complete ("A LON - BEL" could still become "A LON - BEL VIA");
    - a token belongs to the order that owns its FIRST character, so "H\\nA" belongs to the order
      ending in H and ">\\n" of the open tag to none;
    - a line counts as an order only if its stripped text equals one of `orders` (each used once, in
      the order written): constrained decoding writes canonical lines; any other line gets None.
    """
    pieces = [(texts[i] or "") if 0 <= i < len(texts) else "" for i in completion_ids]
    text = "".join(pieces)
    owner: list[str | None] = [None] * len(text)
    remaining = list(orders)
    start, end = _order_block(text)
    line_start = start
    while line_start < end and remaining:
        newline = text.find("\n", line_start, end)
        line_end = end if newline < 0 else newline
        line = text[line_start:line_end].strip()
        if line in remaining:
            remaining.remove(line)
            owned_end = line_end + 1 if newline >= 0 else line_end
            owner[line_start:owned_end] = [line] * (owned_end - line_start)
        line_start = line_end + 1
    result: list[str | None] = []
    offset = 0
    for piece in pieces:
        result.append(owner[offset] if piece else None)
        offset += len(piece)
    return result


def token_advantages(
    group_advantage: float,
    token_orders: Sequence[str | None],
    order_rewards: Mapping[str, float],
    order_coef: float,
) -> list[float]:
    """`group_advantage + order_coef * order_rewards[order of token]`, 0 for tokens of no order.

    An order missing from `order_rewards` (e.g. a phase with no per-order scoring) counts as 0.
    """
    return [
        group_advantage + (order_coef * order_rewards.get(order, 0.0) if order is not None else 0.0)
        for order in token_orders
    ]


class CreditAssigner:
    """Turns a group's returns and per-order rewards into per-token advantages; counts flat groups.

    Stateful only in its counters, which the rollout worker reports (`stats`) so that a rising share
    of skipped groups (a policy whose forks no longer differ) is visible in the metrics.
    """

    def __init__(self, cfg: CreditConfig | None = None) -> None:
        self.cfg = cfg if cfg is not None else CreditConfig()
        self.groups_seen = 0
        self.groups_skipped = 0

    def group_advantages(self, returns: Sequence[float]) -> tuple[list[float] | None, float]:
        """`group_advantages` under this config, counting the group and whether it was skipped.

        Then each completion's `token_advantages` below: the episode builds its records one at a time.
        """
        self.groups_seen += 1
        advantages, std = group_advantages(returns, self.cfg.eps, self.cfg.normalise, self.cfg.std_floor)
        if advantages is None:
            self.groups_skipped += 1
        return advantages, std

    def token_advantages(
        self,
        group_advantage: float,
        completion_ids: Sequence[int],
        texts: Sequence[str | None],
        orders: Sequence[str],
        order_rewards: Mapping[str, float],
    ) -> list[float]:
        """Advantages of one completion's tokens straight from its ids (`order_token_spans` + formula)."""
        spans = order_token_spans(completion_ids, texts, orders)
        return token_advantages(group_advantage, spans, order_rewards, self.cfg.order_coef)

    def stats(self) -> dict[str, float]:
        """Counters for the metrics log."""
        seen = self.groups_seen
        return {
            "credit/groups": float(seen),
            "credit/groups_skipped": float(self.groups_skipped),
            "credit/skipped_fraction": self.groups_skipped / seen if seen else 0.0,
        }
