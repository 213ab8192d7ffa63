"""`python -m diprl.evaluate`: a well-formed report, plots and replays; every bad option fails before play."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path

import pytest

from diprl import evaluate
from diprl.messages import Generation, GenerationRequest

from .conftest import RecordingClient

LAST_LINE = re.compile(r"^hero_solo_rate=\d\.\d{3} hero_mean_sc=\d+\.\d{2}$")
PLOTS = ("outcomes.png", "per_power.png", "centres_by_year.png", "behaviour.png")


def test_bots_suite_writes_report_plots_and_replays(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "ev"
    argv = ["policy=bot:dumbbot", "opponents=bot:random", "games=7", "max_year=1901", f"out={out}", "replays=1"]
    assert evaluate.main([*argv, "progress=false"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert LAST_LINE.match(lines[-1])
    report = json.loads((out / "report.json").read_text())
    assert lines[-1] == f"hero_solo_rate={report['hero_solo_rate']:.3f} hero_mean_sc={report['hero_mean_sc']:.2f}"
    assert report["games"] == 7 and len(report["hero_centres_per_game"]) == 7
    assert report["config"]["policy"] == "bot:dumbbot" and report["opponents"] == ["bot:random"]
    for name in PLOTS:
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    game = out / "replays" / "game0000"
    saved = json.loads((game / "replay.json").read_text())
    frames = sorted((game / "frames").glob("*.svg"))
    assert len(frames) == len(saved["phases"])  # each processed phase plus the final board
    assert frames[0].name == "000_S1901M.svg" and frames[0].read_text().lstrip().startswith("<?xml")
    page = (game / "index.html").read_text()
    assert "frames/000_S1901M.svg" in page and "</script>" in page
    assert not (out / "replays" / "game0001").exists()


def test_llm_seats_use_the_given_client(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    client = RecordingClient()
    argv = ["policy=base", "opponents=[bot:random,bot:hold]", "games=2", "max_year=1901", f"out={tmp_path}"]
    assert evaluate.main([*argv, "progress=false"], client=client) == 0
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["llm"]["hero_requests"] == report["llm"]["requests"] == sum(len(c) for c in client.calls) > 0
    assert all(len(c) == 2 for c in client.calls[:1])  # both games' heroes in the first batch
    assert LAST_LINE.match(capsys.readouterr().out.splitlines()[-1])


class FailingClient:
    """A PolicyServer that answers every request with an error, as a crashed replica does."""

    def __init__(self) -> None:
        self.requests = 0

    def generate(self, requests: Sequence[GenerationRequest]) -> list[Generation]:
        self.requests += len(requests)
        return [Generation(policy=r.policy, error="replica died") for r in requests]


def test_a_hero_whose_every_request_failed_keeps_its_report_and_exits_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    client = FailingClient()
    argv = ["policy=base", "opponents=bot:random", "games=2", "max_year=1901", f"out={tmp_path}", "progress=false"]
    assert evaluate.main(argv, client=client) == 1
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["llm"]["hero_errors"] == report["llm"]["hero_requests"] == client.requests > 0
    captured = capsys.readouterr()
    assert LAST_LINE.match(captured.out.splitlines()[-1])  # the score is printed, and flagged
    assert f"all {client.requests} of the hero's LLM requests failed" in captured.err
    # The server's own reason reaches the console and the report, not only its log.
    assert "the first failure said: replica died" in captured.err
    assert report["hero_first_error"] == "replica died" and report["per_game"][0]["hero_first_error"] == "replica died"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["policy=bot:dumbbot", "gmes=7"], "Key 'gmes' not in"),
        (["policy=bot:dumbbot", "games=many"], "could not be converted"),
        (["policy=bot:dumbbot", "games"], "key=value"),
        (["opponents=bot:random"], "policy=<ref> is required"),
        (["policy=bot:nobody"], "unknown bot"),
        (["policy=bot:dumbbot", "opponents=[bot:random,main@v]"], "unknown PolicyRef"),
        (["policy=bot:dumbbot", "max_year=1800"], "max_year"),
        (["policy=bot:dumbbot", "games=0"], "games"),
        (["policy=bot:dumbbot", "games=7", "replays=8"], "replays"),
        (["policy=bot:dumbbot", "temperature=-1"], "temperature"),
        (["policy=bot:dumbbot", "crossplay=[bot:random]"], "at least two"),
        (["policy=main@v3", "adapters=ADAPTERS"], "not a published adapter"),
        (["policy=base", "server=nowhere"], "unknown inference config"),
        (["policy=base", "search.candidates=-1"], "search.candidates must be an integer >= 0"),
        (["policy=base", "search.depth=2"], "search.depth"),
    ],
)
def test_bad_options_fail_before_anything_starts(
    argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    argv = [a.replace("ADAPTERS", str(tmp_path / "adapters")) for a in argv]
    assert evaluate.main([*argv, f"out={out}"]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not (out / "report.json").exists()


def test_an_out_path_that_is_a_file_is_an_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert evaluate.main(["policy=bot:random", f"out={blocker}"]) == 2
    assert "not a directory" in capsys.readouterr().err


def test_help_lists_every_option(capsys: pytest.CaptureFixture[str]) -> None:
    assert evaluate.main(["--help"]) == 0
    text = capsys.readouterr().out
    for key in ("policy=", "opponents=", "games=", "crossplay=", "replays=", "adapters="):
        assert key in text


def test_the_command_lines_games_keys_reach_every_suite(tmp_path: Path) -> None:
    from diprl.eval.config import GamesConfig, load_evaluate_config
    from diprl.rollout.search import SearchConfig

    argv = [
        "policy=bot:dumbbot",
        "games=14",
        "max_year=1903",
        "seed=2",
        "temperature=0",
        "replays=2",
        f"out={tmp_path}",
    ]
    plan = evaluate.make_plan(load_evaluate_config([*argv, "crossplay=[bot:random,bot:hold]", "crossplay_games=1"]))
    assert plan.suite.play == GamesConfig(games=14, max_year=1903, seed=2, temperature=0.0, replays=2)
    searched = evaluate.make_plan(load_evaluate_config([*argv, "search.candidates=6", "search.opponent_samples=3"]))
    assert searched.suite.play.search == SearchConfig(candidates=6, opponent_samples=3)
    assert plan.suite.replay_dir == str(tmp_path / "replays")
    # Crossplay pairs play crossplay_games each, the same years and seeds, and write no replays.
    assert [c.play for c in plan.crossplay] == [GamesConfig(games=1, max_year=1903, seed=2, temperature=0.0)] * 2
    assert [c.replay_dir for c in plan.crossplay] == [None, None]
    # With crossplay_replays, each pair's first games go to a folder of the pair's own.
    kept = evaluate.make_plan(
        load_evaluate_config([*argv, "crossplay=[bot:random,bot:hold]", "crossplay_games=2", "crossplay_replays=1"])
    )
    assert [c.play.replays for c in kept.crossplay] == [1, 1]
    assert [c.replay_dir for c in kept.crossplay] == [
        str(tmp_path / "crossplay_replays" / "bot_random_vs_bot_hold"),
        str(tmp_path / "crossplay_replays" / "bot_hold_vs_bot_random"),
    ]
    pairs = [*argv, "crossplay=[bot:random,bot:hold]", "crossplay_games=2"]
    for bad in ("crossplay_replays=3", "crossplay_replays=-1"):
        with pytest.raises(ValueError, match="between 0 and the crossplay games"):
            evaluate.make_plan(load_evaluate_config([*pairs, bad]))
    with pytest.raises(ValueError, match="needs crossplay"):
        evaluate.make_plan(load_evaluate_config([*argv, "crossplay_replays=1"]))


def test_an_adapter_wider_than_the_served_model_fails_before_play_and_model_serves_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A rank-32 adapter (a `tiny_wide` warm start) against the default server (`tiny`, LoRA slots of rank
    8) would have every hero request refused and the suite would report a policy playing holds: refused
    before anything starts, naming `served_model=`. With `served_model=tiny_wide` the server's slots hold it."""
    from diprl.inference.adapters import AdapterStore
    from tests.inference.lora_fixtures import make_lora_dir

    adapters = tmp_path / "adapters"
    AdapterStore(adapters).publish("wide", make_lora_dir(tmp_path, seed=1, rank=32))
    argv = ["policy=wide@v1", f"adapters={adapters}", f"out={tmp_path / 'out'}"]
    assert evaluate.main(argv) == 2
    err = capsys.readouterr().err
    assert "rank 32 exceeds the server's max LoRA rank 8" in err and "served_model=" in err and "Traceback" not in err
    plan = evaluate.make_plan(evaluate.load_evaluate_config([*argv, "served_model=tiny_wide"]))
    assert evaluate.server_config(plan.config).max_lora_rank == 32
    assert evaluate.main([*argv, "served_model=nothing"]) == 2
    assert "not a model preset" in capsys.readouterr().err


def test_a_zoo_entry_is_served_on_its_own_model_with_no_other_flag(tmp_path: Path) -> None:
    """`policy=zoo:best` and `crossplay=[zoo:best,...]` need no served_model=: the entry's manifest names it."""
    from diprl.policy.zoo import load_entry

    model = load_entry("zoo:best").model
    out = f"out={tmp_path / 'out'}"
    plan = evaluate.make_plan(evaluate.load_evaluate_config(["policy=zoo:best", "opponents=bot:dumbbot", out]))
    assert plan.config.served_model == model and plan.llm_refs == ["zoo:best"]
    assert evaluate.server_config(plan.config).model == model
    crossplay = ["policy=bot:random", "crossplay=[zoo:best,bot:dumbbot,bot:random]", "games=7", out]
    assert evaluate.make_plan(evaluate.load_evaluate_config(crossplay)).config.served_model == model
    with pytest.raises(ValueError, match="the zoo entries play on"):
        evaluate.make_plan(evaluate.load_evaluate_config(["policy=zoo:best", "served_model=tiny", out]))
    with pytest.raises(ValueError, match="unknown zoo entry"):
        evaluate.make_plan(evaluate.load_evaluate_config(["policy=zoo:nothing", out]))


def test_games_handed_on_as_overrides_come_back_the_same() -> None:
    from diprl.eval.config import GamesConfig, load_evaluate_config
    from diprl.rollout.search import SearchConfig

    play = GamesConfig(
        games=14, max_year=1903, seed=5, temperature=0.0, sampling_seed=None,
        search=SearchConfig(
            candidates=3, opponent_samples=2, unit_weight=0.5, reach_weight=0.25, improve_rounds=2,
            improve_pool="centres",
        ),
    )  # fmt: skip
    assert "search.candidates=3" in play.overrides() and "sampling_seed=null" in play.overrides()
    assert load_evaluate_config(["policy=base", *play.overrides()]).games_config() == play
