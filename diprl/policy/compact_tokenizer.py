"""A compact byte-level BPE for the CPU presets, trained offline on the project's own corpus.

Why: on a CPU, vLLM's sampler draws exponential noise over the whole vocabulary for every sampled
token, and with Qwen's 151,936 ids that noise (not the model) is most of a token's cost; the same
rows are 97% of a tiny model's parameters. A few thousand ids fitted to our prompts and orders make
sampling cheap, spell a prompt in a fraction of Qwen's ids and an order in four or five, and free
the parameters for the body.

What stays the same: Qwen3's chat special tokens (`<|endoftext|>`, `<|im_start|>`, `<|im_end|>`
special; `<think>`, `</think>` matched whole but ordinary text, as in Qwen3) and its chat template,
so prompts are written exactly as for a real Qwen3. Byte-level, so any text still encodes.

Layout: the three special tokens are ids 0-2, the learned merges follow, then reserved ids that
nothing encodes to (when the corpus has fewer words than the vocabulary has room for), and the two
think tags are the last two ids, so `len(tokenizer) == vocab_size` exactly and the model's logits
width equals the tokenizer.

The pre-tokenizer cuts text into words (a run of letters, of digits or of punctuation, each with its
leading space; newlines apart), so merges never cross a word: `A MUN - BUR` is `A`, ` MUN`, ` -`,
` BUR`, and the board's `centres: BER KIE MUN` is ` centres`, `:`, ` BER`, ` KIE`, ` MUN`. The corpus
has about 330 such words, so every one of them is a single id. That is what makes the board readable
to a random-init policy: a province is the same id wherever it appears (a centre list, a unit, an
order's target), so "move onto a centre nobody of mine owns" is a comparison of ids the model can
learn, and the tied output row of ` BUR` is the embedding the board showed it. Recipe 2 merged across
spaces (`VIE) units: A BOH, A ` was one id, a whole opening board line another): a prompt was 4x
shorter, but each board was a few opaque ids, and the trained policy picked the same target whatever
the unit and the board (docs/results.md, "What unlocked learning"). Recipe 1 merged whole orders, giving each its own
random output row that LoRA on the body could not reshape.

Built once into the cache with the same primitives as the Qwen tokenizer: a fingerprint of the
recipe (corpus recipe, vocabulary size, layout), an atomic write, a stamp checked on every load.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from diprl.cache import cache_root
from diprl.policy.corpus import CorpusRecipe, corpus_texts
from diprl.policy.tokenizer import build_cached_dir, chat_tokenizer_config, fingerprint

COMPACT_RECIPE_VERSION = 3
"""Bump when the build below changes in a way the fingerprint cannot see (prompt wording included:
the corpus is regenerated, not hashed, so a stale vocabulary is only less compact, never wrong)."""

COMPACT_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
"""Ids 0, 1, 2: special, skipped by `skip_special_tokens`, as in Qwen3."""

COMPACT_THINK_TOKENS = ("<think>", "</think>")
"""The last two ids: matched whole, but ordinary text (Qwen3 does not mark them special)."""

SPLIT_PATTERN = r" ?[A-Za-z]+| ?[0-9]+| ?[^\sA-Za-z0-9]+|\n+| +"
"""Pre-tokenizer words: letters, digits or punctuation, each run with its leading space; newlines; other
spaces. Merges stay within one word."""

RESERVED_TOKEN = "<|reserved_{}|>"
"""Filler for the ids between the learned merges and the think tags: special, never produced by encoding."""

MIN_VOCAB_SIZE = 512
"""256 byte ids, the five chat tokens, and room for merges that make the vocabulary worth having."""

DEFAULT_CORPUS = CorpusRecipe()


def check_vocab_size(vocab_size: int) -> None:
    """A compact vocabulary must hold the byte alphabet, the chat tokens and some merges."""
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"a compact vocabulary needs at least {MIN_VOCAB_SIZE} ids, got {vocab_size}")


def compact_token_ids(vocab_size: int) -> dict[str, int]:
    """Id of every chat token in a compact vocabulary of `vocab_size` ids (fixed by the layout)."""
    ids = {token: i for i, token in enumerate(COMPACT_SPECIAL_TOKENS)}
    first_think = vocab_size - len(COMPACT_THINK_TOKENS)
    ids.update({token: first_think + i for i, token in enumerate(COMPACT_THINK_TOKENS)})
    return ids


def _tokenizer_config(vocab_size: int) -> dict[str, Any]:
    """`tokenizer_config.json`: Qwen3's chat template and special tokens on the compact ids.

    `PreTrainedTokenizerFast` loads `tokenizer.json` as saved; `Qwen2Tokenizer` would rebuild the
    BPE with Qwen's own pre-tokenizer regex and so split text differently from training.
    """
    ids = compact_token_ids(vocab_size)
    added = [(ids[t], t, t in COMPACT_SPECIAL_TOKENS) for t in (*COMPACT_SPECIAL_TOKENS, *COMPACT_THINK_TOKENS)]
    return chat_tokenizer_config(added, ["<|im_start|>"], "PreTrainedTokenizerFast")


def compact_tokenizer_fingerprint(vocab_size: int, corpus: CorpusRecipe = DEFAULT_CORPUS) -> str:
    """Content key of a compact tokenizer build: every input of `_write_compact` that can change."""
    return fingerprint(
        {
            "recipe": COMPACT_RECIPE_VERSION,
            "vocab_size": vocab_size,
            "corpus": asdict(corpus),
            "special": COMPACT_SPECIAL_TOKENS,
            "think": COMPACT_THINK_TOKENS,
            "split": SPLIT_PATTERN,
            "reserved": RESERVED_TOKEN,
            "config": _tokenizer_config(vocab_size),
        }
    )


def _write_compact(vocab_size: int, corpus: CorpusRecipe, out: Path) -> None:
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(COMPACT_THINK_TOKENS),
        special_tokens=[
            AddedToken(token, single_word=False, lstrip=False, rstrip=False, normalized=False, special=True)
            for token in COMPACT_SPECIAL_TOKENS
        ],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    texts = corpus_texts(corpus, (*COMPACT_SPECIAL_TOKENS, *COMPACT_THINK_TOKENS))
    backend.train_from_iterator(texts, trainer, length=len(texts))
    learned = backend.get_vocab_size(with_added_tokens=True)
    backend.add_tokens(
        [
            AddedToken(
                RESERVED_TOKEN.format(i), single_word=False, lstrip=False, rstrip=False, normalized=False, special=True
            )
            for i in range(vocab_size - len(COMPACT_THINK_TOKENS) - learned)
        ]
    )
    backend.add_tokens(
        [
            AddedToken(token, single_word=False, lstrip=False, rstrip=False, normalized=False, special=False)
            for token in COMPACT_THINK_TOKENS
        ]
    )
    expected = compact_token_ids(vocab_size)
    actual = {token: backend.token_to_id(token) for token in expected}
    if actual != expected:
        raise RuntimeError(f"chat tokens landed on {actual}, expected {expected}")
    backend.save(str(out / "tokenizer.json"))
    config = json.dumps(_tokenizer_config(vocab_size), indent=2, ensure_ascii=False)
    (out / "tokenizer_config.json").write_text(config)


def compact_tokenizer_path(
    vocab_size: int, cache_dir: Path | None = None, corpus: CorpusRecipe = DEFAULT_CORPUS
) -> Path:
    """Directory holding the compact `tokenizer.json` + `tokenizer_config.json`, built on first use.

    Lives in `<root>/tokenizers/compact-<vocab_size>` (root: `cache_dir` or `cache_root()`);
    a missing, stale or corrupt directory is rebuilt atomically in a few seconds.
    """
    check_vocab_size(vocab_size)
    root = cache_dir if cache_dir is not None else cache_root()
    target = root / "tokenizers" / f"compact-{vocab_size}"
    key = compact_tokenizer_fingerprint(vocab_size, corpus)
    return build_cached_dir(target, key, lambda out: _write_compact(vocab_size, corpus, out))
