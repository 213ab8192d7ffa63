"""What a training run creates on a shared Ray cluster is named per run, so two runs never collide."""

from __future__ import annotations

from pathlib import Path

import pytest

from diprl.inference.config import ServerConfig
from diprl.run.rundir import run_id, run_namespace, serve_app_name


def test_two_runs_get_distinct_names_and_a_resumed_run_its_own_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first, second = tmp_path / "a" / "pfsp-20261124T0700Z", tmp_path / "b" / "pfsp-20261124T0700Z"
    names = [(run_namespace(d), serve_app_name(d)) for d in (first, second)]
    assert names[0][0] != names[1][0] and names[0][1] != names[1][1]  # same directory name, other runs
    (tmp_path / "a").mkdir()
    monkeypatch.chdir(tmp_path / "a")
    assert serve_app_name(Path("pfsp-20261124T0700Z")) == names[0][1]  # a resume names the same path
    assert serve_app_name(first).startswith("policy-server-pfsp-20261124T0700Z-")
    assert run_namespace(first).startswith("diprl-pfsp-20261124T0700Z-")


def test_a_run_name_is_a_valid_serve_route_whatever_the_directory_is_called(tmp_path: Path) -> None:
    odd = tmp_path / "my run: #1 (ünïcode)"
    app = serve_app_name(odd)
    assert ServerConfig(name=app, route_prefix=f"/{app}").route_prefix == f"/{app}"
    assert run_id(tmp_path / "???").startswith("run-")
