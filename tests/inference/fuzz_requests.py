"""Hypothesis strategies for malformed generation requests: each one is invalid by construction.

A malformed request is a good one with one or two fields broken (a wrong type, a value out of range,
bad unicode, inconsistent legal orders, an unknown field), or not a dict at all. Every one must be
refused by validation, so a test can demand an error for each and a complete answer for every
good request beside them.
"""

from __future__ import annotations

import math
from typing import Any

from hypothesis import strategies as st

from diprl.inference.requests import MAX_TEMPERATURE, MIN_TEMPERATURE, REQUEST_KEYS

VOCAB = 151_669
CONTEXT = 2048

junk = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
    st.lists(st.integers(min_value=-5, max_value=5), max_size=4),
    st.dictionaries(st.text(max_size=5), st.integers(), max_size=3),
)
surrogates = st.text(alphabet=st.characters(categories=["Cs"]), min_size=1, max_size=3)


def _not_number_in(low: float, high: float) -> st.SearchStrategy[Any]:
    def outside(x: Any) -> bool:
        if isinstance(x, bool) or not isinstance(x, int | float):
            return True
        return not (math.isfinite(x) and low <= x <= high)

    return junk.filter(outside)


# 0 is greedy decoding (evaluation); anything else outside [MIN, MAX] is refused.
_not_temperature = _not_number_in(MIN_TEMPERATURE, MAX_TEMPERATURE).filter(lambda x: not (x == 0 and x is not False))


def _not_int_in(low: int, high: int) -> st.SearchStrategy[Any]:
    return junk.filter(lambda x: isinstance(x, bool) or not isinstance(x, int) or not low <= x <= high)


bad_prompt = st.one_of(
    st.just(""),
    st.just([]),
    st.lists(st.integers(min_value=VOCAB, max_value=2**64), min_size=1, max_size=5),
    st.lists(st.integers(max_value=-1), min_size=1, max_size=5),
    st.lists(st.booleans(), min_size=1, max_size=5),
    st.builds(lambda s, t: f"A PAR{s}{t}", surrogates, st.text(max_size=5)),
    st.just([7] * (CONTEXT + 10)),
    junk.filter(lambda x: not (isinstance(x, str) and x) and not isinstance(x, list)),
)


@st.composite
def bad_legal(draw: st.DrawFn, legal: dict[str, Any]) -> Any:
    locs = sorted(legal["by_loc"])
    loc = draw(st.sampled_from(locs))
    other = draw(st.sampled_from([x for x in locs if x != loc]))
    kind = draw(st.integers(min_value=0, max_value=10))
    by_loc = dict(legal["by_loc"])
    if kind == 0:
        return {**legal, "kind": "none", "by_loc": {}, "n_required": draw(st.integers(0, 9))}
    if kind == 1:  # another unit's order under this location
        return {**legal, "by_loc": {**by_loc, loc: list(by_loc[other])}}
    if kind == 2:  # an order that smuggles text into the completion
        suffix = draw(st.sampled_from(["\n</orders>", "\n", " ", "\x00", "</orders>"]))
        return {**legal, "by_loc": {**by_loc, loc: [*by_loc[loc][:-1], by_loc[loc][-1] + suffix]}}
    if kind == 3:
        return {**legal, "by_loc": {**by_loc, loc: [""]}}
    if kind == 4:
        n = draw(st.integers(min_value=-3, max_value=40).filter(lambda n: n != len(by_loc)))
        return {**legal, "n_required": n}
    if kind == 5:
        return {**legal, "power": draw(st.text(max_size=10).filter(lambda p: p != legal["power"]))}
    if kind == 6:
        drop = draw(st.sampled_from(sorted(legal)))
        return {k: v for k, v in legal.items() if k != drop}
    if kind == 7:
        return {**legal, "by_loc": {**by_loc, loc: [draw(junk)]}}
    if kind == 8:
        return {**legal, "kind": draw(st.text(max_size=8).filter(lambda k: k != legal["kind"]))}
    if kind == 9:
        return {**legal, "by_loc": {**by_loc, loc: [by_loc[loc][0] + draw(surrogates)]}}
    return draw(junk.filter(lambda x: x is not None))


@st.composite
def malformed_request(draw: st.DrawFn, good: dict[str, Any]) -> Any:
    choice = draw(st.integers(min_value=0, max_value=9))
    request = dict(good)
    if choice == 0:
        return draw(junk.filter(lambda x: not isinstance(x, dict)))
    if choice == 1:
        request["prompt"] = draw(bad_prompt)
    elif choice == 2:
        request["temperature"] = draw(_not_temperature)
    elif choice == 3:
        request["max_tokens"] = draw(_not_int_in(1, CONTEXT))
    elif choice == 4:
        request["reasoning_max_tokens"] = draw(_not_int_in(0, CONTEXT).filter(lambda x: x is not None))
    elif choice == 5:
        request["policy"] = draw(junk.filter(lambda p: p != "base"))
    elif choice == 6:
        request["legal"] = draw(bad_legal(good["legal"]))
    elif choice == 7:
        request[draw(st.text(min_size=1, max_size=10).filter(lambda k: k not in REQUEST_KEYS))] = draw(junk)
    elif choice == 8:
        request["request_id"] = draw(st.one_of(st.just(""), st.text(min_size=130), st.just("a\nb"), st.integers()))
    else:  # two broken fields at once
        request["prompt"] = draw(bad_prompt)
        request["temperature"] = draw(_not_temperature)
    return request


def malformed_requests(good: dict[str, Any], count: int) -> st.SearchStrategy[list[Any]]:
    return st.lists(malformed_request(good), min_size=count, max_size=count)
