"""PolicyRef checking for evaluation: who may sit at a table, decided before any game starts.

A benchmark that dies after an hour because the last opponent's name had a typo wastes the hour;
every reference is therefore checked up front: rule bots against the bot registry, adapter
versions against the name grammar (and, where the adapters directory is known, against the
versions actually published there).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from diprl.bots import BOT_NAMES
from diprl.inference.adapters import AdapterError, AdapterStore, parse_policy_ref
from diprl.rollout.types import BOT_PREFIX, is_bot

BASE = "base"
REF_FORMS = f"'{BOT_PREFIX}<name>' (name one of {', '.join(BOT_NAMES)}), '{BASE}', or '<policy>@v<N>' (N >= 1)"


class UnknownPolicyRef(ValueError):
    """A PolicyRef that names no bot, not the base model and no valid adapter version."""


def check_policy_ref(ref: object) -> str:
    """`ref` if it is a well-formed PolicyRef naming something that can exist; else `UnknownPolicyRef`."""
    if not isinstance(ref, str) or not ref:
        raise UnknownPolicyRef(f"a PolicyRef must be a non-empty string, got {ref!r}; use {REF_FORMS}")
    if is_bot(ref):
        if ref[len(BOT_PREFIX) :] not in BOT_NAMES:
            raise UnknownPolicyRef(f"unknown bot {ref!r}; use {REF_FORMS}")
        return ref
    try:
        parse_policy_ref(ref)
    except AdapterError:
        raise UnknownPolicyRef(f"unknown PolicyRef {ref[:80]!r}; use {REF_FORMS}") from None
    return ref


def is_llm(ref: str) -> bool:
    """True when `ref` is played by the PolicyServer (the base model or an adapter version)."""
    return not is_bot(ref)


def check_published(refs: Iterable[str], adapter_root: str | Path) -> None:
    """Every adapter version in `refs` exists (and verifies) in the AdapterStore at `adapter_root`."""
    store = AdapterStore(adapter_root)
    for ref in refs:
        if is_bot(ref) or ref == BASE:
            continue
        try:
            store.resolve(ref)
        except AdapterError as exc:
            raise UnknownPolicyRef(f"{ref!r} is not a published adapter under {adapter_root}: {exc}") from None
