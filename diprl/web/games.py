"""Games the web app can show: evaluation replays, training traces and games played in the browser.

    <run>/eval/<tag>/replays/<opponent>/game0003/replay.json   (+ frames/*.svg, index.html)  evaluation
    <run>/eval/crossplay/rounds/<round>/<a>_vs_<b>/game0000/replay.json   (the same)       scheduled crossplay
    <run>/traces/<match_id>.json                                                              training trace
    <runs>/play/<game_id>/replay.json  (+ game.json: seats, the person's power, status)       played here

Replays are the engine's saved-game format (`diprl.game.replay.to_saved_game`): one entry per phase with
the state before adjudication, the orders played and the results. A trace (`diprl.rollout.episode`) holds
the match (seats, hero, seed), the decision phase and one entry per fork: the hero's completion, orders,
return, reward components, per-order rewards and that fork's replay. Traces are read defensively: the
format grows (per-seat entries, advantages), so known fields are shown as such and anything else is
passed on as plain data, and a file that is not what it claims is listed with its problem instead of
breaking the page.

A listing can be narrowed to the games of one league member against another (`games_between`): the
league page links each figure to the games behind it that way. A member is a PolicyRef (`main@v12`,
`bot:dumbbot`) or a trained policy's name (`main`: any of its versions, as the league's payoff counts
them); seats come from each game's own file (a trace's match, a replay's viewer page, a played game's
metadata), read once per file version.

Games are named by ids made from their place in a listing (`eval/step3/bot_random/game0000`,
`crossplay/crossplay-step4/main@v3_vs_bot_dumbbot/game0000`, `trace/main-12`, `play/<id>`), and an id
is resolved by listing again: no path is ever built from a request. Boards are the engine's own SVG: an
evaluation replay's pre-rendered frame when it has one, otherwise rendered here (about 0.1 s a phase) and
kept in a small cache.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from diprl.web.runs import PLAY_DIR

KNOWN_FORK_KEYS = ("completion", "orders", "complete", "return", "components", "order_rewards", "replay")
_SEATS_RE = re.compile(r"^const SEATS = (.*);$", re.MULTILINE)
_HERO_RE = re.compile(r"^const HERO = (.*);$", re.MULTILINE)


class UnknownGame(LookupError):
    """A game id that names nothing in the listing."""


class BadGameFile(ValueError):
    """A replay or trace file that cannot be read as one."""


@dataclass(frozen=True)
class GameEntry:
    """One game in a listing; `path` is the replay or trace file."""

    kind: str  # eval | trace | play
    id: str
    path: Path
    title: str
    updated: float
    run: str | None = None
    note: str = ""  # e.g. "in play", "finished"


@dataclass
class GameView:
    """A loaded game: seats, hero, and one or more replays (a trace has one per fork)."""

    entry: GameEntry
    seats: dict[str, str]
    hero: str | None
    forks: list[dict[str, Any]]  # [{"label", "phases": [...], "info": {...}}]
    info: dict[str, Any] = field(default_factory=dict)  # trace-level fields (match, decision phase, extras)


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


# ------------------------------------------------------------------------------------------ listing
def eval_replays(run: str, run_dir: Path) -> Iterator[GameEntry]:
    eval_dir = run_dir / "eval"
    if not eval_dir.is_dir():
        return
    for path in sorted(eval_dir.glob("*/replays/**/replay.json")):
        rel = path.parent.relative_to(eval_dir)
        tag, rest = rel.parts[0], rel.parts[2:]
        gid = "/".join(("eval", tag, *rest))
        yield GameEntry("eval", gid, path, f"evaluation {tag}: {'/'.join(rest)}", _mtime(path), run)


def crossplay_replays(run: str, run_dir: Path) -> Iterator[GameEntry]:
    """The replays a training run's scheduled crossplay kept (`Evaluator.crossplay`): evaluation replays
    in all but place, one folder per round."""
    rounds_dir = run_dir / "eval" / "crossplay" / "rounds"
    if not rounds_dir.is_dir():
        return
    for path in sorted(rounds_dir.glob("*/*/*/replay.json")):
        tag, pair, game = path.parent.relative_to(rounds_dir).parts
        gid = f"crossplay/{tag}/{pair}/{game}"
        yield GameEntry("eval", gid, path, f"crossplay {tag}: {pair.replace('_vs_', ' vs ')} {game}", _mtime(path), run)


def traces(run: str, run_dir: Path) -> Iterator[GameEntry]:
    trace_dir = run_dir / "traces"
    if not trace_dir.is_dir():
        return
    for path in sorted(trace_dir.glob("*.json")):
        yield GameEntry("trace", f"trace/{path.stem}", path, f"training trace {path.stem}", _mtime(path), run)


def played_games(runs_dir: Path) -> Iterator[GameEntry]:
    play_dir = runs_dir / PLAY_DIR
    if not play_dir.is_dir():
        return
    for path in sorted(play_dir.glob("*/replay.json")):
        meta = read_play_meta(path.parent)
        note = str(meta.get("status", ""))
        human = meta.get("human")
        title = f"played {path.parent.name}" + (f" ({human})" if human else "")
        yield GameEntry("play", f"play/{path.parent.name}", path, title, _mtime(path), None, note)


def read_play_meta(game_dir: Path) -> dict[str, Any]:
    try:
        data = json.loads((game_dir / "game.json").read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def run_games(run: str, run_dir: Path) -> list[GameEntry]:
    """The games one run kept: evaluation replays, scheduled crossplay's replays, training traces."""
    return [*eval_replays(run, run_dir), *crossplay_replays(run, run_dir), *traces(run, run_dir)]


def list_games(runs_dir: Path, run: str | None, run_dir: Path | None) -> list[GameEntry]:
    """The games of one run (evaluation and crossplay replays, traces) and every game played in the browser."""
    games: list[GameEntry] = []
    if run is not None and run_dir is not None:
        games += run_games(run, run_dir)
    games += list(played_games(runs_dir))
    return games


def plays(ref: str, member: str) -> bool:
    """Whether a seat's PolicyRef `ref` plays for league member `member` (see the module doc).

    An exploiter's generation label (`main_exploiter#2`, the league's health records) stands for its policy.
    """
    member = member.split("#", 1)[0]
    return ref == member or ("@" not in member and ref.startswith(f"{member}@v"))


def game_seats(entry: GameEntry) -> dict[str, str]:
    """Power -> PolicyRef of a listed game, from its own file; {} when the file does not say."""
    return dict(_seats_cached(str(entry.path), entry.kind, _mtime(entry.path)))


@lru_cache(maxsize=4096)
def _seats_cached(path: str, kind: str, mtime: float) -> tuple[tuple[str, str], ...]:
    seats: Mapping[str, Any] = {}
    if kind == "eval":
        seats = _viewer_constants(Path(path).parent / "index.html")[0]
    elif kind == "play":
        seats = _mapping(read_play_meta(Path(path).parent).get("seats"))
    elif kind == "trace":
        try:
            seats = _mapping(_mapping(_mapping(_read_json(Path(path))).get("match")).get("seats"))
        except BadGameFile:
            seats = {}
    return tuple(sorted((str(p), str(r)) for p, r in seats.items()))


def games_between(games: list[GameEntry], member: str, vs: str | None = None) -> list[GameEntry]:
    """The games in which a seat plays for `member` and, if `vs` is given, another seat plays for `vs`."""
    out = []
    for entry in games:
        refs = list(game_seats(entry).values())
        mine = {i for i, ref in enumerate(refs) if plays(ref, member)}
        if mine and (vs is None or any(plays(ref, vs) and mine - {i} for i, ref in enumerate(refs))):
            out.append(entry)
    return out


def find_game(games: list[GameEntry], game_id: str) -> GameEntry:
    for entry in games:
        if entry.id == game_id:
            return entry
    raise UnknownGame(f"unknown game {game_id[:120]!r}: not among the {len(games)} games listed here")


# ------------------------------------------------------------------------------------------ loading
def _mapping(value: Any) -> Mapping[str, Any]:
    """`value` if it is a JSON object, else an empty one: optional parts of a file are read defensively."""
    return value if isinstance(value, Mapping) else {}


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise BadGameFile(f"{path.name}: unreadable JSON ({exc})") from None


def phases_of(saved: Any, where: str) -> list[dict[str, Any]]:
    """The phases of a saved game, each checked to carry a name and a state; `BadGameFile` otherwise."""
    if not isinstance(saved, Mapping) or not isinstance(saved.get("phases"), list) or not saved["phases"]:
        raise BadGameFile(f"{where}: not a saved game (no list of phases)")
    phases = []
    for i, phase in enumerate(saved["phases"]):
        if not isinstance(phase, Mapping) or not isinstance(phase.get("name"), str):
            raise BadGameFile(f"{where}: phase {i} has no name")
        if not isinstance(phase.get("state"), Mapping):
            raise BadGameFile(f"{where}: phase {i} ({phase['name']}) has no state")
        orders, results = _mapping(phase.get("orders")), _mapping(phase.get("results"))
        centres = _mapping(phase["state"].get("centers"))
        phases.append(
            {
                "name": phase["name"],
                "state": dict(phase["state"]),
                "orders": {str(p): [str(o) for o in (os or [])] for p, os in sorted(orders.items())},
                "results": {str(u): [str(r) for r in (rs or []) if str(r)] for u, rs in results.items()},
                "centres": {str(p): len(c or []) for p, c in sorted(centres.items())},
            }
        )
    return phases


def _viewer_constants(index_html: Path) -> tuple[dict[str, str], str | None]:
    """Seats and hero of an evaluation replay, from its viewer page (the only place they are written)."""
    try:
        text = index_html.read_text(encoding="utf-8")
    except OSError:
        return {}, None
    seats: dict[str, str] = {}
    hero = None
    try:
        if m := _SEATS_RE.search(text):
            value = json.loads(m.group(1))
            seats = {str(k): str(v) for k, v in value.items()} if isinstance(value, dict) else {}
        if m := _HERO_RE.search(text):
            value = json.loads(m.group(1))
            hero = value if isinstance(value, str) else None
    except ValueError:
        return {}, None
    return seats, hero


def load_game(entry: GameEntry) -> GameView:
    if entry.kind == "trace":
        return _load_trace(entry)
    saved = _read_json(entry.path)
    phases = phases_of(saved, entry.path.name)
    if entry.kind == "play":
        meta = read_play_meta(entry.path.parent)
        seats = {str(k): str(v) for k, v in (meta.get("seats") or {}).items()}
        hero = meta.get("human") if isinstance(meta.get("human"), str) else None
        info: dict[str, Any] = {k: meta[k] for k in ("status", "max_year", "run", "created") if k in meta}
        return GameView(entry, seats, hero, [{"label": "game", "index": 0, "phases": phases, "info": {}}], info)
    seats, hero = _viewer_constants(entry.path.parent / "index.html")
    return GameView(entry, seats, hero, [{"label": "game", "index": 0, "phases": phases, "info": {}}])


def _plain(value: Any, limit: int = 2000) -> Any:
    """A JSON-safe, bounded copy of an unknown field (for display only)."""
    text = json.dumps(value, default=str)
    return value if len(text) <= limit else text[:limit] + " ..."


def _load_trace(entry: GameEntry) -> GameView:
    data = _read_json(entry.path)
    if not isinstance(data, Mapping) or not isinstance(data.get("forks"), list):
        raise BadGameFile(f"{entry.path.name}: not a trace (no list of forks)")
    match = _mapping(data.get("match"))
    seats = {str(k): str(v) for k, v in _mapping(match.get("seats")).items()}
    hero = match.get("hero") if isinstance(match.get("hero"), str) else None
    forks = []
    problems = []
    for i, fork in enumerate(data["forks"]):
        if not isinstance(fork, Mapping):
            problems.append(f"fork {i} is not an object")
            continue
        try:
            phases = phases_of(fork.get("replay"), f"{entry.path.name} fork {i}")
        except BadGameFile as exc:
            problems.append(str(exc))
            continue
        info: dict[str, Any] = {
            "completion": fork.get("completion") if isinstance(fork.get("completion"), str) else None,
            "orders": [str(o) for o in fork.get("orders") or [] if isinstance(o, str)],
            "complete": fork.get("complete"),
            "return": fork.get("return") if isinstance(fork.get("return"), int | float) else None,
            "components": _numbers(fork.get("components")),
            "order_rewards": _numbers(fork.get("order_rewards")),
            "extra": {str(k): _plain(v) for k, v in fork.items() if k not in KNOWN_FORK_KEYS},
        }
        forks.append({"label": f"fork {i}", "index": i, "phases": phases, "info": info})
    if not forks:
        raise BadGameFile(f"{entry.path.name}: no fork with a readable replay ({'; '.join(problems) or 'no forks'})")
    info = {
        "match": {str(k): _plain(v) for k, v in match.items() if k != "seats"},
        "decision_phase": data.get("decision_phase"),
        "problems": problems,
        "extra": {str(k): _plain(v) for k, v in data.items() if k not in ("match", "decision_phase", "forks")},
    }
    return GameView(entry, seats, hero, forks, info)


def _numbers(value: Any) -> dict[str, float]:
    return {
        str(k): float(v) for k, v in _mapping(value).items() if isinstance(v, int | float) and not isinstance(v, bool)
    }


# ------------------------------------------------------------------------------------------ boards
def phase_svg(entry: GameEntry, fork: int, index: int) -> str:
    """The board of phase `index` of fork `fork`, with its orders (the last phase: the final board)."""
    if entry.kind == "eval":
        frame = _eval_frame(entry.path.parent, index)
        if frame is not None:
            return frame
    return _render_cached(str(entry.path), _mtime(entry.path), entry.kind == "trace", fork, index)


def _eval_frame(game_dir: Path, index: int) -> str | None:
    frames = game_dir / "frames"
    matches = sorted(frames.glob(f"{index:03d}_*.svg")) if frames.is_dir() else []
    if len(matches) != 1:
        return None
    try:
        return matches[0].read_text(encoding="utf-8")
    except OSError:
        return None


@lru_cache(maxsize=128)
def _render_cached(path: str, mtime: float, is_trace: bool, fork: int, index: int) -> str:
    """`mtime` is part of the key: a game still being played (or rewritten) is never served stale."""
    data = _read_json(Path(path))
    saved = data
    if is_trace:
        forks = data.get("forks") if isinstance(data, Mapping) else None
        if not isinstance(forks, list) or not 0 <= fork < len(forks) or not isinstance(forks[fork], Mapping):
            raise UnknownGame(f"fork {fork} is not in this trace")
        saved = forks[fork].get("replay")
    phases = phases_of(saved, Path(path).name)
    if not 0 <= index < len(phases):
        raise UnknownGame(f"phase {index} out of range: the game has {len(phases)} phases")
    return render_phase(phases[index], with_orders=index < len(phases) - 1)


def render_phase(phase: Mapping[str, Any], with_orders: bool = True) -> str:
    """The engine's SVG of a saved phase; orders the engine does not take are left off, not fatal."""
    from diprl.game import DiplomacyGame
    from diprl.game.replay import render_svg

    game = DiplomacyGame.from_state(phase["state"])
    if with_orders:
        for power, orders in phase.get("orders", {}).items():
            try:
                game.engine.set_orders(power, list(orders), expand=False)
            except Exception:  # the engine's own validation: an order it refuses is just not drawn
                continue
    return render_svg(game, incl_orders=with_orders)
