"""Shared fixtures: the tiny model's tokenizer and one small set of DumbBot teacher games."""

from __future__ import annotations

from typing import Any

import pytest

from diprl.imitation.data import TeacherConfig, TeacherData, generate
from diprl.policy.models import load_preset, logits_width, resolve_model_path
from diprl.policy.tokenizer import load_tokenizer
from diprl.policy.vocab import TokenTable, token_table


@pytest.fixture(scope="session")
def tok() -> tuple[Any, TokenTable]:
    preset = load_preset("tiny")  # the model the tests train: its tokenizer spells the examples
    tokenizer = load_tokenizer(resolve_model_path(preset))
    return tokenizer, token_table(tokenizer, logits_width(preset))


@pytest.fixture(scope="session")
def data(tok: tuple[Any, TokenTable]) -> TeacherData:
    tokenizer, table = tok
    config = TeacherConfig(
        teacher="bot:dumbbot", games=5, heldout_games=2, max_year=1904, heldout_examples=None, workers=1
    )
    return generate(config, tokenizer, table)
