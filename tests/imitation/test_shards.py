"""Teacher shards round-trip and refuse damage; the cache is keyed by what decides the data."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from diprl.imitation.data import TeacherConfig, TeacherData
from diprl.imitation.shards import MANIFEST, cached_teacher_data, data_key, read_shards, write_shards
from diprl.imitation.teacher import TeacherError
from diprl.policy.vocab import TokenTable


def test_shards_round_trip_and_detect_damage(data: TeacherData, tmp_path: Path) -> None:
    directory = write_shards(data, tmp_path / "teacher", shard_size=16)
    assert len(list(directory.glob("train-*.jsonl"))) == -(-len(data.train) // 16)
    back = read_shards(directory)
    assert back.train == data.train and back.heldout == data.heldout
    assert back.summary["heldout_games"] == data.summary["heldout_games"]
    shard = directory / "train-00001.jsonl"
    lines = shard.read_text().splitlines()
    shard.write_text("\n".join([*lines[:3], "{not json", *lines[4:]]) + "\n")
    with pytest.raises(TeacherError, match=r"train-00001\.jsonl line 4 is malformed"):
        read_shards(directory)
    shard = directory / "train-00000.jsonl"
    shard.write_text("\n".join(shard.read_text().splitlines()[:-1]) + "\n")
    with pytest.raises(TeacherError, match="manifest says 16"):
        read_shards(directory)
    shard.unlink()
    with pytest.raises(TeacherError, match="is missing"):
        read_shards(directory)
    with pytest.raises(TeacherError, match="no teacher data"):
        read_shards(tmp_path / "elsewhere")


def test_the_cache_serves_the_same_data_until_something_that_decides_it_changes(
    tok: tuple[Any, TokenTable], tmp_path: Path
) -> None:
    tokenizer, table = tok
    config = TeacherConfig(games=2, heldout_games=1, max_year=1901, workers=1, shard_size=8)
    first, directory, made = cached_teacher_data(config, tokenizer, table, root=tmp_path)
    assert made and directory.parent == tmp_path / "imitation" / "teacher"
    assert directory.name.startswith("dumbbot-") and len(list(directory.glob("train-*.jsonl"))) > 1
    again, same_dir, made = cached_teacher_data(replace(config, workers=2, shard_size=64), tokenizer, table, tmp_path)
    assert not made and same_dir == directory
    assert again.train == first.train and again.heldout == first.heldout
    # A different setting is different data; a teacher named as a PolicyRef is the same teacher.
    assert data_key(replace(config, max_year=1902), tokenizer, table) != data_key(config, tokenizer, table)
    assert data_key(replace(config, opponents=["random"]), tokenizer, table) != data_key(config, tokenizer, table)
    assert data_key(replace(config, teacher="bot:dumbbot"), tokenizer, table) == data_key(config, tokenizer, table)
    # An edited shard fails its stamp: the data are made again rather than read half right.
    shard = directory / "train-00000.jsonl"
    shard.write_text(shard.read_text().replace("dumbbot", "dumbbox", 1))
    rebuilt, rebuilt_dir, made = cached_teacher_data(config, tokenizer, table, root=tmp_path)
    assert made and rebuilt_dir == directory and rebuilt.train == first.train
    assert read_shards(directory).train == first.train
    (directory / MANIFEST).unlink()
    assert cached_teacher_data(config, tokenizer, table, root=tmp_path)[2]


def test_the_key_follows_the_vocabulary(tok: tuple[Any, TokenTable]) -> None:
    tokenizer, table = tok
    config = TeacherConfig(games=2)
    assert data_key(config, tokenizer, replace(table, eos_id=table.eos_id + 1)) != data_key(config, tokenizer, table)


def test_the_code_part_of_the_key_ignores_layout_comments_and_docstrings_only() -> None:
    from diprl.imitation.shards import _code

    plain = _code("def f(x):\n    return x + 1\n")
    assert _code('def f( x ):\n    """Why."""\n    return x+1  # note\n') == plain
    assert _code("def f(x):\n    return x + 2\n") != plain
    assert _code("def f(x):\n    return 'x + 1'\n") != plain
