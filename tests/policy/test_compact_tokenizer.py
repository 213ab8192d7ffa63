"""The compact BPE: Qwen3's chat tokens and template on about a thousand ids fitted to our text, one id
per word (a province is the same id on the board and in an order), deterministic whatever the hash seed,
cached like the Qwen tokenizer."""

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
    return load_tokenizer(compact_tokenizer_path(1024))


def test_layout_chat_tokens_and_sizes(tok: Any) -> None:
    assert len(tok) == 1024
    ids = compact_token_ids(1024)
    assert ids == {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2, "<think>": 1022, "</think>": 1023}
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
    """The same chat text as Qwen3 (prompts are written once, for either tokenizer), in no more ids."""
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
    assert len(ids) <= len(qwen.encode(text))


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
    assert 4.0 < mean < 7.0, mean


def test_a_province_is_one_id_wherever_it_appears(tok: Any) -> None:
    """The board's centre lists and units, and an order's unit and target, spell a province with the same
    single id: what lets a random-init policy compare a target with the board (recipe 2 merged board text
    across spaces into opaque ids such as `VIE) units: A BOH, A `)."""
    game = DiplomacyGame()
    prompt = build_prompt(game, "GERMANY")
    board_ids = tok.encode(prompt.board)
    pieces = [tok.decode([i]) for i in board_ids]
    for province in ("BER", "KIE", "MUN", "HOL", "DEN", "BEL"):
        (token,) = tok.encode(f" {province}")
        assert board_ids.count(token) >= 1, (province, pieces)
    order_ids = tok.encode("A MUN - BER\nF KIE - HOL\n")
    assert order_ids.count(tok.encode(" BER")[0]) == 1
    assert order_ids.count(tok.encode(" HOL")[0]) == 1
    assert tok.encode(" MUN")[0] in order_ids
    # Every province and coast of the map is at most three ids (STP, /, NC), and a plain province one.
    for loc in sorted({loc.upper() for loc in game.engine.map.locs}):
        n = len(tok.encode(f" {loc}"))
        assert n == (3 if "/" in loc else 1) or loc == "SWI", (loc, n)


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
    assert not (tmp_path / "tokenizers" / "compact-100").exists()


def test_ids_the_corpus_cannot_fill_are_reserved_and_never_produced(tmp_path: Path) -> None:
    """The corpus has fewer words than the vocabulary has room for: the ids between the learned ones and
    the think tags are special fillers that no text encodes to, and the layout still holds."""
    tok = load_tokenizer(compact_tokenizer_path(2048, tmp_path))
    assert len(tok) == 2048
    assert tok.convert_tokens_to_ids("</think>") == 2047
    reserved = [i for i, t in tok.added_tokens_decoder.items() if t.content.startswith("<|reserved_")]
    assert len(reserved) > 1000 and all(tok.added_tokens_decoder[i].special for i in reserved)
    used = {i for text in corpus_texts(CorpusRecipe(), ("<|im_start|>", "<|im_end|>")) for i in tok.encode(text)}
    assert used and not used & set(reserved)


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
        "print(compact_tokenizer_path(1024, Path(sys.argv[1])))"
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
    assert first == hashlib.sha256((compact_tokenizer_path(1024) / "tokenizer.json").read_bytes()).hexdigest()
