"""The engine core's tcmalloc preload: set for the block that starts it, on CPU only, and put back after."""

from __future__ import annotations

import logging
import os

import pytest

from diprl.inference.config import ServerConfig
from diprl.inference.engine import engine_core_preload, find_tcmalloc

LIBRARY = "libtcmalloc_minimal.so.4"


def has(*names: str):  # type: ignore[no-untyped-def]
    return lambda name: {"tcmalloc_minimal": LIBRARY, "tcmalloc": "libtcmalloc.so.4"}[name] if name in names else None


def test_the_minimal_tcmalloc_is_preferred_and_none_is_found_on_a_machine_without_either() -> None:
    assert find_tcmalloc(has("tcmalloc_minimal", "tcmalloc")) == LIBRARY
    assert find_tcmalloc(has("tcmalloc")) == "libtcmalloc.so.4"
    assert find_tcmalloc(has()) is None


def test_a_process_started_in_the_block_preloads_tcmalloc_and_the_environment_is_restored_after(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("LD_PRELOAD", "/opt/other.so")
    with engine_core_preload(True, lambda: True, has("tcmalloc_minimal")) as library:
        assert library == LIBRARY
        # What a process spawned here (vLLM's engine core) inherits: tcmalloc first, the user's preload kept.
        assert os.environ["LD_PRELOAD"] == f"{LIBRARY}:/opt/other.so"
    assert os.environ["LD_PRELOAD"] == "/opt/other.so"
    monkeypatch.delenv("LD_PRELOAD")
    with engine_core_preload(True, lambda: True, has("tcmalloc_minimal")):
        assert os.environ["LD_PRELOAD"] == LIBRARY
    assert "LD_PRELOAD" not in os.environ


@pytest.mark.parametrize("enabled, on_cpu", [(False, True), (True, False)])
def test_nothing_is_preloaded_when_turned_off_or_off_the_cpu(
    enabled: bool, on_cpu: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    with engine_core_preload(enabled, lambda: on_cpu, has("tcmalloc_minimal")) as library:
        assert library is None and "LD_PRELOAD" not in os.environ


def test_a_machine_without_tcmalloc_is_told_how_to_get_it(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    with caplog.at_level(logging.WARNING), engine_core_preload(True, lambda: True, has()) as library:
        assert library is None and "LD_PRELOAD" not in os.environ
    assert "libtcmalloc-minimal4" in caplog.text


def test_the_switch_is_a_boolean() -> None:
    assert ServerConfig().preload_tcmalloc is True
    with pytest.raises(ValueError, match="preload_tcmalloc must be true or false"):
        ServerConfig(preload_tcmalloc="yes")  # type: ignore[arg-type]
