"""Adapter names (`base`, `<policy>@v<N>`), the errors every adapter operation raises, and base-model identity.

Names arrive in requests from rollout workers, so a name is parsed by exactly one parser
(`PolicyRef.parse`, here through `model_ref`: base or an adapter version, nothing else) into a policy
and a version number, and paths are only ever built from those validated parts: no request can name a
file.
"""

from __future__ import annotations

import re
from pathlib import Path

from diprl.messages import (  # noqa: F401  (BASE, MAX_VERSION, POLICY_PATTERN: re-exported for the store)
    BASE,
    MAX_VERSION,
    POLICY_PATTERN,
    VERSION_PATTERN,
    PolicyRef,
    UnknownPolicyRef,
)
from diprl.messages import validate_policy_name as _validate_policy_name

NAME_HELP = (
    "a valid name is 'base' or '<policy>@v<N>': policy is 1-48 characters of lowercase ASCII letters, digits, "
    "'_' or '-' starting with a letter, and N is a version number from 1 without leading zeros (e.g. 'main@v3')"
)
VERSION_DIR_RE = re.compile(rf"v(?P<version>{VERSION_PATTERN})", re.ASCII)


class AdapterError(ValueError):
    """Anything wrong with an adapter name or version; the request fails, the replica stays up."""


class InvalidAdapterName(AdapterError, UnknownPolicyRef):
    """The string is not `base` or `<policy>@v<N>` (paths, traversal, whitespace, case...): the one
    PolicyRef error (`diprl.messages.UnknownPolicyRef`), raised where an adapter was expected."""


class UnknownAdapter(AdapterError):
    """A well-formed name the store does not hold."""


class CorruptAdapter(AdapterError):
    """Files that do not match their manifest, or that are not a readable PEFT LoRA adapter."""


class IncompatibleAdapter(AdapterError):
    """A sound adapter this server cannot apply: rank above its max, another base model, other modules."""


def model_ref(name: object) -> PolicyRef:
    """The PolicyRef of a model a server plays, `base` or `<policy>@v<N>`; anything else (a bot, a zoo
    entry, a path, a typo) is an `InvalidAdapterName`."""
    try:
        ref = PolicyRef.parse(name)
    except UnknownPolicyRef:
        shown = name[:80] if isinstance(name, str) else type(name).__name__
        raise InvalidAdapterName(f"invalid adapter name {shown!r}; {NAME_HELP}") from None
    if not (ref.is_base or ref.is_adapter):
        raise InvalidAdapterName(f"{name!r} is not the base model or an adapter version; {NAME_HELP}")
    return ref


def validate_policy_name(policy: str) -> str:
    """Return `policy` if it can name adapter versions; `InvalidAdapterName` otherwise."""
    try:
        return _validate_policy_name(policy)
    except UnknownPolicyRef:
        raise InvalidAdapterName(f"invalid policy name {str(policy)[:80]!r}; {NAME_HELP}") from None


def require_adapter(name: str) -> PolicyRef:
    """The adapter version `name` names (`model_ref`); `base` is an `UnknownAdapter` here (it has no files)."""
    ref = model_ref(name)
    if ref.is_base:
        raise UnknownAdapter(f"{BASE!r} is the bare base model: it has no adapter files to load")
    return ref


def base_model_key(name_or_path: str) -> str:
    """What identifies a base model across machines, for comparing an adapter's base with a server's.

    The learner and the replicas may see one model under different paths: a hub snapshot lives at
    `.../models--Qwen--Qwen3-8B/snapshots/<rev>` (key `Qwen/Qwen3-8B`), the tiny model's
    directory name `tiny-qwen3-<hash>` already fingerprints its spec, and a body shipped in the
    repository's zoo (`<checkout>/zoo/bases/<name>`, key `zoo/bases/<name>`) is the same in every
    checkout, its files checked against the zoo's fingerprints where it is served. Anything else
    compares as written, minus trailing slashes.
    """
    text = name_or_path.strip().rstrip("/")
    parts = Path(text).parts
    for part in parts:
        if part.startswith("models--") and part.count("--") >= 2:
            return "/".join(part.split("--")[1:])
    if parts and parts[-1].startswith("tiny-qwen3-"):
        return parts[-1]
    if len(parts) >= 3 and parts[-3:-1] == ("zoo", "bases"):
        return "/".join(parts[-3:])
    return text


def same_base_model(a: str, b: str) -> bool:
    return base_model_key(a) == base_model_key(b)
