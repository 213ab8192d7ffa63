"""The adapters one vLLM engine holds: trained versions loaded on first use, and shipped zoo entries.

Versions are loaded on first use from the run's AdapterStore (its directory: one machine, or the run
directory every node mounts), kept in an LRU and unloaded when it overflows. Adapter files
are re-hashed on every load, checked against the fingerprint pinned when the version was published
and against the served base model (name and weight shapes), and vLLM is given the replica's private
copy of exactly the verified bytes (it re-reads the path after its own cache evicts an adapter).
Each adapter has its own load lock, so a cold load never holds up requests for other adapters. A
version is then proven by its canary (`prove`, the engine's: it serves the canary through the normal
request path) before any request uses it; a refused one is answered `CanaryMismatch` from then on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from diprl.adapter_files import CONFIG_FILE
from diprl.inference.adapters import (
    AdapterError,
    AdapterStore,
    AdapterVersion,
    check_compatible,
    model_ref,
)
from diprl.inference.adapters.private import PrivateCopies
from diprl.inference.canary import CanaryMismatch, ReplicaCanaries
from diprl.inference.concurrency import KeyedLocks
from diprl.inference.config import ServerConfig
from diprl.messages import PolicyRef

log = logging.getLogger(__name__)


def error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


@dataclass(frozen=True)
class LoadedAdapter:
    """A version loaded into the engine: the request vLLM knows it by, and its private copy's key."""

    request: Any  # vllm.lora.request.LoRARequest
    fingerprint: str


class EngineAdapters:
    """The LoRA versions and zoo entries loaded into `engine` (vLLM's `AsyncLLM`, or a stand-in answering
    `add_lora`/`remove_lora` as it does), for the `PolicyEngine` that answers requests with them.

    `prove(version, lora)` checks a freshly loaded version's canary and raises to refuse it (its verdicts
    are in `canaries`); `on_engine_failure(exc)` is told of every engine error, to notice a dead engine.
    """

    def __init__(
        self,
        config: ServerConfig,
        engine: Any,
        model_path: str,
        store: AdapterStore,
        canaries: ReplicaCanaries,
        prove: Callable[[AdapterVersion, Any], Awaitable[None]],
        on_engine_failure: Callable[[BaseException], None],
    ) -> None:
        self.config = config
        self.engine = engine
        self.model_path = model_path
        self.canaries = canaries
        self.prove = prove
        self.on_engine_failure = on_engine_failure
        self.store = store
        self.private = PrivateCopies()  # what vLLM reads: never the store's own files
        self._loras: OrderedDict[str, LoadedAdapter] = OrderedDict()
        self._in_use: Counter[str] = Counter()
        self._next_lora_id = 1
        self._zoo: dict[str, Any] = {}  # zoo entries verified and loaded: their LoRARequest, None for a base
        self._loading = KeyedLocks()  # one per adapter: a cold load never holds up other adapters
        self.loads = 0
        self.unloads = 0

    def _verified_copy(self, name: str) -> tuple[AdapterVersion, Path]:
        """The version re-hashed and checked against its pin now, then against this server's rank
        limit and base model, and the private copy of exactly those bytes that vLLM will read."""
        version = self._resolve(name)
        check_compatible(version, max_rank=self.config.max_lora_rank, base_model=self.model_path)
        return version, self.private.acquire(version)

    def _resolve(self, name: str) -> AdapterVersion:
        """The store's verified version; raises `AdapterError` (never anything that kills a replica)."""
        try:
            return self.store.resolve(name)
        except AdapterError:
            raise
        except (OSError, RecursionError, MemoryError) as err:
            raise AdapterError(f"cannot read adapter {name}: {type(err).__name__}: {err}") from err

    async def acquire(self, policy: str) -> Any:
        """The LoRARequest for `policy` (None for base), loaded if needed; marks it in use.

        Only requests for the same adapter wait for its load; one already loaded is served at once."""
        if PolicyRef.parse(policy).is_zoo:  # validated: base, <policy>@v<N> or zoo:<name>
            return await self._acquire_zoo(policy)
        ref = model_ref(policy)
        if ref.is_base:
            return None
        name = str(ref)
        if name in self.canaries.refused:
            raise CanaryMismatch(self.canaries.refused[name])
        loaded = self._loras.get(name)
        if loaded is None:
            async with self._loading.hold(name):
                loaded = self._loras.get(name)  # a request that held the lock before us loaded it
                if name in self.canaries.refused:  # or found it refused by its canary
                    raise CanaryMismatch(self.canaries.refused[name])
                if loaded is None:
                    loaded = await self._load(name)
                    self._loras[name] = loaded
                    self.loads += 1
                self._in_use[name] += 1  # before the lock goes: nothing can evict it in between
        else:
            self._in_use[name] += 1
        self._loras.move_to_end(name)
        return loaded.request

    async def _acquire_zoo(self, ref: str) -> Any:
        """A shipped policy (`zoo:<name>`): its LoRARequest, or None when the entry is this engine's base alone.

        The entry is verified file by file (off the event loop) and checked against this engine's model and
        LoRA slots the first time it is asked for; its adapter is then loaded once and kept (the zoo is a few
        read-only entries, never evicted). An entry of another model is refused, naming both models."""
        if ref not in self._zoo:
            async with self._loading.hold(ref):
                if ref not in self._zoo:
                    self._zoo[ref] = await self._load_zoo(ref)
        lora = self._zoo[ref]
        if lora is not None:
            self._in_use[ref] += 1  # balanced by `release`; zoo adapters are not in the LRU
        return lora

    async def _load_zoo(self, ref: str) -> Any:
        from vllm.lora.request import LoRARequest

        entry = await asyncio.to_thread(self._verified_zoo_entry, ref)
        if entry.adapter_dir is None:
            return None
        lora = LoRARequest(ref, self._next_lora_id, str(entry.adapter_dir))
        self._next_lora_id += 1
        try:
            await asyncio.wait_for(self.engine.add_lora(lora), self.config.request_timeout_s)
        except Exception as exc:
            self.on_engine_failure(exc)
            raise AdapterError(f"{ref} could not be loaded by the engine: {error_text(exc)}") from exc
        return lora

    def _verified_zoo_entry(self, ref: str) -> Any:
        import json

        from diprl.inference.adapters.names import same_base_model
        from diprl.policy.models import load_preset, resolve_model_path
        from diprl.policy.zoo import ZooError, load_entry

        try:
            entry = load_entry(ref)
        except ZooError as err:
            raise AdapterError(str(err)) from None
        try:
            served = str(resolve_model_path(load_preset(entry.model)))
        except FileNotFoundError as err:  # ModelNotBuilt: its model is not this server's, which built its own
            raise AdapterError(f"{ref} plays on model {entry.model!r}, which this server does not run: {err}") from None
        if not same_base_model(served, self.model_path):
            raise AdapterError(f"{ref} plays on model {entry.model!r} ({served}); this server runs {self.model_path!r}")
        if entry.adapter_dir is not None:
            rank = json.loads((entry.adapter_dir / CONFIG_FILE).read_text()).get("r")
            if not isinstance(rank, int) or rank > self.config.max_lora_rank:
                raise AdapterError(
                    f"{ref}: its adapter's rank {rank!r} exceeds the server's max LoRA rank {self.config.max_lora_rank}"
                )
        return entry

    async def _load(self, name: str) -> LoadedAdapter:
        from vllm.lora.request import LoRARequest

        timeout = self.config.request_timeout_s
        # Hashing and copying a large adapter take a moment: off the event loop, so streams keep flowing.
        copying = asyncio.ensure_future(asyncio.to_thread(self._verified_copy, name))
        try:
            version, path = await asyncio.wait_for(asyncio.shield(copying), timeout)
        except BaseException as exc:  # the thread runs on: whatever copy it makes must not be kept forever
            copying.add_done_callback(self._release_abandoned_copy)
            if isinstance(exc, TimeoutError):
                raise AdapterError(f"{name}: verifying and copying it took more than {timeout:g} s") from None
            raise
        lora = LoRARequest(name, self._next_lora_id, str(path))
        self._next_lora_id += 1
        try:
            # Load now: a broken adapter fails here, alone.
            await asyncio.wait_for(self.engine.add_lora(lora), timeout)
        except BaseException as exc:
            self.private.release(version.fingerprint)
            if isinstance(exc, TimeoutError):
                raise AdapterError(f"{name}: the engine did not load it within {timeout:g} s") from None
            if not isinstance(exc, Exception):
                raise
            self.on_engine_failure(exc)
            raise AdapterError(f"{name} could not be loaded by the engine: {error_text(exc)}") from exc
        try:
            await self.prove(version, lora)
        except BaseException:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.engine.remove_lora(lora.lora_int_id), timeout)
            self.private.release(version.fingerprint)
            raise
        return LoadedAdapter(lora, version.fingerprint)

    def _release_abandoned_copy(self, copying: asyncio.Future[tuple[AdapterVersion, Path]]) -> None:
        if not copying.cancelled() and copying.exception() is None:
            self.private.release(copying.result()[0].fingerprint)

    async def release(self, lora: Any) -> None:
        """No lock: releasing never waits for another adapter's load."""
        if lora is not None:
            self._in_use[lora.lora_name] -= 1
            await self._evict()

    async def _evict(self) -> None:
        """Unload least recently used versions beyond the LRU size (never one a request is using)."""
        while len(self._loras) > self.config.loaded_adapters:
            idle = next((name for name in self._loras if self._in_use[name] <= 0), None)
            if idle is None:
                return
            loaded = self._loras.pop(idle)  # chosen and removed with no await between: no two evict one
            del self._in_use[idle]
            try:
                await asyncio.wait_for(
                    self.engine.remove_lora(loaded.request.lora_int_id), self.config.request_timeout_s
                )
            except Exception as exc:  # the engine keeps its own LRU; failing to unload costs memory only
                self.on_engine_failure(exc)
                log.warning("could not unload adapter %s: %s", idle, error_text(exc))
            self.private.release(loaded.fingerprint)
            self.unloads += 1

    def loaded(self) -> list[str]:
        return list(self._loras)
