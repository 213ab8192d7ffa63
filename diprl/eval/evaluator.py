"""The evaluator of a training run: the fixed suite against a frozen pool, on demand, off the hot path.

In-league ratings can stay flat while a policy improves (everyone improves together) or rise while
it forgets how to beat weak play; a fixed yardstick tells the two apart. The training driver calls
`evaluate.remote(policy_ref, tag)` on the named actor "evaluator" now and then and does not wait:
the actor plays the suite against every member of its frozen pool (Random, DumbBot, `base`, and
any pinned snapshots) in one lockstep run, as just another client of the PolicyServer, so
rollouts and the learner carry on. It returns a small `EvaluationResult` (the hero's mean centres
with their interval, solo rate and games per opponent, and where the report is); each evaluation writes

    <run_dir>/eval/<tag>/report.json      # one suite report per pool member + a flat summary
    <run_dir>/eval/<tag>/*.png            # the suites side by side
    <run_dir>/eval/metrics.jsonl          # one line per evaluation: flat `eval/<opponent>/<metric>` values
    <run_dir>/eval/crossplay/<tag>.json   # a scheduled crossplay round (`crossplay`)
    <run_dir>/eval/crossplay/rounds/<tag>/<hero>_vs_<opponent>/game0000/   # its replays (newest rounds only)

and pins survive a restart (kept in `<run_dir>/eval/pool.json`).
"""

from __future__ import annotations

import json
import re
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from diprl.atomic_io import write_json_atomic
from diprl.eval.config import GamesConfig
from diprl.eval.refs import check_policy_ref
from diprl.eval.suite import SuiteConfig, run_suites
from diprl.messages import EvaluationResult, OpponentResult
from diprl.rollout.clients import PolicyClient

_TAG = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@-]{0,99}")


@dataclass
class EvaluatorConfig:
    """The frozen pool and the games of every evaluation (`play`: any `GamesConfig`, such as the
    training run's `evaluation` section; only its games part is kept).

    `client`: "serve" (the PolicyServer app `serve_app`) or "uniform" (a uniformly random legal
    policy for every LLM seat, with no model: tests and dry runs).
    """

    pool: list[str] = field(default_factory=lambda: ["bot:random", "bot:dumbbot", "base"])
    pinned: list[str] = field(default_factory=list)  # snapshots to compare against, e.g. ["main@v1"]
    play: GamesConfig = field(default_factory=lambda: GamesConfig(games=28))
    plots: bool = True
    client: str = "serve"
    serve_app: str = "policy"
    model: str = "tiny"  # model preset whose tokenizer the uniform client spells completions in

    def __post_init__(self) -> None:
        if not self.pool and not self.pinned:
            raise ValueError("the evaluator's pool is empty")
        for ref in (*self.pool, *self.pinned):
            check_policy_ref(ref)
        if not isinstance(self.play, GamesConfig):
            raise TypeError(f"play must be a GamesConfig, got {type(self.play).__name__}")
        self.play = self.play.games_config()
        from diprl.rollout.clients import CLIENTS

        if self.client not in CLIENTS:
            raise ValueError(f"client must be one of {', '.join(CLIENTS)}, got {self.client!r}")


def flat_metrics(policy: str, tag: str, reports: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """One flat dict per evaluation (what a metrics logger plots): `eval/<opponent>/<metric>`."""
    row: dict[str, Any] = {"policy": policy, "tag": tag, "time": time.time()}
    for opponent, report in reports.items():
        b = report["behaviour"]
        prefix = f"eval/{opponent}"
        row[f"{prefix}/solo_rate"] = report["hero_solo_rate"]
        row[f"{prefix}/top_rate"] = report["categories"]["top"]["rate"]
        row[f"{prefix}/eliminated_rate"] = report["categories"]["eliminated"]["rate"]
        row[f"{prefix}/mean_sc"] = report["hero_mean_sc"]
        row[f"{prefix}/mean_sos"] = report["hero_sum_of_squares"]["mean"]
        if "hold_rate" in b:  # reports written before the order-kind mix have neither
            row[f"{prefix}/hold_rate"] = b["hold_rate"]["rate"]
        for kind, share in (b.get("order_kinds") or {}).items():
            row[f"{prefix}/kind_share/{kind}"] = share
        row[f"{prefix}/support_rate"] = b["support_rate"]["rate"]
        row[f"{prefix}/void_support_rate"] = b["void_support_rate"]["rate"]
        if b["critical_support_rate"] is not None:
            row[f"{prefix}/critical_support_rate"] = b["critical_support_rate"]["rate"]
        row[f"{prefix}/centres_gained_per_year"] = b["centres_gained_per_year"]["mean"]
        if b["waived_build_rate"]["rate"] is not None:
            row[f"{prefix}/waived_build_rate"] = b["waived_build_rate"]["rate"]
        row[f"{prefix}/bad_completion_rate"] = (
            (report["llm"]["hero_errors"] + report["llm"]["hero_incomplete"]) / report["llm"]["hero_requests"]
            if report["llm"]["hero_requests"]
            else None
        )
    return row


def opponent_result(opponent: str, report: dict[str, Any]) -> OpponentResult:
    """The gist of one suite report that crosses back to the driver."""
    low, high = report["hero_centres"]["ci95"]
    return OpponentResult(opponent, report["games"], report["hero_mean_sc"], (low, high), report["hero_solo_rate"])


def _saved_pins(path: Path) -> list[str]:
    """The pinned snapshots kept in `path`, read with the run files' limits (size, depth: `diprl.run_yaml`);
    `ValueError` naming the file when it is not what `Evaluator.pin` writes."""
    from diprl.run_yaml import RunYamlError, check_run_yaml, read_run_yaml_text

    text = read_run_yaml_text(path)
    try:
        check_run_yaml(text, str(path))  # JSON is YAML: one linear pass, no recursion, before json.loads
        pinned = json.loads(text).get("pinned", [])
    except (RunYamlError, json.JSONDecodeError, AttributeError) as exc:
        raise ValueError(f"{path} is not an evaluation pool file ({str(exc)[:200]}); fix or remove it") from None
    if not isinstance(pinned, list) or not all(isinstance(r, str) for r in pinned):
        raise ValueError(f"{path}: 'pinned' must be a list of PolicyRefs; fix or remove it")
    return pinned


class Evaluator:
    """Runs the suite for a policy against the frozen pool; a plain class, and the "evaluator" actor."""

    def __init__(self, config: EvaluatorConfig, run_dir: str | Path, client: PolicyClient | None = None) -> None:
        self.config = config
        self.root = Path(run_dir) / "eval"
        self.root.mkdir(parents=True, exist_ok=True)
        self._client = client
        pool_file = self.root / "pool.json"
        saved = _saved_pins(pool_file) if pool_file.is_file() else []
        self._pinned = list(dict.fromkeys(check_policy_ref(r) for r in [*config.pinned, *saved]))

    def _get_client(self) -> PolicyClient:
        if self._client is None:
            from diprl.rollout.clients import make_client

            cfg = self.config
            self._client = make_client(cfg.client, cfg.serve_app, cfg.model, cfg.play.seed)
        return self._client

    def pool(self) -> list[str]:
        """The opponents of every evaluation: the fixed pool, then the pinned snapshots."""
        return list(dict.fromkeys([*self.config.pool, *self._pinned]))

    def pin(self, ref: str) -> list[str]:
        """Add a snapshot (e.g. the first version of a run) to the pool for later evaluations."""
        check_policy_ref(ref)
        if ref not in self._pinned:
            self._pinned.append(ref)
            write_json_atomic(self.root / "pool.json", {"pinned": self._pinned})
        return self.pool()

    def evaluate(self, policy_ref: str, tag: str) -> EvaluationResult:
        """Play `policy_ref` against every pool member (one lockstep run); write the report, return its gist.

        `<run_dir>/eval/<tag>/report.json` holds one suite report per opponent (`suites`, keyed by the
        opponent's ref) and `summary`, the flat metrics also appended to `<run_dir>/eval/metrics.jsonl`.
        """
        check_policy_ref(policy_ref)
        if not isinstance(tag, str) or not _TAG.fullmatch(tag) or ".." in tag:
            raise ValueError(f"tag must be a short name of letters, digits and ._@- (no '..'), got {tag!r}")
        cfg = self.config
        out = self.root / tag
        opponents = [ref for ref in self.pool() if ref != policy_ref]
        if not opponents:
            raise ValueError(f"nothing to evaluate {policy_ref} against: the pool is {self.pool()}")
        suites = [
            SuiteConfig(
                policy=policy_ref,
                opponents=[opponent],
                play=cfg.play,
                replay_dir=str(out / "replays" / opponent.replace(":", "_")) if cfg.play.replays else None,
            )
            for opponent in opponents
        ]
        needs_client = any(s.needs_client for s in suites)
        reports = run_suites(suites, self._get_client() if needs_client else None)
        by_opponent = dict(zip(opponents, reports, strict=True))
        summary = flat_metrics(policy_ref, tag, by_opponent)
        path = write_json_atomic(
            out / "report.json",
            {"policy": policy_ref, "tag": tag, "pool": opponents, "summary": summary, "suites": by_opponent},
            indent=1,
        )
        if cfg.plots:
            from diprl.eval.plots import write_plots

            write_plots(reports, out)
        with (self.root / "metrics.jsonl").open("a") as sink:
            sink.write(json.dumps(summary) + "\n")
        return EvaluationResult(
            tag, policy_ref, str(path), tuple(opponent_result(o, r) for o, r in by_opponent.items())
        )

    def crossplay(
        self, pairs: Sequence[Sequence[str]], games: int, tag: str, replays: int = 0, keep_rounds: int = 10
    ) -> list[dict[str, Any]]:
        """Scheduled crossplay between pool members, so the league's Nash has measured pairs (issue 36).

        Each pair `(A, B)` plays A as hero against six seats of B for `games` games: the evaluation's
        seeded games (game i: its seed, the hero on power i % 7), all pairs in one lockstep run. Returns,
        per pair, the hero's outcome in every game (`outrank_share`: the share of the six seats it outranks
        by centres, ties half, the league's payoff outcome); the same pairs and games always play the same
        games. Kept in `<run_dir>/eval/crossplay/<tag>.json`; each pair's first `replays` games are kept
        as replays in a folder of this round's own (`diprl.eval.crossplay.pair_replay_dir`: a round played
        again under the same tag replaces its own), and only the newest `keep_rounds` rounds' replays stay.
        """
        from diprl.eval.crossplay import outrank_share, pair_replay_dir, prune_replay_rounds

        if not isinstance(tag, str) or not _TAG.fullmatch(tag) or ".." in tag:
            raise ValueError(f"tag must be a short name of letters, digits and ._@- (no '..'), got {tag!r}")
        if games < 1:
            raise ValueError(f"crossplay needs at least one game a pair, got {games}")
        if isinstance(keep_rounds, bool) or not isinstance(keep_rounds, int) or keep_rounds < 1:
            raise ValueError(f"crossplay keep_rounds must be an integer >= 1, got {keep_rounds!r}")
        play = replace(self.config.play, games=games, replays=replays)  # GamesConfig checks 0 <= replays <= games
        pairs = [(check_policy_ref(a), check_policy_ref(b)) for a, b in pairs]
        if any(a == b for a, b in pairs):
            raise ValueError(f"a crossplay pair needs two policies, got {pairs}")
        if not pairs:
            return []
        rounds = self.root / "crossplay" / "rounds"  # only scheduled crossplay writes here: pruning is safe
        if replays:
            shutil.rmtree(rounds / tag, ignore_errors=True)  # this round played again: its own replays go
        suites = [
            SuiteConfig(
                policy=a,
                opponents=[b],
                play=play,
                label=f"{a} vs {b}",
                replay_dir=str(pair_replay_dir(rounds, tag, a, b)) if replays else None,
            )
            for a, b in pairs
        ]
        reports = run_suites(suites, self._get_client() if any(s.needs_client for s in suites) else None)
        if replays:
            prune_replay_rounds(rounds, keep_rounds, tag)
        results = []
        for (a, b), report in zip(pairs, reports, strict=True):
            outcomes = []
            for game in report["per_game"]:
                others = [p for p in game["seats"] if p != game["hero_power"]]
                outcomes.append(outrank_share(game["centres"], game["hero_power"], others))
            results.append({"hero": a, "opponent": b, "games": len(outcomes), "outcomes": outcomes})
        write_json_atomic(self.root / "crossplay" / f"{tag}.json", {"tag": tag, "pairs": results}, indent=1)
        return results

    def pid_of(self) -> int:
        import os

        return os.getpid()

    def history(self) -> list[dict[str, Any]]:
        """Every evaluation's flat summary so far, oldest first (survives restarts: read from disk)."""
        path = self.root / "metrics.jsonl"
        if not path.is_file():
            return []
        rows = []
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a line cut short by a crash mid-write
        return rows


def start_evaluator(
    config: EvaluatorConfig,
    run_dir: str | Path,
    name: str = "evaluator",
    num_cpus: float = 1.0,
    resources: dict[str, float] | None = None,
) -> Any:
    """The named Ray actor (created, or the running one returned); restarted with its pins if it dies.

    Its calls are independent, so a call cut by a crash is retried on the restarted actor. `resources`
    (custom resources) keep it on the nodes that declare them.
    """
    import ray

    actor = ray.remote(Evaluator).options(
        name=name,
        get_if_exists=True,
        num_cpus=num_cpus,
        max_restarts=-1,
        max_task_retries=-1,
        resources=dict(resources or {}),
    )
    return actor.remote(config, str(run_dir))
