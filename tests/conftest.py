"""Offline, loopback-only defaults for every test (the same values the Makefile exports).

Ray's token authentication stays on (its token lives in the diprl cache, see diprl.raysession) and
every test that needs Ray starts it through `diprl.raysession`, which pins loopback.
"""

from __future__ import annotations

import os

import pytest

for _name, _value in {
    "HF_HUB_OFFLINE": "1",
    "WANDB_MODE": "offline",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
}.items():
    os.environ.setdefault(_name, _value)

from diprl.raysession import prepare_environment  # noqa: E402  (after the offline defaults)

prepare_environment()  # before any test module imports Ray or vLLM


@pytest.fixture(scope="session", autouse=True)
def _built_models() -> None:
    """The test session is an entry point: it builds the tiny model once, up front, as `train` and `evaluate`
    do (`diprl.policy.models.build_model`); everything the tests start only looks it up."""
    from diprl.policy.models import build_model

    build_model("tiny")
