"""The compact BPE: Qwen3's chat tokens and template on a few thousand ids fitted to our text,
deterministic whatever the hash seed, cached like the Qwen tokenizer, and far shorter on prompts."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import diprl.policy.compact_tokenizer as compact
from diprl.game import DiplomacyGame
from diprl.policy.compact_tokenizer import compact_token_ids, compact_tokenizer_fingerprint, compact_tokenizer_path
from diprl.policy.corpus import CorpusRecipe, corpus_texts
from diprl.policy.prompt import build_prompt
from diprl.policy.tokenizer import STAMP_FILE, load_tokenizer

ORDER_TEXTS = [
    "A PAR - BUR\nF STP/SC S A MOS - LVN\n</orders>",
    "<orders>\nA MUN S A BER - KIE\nF NTH C A LON - NWY\nA VIE H\n</orders>",
    "F BUL/EC - CON\nA SER R ALB\nA WAR D\nF STP/NC B\nWAIVE\n</orders>",
    "<think>\nHold Paris.\n</think>\n\n<orders>\nA PAR H\n</orders>",
    "Ünïcödé and emoji 🎲 still encode: byte-level",
]
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tok() -> Any:
    return load_tokenizer(compact_tokenizer_path(4096))


def test_layout_chat_tokens_and_sizes(tok: Any) -> None:
    assert len(tok) == 4096
    ids = compact_token_ids(4096)
    assert ids == {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2, "<think>": 4094, "</think>": 4095}
    assert {t: tok.convert_tokens_to_ids(t) for t in ids} == ids
    assert (tok.eos_token, tok.eos_token_id, tok.pad_token, tok.pad_token_id) == ("<|im_end|>", 2, "<|endoftext|>", 0)
    decoder = tok.added_tokens_decoder
    assert {decoder[i].content: decoder[i].special for i in ids.values()} == {
        "<|endoftext|>": True,
        "<|im_start|>": True,
        "<|im_end|>": True,
        "<think>": False,  # as in Qwen3: ordinary text, so skip_special_tokens keeps it
        "</think>": False,
    }


@pytest.mark.parametrize("text", ORDER_TEXTS)
def test_round_trip_and_chat_tokens_are_single_ids(tok: Any, text: str) -> None:
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    for tag in ("<think>", "</think>"):
        if tag in text:
            assert tok.convert_tokens_to_ids(tag) in ids


def test_chat_template_and_prompts_are_qwens(tok: Any) -> None:
    """The same chat text as Qwen3 (prompts are written once, for either tokenizer), in far fewer ids."""
    qwen = load_tokenizer()
    messages = [{"role": "system", "content": "rules"}, {"role": "user", "content": "board"}]
    for thinking in (False, True):
        kwargs = {"tokenize": False, "add_generation_prompt": True, "enable_thinking": thinking}
        assert tok.apply_chat_template(messages, **kwargs) == qwen.apply_chat_template(messages, **kwargs)
    game = DiplomacyGame()
    text = build_prompt(game, "FRANCE").text
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert ids.count(1) == 3 and ids.count(2) == 2  # three <|im_start|>, two <|im_end|> as single ids
    assert len(ids) < 0.4 * len(qwen.encode(text))


def test_an_order_is_spelled_unit_type_target_in_few_ids(tok: Any) -> None:
    """Every order type is a token of its own, shared by all orders: one output row for "support" or
    "move" that a LoRA on the body can learn to favour (whole-order tokens each had their own row)."""
    game = DiplomacyGame()
    orders = [o for power in game.powers for loc_orders in game.legal_orders(power).by_loc.values() for o in loc_orders]
    spelled = {o: [tok.decode([i]) for i in tok.encode(f"{o}\n")] for o in orders}
    for order, pieces in spelled.items():
        words = order.split(" ")
        if len(words) > 2:  # not a WAIVE
            assert f" {words[2]}" in pieces, (order, pieces)  # the type marker: " -", " S", " H", " C"
    mean = sum(len(p) for p in spelled.values()) / len(spelled)
    assert 3.0 < mean < 5.0, mean


def test_corpus_covers_every_phase_kind_and_power() -> None:
    texts = corpus_texts(CorpusRecipe(), ("<|im_start|>", "<|im_end|>"))
    joined = "".join(texts)
    assert "<|im_start|>" not in joined and "<|im_end|>" not in joined
    for power in DiplomacyGame().powers:
        assert f"You are {power}." in joined
    for heading in ("Movement:", "Retreats:", "Builds:", "Disbands:"):
        assert heading in joined
    assert any(t.endswith("</orders>") for t in texts)


def test_a_corpus_without_every_phase_kind_is_a_clear_error() -> None:
    with pytest.raises(RuntimeError, match=r"shows no .*disband"):
        corpus_texts(CorpusRecipe(games=1, max_year=1901), ())


def test_bad_vocabulary_sizes_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="at least 512"):
        compact_tokenizer_path(100, tmp_path)
    with pytest.raises(RuntimeError, match="fewer than the 65536 asked for"):
        compact_tokenizer_path(65536, tmp_path)
    assert not (tmp_path / "tokenizers" / "compact-65536").exists()


def test_cached_and_rebuilt_when_the_recipe_or_a_file_changes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    builds: list[Path] = []
    real = compact._write_compact

    def counting(vocab_size: int, corpus: CorpusRecipe, out: Path) -> None:
        builds.append(out)
        real(vocab_size, corpus, out)

    monkeypatch.setattr(compact, "_write_compact", counting)
    first = compact_tokenizer_path(1024, tmp_path)
    assert compact_tokenizer_path(1024, tmp_path) == first and len(builds) == 1
    assert (first / STAMP_FILE).is_file() and len(load_tokenizer(first)) == 1024

    with (first / "tokenizer.json").open("r+b") as fh:
        fh.truncate(100)
    compact_tokenizer_path(1024, tmp_path)
    assert len(builds) == 2 and len(load_tokenizer(first)) == 1024

    assert compact_tokenizer_fingerprint(1024) != compact_tokenizer_fingerprint(2048)
    monkeypatch.setattr(compact, "COMPACT_RECIPE_VERSION", compact.COMPACT_RECIPE_VERSION + 1)
    compact_tokenizer_path(1024, tmp_path)
    assert len(builds) == 3


def _build_in_subprocess(cache: Path, hash_seed: str) -> str:
    code = (
        "import sys; from pathlib import Path; from diprl.policy.compact_tokenizer import compact_tokenizer_path; "
        "print(compact_tokenizer_path(4096, Path(sys.argv[1])))"
    )
    env = dict(os.environ, PYTHONHASHSEED=hash_seed, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", code, str(cache)], env=env, capture_output=True, text=True, check=True)
    directory = Path(out.stdout.strip().splitlines()[-1])
    return hashlib.sha256((directory / "tokenizer.json").read_bytes()).hexdigest()


def test_the_build_does_not_depend_on_the_hash_seed(tmp_path: Path) -> None:
    """Two fresh processes with different PYTHONHASHSEED train byte-identical vocabularies, and the
    same one this process cached (every machine of a cluster spells text the same way)."""
    first = _build_in_subprocess(tmp_path / "a", "1")
    second = _build_in_subprocess(tmp_path / "b", "2")
    assert first == second
    assert first == hashlib.sha256((compact_tokenizer_path(4096) / "tokenizer.json").read_bytes()).hexdigest()
