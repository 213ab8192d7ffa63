"""`AdapterRegistry`: adapter versions carried by Ray's object store, for clusters without a shared disk.

The learner publishes a version to its own AdapterStore, then registers the packed files here; the
registry actor owns the object (it lives as long as the run, not as long as the publisher's task),
and replicas whose directory lacks a version fetch it from here once and keep a verified local copy.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import ray

from diprl.inference.adapters import AdapterRef, AdapterStore, model_ref, pack_adapter

REGISTRY_NAME = "diprl-adapter-registry"
NAMESPACE = "diprl"  # named actors are per namespace; Serve replicas run in "serve", drivers in their own


@ray.remote
class AdapterRegistry:
    def __init__(self) -> None:
        self.objects: dict[str, Any] = {}

    def register(self, name: str, packed: Mapping[str, bytes]) -> None:
        ref = model_ref(name)  # the one name check: no paths, no "base"
        if ref.is_base:
            raise ValueError("the base model is not an adapter")
        if str(ref) in self.objects:
            raise ValueError(f"{ref} is already registered: versions are immutable")
        self.objects[str(ref)] = ray.put(dict(packed))

    def get(self, name: str) -> Mapping[str, bytes]:
        """The packed files of `name`; KeyError (UnknownAdapter for the cache) when not registered."""
        if name not in self.objects:
            raise KeyError(name)
        packed: dict[str, bytes] = ray.get(self.objects[name])
        return packed

    def names(self) -> list[str]:
        return sorted(self.objects)


def start_registry(name: str = REGISTRY_NAME) -> Any:
    """The run's registry actor, created on first call (get-if-exists).

    Keep the returned handle for the whole run (the training driver holds it): Ray ends an actor
    that is not detached once no handle to it remains, and its objects with it.
    """
    return AdapterRegistry.options(  # type: ignore[attr-defined]
        name=name, namespace=NAMESPACE, get_if_exists=True
    ).remote()


def publish_everywhere(
    store: AdapterStore,
    policy: str,
    source: Path | Any,
    registry: Any = None,
    base_model: str | None = None,
    canary: bytes | None = None,
) -> AdapterRef:
    """Publish to the store (atomic, immutable) and, if given, register the same files in the registry.

    `base_model` and `canary` are passed to `AdapterStore.publish` (the first overrides the adapter
    config's base model; the second travels with the version, fingerprinted)."""
    ref = store.publish(policy, source, base_model=base_model, canary=canary)
    if registry is not None:
        ray.get(registry.register.remote(str(ref), pack_adapter(store.resolve(str(ref)))))
    return ref


FETCH_TIMEOUT_S = 120.0


def registry_fetch(registry_name: str, timeout_s: float = FETCH_TIMEOUT_S) -> Any:
    """A `Fetch` for `LocalAdapterCache` that asks the named registry actor (a stuck fetch times out:
    the cache reports it as that request's `AdapterError`)."""
    registry = ray.get_actor(registry_name, namespace=NAMESPACE)

    def fetch(name: str) -> Mapping[str, bytes]:
        packed: Any = ray.get(registry.get.remote(name), timeout=timeout_s)
        return dict(packed)

    return fetch
