"""Which teacher decisions to keep: a quota per (power, phase class), filled like water.

Bot games are dominated by movement phases and by the powers that survive longest, so when a cap
is set the kept decisions are stratified over (power, phase class): the cap is shared over the
strata by class weight, equally over powers, and what a small stratum cannot use goes to the
others (`allocate`), so scarce retreats and builds are never sampled away.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from diprl.imitation.teacher import TeacherExample


def allocate(available: Mapping[Any, int], weights: Mapping[Any, float], total: int) -> dict[Any, int]:
    """Split `total` over strata in proportion to `weights`, never above what a stratum has.

    Water-filling: a stratum that cannot take its share keeps all it has, and the rest is shared
    again over the others, so the total is met whenever enough examples exist. Shares are
    rounded down and the remainder goes, one each, to the strata with the largest fractional
    parts (ties by key order), which makes the result deterministic.
    """
    out = {key: 0 for key in available}
    open_keys = [k for k in sorted(available) if available[k] > 0 and weights.get(k, 0.0) > 0]
    left = min(total, sum(available[k] for k in open_keys))
    while left > 0 and open_keys:
        weight = sum(weights[k] for k in open_keys)
        shares = {k: left * weights[k] / weight for k in open_keys}
        full = [k for k in open_keys if shares[k] >= available[k] - out[k]]
        if full:
            for k in full:
                left -= available[k] - out[k]
                out[k] = available[k]
            open_keys = [k for k in open_keys if k not in full]
            continue
        floors = {k: int(shares[k]) for k in open_keys}
        for k in open_keys:
            out[k] += floors[k]
        rest = left - sum(floors.values())
        for k in sorted(open_keys, key=lambda k: (-(shares[k] - floors[k]), open_keys.index(k)))[:rest]:
            out[k] += 1
        left = 0
    return out


def stratified_sample(
    candidates: Sequence[TeacherExample], limit: int | None, class_weights: Mapping[str, float], rng: random.Random
) -> list[TeacherExample]:
    """Up to `limit` candidates, spread over (power, phase class) strata by `allocate`, in game order."""
    if limit is None or limit >= len(candidates):
        return list(candidates)
    by_stratum: dict[tuple[str, str], list[TeacherExample]] = {}
    for example in candidates:
        by_stratum.setdefault(example.stratum, []).append(example)
    powers = sorted({p for p, _ in by_stratum})
    weights = {(p, c): class_weights.get(c, 0.0) / max(len(powers), 1) for p, c in by_stratum}
    quota = allocate({k: len(v) for k, v in by_stratum.items()}, weights, limit)
    kept: list[TeacherExample] = []
    for key in sorted(by_stratum):
        kept.extend(rng.sample(by_stratum[key], quota[key]))
    return sorted(kept, key=lambda e: (e.game, phase_order(e.phase), e.power))


def phase_order(phase: str) -> tuple[int, int]:
    """Chronological key of a phase name such as S1901M / F1901R / W1901A."""
    season = {"S": 0, "F": 1, "W": 2}.get(phase[:1], 3)
    sub = {"M": 0, "R": 1, "A": 2}.get(phase[-1:], 3)
    return int(phase[1:5]) if phase[1:5].isdigit() else 0, season * 3 + sub


def strata_counts(examples: Iterable[TeacherExample]) -> dict[str, int]:
    """`"POWER/class" -> n`, for manifests and reports."""
    counts = Counter(f"{p}/{c}" for p, c in (e.stratum for e in examples))
    return dict(sorted(counts.items()))
