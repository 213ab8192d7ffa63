"""A runs directory made by the project's own writers, one web server over it, one headless Chromium.

The run is built from the files a training run writes, each by the code that writes it there: the
resolved smoke config (`diprl.train.compose_config`), `metrics.jsonl` through `Tracker`, the league's
`state.json` and `league_summary.json` through a `LeagueManager` that hands out and is told about
matches, two published adapter versions in an `AdapterStore`, a training trace from a real `Episode`
(bots and a uniformly random legal LLM seat), and an evaluation replay through `write_replay`.

Chromium and its driver come from Debian (`make install` installs them as root: the Makefile's
`system-packages`); without them these tests fail, naming what to install, rather than skip.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from diprl.messages import Generation, GenerationRequest, parse_seats
from diprl.rollout.clients import PolicyClient, UniformConstrainedClient
from diprl.web import WebHandle, start_web
from tests.eval.conftest import CHAR_TABLE

POWERS = ("AUSTRIA", "ENGLAND", "FRANCE", "GERMANY", "ITALY", "RUSSIA", "TURKEY")
RUN = "smoke-20261125-101500"
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"  # Debian's packages
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"


# ------------------------------------------------------------------------------------- the run
def _publish_versions(adapters: Path, n: int) -> None:
    """`n` published versions of `main`: minimal LoRA files (one module) through the store's own checks."""
    import numpy as np
    from safetensors.numpy import save_file

    from diprl.inference.adapters import AdapterStore

    store = AdapterStore(adapters)
    for seed in range(n):
        src = adapters.parent / f"lora-src-{seed}"
        src.mkdir()
        rng = np.random.default_rng(seed)
        module = "base_model.model.model.layers.0.self_attn.q_proj"
        weights = {
            f"{module}.lora_A.weight": rng.normal(0, 0.02, (8, 64)).astype(np.float32),
            f"{module}.lora_B.weight": rng.normal(0, 0.02, (64, 8)).astype(np.float32),
        }
        save_file(weights, str(src / "adapter_model.safetensors"), metadata={"format": "pt"})
        config = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "base_model_name_or_path": "tiny-web-test"}
        (src / "adapter_config.json").write_text(json.dumps(config))
        store.publish("main", src)
        shutil.rmtree(src)


def _history(run_dir: Path, tracker: Any, steps: int) -> None:
    """Six learner steps; main@v1 at step 0, v2 and v3 published at steps 2 and 4 (snapshots by the rule),
    four reported matches of two forks after each publish; evaluations at steps 0 and 6."""
    from diprl.game.scoring import ranks
    from diprl.league.config import LeagueConfig
    from diprl.league.manager import LeagueManager
    from diprl.messages import MatchResult

    league = LeagueManager(LeagueConfig(snapshot_steps=1, seed=3), run_dir)
    rng = random.Random(5)

    def publish(version: str, step: int) -> None:
        tracker.log("league", {"version": version, **league.register_version("main", version, step).to_dict()})
        for _ in range(4):
            match = league.next_match("main")
            results = []
            for fork in range(2):
                centres = {p: rng.randint(0, 6) for p in POWERS}
                results.append(
                    MatchResult(
                        match.match_id, fork, dict(match.seats), match.hero, centres, ranks(centres), "S1903M", None, 2
                    )
                )
            league.report(results)

    def evaluate(step: int) -> None:
        tracker.log(
            "eval",
            {"step": step, "version": f"main@v{step // 2 + 1}", "opponents": "bot:random"}
            | {"eval/hero_mean_sc": 3.2 + 0.1 * step, "eval/hero_mean_sc_lo": 2.8, "eval/hero_mean_sc_hi": 3.9},
        )

    publish("main@v1", 0)
    evaluate(0)
    for step in range(1, steps + 1):
        tracker.log(
            "learner",
            {"step": step, "loss": 0.1 - 0.01 * step, "entropy": 1.4 - 0.02 * step}
            | {"clip_frac_low": 0.0, "clip_frac_high": 0.01 * rng.random()},
        )
        tracker.log(
            "rollout",
            {"learner/step": step, "rollout/mean_reward": 0.3 + 0.02 * step + 0.01 * rng.random()}
            | {"rollout/hero_centres": 3.0 + 0.1 * step, "rollout/groups_per_s": 1.5},
        )
        if step in (2, 4):
            publish(f"main@v{step // 2 + 1}", step)
    evaluate(steps)
    (run_dir / "league_summary.json").write_text(json.dumps(league.summary(), indent=1, default=str))


def _trace(run_dir: Path) -> str:
    """A trace written the way the rollout code writes it: `Episode` with `trace_fraction=1`."""
    from diprl.messages import Match
    from diprl.rollout.credit import CreditAssigner
    from diprl.rollout.episode import Episode, EpisodeConfig
    from diprl.rollout.rewards import Rubric, load_reward_config
    from tests.rollout.play import play_matches

    config = EpisodeConfig(group_size=2, warmup_max_phases=0, horizon_years=1, max_year=1902, trace_fraction=1.0)
    # Prompt ids make the hero's completions trainable, as the server's are (any ids do: nothing trains).
    client = UniformConstrainedClient(CHAR_TABLE, seed=2, tokenizer=SimpleNamespace(encode=lambda text: [1, 2, 3]))
    episode = Episode(config, Rubric(load_reward_config("default")), CreditAssigner(), CHAR_TABLE)
    seats = {p: "bot:random" for p in POWERS} | {"FRANCE": "main@v2", "ITALY": "main@v2"}
    match = Match(match_id="main-7", seats=parse_seats(seats), hero="FRANCE", seed=7, train=("FRANCE", "ITALY"))
    [out], _ = play_matches(episode, [match], client)
    assert out.trace is not None
    (run_dir / "traces").mkdir()
    (run_dir / "traces" / "main-7.json").write_text(json.dumps(out.trace, indent=1))
    return "main-7"


def _eval_replay(run_dir: Path) -> None:
    """One evaluation game to 1901 (DumbBot hero vs Random), written where the evaluator writes replays."""
    from diprl.bots import make_agent
    from diprl.eval.replays import write_replay
    from diprl.game import DiplomacyGame

    game = DiplomacyGame(max_year=1901)
    seats = {p: "bot:random" for p in POWERS} | {"ENGLAND": "bot:dumbbot"}
    agents = {p: make_agent(ref[4:], seed=i) for i, (p, ref) in enumerate(seats.items())}
    while not game.is_done:
        game.step({p: agents[p].orders(game, p) for p in game.orderable_powers()})
    write_replay(game, run_dir / "eval" / "step3" / "replays" / "bot_random", "game0000", seats, "ENGLAND")


def _crossplay(run_dir: Path) -> None:
    """A crossplay evaluation of three bots, written where `python -m diprl.evaluate ... out=` puts it."""
    from diprl.evaluate import main

    out = run_dir / "eval" / "crossplay"
    args = ["policy=bot:dumbbot", "opponents=bot:random", "games=7", "max_year=1901", "progress=false"]
    args += ["crossplay=[bot:random,bot:dumbbot,bot:hold]", "crossplay_games=7", f"out={out}"]
    assert main(args) == 0


@dataclass
class RunTree:
    runs_dir: Path
    run_dir: Path
    trace: str
    steps: int = 6


def build_run(runs_dir: Path, name: str = RUN) -> RunTree:
    from diprl.run.config import compose_config
    from diprl.tracking import Tracker

    run_dir = runs_dir / name
    run_dir.mkdir(parents=True)
    _, resolved = compose_config(["+experiment=smoke", "train.max_steps=6"])
    (run_dir / "config.yaml").write_text(resolved)
    tracker = Tracker(run_dir, {}, use_wandb=False)
    _history(run_dir, tracker, 6)
    tracker.close()
    _publish_versions(run_dir / "adapters", 3)
    trace = _trace(run_dir)
    _eval_replay(run_dir)
    _crossplay(run_dir)
    (run_dir / ".lock").write_text("12345")  # a finished run leaves its lock file behind, unlocked
    return RunTree(runs_dir, run_dir, trace)


@pytest.fixture(scope="session")
def run_tree(tmp_path_factory: pytest.TempPathFactory) -> RunTree:
    return build_run(tmp_path_factory.mktemp("web") / "runs")


# ------------------------------------------------------------------------------------- clients
@dataclass
class FakePolicyClients:
    """Stands in for the PolicyServer: a uniformly random legal policy that records what it was asked."""

    fail: bool = False
    calls: list[tuple[Path | None, list[GenerationRequest], list[Generation]]] = field(default_factory=list)
    models: list[str] = field(default_factory=list)  # the model each client was asked for

    def __call__(self, adapters: Path | None, model: str = "") -> PolicyClient:
        self.models.append(model)
        parent = self

        class Client:
            def generate(self, requests: Sequence[GenerationRequest]) -> list[Generation]:
                if parent.fail:
                    raise ConnectionError("PolicyServer unreachable (test)")
                answers = UniformConstrainedClient(CHAR_TABLE, seed=len(parent.calls)).generate(requests)
                parent.calls.append((adapters, list(requests), answers))
                return answers

        return Client()


@pytest.fixture(scope="session")
def clients() -> FakePolicyClients:
    return FakePolicyClients()


@pytest.fixture(scope="session")
def web(run_tree: RunTree, clients: FakePolicyClients) -> Iterator[WebHandle]:
    handle = start_web(run_tree.runs_dir, port=0, client_factory=clients, poll_s=0.5)
    yield handle
    handle.stop()


# ------------------------------------------------------------------------------------- browser
def screenshot_dir() -> Path:
    """Where the browser tests leave their screenshots for a person to look at."""
    from diprl.cache import cache_root

    path = Path(os.environ.get("DIPRL_WEB_SCREENSHOTS") or cache_root() / "web-screenshots")
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="session")
def browser() -> Iterator[Any]:
    missing = [p for p in (CHROMIUM, CHROMEDRIVER) if not Path(p).exists()]
    if missing:
        pytest.fail(
            f"the web tests drive a real Chromium and {', '.join(missing)} is missing: install the Debian packages "
            "chromium and chromium-driver (`make system-packages` as root, or apt-get install chromium chromium-driver)"
        )
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in (
        "--headless=new",
        "--no-sandbox",  # root in containers and CI
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--window-size=1400,1000",
        # Nothing but loopback: no update checks, sync, safe-browsing lists or metrics uploads.
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-default-apps",
        "--disable-domain-reliability",
        "--disable-client-side-phishing-detection",
        "--no-first-run",
        "--metrics-recording-only",
    ):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(60)
    yield driver
    driver.quit()
