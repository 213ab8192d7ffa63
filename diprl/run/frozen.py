"""Frozen adapters from elsewhere: another run's policy brought into this run's store as an opponent.

An exploiter trained against a fixed main (`python -m diprl.bench league-value`) plays that main in every
seat, yet a run's PolicyServer serves only the run's own AdapterStore, and a request can never name a path.
`train.frozen_adapters` maps a policy name to a PEFT adapter directory (another run's
`adapters/main/v37`, say); before anything starts, each is published into the run's store as
`<name>@v1`, byte for byte with its canary when it has one, and `league.anchors` may name it. Nothing
trains it: a frozen anchor is played, never trained. A resumed run finds it already there.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from diprl.messages import PolicyRef
from diprl.structured_config import ConfigError

FROZEN_VERSION = 1
"""The version a frozen adapter is published as: the first of a policy the run never trains."""


def frozen_ref(name: str) -> str:
    """The PolicyRef a frozen adapter is played as (`<name>@v1`)."""
    return str(PolicyRef.adapter(name, FROZEN_VERSION))


def frozen_problems(frozen: Mapping[str, str], roles: list[str], anchors: list[str]) -> list[str]:
    """What is wrong with `train.frozen_adapters` beside these league roles and anchors (empty: nothing).

    A frozen name must be a policy name no role trains; an adapter anchor must be a frozen adapter's
    `<name>@v1`, the only adapter of another policy the run's store will hold.
    """
    problems = []
    for name in frozen:
        try:
            frozen_ref(name)
        except ValueError as err:
            problems.append(f"train.frozen_adapters.{name}: {err}")
            continue
        if name in roles:
            problems.append(f"train.frozen_adapters.{name}: {name!r} is a trained role of this run, not a frozen one")
    for ref in anchors:
        parsed = PolicyRef.parse(ref)
        if parsed.is_adapter and (parsed.policy not in frozen or parsed.version != FROZEN_VERSION):
            problems.append(
                f"league.anchors: {ref} is not in this run's store; bring an adapter in with "
                f"+train.frozen_adapters.{parsed.policy}=<adapter directory> and name it {frozen_ref(parsed.policy)}"
            )
    return problems


def publish_frozen(frozen: Mapping[str, str], adapter_root: Path) -> dict[str, str]:
    """Publish each frozen adapter into the store at `adapter_root` unless it holds that policy already;
    returns name -> PolicyRef. A source that is missing or not a servable adapter is a `ConfigError`."""
    from diprl.inference.adapters import AdapterError, AdapterStore
    from diprl.inference.adapters.files import CANARY_FILE

    store = AdapterStore(adapter_root)
    out = {}
    for name, source in sorted(frozen.items()):
        if store.latest(name) is None:
            src = Path(source)
            if not src.is_dir():
                raise ConfigError(f"train.frozen_adapters.{name}={source}: not a directory")
            canary = (src / CANARY_FILE).read_bytes() if (src / CANARY_FILE).is_file() else None
            try:
                published = store.publish(name, src, canary=canary)
            except AdapterError as err:
                raise ConfigError(f"train.frozen_adapters.{name}={source}: {err}") from None
            if published.version != FROZEN_VERSION:  # cannot happen: the store held no version of it
                raise ConfigError(f"train.frozen_adapters.{name}: published as {published}, not {frozen_ref(name)}")
        out[name] = frozen_ref(name)
    return out
