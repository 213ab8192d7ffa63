"""The preload benchmark's own logic: which libraries it finds, how it reads a child, how rounds are paired.
(The children themselves start a vLLM engine each; the benchmark is run by hand, docs/benchmarks.md.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from diprl.bench import preload


def test_it_preloads_the_machines_tcmalloc_and_on_request_the_environments_iomp(tmp_path: Path) -> None:
    assert preload.preload_libraries(str(tmp_path), find=lambda name: None, with_iomp=True) == []
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "libiomp5.so").write_bytes(b"")
    found = {"tcmalloc_minimal": "libtcmalloc_minimal.so.4"}
    assert preload.preload_libraries(str(tmp_path), find=found.get) == ["libtcmalloc_minimal.so.4"]
    assert preload.preload_libraries(str(tmp_path), find=found.get, with_iomp=True) == [
        str(tmp_path / "lib" / "libiomp5.so"),
        "libtcmalloc_minimal.so.4",
    ]


def test_a_child_that_printed_no_rate_is_an_error_not_a_zero() -> None:
    assert preload.child_rate("warming up\ntokens_per_s=12.5\n") == 12.5
    with pytest.raises(RuntimeError, match="no tokens_per_s"):
        preload.child_rate("Traceback (most recent call last):\n  ...\nOSError: cannot load")


def test_rounds_alternate_which_side_runs_first_and_the_median_ratio_is_reported() -> None:
    calls: list[bool] = []
    rates = iter([10.0, 12.0, 15.0, 10.0, 10.0, 11.0])  # round 0 plain, preloaded; round 1 preloaded, plain; ...

    def measure(preloaded: bool) -> float:
        calls.append(preloaded)
        return next(rates)

    rounds: list[tuple[int, float, float]] = []
    speedup = preload.compare(3, measure, lambda i, plain, loaded: rounds.append((i, plain, loaded)))
    assert calls == [False, True, True, False, False, True]
    assert rounds == [(0, 10.0, 12.0), (1, 10.0, 15.0), (2, 10.0, 11.0)]
    assert speedup == pytest.approx(1.2)  # ratios 1.2, 1.5, 1.1


def test_a_child_runs_with_the_variables_set_and_removed_and_its_failure_is_shown(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "probe.py").write_text(
        "import os, sys\n"
        "print(os.environ.get('DIPRL_SET'), os.environ.get('DIPRL_DROPPED'))\n"
        "sys.exit(len(sys.argv) - 1)\n"
    )
    monkeypatch.setenv("DIPRL_DROPPED", "x")
    env = {"PYTHONPATH": str(tmp_path), "DIPRL_SET": "1", "DIPRL_DROPPED": None}
    assert preload.run_module("probe", [], env) == "1 None\n"
    with pytest.raises(RuntimeError, match="exited 1:\n1 None"):
        preload.run_module("probe", ["fail"], env)
