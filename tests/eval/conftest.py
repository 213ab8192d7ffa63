"""Clients for suites with LLM seats that need no model: a uniform legal policy that records its calls."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from diprl.messages import Generation, GenerationRequest
from diprl.policy.vocab import ORDER_ALPHABET, TokenTable
from diprl.rollout.clients import UniformConstrainedClient

# One token per character (EOS at 0): enough for OrderConstraint to spell every legal order.
CHAR_TABLE = TokenTable.from_texts([None, *sorted(ORDER_ALPHABET)], eos_id=0)


class RecordingClient:
    """A uniformly random legal policy (no engine) that keeps every batch it was sent."""

    def __init__(self, seed: int = 0) -> None:
        self.inner = UniformConstrainedClient(CHAR_TABLE, seed=seed)
        self.calls: list[list[GenerationRequest]] = []

    def generate(self, requests: Sequence[GenerationRequest]) -> list[Generation]:
        self.calls.append(list(requests))
        return self.inner.generate(requests)


@pytest.fixture
def recording_client() -> RecordingClient:
    return RecordingClient()
