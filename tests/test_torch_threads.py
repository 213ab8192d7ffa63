"""`set_torch_threads` holds where vLLM's CPU worker has swapped out `torch.set_num_threads`."""

from __future__ import annotations

import pytest
import torch

from diprl.torch_threads import set_torch_threads, torch_threads


def test_the_count_holds_after_an_engine_has_swapped_out_torchs_setter(monkeypatch: pytest.MonkeyPatch) -> None:
    before = torch.get_num_threads()
    other = 1 if before > 1 else 2
    # what vLLM's CPU worker does to the process once it has bound its threads to cores
    monkeypatch.setattr(torch, "set_num_threads", lambda count: None)
    try:
        with torch_threads(other):
            assert torch.get_num_threads() == other
        assert torch.get_num_threads() == before
        with torch_threads():  # an engine inside sets its own count; the one before comes back
            set_torch_threads(other)
        assert torch.get_num_threads() == before
        set_torch_threads(other)
        assert torch.get_num_threads() == other
    finally:
        set_torch_threads(before)


def test_the_count_comes_back_when_the_block_fails() -> None:
    before = torch.get_num_threads()
    with pytest.raises(KeyError), torch_threads(1 if before > 1 else 2):
        raise KeyError("inside")
    assert torch.get_num_threads() == before


def test_no_threads_is_an_error() -> None:
    with pytest.raises(ValueError, match="at least one thread"):
        set_torch_threads(0)
