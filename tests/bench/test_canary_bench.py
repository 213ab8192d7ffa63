"""`python -m diprl.bench canary` runs end to end on its smallest setting, so it cannot rot silently: every
injected fault caught (a load cut off mid-probe included), no false alarm, versions between two canaries
served on their bytes, and its last line in the issue's form. Timings are printed, never asserted."""

from __future__ import annotations

import re

import pytest

from diprl.bench.__main__ import main

LAST = re.compile(r"canary_caught=(\d+)/(\d+) canary_false_alarms=(\d+) canary_cost=\d+\.\d{3}")


def test_the_canary_bench_catches_every_fault_without_false_alarms(capsys: pytest.CaptureFixture[str]) -> None:
    # one warm-up and one timed step: main@v1 (start) and main@v3 carry a canary, main@v2 does not
    smallest = ["--steps", "1", "--groups", "1", "--forks", "2", "--canary-every", "2"]
    smallest += ["--traffic", "2", "--trials", "1"]
    code = main(["canary", *smallest])
    out = capsys.readouterr().out.strip().splitlines()
    last = LAST.fullmatch(out[-1])
    assert last is not None, out[-3:]
    caught, injected, false_alarms = (int(x) for x in last.groups())
    assert injected >= 4 and caught == injected and false_alarms == 0, out
    assert code == 0
    assert any(line.startswith("clean versions: main@v1, main@v3;") for line in out), out
    assert "versions without a canary (canary_every=2), served: main@v2" in out
    for fault in ("stale", "base", "reload_skipped"):
        assert any(re.fullmatch(rf"fault {fault} +as main@v\d+: caught", line) for line in out), (fault, out)
    # the probe was timed beside sampled traffic that the engine served without an error
    assert any(line.startswith("replica probe ") and "beside 2 sampled requests (median of 1)" in line for line in out)
    # a load cut off mid-probe leaves nothing served unproven: the next request proves the version again
    assert any(line.startswith("fault killed_mid_load as main@v") and ": caught (" in line for line in out), out


def test_a_cadence_that_leaves_one_canaried_version_is_a_usage_error() -> None:
    with pytest.raises(SystemExit) as exc:
        main(["canary", "--steps", "2", "--canary-every", "4"])
    assert exc.value.code == 2
