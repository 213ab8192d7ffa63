"""A person at the table: one power played from the browser against six seats of any PolicyRef.

The person only ever picks from the game layer's legal orders (`DiplomacyGame.legal_orders`): one
choice per unit (movement, retreats), per build site (builds: leave a site empty to waive it) or per
unit (disbands: exactly as many as the phase takes). Rule-bot seats decide in this process; LLM seats
(`base`, `<policy>@v<N>`) are answered in one batched call through a policy client (`PolicyClient`, the
PolicyServer's plain-dict schema, as in rollouts and evaluation). Everything is checked before the game
moves: a stale phase (the form was for an earlier phase), an order outside the legal set, a unit ordered
twice, a missing order, a client that fails; each is a `PlayError` naming what is wrong, and the game
stays exactly where it was.

Phases in which the person has nothing to order are played on at once. The game ends at its year cap, a
solo, or when the person's power is eliminated. After every phase the game is written under
`<runs>/play/<game_id>/`: `replay.json` (the engine's saved-game format, see `diprl.game.replay`) and
`game.json` (seats, the person's power, status, result), so a game in play and a finished one can be
opened on the games page.
"""

from __future__ import annotations

import json
import secrets
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

from diprl.atomic_io import write_file_atomic
from diprl.game import DiplomacyGame, PhaseKind, PhaseRecord, PowerOrders
from diprl.messages import PolicyRef, UnknownPolicyRef
from diprl.rollout.clients import PolicyClient
from diprl.rollout.lockstep import Table, play_phase
from diprl.rollout.search import SearchConfig
from diprl.web.runs import PLAY_DIR

FIRST_YEAR = 1901
MAX_YEAR = 1935
TEMPERATURE = 1.0  # LLM seats sample as in training
MAX_TOKENS = 384
SEARCH = 8  # the candidates the form's "search" box asks each LLM seat to weigh
MAX_SEARCH = 32

ClientFor = Callable[[Path | None, str], PolicyClient]
"""Gives the policy client for LLM seats served from an adapter store (None: no adapters, `base` only), on a
model preset ("": the server's own; a zoo entry's model when zoo seats play)."""


class PlayError(ValueError):
    """Bad input for a game: the message says what is wrong; nothing was changed."""

    status = 400


class StalePhase(PlayError):
    status = 409


class UnknownPlayGame(PlayError, LookupError):
    status = 404


class ServerInUse(PlayError):
    """The one PolicyServer serves another store or model for games in play: this game would take it away."""

    status = 409


class TooManyGames(PlayError):
    status = 429


class SeatFailure(RuntimeError):
    """An LLM seat could not be answered (server down, wrong answer count): the phase was not played."""


@cache
def powers() -> tuple[str, ...]:
    return DiplomacyGame().powers


def bot_names() -> tuple[str, ...]:
    from diprl.bots import BOT_NAMES

    return BOT_NAMES


@dataclass(frozen=True)
class PlaySetup:
    """A checked game: the person's power, who sits in the other six seats, the year cap, whose adapters."""

    human: str
    seats: dict[str, str]  # every power, the person's included (as "human")
    max_year: int
    run: str | None
    adapters: Path | None
    model: str = ""  # the model preset the zoo seats play on; "" without zoo seats
    search: int = 0  # candidates each LLM seat searches its moves over (`diprl.rollout.search`); 0: its answer

    @property
    def search_config(self) -> SearchConfig:
        return SearchConfig.strongest(self.search)

    @property
    def llm_seats(self) -> list[str]:
        return [p for p, ref in self.seats.items() if p != self.human and PolicyRef.parse(ref).is_llm]


def check_setup(
    human: str, seats: Mapping[str, str], max_year: int, run: str | None, adapters: Path | None, search: int = 0
) -> PlaySetup:
    """Every choice checked before anything starts; `PlayError` names the first thing wrong."""
    if isinstance(search, bool) or not isinstance(search, int) or not 0 <= search <= MAX_SEARCH:
        raise PlayError(f"search takes 0 to {MAX_SEARCH} candidates, got {search!r}")
    if human not in powers():
        raise PlayError(f"unknown power {str(human)[:40]!r}; powers are {', '.join(powers())}")
    unknown = sorted(set(seats) - set(powers()))
    if unknown:
        raise PlayError(f"unknown power {unknown[0][:40]!r} among the seats; powers are {', '.join(powers())}")
    if human in seats:
        raise PlayError(f"{human} is your power: it has no opponent seat")
    missing = [p for p in powers() if p != human and not seats.get(p)]
    if missing:
        raise PlayError(f"no PolicyRef for {', '.join(missing)}: every other power needs a seat")
    if isinstance(max_year, bool) or not isinstance(max_year, int) or not FIRST_YEAR <= max_year <= MAX_YEAR:
        raise PlayError(f"the last year must be between {FIRST_YEAR} and {MAX_YEAR}, got {max_year!r}")
    refs = {power: check_ref(power, text, run, adapters) for power, text in seats.items()}
    model = _zoo_model(refs)
    # The checked refs, not the texts: `main@best` sits as the version it named when the game started.
    seated = {**{p: str(r) for p, r in refs.items()}, human: "human"}
    return PlaySetup(human, seated, max_year, run, adapters, model, search)


def _zoo_model(refs: Mapping[str, PolicyRef]) -> str:
    """The model the zoo seats play on; a game's LLM seats share one PolicyServer, so zoo entries sit with
    rule bots and entries of the same model only (`base` and a run's versions play on the run's model)."""
    zoo = sorted(p for p, r in refs.items() if r.is_zoo)
    if not zoo:
        return ""
    others = sorted(p for p, r in refs.items() if r.is_llm and not r.is_zoo)
    if others:
        raise PlayError(
            f"zoo entries ({', '.join(zoo)}) and base or run versions ({', '.join(others)}) play on different "
            "servers: seat them in separate games"
        )
    from diprl.eval.refs import zoo_model

    try:
        return zoo_model([str(refs[p]) for p in zoo]) or ""
    except ValueError as exc:
        raise PlayError(str(exc)) from None


def check_ref(power: str, text: str, run: str | None, adapters: Path | None) -> PolicyRef:
    """A PolicyRef that names somebody who can play: a registered bot, `base`, a zoo entry, or a published version
    (`<policy>@best` is the version the run marked best, resolved here: a game keeps that version)."""
    if adapters is not None:
        from diprl.inference.adapters import AdapterError, AdapterStore

        try:
            text = AdapterStore(adapters).resolve_alias(text)
        except AdapterError as exc:
            raise PlayError(f"{power}: {exc}") from None
    try:
        ref = PolicyRef.parse(text)
    except UnknownPolicyRef as exc:
        raise PlayError(f"{power}: {exc}") from None
    if ref.is_bot and ref.name not in bot_names():
        raise PlayError(f"{power}: unknown bot {text!r}; bots are {', '.join(bot_names())}")
    if ref.is_zoo:
        from diprl.policy.zoo import ZooError, load_entry

        try:
            load_entry(str(ref))
        except ZooError as exc:
            raise PlayError(f"{power}: {exc}") from None
    if ref.is_adapter:
        if adapters is None:
            raise PlayError(f"{power}: {text} is an adapter version: choose the run whose adapters hold it")
        from diprl.inference.adapters import AdapterError, AdapterStore

        try:
            AdapterStore(adapters).resolve(str(ref))
        except AdapterError as exc:
            raise PlayError(f"{power}: {text} is not a published version of run {run}: {exc}") from None
    return ref


def check_orders(legal: PowerOrders, chosen: Mapping[str, str]) -> list[str]:
    """The orders to play from the person's choice per location ("" = none); `PlayError` if not legal.

    Movement and retreats take one order per unit; builds at most as many as allowed (the rest are
    waived); disbands exactly as many as required.
    """
    where = f"{legal.power} in {legal.phase}"
    if legal.kind is PhaseKind.NONE:
        raise PlayError(f"{where} has nothing to order")
    for loc in chosen:
        if loc not in legal.by_loc:
            raise PlayError(
                f"{str(loc)[:20]!r} is not one of the units or sites {where} orders ({', '.join(legal.locs)})"
            )
    orders = []
    for loc, order in chosen.items():
        if not order:
            continue
        if order not in legal.by_loc[loc]:
            raise PlayError(f"{str(order)[:60]!r} is not a legal order for {loc} ({where})")
        orders.append(order)
    if legal.kind in (PhaseKind.MOVEMENT, PhaseKind.RETREAT):
        missing = [loc for loc in legal.locs if not chosen.get(loc)]
        if missing:
            raise PlayError(f"no order for {', '.join(missing)} ({where}): every unit needs one")
    elif legal.kind is PhaseKind.BUILD and len(orders) > legal.n_required:
        raise PlayError(f"{where} allows {legal.n_required} build(s), {len(orders)} chosen")
    elif legal.kind is PhaseKind.DISBAND and len(orders) != legal.n_required:
        raise PlayError(f"{where} must disband {legal.n_required} unit(s), {len(orders)} chosen")
    return sorted(orders)


@dataclass
class PlaySession:
    """One game in the browser. `submit` is the only way it moves; it holds `lock` while it does."""

    game_id: str
    setup: PlaySetup
    directory: Path
    client_for: ClientFor
    seed: int
    game: DiplomacyGame = field(init=False)
    notes: list[str] = field(default_factory=list)  # what LLM seats got wrong, per phase
    created: float = field(default_factory=time.time)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    last_used: float = 0.0  # on the room's clock: when a request last touched the game

    def __post_init__(self) -> None:
        from diprl.bots import make_agent
        from diprl.bots.base import seat_seed

        self.game = DiplomacyGame(max_year=self.setup.max_year)
        self.bots = {
            power: make_agent(PolicyRef.parse(ref).name, seed=seat_seed(self.seed, i))
            for i, (power, ref) in enumerate(sorted(self.setup.seats.items()))
            if power != self.setup.human and PolicyRef.parse(ref).is_bot
        }

    # ---------------------------------------------------------------- views
    @property
    def human(self) -> str:
        return self.setup.human

    @property
    def finished(self) -> bool:
        return self.game.is_done or self.game.is_eliminated(self.human)

    @property
    def last(self) -> PhaseRecord | None:
        history = self.game.history
        return history[-1] if history else None

    def legal(self) -> PowerOrders:
        return self.game.legal_orders(self.human)

    def status(self) -> str:
        if not self.finished:
            return "in play"
        if self.game.is_eliminated(self.human):
            return "finished: eliminated"
        winner = self.game.solo_winner()
        return f"finished: solo by {winner}" if winner else f"finished: year cap {self.setup.max_year}"

    # ---------------------------------------------------------------- moves
    def submit(self, phase: str, chosen: Mapping[str, str]) -> PhaseRecord:
        """Play the person's orders for `phase` (one choice per location) and every seat's, then move on."""
        with self.lock:
            if self.finished:
                raise PlayError(f"the game is over ({self.status()}); nothing was changed")
            if phase != self.game.phase:
                raise StalePhase(
                    f"stale phase: these orders were for {str(phase)[:20]!r} but the game is at {self.game.phase}; "
                    "nothing was changed (reload the page)"
                )
            orders = check_orders(self.legal(), chosen)
            try:
                record = self._play_phase(orders)
            except SeatFailure as exc:
                raise PlayError(f"{exc}; nothing was changed") from exc
            try:
                self._advance()
            except SeatFailure as exc:
                raise PlayError(f"your orders for {phase} were played, then {exc}: continue to try again") from exc
            finally:
                self.save()
            return record

    def resume(self) -> None:
        """Play on the phases the person has nothing to order in (before the first decision, or after a seat
        failed to answer), then save."""
        with self.lock:
            try:
                self._advance()
            except SeatFailure as exc:
                raise PlayError(str(exc)) from exc
            finally:
                self.save()

    def _advance(self) -> None:
        while not self.finished and self.legal().kind is PhaseKind.NONE:
            self._play_phase([])

    def _play_phase(self, human_orders: list[str]) -> PhaseRecord:
        """Everyone's orders for the current phase, then one step (`diprl.rollout.lockstep.play_phase`, as in
        training and evaluation); nothing moves if a seat cannot answer."""
        game = self.game
        searched = {power: self.setup.search_config for power in self.setup.llm_seats} if self.setup.search else {}
        bots = {**self.bots, self.human: _Chosen(human_orders)}
        table = Table(game, self.setup.seats, bots, TEMPERATURE, MAX_TOKENS, search=searched)
        asked = [p for p in game.orderable_powers() if p not in table.bots]
        try:
            client = self.client_for(self.setup.adapters, self.setup.model) if asked else None
            [outcome] = play_phase([table], client)
        except Exception as exc:  # a server that is down or refuses: the phase is not played
            raise SeatFailure(
                f"the PolicyServer could not answer the LLM seats ({', '.join(asked)}) in {game.phase}: {exc!r:.300}"
            ) from exc
        for power, turn in outcome.turns.items():
            if turn.answer.bad:
                why = turn.answer.error or "an incomplete order set"
                self.notes.append(f"{turn.phase} {power} ({self.setup.seats[power]}): {why[:200]}; defaults filled in")
        return outcome.record

    # ---------------------------------------------------------------- saving
    def meta(self) -> dict[str, Any]:
        from diprl.game.scoring import ranks

        centres = self.game.centre_counts()
        return {
            "game_id": self.game_id,
            "human": self.human,
            "seats": self.setup.seats,
            "max_year": self.setup.max_year,
            "search": self.setup.search,
            "run": self.setup.run,
            "seed": self.seed,
            "created": self.created,
            "status": self.status(),
            "phase": self.game.phase,
            "centres": centres,
            "ranks": ranks(centres),
            "notes": self.notes[-50:],
        }

    def save(self) -> None:
        from diprl.game.replay import to_saved_game

        self.directory.mkdir(parents=True, exist_ok=True)
        write_file_atomic(self.directory / "replay.json", json.dumps(to_saved_game(self.game, self.game_id)).encode())
        write_file_atomic(self.directory / "game.json", json.dumps(self.meta(), indent=1).encode())


@dataclass(eq=False)
class PlayRoom:
    """The games being played in this server, by id; each is saved under `<runs>/play/<id>/`.

    A game left alone for `idle_s` leaves the room (its files stay: the games page shows it), and so stops
    holding its PolicyServer. At most `max_sessions` games are kept, and at most `max_llm_sessions` with LLM
    seats on one server (each of their moves holds a worker thread while the server answers).
    """

    runs_dir: Path
    client_for: ClientFor
    max_sessions: int = 64
    max_llm_sessions: int = 8
    idle_s: float = 3600.0
    clock: Callable[[], float] = time.monotonic
    sessions: dict[str, PlaySession] = field(default_factory=dict, init=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    def _evict_idle(self) -> None:
        """Drop games nobody touched for `idle_s` (caller holds `_lock`)."""
        cutoff = self.clock() - self.idle_s
        for game_id in [g for g, s in self.sessions.items() if s.last_used < cutoff]:
            del self.sessions[game_id]

    def start(self, setup: PlaySetup, seed: int | None = None) -> PlaySession:
        """A new game, saved at once. Its LLM seats' server is asked for first, without waiting for it to
        start (`prepare`), so a game that cannot be served (too many games, the server busy with another
        run's games) is refused before it exists, and no request waits for vLLM."""
        with self._lock:
            self._evict_idle()
            if len(self.sessions) >= self.max_sessions:
                raise TooManyGames(
                    f"this server already keeps {len(self.sessions)} games; finish one, or wait for one left alone "
                    f"for {self.idle_s / 60:.0f} minutes to leave"
                )
            in_play = [s for s in self.sessions.values() if not s.finished and s.setup.llm_seats]
        if setup.llm_seats:
            key = (setup.adapters, setup.model)
            same = [s for s in in_play if (s.setup.adapters, s.setup.model) == key]
            if len(same) >= self.max_llm_sessions:
                raise TooManyGames(
                    f"{len(same)} games with LLM seats on this PolicyServer are in play (at most "
                    f"{self.max_llm_sessions}); finish one, or wait for one left alone for "
                    f"{self.idle_s / 60:.0f} minutes to leave"
                )
            self._ask_for_server(setup, in_play)
        game_id = time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + "-" + secrets.token_hex(3)
        session = PlaySession(
            game_id=game_id,
            setup=setup,
            directory=self.runs_dir / PLAY_DIR / game_id,
            client_for=self.client_for,
            seed=secrets.randbelow(2**31) if seed is None else seed,
            last_used=self.clock(),
        )
        session.resume()
        with self._lock:
            self.sessions[game_id] = session
        return session

    def _ask_for_server(self, setup: PlaySetup, in_play: list[PlaySession]) -> None:
        prepare = getattr(self.client_for, "prepare", None)
        try:
            if prepare is None:  # a factory whose clients come at once (beside a training run, tests)
                self.client_for(setup.adapters, setup.model)
                return
            served = getattr(self.client_for, "served")  # noqa: B009  # with prepare, the same factory's
            in_use = {served(s.setup.adapters, s.setup.model): s for s in in_play}
            prepare(setup.adapters, setup.model, in_use=set(in_use))
        except ServerInUse as exc:
            holders = [s for s in in_play if (s.setup.adapters, s.setup.model) != (setup.adapters, setup.model)]
            users = [s.game_id for s in holders]
            run = holders[0].setup.run if holders else None
            raise ServerInUse(
                f"{exc}: it serves run {run}'s versions for games {', '.join(users)}. Finish those games (or leave "
                f"them {self.idle_s / 60:.0f} minutes), or play this run in another `python -m diprl.web`"
            ) from None
        except Exception as exc:
            raise PlayError(f"no PolicyServer for the LLM seats ({', '.join(setup.llm_seats)}): {exc}") from exc

    def get(self, game_id: str) -> PlaySession:
        with self._lock:
            self._evict_idle()
            session = self.sessions.get(game_id)
            if session is not None:
                session.last_used = self.clock()
        if session is None:
            raise UnknownPlayGame(
                f"no game {game_id[:40]!r} is being played in this server (older games, and games left alone for "
                f"{self.idle_s / 60:.0f} minutes, are on the games page)"
            )
        return session


class _Chosen:
    """The person's seat as an agent: the orders they chose (checked against the legal set before)."""

    name = "human"

    def __init__(self, orders: list[str]) -> None:
        self.chosen = list(orders)

    def orders(self, game: DiplomacyGame, power: str) -> list[str]:
        return list(self.chosen)
