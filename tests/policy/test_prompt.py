"""Prompts: a shared prefix up to the board, power-specific tails, and instructions that match the phase."""

from __future__ import annotations

import os
import random
import re
import subprocess
import sys
from functools import lru_cache
from pathlib import Path
from typing import Any

import pytest

from diprl.game import DiplomacyGame, PhaseKind
from diprl.game.board_text import board_text, last_phase_text
from diprl.policy.prompt import (
    RULES,
    NothingToOrderError,
    Prompt,
    PromptOptions,
    build_prompt,
    chat_prefix,
)
from diprl.policy.tokenizer import load_tokenizer

from .states import random_step

ROOT = Path(__file__).resolve().parents[2]


@lru_cache(maxsize=1)
def real_tokenizer() -> Any:
    """The Qwen tokenizer from `diprl.policy.tokenizer` (built offline, cached)."""
    return load_tokenizer()


@lru_cache(maxsize=1)
def states_by_kind() -> dict[PhaseKind, tuple[DiplomacyGame, str]]:
    """A (game, power) for every phase kind, from seeded random games (forks, so callers cannot disturb them)."""
    found: dict[PhaseKind, tuple[DiplomacyGame, str]] = {}
    wanted = (PhaseKind.MOVEMENT, PhaseKind.RETREAT, PhaseKind.BUILD, PhaseKind.DISBAND)
    for seed in range(50):
        rng = random.Random(seed)
        game = DiplomacyGame(max_year=1912)
        while not game.is_done and len(found) < len(wanted):
            for power, legal in game.all_legal_orders().items():
                # Movement: a mid-game phase, so the board has a history and powers have grown.
                mid_game = legal.kind is not PhaseKind.MOVEMENT or game.year >= 1904
                if legal.kind in wanted and legal.kind not in found and mid_game:
                    found[legal.kind] = (game.fork(), power)
            random_step(game, rng)
        if len(found) == len(wanted):
            return found
    raise AssertionError(f"no game reached every phase kind; found {sorted(found)}")


def game_at(kind: PhaseKind) -> tuple[DiplomacyGame, str]:
    game, power = states_by_kind()[kind]
    return game.fork(), power


def expected_prefix(game: DiplomacyGame, include_last_phase: bool = True) -> str:
    """The system message and board written out by hand from the chat format and the board text."""
    board = board_text(game) + (f"\n\n{last_phase_text(game)}" if include_last_phase else "")
    return f"<|im_start|>system\n{RULES}<|im_end|>\n<|im_start|>user\n{board}\n\n"


def unit_in(game: DiplomacyGame, power: str, loc: str) -> str:
    """The unit of `power` whose province is `loc`, looked up on the board (not in the legal lists)."""
    units = [*game.units(power), *game.dislodged(power)] if game.phase_type == "R" else list(game.units(power))
    (unit,) = [u for u in units if u.split()[1][:3] == loc]
    return unit


def plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def all_prompts(game: DiplomacyGame, options: PromptOptions | None = None) -> dict[str, Prompt]:
    return {p: build_prompt(game, p, options or PromptOptions()) for p in game.orderable_powers()}


# ------------------------------------------------------------------------------------------ layout
def test_opening_prompt_layout() -> None:
    prompt = build_prompt(DiplomacyGame(), "FRANCE")
    assert prompt.text == (
        expected_prefix(DiplomacyGame())
        + prompt.power_part
        + "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n<orders>\n"
    )
    assert prompt.power == "FRANCE" and prompt.phase == "S1901M"
    assert prompt.power_part.startswith("You are FRANCE.\nMovement: give exactly one order for each of your 3 units.")
    assert prompt.power_part.endswith("Write exactly 3 orders, one per line, between <orders> and </orders>.")
    assert chat_prefix(prompt.rules, prompt.board) == expected_prefix(DiplomacyGame())
    assert prompt.text.count("<|im_start|>") == 3 and prompt.text.count("<|im_end|>") == 2


def test_rules_show_every_order_type_in_canonical_form() -> None:
    for example in ("A PAR - BUR", "A PAR H", "A PAR S A MAR - BUR", "A PAR S F BRE", "F ENG C A LON - BRE",
                    "A LON - BRE VIA", "A PAR R GAS", "A PAR D", "A PAR B", "F STP/NC B", "WAIVE"):  # fmt: skip
        assert f"\n{example} (" in RULES, example
    assert "<orders>" in RULES and "</orders>" in RULES


@pytest.mark.parametrize("where", ["opening", "movement", "retreat", "build"])
def test_all_powers_share_the_prefix_up_to_the_board(where: str) -> None:
    if where == "opening":
        game = DiplomacyGame()
    else:
        game, _ = game_at(PhaseKind(where))
    common = expected_prefix(game)
    prompts = all_prompts(game)
    assert len(prompts) >= 2 or where != "opening"
    tails = set()
    for power, prompt in prompts.items():
        assert prompt.text.startswith(common), power
        tail = prompt.text[len(common) :]
        assert tail.startswith(f"You are {power}.\n")
        tails.add(tail)
    assert len(tails) == len(prompts)
    if where == "opening":
        assert len(prompts) == 7


def test_board_part_has_nothing_power_specific() -> None:
    game, _ = game_at(PhaseKind.MOVEMENT)
    boards = {p.board for p in all_prompts(game).values()}
    assert len(boards) == 1
    assert "You are" not in boards.pop()


def test_forks_of_one_phase_give_identical_prompts() -> None:
    game, _ = game_at(PhaseKind.MOVEMENT)
    a, b = game.fork(), game.fork()
    for power in game.orderable_powers():
        assert build_prompt(a, power) == build_prompt(b, power) == build_prompt(game, power)


def test_forks_diverge_only_after_a_step() -> None:
    game = DiplomacyGame()
    a, b = game.fork(), game.fork()
    a.step({"FRANCE": ["A PAR - BUR"]})
    b.step({"FRANCE": ["A PAR - PIC"]})
    assert build_prompt(a, "FRANCE").board != build_prompt(b, "FRANCE").board


def test_rules_identical_across_phases_and_options() -> None:
    prompts = [build_prompt(DiplomacyGame(), "FRANCE")]
    for kind in (PhaseKind.MOVEMENT, PhaseKind.RETREAT, PhaseKind.BUILD, PhaseKind.DISBAND):
        game, power = game_at(kind)
        prompts.append(build_prompt(game, power))
        prompts.append(build_prompt(game, power, PromptOptions(thinking=True, unit_hints=False)))
    system = f"<|im_start|>system\n{RULES}<|im_end|>\n<|im_start|>user\n"
    assert {p.rules for p in prompts} == {RULES}
    assert all(p.text.startswith(system) for p in prompts)
    assert len({p.phase for p in prompts}) >= 4


# ----------------------------------------------------------------------------------- power part
@pytest.mark.parametrize("kind", [PhaseKind.MOVEMENT, PhaseKind.RETREAT, PhaseKind.DISBAND])
def test_every_unit_is_listed_with_its_number_of_legal_orders(kind: PhaseKind) -> None:
    game, power = game_at(kind)
    legal = game.legal_orders(power)
    part = build_prompt(game, power).power_part
    for loc, orders in legal.by_loc.items():
        assert f"\n{unit_in(game, power, loc)} ({plural(len(orders), 'legal order')})\n" in part


def test_opening_counts_for_france() -> None:
    part = build_prompt(DiplomacyGame(), "FRANCE").power_part
    assert "\nF BRE (9 legal orders)\nA MAR (10 legal orders)\nA PAR (11 legal orders)\n" in part


def test_movement_instruction() -> None:
    game, power = game_at(PhaseKind.MOVEMENT)
    n = len(game.units(power))
    part = build_prompt(game, power).power_part
    assert f"\nMovement: give exactly one order for each of your {plural(n, 'unit')}.\n" in part
    assert f"Write exactly {plural(n, 'order')}, one per line" in part


def test_retreat_instruction() -> None:
    game, power = game_at(PhaseKind.RETREAT)
    dislodged = game.dislodged(power)
    part = build_prompt(game, power).power_part
    assert f"Retreats: give exactly one order for each of your {plural(len(dislodged), 'dislodged unit')}" in part
    for unit, destinations in dislodged.items():
        # One retreat per destination, plus the disband.
        assert f"\n{unit} ({plural(len(destinations) + 1, 'legal order')})" in part


def test_build_instruction() -> None:
    game, power = game_at(PhaseKind.BUILD)
    occupied = {u.split()[1][:3] for p in game.powers for u in game.units(p)}
    sites = [h for h in game.homes(power) if h in game.centres(power) and h not in occupied]
    n = min(len(game.centres(power)) - len(game.units(power)), len(sites))
    part = build_prompt(game, power).power_part
    assert (
        f"\nBuilds: you may build {plural(n, 'unit')} at your vacant home centres {', '.join(sites)}; "
        "write WAIVE for a build you skip.\n"
    ) in part
    assert f"Write exactly {plural(n, 'order')}" in part
    legal = game.legal_orders(power)
    for site in sites:
        assert f"\n{site} ({plural(len(legal.by_loc[site]), 'legal order')})" in part


def test_disband_instruction() -> None:
    game, power = game_at(PhaseKind.DISBAND)
    n = len(game.units(power)) - len(game.centres(power))
    part = build_prompt(game, power).power_part
    assert f"\nDisbands: remove exactly {plural(n, 'unit')}.\n" in part
    assert f"Write exactly {plural(n, 'order')}" in part


def test_power_with_nothing_to_order_is_refused() -> None:
    game, _ = game_at(PhaseKind.RETREAT)
    idle = next(p for p in game.powers if p not in game.orderable_powers())
    with pytest.raises(NothingToOrderError, match=idle):
        build_prompt(game, idle)


# ----------------------------------------------------------------------------------------- options
def test_thinking_opens_a_think_block_instead_of_priming_orders() -> None:
    prompt = build_prompt(DiplomacyGame(), "FRANCE", PromptOptions(thinking=True))
    assert prompt.text.endswith("<|im_end|>\n<|im_start|>assistant\n<think>\n")
    assert "</think>" not in prompt.text
    plain = build_prompt(DiplomacyGame(), "FRANCE")
    assert plain.text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n<orders>\n")
    assert (prompt.rules, prompt.board) == (plain.rules, plain.board)  # the same shared prefix


def test_without_unit_hints_units_are_listed_without_counts() -> None:
    part = build_prompt(DiplomacyGame(), "FRANCE", PromptOptions(unit_hints=False)).power_part
    assert "legal order" not in part
    assert "Your units: F BRE, A MAR, A PAR." in part


def test_without_last_phase_the_board_is_the_board_text() -> None:
    game, power = game_at(PhaseKind.MOVEMENT)
    prompt = build_prompt(game, power, PromptOptions(include_last_phase=False))
    assert prompt.board == board_text(game)
    assert prompt.text.startswith(expected_prefix(game, include_last_phase=False))
    assert "Previous phase" not in prompt.text
    assert last_phase_text(game) in build_prompt(game, power).board


# ----------------------------------------------------------------------------------- determinism
def test_same_input_same_text() -> None:
    game, _ = game_at(PhaseKind.BUILD)
    first = all_prompts(game)
    assert all_prompts(game.fork()) == first == all_prompts(game)


_DIGEST_SCRIPT = """
import hashlib, random
from diprl.game import DiplomacyGame, PhaseKind
from diprl.policy.prompt import build_prompt
rng = random.Random(7)
game = DiplomacyGame(max_year=1903)
digest = hashlib.sha256()
while not game.is_done:
    for power in game.orderable_powers():
        digest.update(build_prompt(game, power).text.encode())
    orders = {}
    for power, legal in game.all_legal_orders().items():
        if legal.kind in (PhaseKind.MOVEMENT, PhaseKind.RETREAT):
            orders[power] = [rng.choice(o) for o in legal.by_loc.values()]
        elif legal.kind in (PhaseKind.BUILD, PhaseKind.DISBAND):
            locs = rng.sample(sorted(legal.by_loc), legal.n_required)
            orders[power] = [rng.choice(legal.by_loc[loc]) for loc in locs]
    game.step(orders)
print(digest.hexdigest())
"""


def test_text_does_not_depend_on_the_hash_seed() -> None:
    """The engine's own lists follow Python's hash seed; prompts of a seeded game must not."""
    digests = set()
    for hash_seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        out = subprocess.run(
            [sys.executable, "-c", _DIGEST_SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True, check=True
        )
        digests.add(out.stdout.strip())
    assert len(digests) == 1


# ---------------------------------------------------------------------------------------- tokens
def test_qwen_prefix_tokens_are_shared_and_prompts_fit_the_budget() -> None:
    """Prefix caching works on token ids: the shared text must tokenize to a prefix of every prompt."""
    tokenizer = real_tokenizer()
    budget = PromptOptions().max_prompt_tokens
    assert len(tokenizer.encode(RULES)) <= 250
    for kind in (PhaseKind.MOVEMENT, PhaseKind.RETREAT, PhaseKind.BUILD):
        game, _ = game_at(kind)
        for prompt in all_prompts(game).values():
            prefix_ids = tokenizer.encode(chat_prefix(prompt.rules, prompt.board))
            ids = tokenizer.encode(prompt.text)
            assert ids[: len(prefix_ids)] == prefix_ids
            assert len(ids) <= budget, f"{prompt.power} at {prompt.phase}: {len(ids)} tokens, over {budget}"


def test_hints_match_the_legal_lists_through_random_games() -> None:
    """Every orderable power of every phase: the instruction's count and each listed count are the lists'."""
    rng = random.Random(3)
    game = DiplomacyGame(max_year=1906)
    seen: set[PhaseKind] = set()
    while not game.is_done:
        for power in game.orderable_powers():
            legal = game.legal_orders(power)
            part = build_prompt(game, power).power_part
            seen.add(legal.kind)
            assert f"Write exactly {plural(legal.n_required, 'order')}, one per line" in part
            listed = part.split("\n")[3:-1]
            assert len(listed) == len(legal.locs)
            for line, (loc, options) in zip(listed, legal.by_loc.items(), strict=True):
                assert line.endswith(f" ({plural(len(options), 'legal order')})")
                assert line.split(" (")[0].split()[-1][:3] == loc
        random_step(game, rng)
    assert {PhaseKind.MOVEMENT, PhaseKind.BUILD} <= seen


# ----------------------------------------------------------------------------------- reach hints
def _brought_by_the_engine(game: DiplomacyGame, power: str, centre: str) -> int:
    """Units of `power` in `centre` or with a legal move into it, read off the engine's own legal orders."""
    legal = game.legal_orders(power)
    count = 0
    for loc, orders in legal.by_loc.items():
        moves_in = any(o.split()[2:3] == ["-"] and o.split()[3][:3] == centre and not o.endswith("VIA") for o in orders)
        count += loc[:3] == centre or moves_in
    return count


REACH_LINE = re.compile(r"([A-Z]{3}) (yours|unowned|[A-Z]+): you (\d+), (?:no rival|([A-Z]+) (\d+))")


def test_reach_hints_count_each_sides_units_as_the_engines_legal_moves_do() -> None:
    """Every centre line of every power's movement prompt in a random game, recounted from the legal orders:
    the centres listed, their owners, the power's count and the strongest rival's."""
    rng = random.Random(5)
    game = DiplomacyGame(max_year=1905)
    checked = 0
    while not game.is_done:
        for power in game.orderable_powers():
            part = build_prompt(game, power, PromptOptions(reach_hints=True)).power_part
            plain = build_prompt(game, power).power_part
            if game.phase_type != "M":
                assert part == plain
                continue
            head, _, rest = part.partition("Centres in reach (units you and the strongest rival can bring):\n")
            *lines, last = rest.split("\n")
            assert f"{head}{last}" == plain  # added before the closing line; nothing else moves
            owner = {c: p for p in game.powers for c in game.centres(p)}
            centres = [c.upper() for c in game.engine.map.scs]
            counts = {c: {p: _brought_by_the_engine(game, p, c) for p in game.powers} for c in centres}
            rivals = {c: max(n for p, n in by.items() if p != power) for c, by in counts.items()}
            wanted = {c for c, by in counts.items() if by[power] or (owner.get(c) == power and rivals[c])}
            parsed = [REACH_LINE.fullmatch(line) for line in lines]
            assert all(parsed), lines
            assert [m[1] for m in parsed if m] == sorted(wanted)
            for m in filter(None, parsed):
                centre = m[1]
                assert m[2] == ("yours" if owner.get(centre) == power else owner.get(centre, "unowned"))
                assert int(m[3]) == counts[centre][power]
                if rivals[centre] == 0:
                    assert m[4] is None
                else:
                    assert m[4] != power and int(m[5]) == counts[centre][m[4]] == rivals[centre]
                checked += 1
        random_step(game, rng)
    assert checked > 100
