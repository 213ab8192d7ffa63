"""Chat prompts for the order policy, laid out so the prefix cache does most of the work.

A phase asks all seven powers of every fork of one decision state for orders, so the text is
ordered from the most shared to the least: the rules (identical for every request), then the board
(identical for every power and every fork of a phase), then the few lines that name the power and
what it must order. The Qwen3 chat format is written here by hand rather than through a tokenizer's
chat template, so the shared part is byte-identical whatever tokenizer or template version is used.

The assistant turn is primed with `<orders>\\n` (after an empty think block, which is how Qwen3
marks thinking as off), so the completion starts with the first order line, the form the decoding
constraint expects. With `thinking=True` the turn is opened with `<think>\\n` instead: the model
reasons, closes `</think>`, and then writes `<orders>` itself.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from diprl.game.board_text import board_text, last_phase_text
from diprl.game.game import DiplomacyGame
from diprl.game.legal import PhaseKind, PowerOrders
from diprl.game.mapgraph import map_graph

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
OPEN_TAG = "<orders>"
CLOSE_TAG = "</orders>"
# Qwen3's template renders `enable_thinking=False` as an empty think block in the assistant turn.
EMPTY_THINK = "<think>\n\n</think>\n\n"
OPEN_THINK = "<think>\n"

RULES = f"""You play no-press Diplomacy on the standard map: no messages, only orders. Each phase you \
see the board and give orders for your units. Aim: control as many supply centres as possible; 18 \
wins the game.
Orders use A (army) or F (fleet), 3-letter province codes and a coast where needed (STP/NC). Examples:
A PAR H (hold)
A PAR - BUR (move)
A PAR S A MAR - BUR (support a move)
A PAR S F BRE (support a hold)
F ENG C A LON - BRE (convoy)
A LON - BRE VIA (move by convoy)
A PAR R GAS (retreat)
A PAR D (disband)
A PAR B (build an army)
F STP/NC B (build a fleet)
WAIVE (skip a build)
Write only legal orders, exactly one per line, between {OPEN_TAG} and {CLOSE_TAG}, and nothing else."""


class NothingToOrderError(ValueError):
    """Raised when a prompt is asked for a power that has nothing to order this phase."""


@dataclass(frozen=True)
class PromptOptions:
    """What goes into a prompt. `unit_hints` adds each unit's number of legal orders, which tells
    the model how much choice it has without spending tokens on the lists themselves. `reach_hints`
    adds, in movement phases, the supply centres within one move of the power's units and how many units
    it and its strongest rival can bring to each (`reach_section`): the sums a supported attack turns on,
    which a small body would otherwise have to work out from the board's unit lists and the map it
    memorised. Off by default: every shipped policy was trained without them."""

    thinking: bool = False
    unit_hints: bool = True
    reach_hints: bool = False
    include_last_phase: bool = True
    max_prompt_tokens: int = 1536


DEFAULT_PROMPT_OPTIONS = PromptOptions()


@dataclass(frozen=True)
class Prompt:
    """A full chat-formatted prompt and its sections: `chat_prefix(rules, board)` is the part every power and
    fork of a phase share (what the prefix cache reuses)."""

    text: str
    rules: str
    board: str
    power_part: str
    power: str
    phase: str


def chat_prefix(rules: str, board: str) -> str:
    """System message plus the opening of the user turn up to and including the board."""
    return f"{IM_START}system\n{rules}{IM_END}\n{IM_START}user\n{board}\n\n"


def assistant_opening(thinking: bool) -> str:
    """How the assistant turn starts: primed with the orders tag, or open for reasoning."""
    return f"{IM_START}assistant\n" + (OPEN_THINK if thinking else f"{EMPTY_THINK}{OPEN_TAG}\n")


def board_section(game: DiplomacyGame, include_last_phase: bool = True) -> str:
    """The board as every power sees it; nothing power-specific may ever be added here."""
    parts = [board_text(game)]
    if include_last_phase:
        parts.append(last_phase_text(game))
    return "\n\n".join(parts)


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def _unit_at(legal: PowerOrders, loc: str) -> str:
    """The unit text ("F STP/SC") of an orderable province, read off its first legal order."""
    return " ".join(legal.by_loc[loc][0].split()[:2])


def _instruction(legal: PowerOrders) -> str:
    n = legal.n_required
    if legal.kind is PhaseKind.MOVEMENT:
        return f"Movement: give exactly one order for each of your {_plural(n, 'unit')}."
    if legal.kind is PhaseKind.RETREAT:
        return (
            f"Retreats: give exactly one order for each of your {_plural(n, 'dislodged unit')}: "
            "retreat (R) or disband (D)."
        )
    if legal.kind is PhaseKind.BUILD:
        sites = ", ".join(legal.locs)
        return (
            f"Builds: you may build {_plural(n, 'unit')} at your vacant home centres {sites}; "
            "write WAIVE for a build you skip."
        )
    if legal.kind is PhaseKind.DISBAND:
        return f"Disbands: remove exactly {_plural(n, 'unit')}."
    raise NothingToOrderError(f"{legal.power} has nothing to order in {legal.phase}")


def _listing(legal: PowerOrders, unit_hints: bool) -> str:
    if legal.kind is PhaseKind.BUILD:
        heading, names = "Build sites", list(legal.locs)
    else:
        heading = "Your dislodged units" if legal.kind is PhaseKind.RETREAT else "Your units"
        names = [_unit_at(legal, loc) for loc in legal.locs]
    if not unit_hints:
        return f"{heading}: {', '.join(names)}."
    lines = [f"{heading} (legal orders each):"]
    lines += [
        f"{name} ({_plural(len(legal.by_loc[loc]), 'legal order')})"
        for name, loc in zip(names, legal.locs, strict=True)
    ]
    return "\n".join(lines)


def power_section(legal: PowerOrders, unit_hints: bool = True, reach: str = "") -> str:
    """Who the model plays, what the phase asks of it, the centres in reach (`reach_section`, when given) and the
    exact output format."""
    n = legal.n_required
    return "\n".join(
        [
            f"You are {legal.power}.",
            _instruction(legal),
            _listing(legal, unit_hints),
            *([reach] if reach else []),
            f"Write exactly {_plural(n, 'order')}, one per line, between {OPEN_TAG} and {CLOSE_TAG}.",
        ]
    )


def reach_section(game: DiplomacyGame, power: str) -> str:
    """Every supply centre `power` can reach or must defend this move, with the units it and its strongest rival
    can bring to it (a unit in the province or one move away): "BEL unowned: you 2, GERMANY 1". A centre is listed
    when one of `power`'s units can bring itself there, or when it is `power`'s and a rival can. Empty outside
    movement phases."""
    if game.phase_type != "M":
        return ""
    graph = map_graph()
    brought = {  # power -> province -> units that stand there or can move there
        p: Counter(province for unit in game.units(p) for province in {unit[2:5], *graph.reachable_provinces(unit)})
        for p in game.powers
    }
    owner = {centre: p for p in game.powers for centre in game.centres(p)}
    rivals = [p for p in game.powers if p != power]
    lines = []
    for centre in sorted(graph.supply_centres):
        mine = brought[power][centre]
        rival = max(rivals, key=lambda p: brought[p][centre])  # the first of equals, in the powers' order
        best = brought[rival][centre]
        if mine == 0 and not (owner.get(centre) == power and best > 0):
            continue
        held = "yours" if owner.get(centre) == power else owner.get(centre, "unowned")
        lines.append(f"{centre} {held}: you {mine}, " + (f"{rival} {best}" if best else "no rival"))
    return "\n".join(["Centres in reach (units you and the strongest rival can bring):", *lines]) if lines else ""


def build_prompt(game: DiplomacyGame, power: str, options: PromptOptions = DEFAULT_PROMPT_OPTIONS) -> Prompt:
    """The prompt asking `power` for its orders in the game's current phase."""
    legal = game.legal_orders(power)
    board = board_section(game, options.include_last_phase)
    reach = reach_section(game, legal.power) if options.reach_hints else ""
    power_part = power_section(legal, options.unit_hints, reach)
    text = f"{chat_prefix(RULES, board)}{power_part}{IM_END}\n{assistant_opening(options.thinking)}"
    return Prompt(text=text, rules=RULES, board=board, power_part=power_part, power=legal.power, phase=legal.phase)
