"""The PolicyServer's client: a batch larger than the server takes goes out in chunks, answers in order."""

from __future__ import annotations

from typing import Any

import pytest

from diprl.messages import Generation, GenerationRequest
from diprl.rollout.clients import ServeClient


class _Call:
    def __init__(self, answers: list[Generation]) -> None:
        self.answers = answers

    def result(self, timeout_s: float) -> list[Generation]:
        return self.answers


class _Handle:
    """A deployment handle that answers each request with its prompt and records the chunks it was sent."""

    def __init__(self) -> None:
        self.chunks: list[int] = []
        self.generate = self

    def remote(self, requests: list[GenerationRequest]) -> _Call:
        self.chunks.append(len(requests))
        return _Call([Generation(policy="base", text=str(r.prompt)) for r in requests])


def _client(max_batch: int) -> tuple[ServeClient, _Handle]:
    client = ServeClient(max_batch=max_batch)
    handle = _Handle()
    client._handle = handle
    return client, handle


@pytest.mark.parametrize(("n", "chunks"), [(10, [4, 4, 2]), (8, [4, 4]), (3, [3]), (0, [0])])
def test_a_batch_over_max_batch_goes_out_in_chunks_and_comes_back_in_order(n: int, chunks: list[int]) -> None:
    client, handle = _client(4)
    answers = client.generate([GenerationRequest(policy="base", prompt=f"p{i}") for i in range(n)])
    assert handle.chunks == chunks
    assert [a.text for a in answers] == [f"p{i}" for i in range(n)]


@pytest.mark.parametrize("bad", [0, -1, True, 2.0])
def test_a_bad_max_batch_is_refused(bad: Any) -> None:
    with pytest.raises(ValueError, match="max_batch"):
        ServeClient(max_batch=bad)


def test_the_default_chunk_is_the_servers_default_batch() -> None:
    from diprl.inference.config import ServerConfig

    assert ServeClient().max_batch == ServerConfig().max_batch
