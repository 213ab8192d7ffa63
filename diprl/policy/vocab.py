"""The decoded text of every token, and a character trie over the tokens that orders can use.

Constrained decoding reasons about characters, not token ids: the same order can be spelt by
many token sequences (BPE merges an order's end with its newline, a tag can come in pieces), so
every token is mapped to the exact text it adds, once per tokenizer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

# Every character an order completion can contain: engine order text, newlines and the close tag.
ORDER_ALPHABET = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZ -/\n<>orders")


class TokenizerLike(Protocol):
    """The part of a Hugging Face tokenizer the constraint needs."""

    def __len__(self) -> int: ...

    def convert_ids_to_tokens(self, ids: Any) -> Any: ...

    def convert_tokens_to_ids(self, tokens: Any) -> Any: ...

    def decode(self, ids: Any, **kwargs: Any) -> str: ...


def _byte_decoder() -> dict[str, int]:
    """Inverse of byte-level BPE's byte-to-printable-character table (the GPT-2 scheme)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


@dataclass
class VocabTrie:
    """Character trie over the tokens whose text uses only ORDER_ALPHABET."""

    children: list[dict[str, int]]
    ids_at: list[tuple[int, ...]]  # token ids whose text ends at this node


@dataclass
class TokenTable:
    """What the constraint knows about a tokenizer: token texts, the order trie, EOS, logits width."""

    texts: list[str | None]  # decoded text per token id; None for special/undecodable tokens
    eos_id: int
    vocab_size: int
    trie: VocabTrie
    close_candidates: tuple[int, ...]  # ids whose text contains '>': the only ones that can end a tag

    def text(self, token_id: int) -> str | None:
        return self.texts[token_id] if 0 <= token_id < len(self.texts) else None

    @classmethod
    def from_texts(cls, texts: list[str | None], eos_id: int, vocab_size: int | None = None) -> TokenTable:
        """Build from decoded token texts (None marks special tokens that never appear as text)."""
        children: list[dict[str, int]] = [{}]
        ids_at: list[list[int]] = [[]]
        for token_id, text in enumerate(texts):
            if not text or not set(text) <= ORDER_ALPHABET:
                continue
            node = 0
            for ch in text:
                nxt = children[node].get(ch)
                if nxt is None:
                    nxt = len(children)
                    children[node][ch] = nxt
                    children.append({})
                    ids_at.append([])
                node = nxt
            ids_at[node].append(token_id)
        return cls(
            texts=texts,
            eos_id=eos_id,
            vocab_size=max(vocab_size or 0, len(texts)),
            trie=VocabTrie(children=children, ids_at=[tuple(ids) for ids in ids_at]),
            close_candidates=tuple(i for i, t in enumerate(texts) if t and ">" in t),
        )


def _decode_all(tokenizer: TokenizerLike) -> list[str | None]:
    n = len(tokenizer)
    pieces = tokenizer.convert_ids_to_tokens(list(range(n)))
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    # Added tokens are single units whatever their text: special ones (<|im_end|>) never count as
    # text; ordinary ones (Qwen3's <think>, </think>) do, so reasoning can close its think block.
    added = {i: t for i, t in (getattr(tokenizer, "added_tokens_decoder", {}) or {}).items()}
    decoder = _byte_decoder()
    texts: list[str | None] = []
    for i, piece in enumerate(pieces):
        if piece is None or i in special or getattr(added.get(i), "special", False):
            texts.append(None)
            continue
        if i in added:
            texts.append(str(added[i].content))
            continue
        try:
            texts.append(bytes(decoder[c] for c in piece).decode("utf-8"))
        except (KeyError, UnicodeDecodeError):
            # Not byte-level BPE, or a partial UTF-8 sequence: only whole characters matter here.
            text = tokenizer.decode([i])
            texts.append(text if "\ufffd" not in text else None)
    return texts


def build_token_table(
    tokenizer: TokenizerLike, vocab_size: int | None = None, eos_token: str = "<|im_end|>"
) -> TokenTable:
    """Decode every token once; `vocab_size` is the model's logits width (may exceed the tokenizer)."""
    eos_id = int(tokenizer.convert_tokens_to_ids(eos_token))
    return TokenTable.from_texts(_decode_all(tokenizer), eos_id, vocab_size)


_TABLES: dict[tuple[int, int | None, str], tuple[Any, TokenTable]] = {}


def token_table(tokenizer: TokenizerLike, vocab_size: int | None = None, eos_token: str = "<|im_end|>") -> TokenTable:
    """The table for a tokenizer, built once per process per (tokenizer object, logits width)."""
    key = (id(tokenizer), vocab_size, eos_token)
    hit = _TABLES.get(key)
    if hit is None or hit[0] is not tokenizer:
        hit = (tokenizer, build_token_table(tokenizer, vocab_size, eos_token))
        _TABLES[key] = hit
    return hit[1]
