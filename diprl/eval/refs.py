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
from diprl.inference.adapters import AdapterError, AdapterStore
from diprl.inference.adapters.files import check_compatible
from diprl.messages import BASE, REF_FORMS, PolicyRef, UnknownPolicyRef

__all__ = ["BASE", "UnknownPolicyRef", "check_policy_ref", "check_published", "is_llm", "zoo_model"]


def check_policy_ref(ref: object) -> str:
    """`ref` if it is a well-formed PolicyRef naming something that can exist (a registered bot, the
    base model, an adapter version); else `UnknownPolicyRef`."""
    parsed = PolicyRef.parse(ref)
    if parsed.is_bot and parsed.name not in BOT_NAMES:
        raise UnknownPolicyRef(f"unknown bot {ref!r} (known: {', '.join(BOT_NAMES)}); use {REF_FORMS}")
    if parsed.is_zoo:
        from diprl.policy.zoo import load_entry

        load_entry(str(parsed))  # ZooError (an UnknownPolicyRef): unknown, or its files do not match
    return str(parsed)


def zoo_model(refs: Iterable[str]) -> str | None:
    """The model preset the zoo entries among `refs` play on (None without any); `ValueError` when they
    name different ones: one PolicyServer serves one model."""
    from diprl.policy.zoo import load_entry

    models = {ref: load_entry(ref).model for ref in refs if PolicyRef.parse(ref).is_zoo}
    if len(set(models.values())) > 1:
        raise ValueError(f"these zoo entries play on different models, which one server cannot serve: {models}")
    return next(iter(models.values()), None)


def is_llm(ref: str) -> bool:
    """True when `ref` is played by the PolicyServer (the base model or an adapter version)."""
    return PolicyRef.parse(ref).is_llm


def check_published(refs: Iterable[str], adapter_root: str | Path, max_lora_rank: int | None = None) -> None:
    """Every adapter version in `refs` exists (and verifies) in the AdapterStore at `adapter_root`
    (`UnknownPolicyRef` if not) and, given the server's `max_lora_rank`, fits its LoRA slots
    (`IncompatibleAdapter` if not: the server would answer every request for it with an error)."""
    store = AdapterStore(adapter_root)
    for ref in refs:
        if not PolicyRef.parse(ref).is_adapter:
            continue
        try:
            version = store.resolve(ref)
        except AdapterError as exc:
            raise UnknownPolicyRef(f"{ref!r} is not a published adapter under {adapter_root}: {exc}") from None
        if max_lora_rank is not None:
            check_compatible(version, max_lora_rank)
