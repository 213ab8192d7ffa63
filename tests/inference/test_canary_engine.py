"""The real CPU engine proves each version it loads by its canary: the learner's greedy canary of the
published weights is reproduced by vLLM within the tolerance, and a version whose weights are not the
ones its canary was made with (a stale adapter published under a new name, a reload that was skipped)
is refused, alone; a
version published without a canary is served as before. One engine for the module."""

from __future__ import annotations

from typing import Any

import pytest

from diprl.game import DiplomacyGame
from diprl.inference.adapters import AdapterStore
from diprl.inference.canary import TOLERANCE, canary_prompts
from diprl.inference.config import ServerConfig
from diprl.learn.canary import learner_canary
from diprl.policy.models import random_lora_model
from diprl.policy.tokenizer import load_tokenizer
from diprl.policy.vocab import token_table

from .lora_fixtures import run_engine, tiny_base_path

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[Any], list[Any], dict[str, Any]]:
    """Two rounds of requests answered by one engine over a store holding an honest version, a stale
    one and one without a canary, and the engine's canary metrics."""
    from diprl.inference.engine_adapters import EngineAdapters
    from diprl.inference.policy_engine import PolicyEngine

    root = tmp_path_factory.mktemp("canary-engine")
    base = tiny_base_path()
    tokenizer = load_tokenizer(base)
    prompts = canary_prompts(tokenizer)
    store = AdapterStore(root / "store")
    trained, other = random_lora_model(1), random_lora_model(2)
    table = token_table(tokenizer, trained.config.vocab_size)
    canary = learner_canary(trained, table, prompts).to_bytes()
    store.publish("p", trained, base_model=str(base), canary=canary)  # p@v1: honest
    store.publish("p", other, base_model=str(base), canary=canary)  # p@v2: stale weights under a new name
    store.publish("q", other, base_model=str(base))  # q@v1: published before canaries
    store.publish("r", trained, base_model=str(base), canary=canary)  # r@v1: honest, but its reload is skipped
    game = DiplomacyGame()
    legal = game.legal_orders("FRANCE").to_dict()
    requests = [{"policy": name, "prompt": "A PAR", "legal": legal} for name in ("p@v1", "p@v2", "q@v1", "r@v1")]
    config = ServerConfig(
        model=str(base),
        dtype="float32",
        adapter_root=str(root / "store"),
        max_num_seqs=8,
    )

    class SkipsAReload(EngineAdapters):
        """Hands vLLM q@v1's copy for r@v1, as a replica that never reloaded would serve old weights."""

        def _verified_copy(self, name: str) -> Any:
            version, path = super()._verified_copy(name)
            if name != "r@v1":
                return version, path
            self.private.release(version.fingerprint)
            return version, self.private.acquire(store.resolve("q@v1"))

    class SkipsAReloadEngine(PolicyEngine):
        adapters_class = SkipsAReload

    async def work(engine: Any) -> tuple[list[Any], list[Any], dict[str, Any]]:
        first = await engine.generate(requests)
        again = await engine.generate(requests[1:2])
        return first, again, {**engine.canaries.stats(), "loaded": engine.adapters.loaded()}

    result: tuple[list[Any], list[Any], dict[str, Any]] = run_engine(config, work, SkipsAReloadEngine)
    return result


def test_the_published_canary_is_reproduced_by_the_engine(served: tuple[list[Any], list[Any], dict[str, Any]]) -> None:
    first, _, stats = served
    assert first[0].error is None and first[0].complete
    assert stats["canary_errors"]["p@v1"] <= TOLERANCE
    assert first[2].error is None and first[2].complete  # no canary: the bytes checks alone, as before


def test_a_stale_adapter_under_a_new_name_is_refused_and_unloaded(
    served: tuple[list[Any], list[Any], dict[str, Any]],
) -> None:
    first, again, stats = served
    assert first[1].error is not None and first[1].error.startswith("CanaryMismatch: p@v2:")
    assert again[0].error == first[1].error  # refused for good, without another probe
    assert stats["canary_checks"] == 3 and stats["canary_failures"] == 2
    assert stats["canary_refused"] == ["p@v2", "r@v1"] and stats["canary_errors"]["p@v2"] > TOLERANCE
    assert "p@v2" not in stats["loaded"]


def test_a_skipped_reload_is_refused_though_the_copy_handed_to_vllm_checks_out(
    served: tuple[list[Any], list[Any], dict[str, Any]],
) -> None:
    first, _, stats = served
    assert first[3].error is not None and first[3].error.startswith("CanaryMismatch: r@v1:")
    assert "r@v1" not in stats["loaded"]
