"""The FastAPI application: server-rendered pages (Jinja2) with a little vanilla JavaScript, no build step.

    /               runs: status, config, learning curves (the page polls /api/curves while a run goes)
    /league         members, payoff heatmap, Nash weights, the league's health over time, snapshots over time
    /games          evaluation replays, training traces, games played here (?member=&vs=: one member's games
                    against another); /games/view steps through one
    /play           start a game as one power against six PolicyRefs; /play/<id> plays it

Every page takes `?run=<name>` (the newest run when absent) and says so when there is no run yet. Bad
input (an unknown run, game, power, PolicyRef or version, a stale phase, an order outside the legal
set) is answered with a page or JSON naming what is wrong, with a 4xx status, and changes nothing.
"""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from fastapi.templating import Jinja2Templates

from diprl.web import games as games_mod
from diprl.web import runs as runs_mod
from diprl.web.auth import SecurityHeaders, origin_guard, token_guard
from diprl.web.league_view import NoLeague, crossplay_reports, league_view
from diprl.web.play import (
    SEARCH,
    ClientFor,
    PlayError,
    PlayRoom,
    PlaySession,
    bot_names,
    check_setup,
    powers,
)

HERE = Path(__file__).resolve().parent
ORDER_FIELD = "order:"  # form field of one location's order in the play form: order:<loc>
SEAT_FIELD = "seat:"  # form field of one power's PolicyRef in the new-game form: seat:<POWER>


@dataclass(frozen=True)
class WebConfig:
    runs_dir: Path
    token: str | None = None
    poll_s: float = 5.0  # how often the runs page asks for new metrics while a run goes
    exposed: bool = False  # listening on a non-loopback address (with a token): any Host header is fine


class PageError(Exception):
    """Bad input found while building a page: shown with its status, nothing changed."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


def _json_data(value: Any) -> str:
    """JSON for a <script> block: `<`, `>` and `&` escaped so no text can end the script."""
    return json.dumps(value).replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def create_app(config: WebConfig, client_for: ClientFor) -> FastAPI:
    """The app over `config.runs_dir`; `client_for(adapters)` answers the LLM seats of games played here."""
    runs_dir = config.runs_dir
    app = FastAPI(title="diprl", docs_url=None, redoc_url=None, openapi_url=None)
    from starlette.middleware.base import BaseHTTPMiddleware

    if config.token is not None:
        app.add_middleware(BaseHTTPMiddleware, dispatch=token_guard(config.token))
    app.add_middleware(BaseHTTPMiddleware, dispatch=origin_guard(loopback_hosts_only=not config.exposed))
    # Outside even Starlette's own error layer (which answers an unhandled exception with a 500 from beyond
    # every added middleware), so every response, that one included, carries the security headers.
    build_stack = app.build_middleware_stack
    app.build_middleware_stack = lambda: SecurityHeaders(build_stack())  # type: ignore[method-assign]
    app.mount("/static", StaticFiles(directory=HERE / "static"), name="static")
    templates = Jinja2Templates(directory=HERE / "templates")
    templates.env.filters["json_data"] = _json_data
    templates.env.filters["when"] = lambda t: time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if t else "-"
    room = PlayRoom(runs_dir, client_for)
    app.state.room = room

    def page(request: Request, name: str, status: int = 200, **context: Any) -> HTMLResponse:
        names = runs_mod.run_names(runs_dir)
        base = {"runs_dir": str(runs_dir), "run_names": names, "nav": name.split(".")[0], "run": None}
        return templates.TemplateResponse(request, name, base | context, status_code=status)

    def error_page(request: Request, exc: PageError | PlayError, **context: Any) -> HTMLResponse:
        status = exc.status if isinstance(exc, PageError) else type(exc).status
        return page(request, "error.html", status=status, message=str(exc), **context)

    def pick_run(run: str | None) -> tuple[str | None, Path | None]:
        """The named run, the newest one when `run` is None, (None, None) when there is no run."""
        if run is None:
            found = runs_mod.discover_runs(runs_dir)
            return (runs_mod.run_names(runs_dir)[0], found[0]) if found else (None, None)
        try:
            return run, runs_mod.resolve_run(runs_dir, run)
        except runs_mod.UnknownRun as exc:
            raise PageError(str(exc), 404) from None

    @app.exception_handler(PageError)
    async def _page_error(request: Request, exc: PageError) -> Response:
        if request.url.path.startswith("/api/"):
            return JSONResponse({"error": str(exc)}, status_code=exc.status)
        return error_page(request, exc)

    @app.exception_handler(PlayError)
    async def _play_error(request: Request, exc: PlayError) -> Response:
        if request.url.path.startswith("/api/"):
            return JSONResponse({"error": str(exc)}, status_code=exc.status)
        return error_page(request, exc)

    # ------------------------------------------------------------------------------------- runs
    @app.get("/", response_class=HTMLResponse)
    def runs_page(request: Request, run: str | None = None) -> HTMLResponse:
        name, path = pick_run(run)
        infos = [runs_mod.run_info(runs_dir, p) for p in runs_mod.discover_runs(runs_dir)]
        selected = runs_mod.run_info(runs_dir, path) if path is not None else None
        return page(request, "runs.html", runs=infos, run=name, selected=selected, poll_s=config.poll_s)

    @app.get("/api/runs")
    def runs_api() -> list[dict[str, Any]]:
        infos = [runs_mod.run_info(runs_dir, p) for p in runs_mod.discover_runs(runs_dir)]
        return [
            {"run": i.name, "status": i.status, "experiment": i.experiment, "steps": i.steps, "updated": i.updated}
            for i in infos
        ]

    @app.get("/api/curves")
    def curves_api(run: str) -> dict[str, Any]:
        _, path = pick_run(run)
        assert path is not None
        return runs_mod.curves_payload(runs_dir, path)

    # ------------------------------------------------------------------------------------- league
    @app.get("/league", response_class=HTMLResponse)
    def league_page(request: Request, run: str | None = None) -> HTMLResponse:
        name, path = pick_run(run)
        league: dict[str, Any] | None = None
        problem = ""
        crossplay: list[dict[str, Any]] = []
        if path is not None:
            crossplay = crossplay_reports(path)
            try:
                league = league_view(path)
            except NoLeague as exc:
                problem = str(exc)
        return page(request, "league.html", run=name, league=league, problem=problem, crossplay=crossplay)

    @app.get("/api/league")
    def league_api(run: str) -> dict[str, Any]:
        _, path = pick_run(run)
        assert path is not None
        try:
            return league_view(path)
        except NoLeague as exc:
            raise PageError(str(exc), 404) from None

    # ------------------------------------------------------------------------------------- games
    def game_list(run: str | None) -> tuple[str | None, list[games_mod.GameEntry]]:
        name, path = pick_run(run)
        return name, games_mod.list_games(runs_dir, name, path)

    def find(run: str | None, game_id: str) -> games_mod.GameEntry:
        _, listing = game_list(run)
        try:
            return games_mod.find_game(listing, game_id)
        except games_mod.UnknownGame as exc:
            raise PageError(str(exc), 404) from None

    @app.get("/games", response_class=HTMLResponse)
    def games_page(
        request: Request, run: str | None = None, member: str | None = None, vs: str | None = None
    ) -> HTMLResponse:
        """Every game, or those of one league member against another (the league page's figure links)."""
        name, listing = game_list(run)
        if any(len(x or "") > 200 for x in (member, vs)):
            raise PageError("member and vs name league members: at most 200 characters")
        if member:
            listing = games_mod.games_between(listing, member, vs or None)
        return page(request, "games.html", run=name, games=listing, member=member or None, vs=vs or None)

    @app.get("/games/view", response_class=HTMLResponse)
    def game_view(request: Request, id: str, run: str | None = None) -> HTMLResponse:
        name, _ = pick_run(run)
        entry = find(run, id)
        try:
            view = games_mod.load_game(entry)
        except games_mod.BadGameFile as exc:
            raise PageError(f"{entry.title}: {exc}", 422) from None
        data = {
            "forks": [
                {
                    "label": f["label"],
                    "index": f["index"],
                    "info": f["info"],
                    "phases": [{k: p[k] for k in ("name", "orders", "results", "centres")} for p in f["phases"]],
                }
                for f in view.forks
            ],
            "seats": view.seats,
            "hero": view.hero,
            "info": view.info,
            "svg": str(request.url_for("game_svg").include_query_params(run=name or "", id=entry.id)),
        }
        return page(request, "game.html", run=name, view=view, data=data)

    @app.get("/games/svg", name="game_svg")
    def game_svg(id: str, run: str | None = None, fork: int = 0, phase: int = 0) -> Response:
        entry = find(run or None, id)
        try:
            svg = games_mod.phase_svg(entry, fork, phase)
        except games_mod.UnknownGame as exc:
            raise PageError(str(exc), 404) from None
        except games_mod.BadGameFile as exc:
            raise PageError(str(exc), 422) from None
        return Response(svg, media_type="image/svg+xml", headers={"Cache-Control": "no-cache"})

    # ------------------------------------------------------------------------------------- play
    def seat_choices(path: Path | None) -> list[str]:
        from diprl.policy.zoo import known_entries

        refs = [f"bot:{b}" for b in bot_names()] + [f"zoo:{name}" for name in known_entries()] + ["base"]
        if path is not None:
            from diprl.inference.adapters import AdapterError, AdapterStore
            from diprl.inference.adapters.store import BEST

            store = AdapterStore(path / "adapters")
            for policy in store.policies():
                with contextlib.suppress(AdapterError):  # a broken mark offers the versions alone
                    if store.alias(policy, BEST) is not None:
                        refs.append(f"{policy}@{BEST}")  # the version the run's league found best
                refs += [str(r) for r in reversed(store.versions(policy))]
        return refs

    @app.get("/play", response_class=HTMLResponse)
    def play_setup(request: Request, run: str | None = None) -> HTMLResponse:
        name, path = pick_run(run)
        games = sorted(room.sessions.values(), key=lambda s: -s.created)
        return page(
            request,
            "play.html",
            run=name,
            powers=powers(),
            choices=seat_choices(path),
            sessions=games,
            search=SEARCH,
        )

    @app.post("/play")
    async def play_start(request: Request) -> Response:
        form = await request.form()
        fields = {str(k): str(v) for k, v in form.items()}
        run = fields.get("run") or None
        name, path = pick_run(run) if run else (None, None)
        seats = {k[len(SEAT_FIELD) :]: v for k, v in fields.items() if k.startswith(SEAT_FIELD)}
        human = fields.get("human", "")
        seats.pop(human, None)  # the person's own row of the form, if the page sent one
        try:
            max_year = int(fields.get("max_year", "1901"))
        except ValueError:
            raise PlayError(f"the last year must be a number, got {fields.get('max_year', '')[:20]!r}") from None
        try:
            search = int(fields.get("search", "0") or "0")
        except ValueError:
            raise PlayError(f"search must be a number of candidates, got {fields.get('search', '')[:20]!r}") from None
        setup = check_setup(human, seats, max_year, name, path / "adapters" if path is not None else None, search)
        session = await _in_thread(room.start, setup)
        return RedirectResponse(f"/play/{session.game_id}", status_code=303)

    @app.get("/play/{game_id}", response_class=HTMLResponse)
    def play_game(request: Request, game_id: str) -> HTMLResponse:
        session = room.get(game_id)
        return _game_page(request, session)

    def _game_page(request: Request, session: PlaySession, error: str = "", status: int = 200) -> HTMLResponse:
        with session.lock:
            legal = None if session.finished else session.legal()
            defaults = {}
            if legal is not None and legal.kind.value in ("movement", "retreat"):
                defaults = {loc: legal.default_order(loc) for loc in legal.locs}
            return page(
                request,
                "play_game.html",
                status=status,
                session=session,
                game=session.game,
                legal=legal,
                defaults=defaults,
                last=session.last,
                meta=session.meta(),
                error=error,
                run=session.setup.run,
            )

    @app.post("/play/{game_id}/orders")
    async def play_orders(request: Request, game_id: str) -> Response:
        session = room.get(game_id)
        form = await request.form()
        phase = str(form.get("phase", ""))
        chosen = {str(k)[len(ORDER_FIELD) :]: str(v) for k, v in form.items() if str(k).startswith(ORDER_FIELD)}
        try:
            await _in_thread(session.submit, phase, chosen)
        except PlayError as exc:
            return _game_page(request, session, error=str(exc), status=type(exc).status)
        return RedirectResponse(f"/play/{game_id}", status_code=303)

    @app.post("/play/{game_id}/continue")
    async def play_continue(request: Request, game_id: str) -> Response:
        session = room.get(game_id)
        try:
            await _in_thread(session.resume)
        except PlayError as exc:
            return _game_page(request, session, error=str(exc), status=type(exc).status)
        return RedirectResponse(f"/play/{game_id}", status_code=303)

    @app.get("/play/{game_id}/board.svg")
    def play_board(game_id: str, phase: str | None = None) -> Response:
        from diprl.game.replay import render_svg

        session = room.get(game_id)
        with session.lock:
            try:
                svg = render_svg(session.game, phase, incl_orders=phase is not None)
            except KeyError as exc:
                raise PageError(str(exc).strip("'\""), 404) from None
        return Response(svg, media_type="image/svg+xml", headers={"Cache-Control": "no-cache"})

    return app


async def _in_thread(fn: Any, *args: Any) -> Any:
    """Run blocking work (a phase with LLM seats, a PolicyServer start) off the event loop."""
    from starlette.concurrency import run_in_threadpool

    return await run_in_threadpool(fn, *args)
