"""Replays a person can open: the engine's saved-game JSON, one SVG per phase, and an HTML viewer.

    <dir>/game0003/replay.json        # diplomacy.utils.export.from_saved_game_format loads it
    <dir>/game0003/frames/012_F1906M.svg
    <dir>/game0003/index.html         # open in a browser: step with the arrow keys, or play

The viewer is one self-contained page (no network, no build step) showing each frame with its
phase, the orders played and every power's centre count; it references the SVG files beside it,
so frames can also be opened one by one; `index.html#frame=12` opens at frame 12. Rendering uses
the engine's own renderer (about half a second per phase here), which is why only the first
`replays` games of a suite are written.
"""

from __future__ import annotations

import html
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from diprl.game import DiplomacyGame
from diprl.game.replay import render_svg, to_saved_game


def _frame_name(i: int, phase: str) -> str:
    return f"{i:03d}_{phase}.svg"


def write_replay(
    game: DiplomacyGame, root: Path, game_id: str, seats: Mapping[str, str] | None = None, hero: str | None = None
) -> Path:
    """Write `game`'s replay JSON, SVG frames (each processed phase with its orders, then the final
    board) and `index.html` under `root/game_id`; returns the HTML page's path."""
    out = root / game_id
    frames_dir = out / "frames"
    frames_dir.mkdir(parents=True, exist_ok=True)
    (out / "replay.json").write_text(json.dumps(to_saved_game(game, game_id=game_id)))
    frames: list[dict[str, Any]] = []
    for i, record in enumerate(game.history):
        name = _frame_name(i, record.name)
        (frames_dir / name).write_text(render_svg(game, record.name))
        centres = {p: len(c) for p, c in sorted(record.state.get("centers", {}).items())}
        orders = {p: list(o) for p, o in sorted(record.orders.items())}
        results = {u: list(r) for u, r in record.results.items() if r}
        frames.append({"file": f"frames/{name}", "phase": record.name, "centres": centres, "orders": orders,
                       "results": results})  # fmt: skip
    final = _frame_name(len(game.history), "final")
    (frames_dir / final).write_text(render_svg(game, incl_orders=False))
    frames.append(
        {
            "file": f"frames/{final}",
            "phase": f"end ({game.phase})",
            "centres": game.centre_counts(),
            "orders": {},
            "results": {},
        }
    )
    page = out / "index.html"
    page.write_text(viewer_html(game_id, frames, dict(seats or {}), hero))
    return page


_PAGE = r"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>__TITLE__</title>
<style>
body { font-family: sans-serif; margin: 12px; background: #f6f6f2; }
#bar { display: flex; gap: 8px; align-items: center; margin-bottom: 8px; }
#phase { font-weight: bold; font-size: 1.2em; min-width: 11em; }
#wrap { display: flex; gap: 16px; align-items: flex-start; }
#map { width: 62vw; max-width: 1000px; border: 1px solid #999; background: white; }
#side { font-size: 0.85em; max-height: 88vh; overflow-y: auto; }
table { border-collapse: collapse; } td, th { padding: 1px 6px; text-align: left; }
.power { font-weight: bold; margin-top: 6px; } .res { color: #a33; } .hero { font-weight: bold; }
</style></head><body>
<h2>__TITLE__</h2>
<div id="bar"><button id="first">&laquo; first</button><button id="prev">&lsaquo; prev</button>
<button id="play">play</button><button id="next">next &rsaquo;</button><button id="last">last &raquo;</button>
<input id="slider" type="range" min="0" value="0"><span id="phase"></span><span id="count"></span></div>
<div id="wrap"><img id="map" alt="map"><div id="side"><table id="centres"></table><div id="orders"></div></div></div>
<script>
const FRAMES = __FRAMES__;
const SEATS = __SEATS__;
const HERO = __HERO__;
let i = 0, timer = null;
const $ = (id) => document.getElementById(id);
$("slider").max = FRAMES.length - 1;
function esc(s) { const d = document.createElement("div"); d.textContent = s; return d.innerHTML; }
function show(k) {
  i = Math.max(0, Math.min(FRAMES.length - 1, k));
  const f = FRAMES[i];
  $("map").src = f.file; $("phase").textContent = f.phase; $("slider").value = i;
  $("count").textContent = `frame ${i + 1} / ${FRAMES.length}`;
  let rows = "<tr><th>power</th><th>seat</th><th>centres</th></tr>";
  for (const [p, n] of Object.entries(f.centres)) {
    const who = esc(SEATS[p] || "") + (p === HERO ? " (hero)" : "");
    rows += `<tr${p === HERO ? ' class="hero"' : ""}><td>${esc(p)}</td><td>${who}</td><td>${n}</td></tr>`;
  }
  $("centres").innerHTML = rows;
  let html = "";
  for (const [p, os] of Object.entries(f.orders)) {
    if (!os.length) continue;
    html += `<div class="power">${esc(p)}</div>`;
    for (const o of os) {
      const unit = o.split(" ").slice(0, 2).join(" ");
      const r = f.results[unit];
      html += `<div>${esc(o)}${r ? ` <span class="res">(${esc(r.join(", "))})</span>` : ""}</div>`;
    }
  }
  $("orders").innerHTML = html;
}
$("first").onclick = () => show(0); $("last").onclick = () => show(FRAMES.length - 1);
$("prev").onclick = () => show(i - 1); $("next").onclick = () => show(i + 1);
$("slider").oninput = (e) => show(+e.target.value);
$("play").onclick = () => {
  if (timer) { clearInterval(timer); timer = null; $("play").textContent = "play"; return; }
  $("play").textContent = "pause";
  timer = setInterval(() => { if (i >= FRAMES.length - 1) $("play").click(); else show(i + 1); }, 900);
};
document.addEventListener("keydown", (e) => {
  if (e.key === "ArrowRight") show(i + 1); else if (e.key === "ArrowLeft") show(i - 1);
  else if (e.key === "Home") show(0); else if (e.key === "End") show(FRAMES.length - 1);
});
const start = /frame=(\d+)/.exec(location.hash);  // index.html#frame=12 opens at frame 12
show(start ? +start[1] : 0);
</script></body></html>
"""


def viewer_html(title: str, frames: list[dict[str, Any]], seats: dict[str, str], hero: str | None = None) -> str:
    """The stepping viewer page; data goes in as JSON with `<` escaped, so no text can end the script."""

    def data(value: Any) -> str:
        return json.dumps(value).replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")

    return (
        _PAGE.replace("__TITLE__", html.escape(f"diprl replay: {title}"))
        .replace("__FRAMES__", data(frames))
        .replace("__SEATS__", data(seats))
        .replace("__HERO__", data(hero))
    )
