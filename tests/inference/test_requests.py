"""Request validation without an engine: every malformed request issue 12 found is refused, naming the
field, and every request a real game produces is accepted unchanged."""

from __future__ import annotations

import random
from typing import Any

import pytest

from diprl.bots import make_agent
from diprl.game import DiplomacyGame, PhaseKind
from diprl.game.legal import PowerOrders
from diprl.inference.requests import EngineLimits, RequestError, validate_batch, validate_legal, validate_request

LIMITS = EngineLimits(max_model_len=2048, vocab_size=151_669)


def good() -> dict[str, Any]:
    game = DiplomacyGame()
    return {"policy": "base", "prompt": "A PAR", "legal": game.legal_orders("FRANCE").to_dict(), "temperature": 1.0}


def legal_with(**changes: Any) -> dict[str, Any]:
    return {**good()["legal"], **changes}


def test_a_good_request_passes_with_defaults() -> None:
    valid = validate_request(good(), LIMITS)
    assert valid.max_tokens == 384 and valid.temperature == 1.0 and valid.legal is not None
    assert valid.legal == PowerOrders.from_dict(good()["legal"])
    assert validate_request({"prompt": [1, 2, 3]}, LIMITS).policy == "base"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"prompt": [True]}, r"'prompt' token 0 must be an int id"),  # found: killed the engine's input thread
        ({"prompt": [-1]}, r"'prompt' token 0"),
        ({"prompt": [10**10]}, r"'prompt' token 0"),
        ({"prompt": [151_700]}, r"in \[0, 151669\)"),
        ({"prompt": [1] * 2048}, "the context holds 2048"),
        ({"prompt": "x\ud800y"}, "not valid unicode"),
        ({"prompt": ""}, "non-empty"),
        ({"prompt": []}, "non-empty"),
        ({"prompt": None}, "'prompt' must be"),
        ({"prompt": "x" * 200_000}, "far beyond the context"),
        ({"temperature": float("nan")}, "'temperature' must be 0 \\(greedy\\) or a finite number"),
        ({"temperature": float("inf")}, "'temperature'"),
        ({"temperature": 1e308}, "'temperature'"),
        ({"temperature": 0.001}, "'temperature' must be 0 \\(greedy\\)"),
        ({"temperature": -1.0}, "'temperature'"),
        ({"sample_seed": -1}, "'sample_seed'"),
        ({"sample_seed": 2**63}, "'sample_seed'"),
        ({"sample_seed": 1.5}, "'sample_seed'"),
        ({"sample_seed": True}, "'sample_seed'"),
        ({"temperature": True}, "'temperature'"),
        ({"temperature": "1.0"}, "'temperature'"),
        ({"max_tokens": 10**30}, r"'max_tokens' must be an int in \[1, 2048\]"),
        ({"max_tokens": True}, "'max_tokens'"),  # found: accepted as 1
        ({"max_tokens": 0}, "'max_tokens'"),
        ({"max_tokens": 16.0}, "'max_tokens'"),
        ({"reasoning_max_tokens": -1}, "'reasoning_max_tokens'"),
        ({"reasoning_max_tokens": False}, "'reasoning_max_tokens'"),
        ({"policy": 3}, "'policy' must be a string"),
        ({"request_id": ""}, "'request_id'"),
        ({"request_id": "a\nb"}, "'request_id'"),
        ({"request_id": 7}, "'request_id'"),
        ({"temprature": 0.5}, r"unknown request fields \['temprature'\]"),
        ({"legal": "FRANCE"}, "'legal' must be PowerOrders.to_dict"),
    ],
)
def test_malformed_fields_are_refused_naming_the_field(change: dict[str, Any], message: str) -> None:
    with pytest.raises(RequestError, match=message):
        validate_request({**good(), **change}, LIMITS)


def test_greedy_and_seeded_requests_are_valid() -> None:
    valid = validate_request({**good(), "temperature": 0, "sample_seed": 2**63 - 1}, LIMITS)
    assert valid.temperature == 0.0 and valid.sample_seed == 2**63 - 1
    assert validate_request(good(), LIMITS).sample_seed is None
    request = {k: v for k, v in good().items() if k != "legal"}
    with pytest.raises(RequestError, match="only applies to constrained"):
        validate_request({**request, "sample_seed": 3}, LIMITS)


def test_reasoning_budget_needs_legal_orders() -> None:
    request = {k: v for k, v in good().items() if k != "legal"}
    with pytest.raises(RequestError, match="only applies to constrained"):
        validate_request({**request, "reasoning_max_tokens": 10}, LIMITS)


@pytest.mark.parametrize(
    ("legal", "message"),
    [
        # Found: passed PowerOrders.from_dict, then OrderConstraint raised inside vLLM's loop.
        (legal_with(kind="none", by_loc={}, n_required=5), "nothing to order"),
        (legal_with(by_loc={}), "nothing to order"),
        # Found: silently accepted.
        (legal_with(by_loc={"PAR": ["A MAR - SPA"]}, n_required=1), "an order for a unit in MAR, not PAR"),
        (legal_with(by_loc={"PAR": ["A PAR H\n</orders>"]}, n_required=1), "not a movement order"),
        (legal_with(by_loc={"PAR": [""]}, n_required=1), "not a movement order"),
        (legal_with(by_loc={"PAR": ["A PAR H", "A PAR H"]}, n_required=1), "distinct"),
        (legal_with(by_loc={"PAR": [7]}, n_required=1), "distinct order strings"),
        (legal_with(by_loc={"PAR": []}, n_required=1), "list of 1-512 orders"),
        (legal_with(by_loc={"paris": ["A PAR H"]}, n_required=1), "not a location"),
        (legal_with(by_loc={"PAR": ["A PAR B"]}, n_required=1), "not a movement order"),
        (legal_with(power="ATLANTIS"), "'legal.power' must be one of"),
        (legal_with(phase="S1901X"), "'legal.phase'"),
        (legal_with(kind="retreat"), "cannot occur in phase S1901M"),
        (legal_with(kind="building"), "'legal.kind' must be one of"),
        (legal_with(n_required=True), "'legal.n_required' must be an int"),
        (legal_with(n_required=2), r"= the number of locations \(3\)"),
        ({**good()["legal"], "extra": 1}, "exactly the keys"),
        ({k: v for k, v in good()["legal"].items() if k != "phase"}, "exactly the keys"),
    ],
)
def test_inconsistent_legal_orders_are_refused(legal: dict[str, Any], message: str) -> None:
    with pytest.raises(RequestError, match=message):
        validate_legal(legal)


def test_a_string_or_a_dict_is_not_a_batch() -> None:
    with pytest.raises(RequestError, match="generate takes a list of request dicts, got str"):
        validate_batch("a string", 10)  # found: treated as one request per character
    with pytest.raises(RequestError, match="got dict"):
        validate_batch(good(), 10)
    with pytest.raises(RequestError, match="at most 2"):
        validate_batch([good()] * 3, 2)
    assert validate_batch([good()], 2) == [good()]


def test_every_legal_order_set_a_real_game_produces_is_accepted_unchanged() -> None:
    """Seeded bot games to 1910: movement, retreats, builds and disbands all pass validation as is."""
    rng = random.Random(0)
    kinds: set[PhaseKind] = set()
    checked = 0
    for seed in range(3):
        game = DiplomacyGame(max_year=1910)
        agents = {p: make_agent(rng.choice(["dumbbot", "random"]), seed * 7 + i) for i, p in enumerate(game.powers)}
        while not game.is_done:
            for power in game.orderable_powers():
                legal = game.legal_orders(power)
                assert validate_legal(legal.to_dict()) == legal, (legal.phase, power)
                kinds.add(legal.kind)
                checked += 1
            game.step({p: agents[p].orders(game, p) for p in game.orderable_powers()})
    assert {PhaseKind.MOVEMENT, PhaseKind.RETREAT, PhaseKind.BUILD} <= kinds and checked > 100


def test_every_fuzzed_malformed_request_is_refused_by_validation() -> None:
    """The strategies the server fuzz test uses make only invalid requests (checked here without an engine)."""
    from hypothesis import HealthCheck, given, settings

    from diprl.inference.adapters import InvalidAdapterName

    from .fuzz_requests import malformed_request

    @settings(max_examples=150, deadline=None, database=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(malformed_request(good()))
    def refused(request: Any) -> None:
        with pytest.raises((RequestError, InvalidAdapterName)):
            validate_request(request, LIMITS)

    refused()
