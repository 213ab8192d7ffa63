"""Matches played in the test's own process: an `Episode` driven in lockstep without Ray or a worker."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from diprl.messages import Match
from diprl.rollout.episode import Episode, EpisodeOutput
from diprl.rollout.lockstep import IterSource, Job, LockstepStats, PolicyClient, drive


def play_matches(
    episode: Episode, matches: Sequence[Match], client: PolicyClient | None, matches_in_flight: int = 8
) -> tuple[list[EpisodeOutput], LockstepStats]:
    """Play `matches` in this process, `matches_in_flight` at a time in lockstep; outputs in match order."""
    jobs: dict[int, int] = {}  # id(job) -> match index
    outputs: dict[int, EpisodeOutput] = {}

    def source() -> Iterator[Job]:
        for i, match in enumerate(matches):
            job = episode.play(match)
            jobs[id(job)] = i
            yield job

    def done(job: Job, out: EpisodeOutput) -> None:
        outputs[jobs[id(job)]] = out

    stats = drive(IterSource(source()), client, matches_in_flight, done)
    return [outputs[i] for i in range(len(matches))], stats
