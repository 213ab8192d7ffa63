"""PolicyServer on a real local Ray cluster with real Serve and real vLLM (CPU), tiny Qwen3."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from diprl.game import DiplomacyGame
from diprl.inference.adapters import AdapterStore
from diprl.inference.config import ServerConfig
from diprl.policy.constraint import OrderConstraint
from diprl.policy.logprobs import constrained_logprobs
from diprl.policy.models import create_tiny_model, load_preset, resolve_model_path
from diprl.policy.prompt import build_prompt
from diprl.policy.tokenizer import load_tokenizer
from diprl.policy.vocab import token_table

from .lora_fixtures import make_lora_dir


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    def __init__(self, handle: Any, store: AdapterStore, port: int, lora_dirs: dict[str, Path]) -> None:
        self.handle, self.store, self.port, self.lora_dirs = handle, store, port, lora_dirs

    def generate(self, requests: list[dict[str, Any]], timeout: float = 300) -> list[dict[str, Any]]:
        return list(self.handle.generate.remote(requests).result(timeout_s=timeout))


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    import ray
    from ray import serve

    from diprl.inference.server import serve_policy

    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    root = tmp_path_factory.mktemp("server")
    store = AdapterStore(root / "adapters")
    lora_dirs = {
        f"{policy}@v1": make_lora_dir(root / policy, seed=seed) for policy, seed in (("alpha", 1), ("beta", 2))
    }
    for name, path in lora_dirs.items():
        assert store.publish(name.split("@")[0], path).name == name
    port = _free_port()
    ray.init(num_cpus=4, include_dashboard=False, _node_ip_address="127.0.0.1")
    from diprl.inference.registry import REGISTRY_NAME, start_registry

    registry = start_registry()  # versions missing from the server's directory come through the object store
    config = ServerConfig(
        model="tiny",
        adapter_root=str(root / "adapters"),
        adapter_cache=str(root / "cache"),
        adapter_registry=REGISTRY_NAME,
        port=port,
        loaded_adapters=2,
    )
    handle = serve_policy(config)
    yield Server(handle, store, port, lora_dirs)
    del registry  # held until here: the registry lives as long as a handle to it does
    serve.shutdown()
    ray.shutdown()


def _requests(policies: list[str]) -> list[dict[str, Any]]:
    game = DiplomacyGame()
    powers = game.orderable_powers()
    out = []
    for i, policy in enumerate(policies):
        power = powers[i % len(powers)]
        out.append(
            {
                "policy": policy,
                "prompt": build_prompt(game, power).text,
                "legal": game.legal_orders(power).to_dict(),
                "temperature": 1.0,
            }
        )
    return out


def _reference_logprobs(result: dict[str, Any], request: dict[str, Any], lora_dir: Path | None) -> torch.Tensor:
    """The same completion scored by transformers (+ PEFT) under the same mask and temperature."""
    from peft import PeftModel

    from diprl.game.legal import PowerOrders

    preset = load_preset("tiny")
    path = resolve_model_path(preset)
    model: Any = create_tiny_model(preset.tiny)
    if lora_dir is not None:
        model = PeftModel.from_pretrained(model, str(lora_dir))
    model.eval()
    ids = torch.tensor([result["prompt_ids"] + result["token_ids"]])
    with torch.no_grad():
        logits = model(ids).logits[0, len(result["prompt_ids"]) - 1 : -1]
    table = token_table(load_tokenizer(path), 151936)
    masks = OrderConstraint(PowerOrders.from_dict(request["legal"]), table).masks_for(result["token_ids"])
    return constrained_logprobs(logits, masks, torch.tensor(result["token_ids"]), request["temperature"])


def test_base_and_two_adapters_in_one_batch_each_get_their_own_policy(server: Server) -> None:
    requests = _requests(["base", "alpha@v1", "beta@v1", "alpha@v1", "beta@v1", "base"])
    results = server.generate(requests)
    assert [r["error"] for r in results] == [None] * 6
    assert all(r["complete"] for r in results), [r["text"] for r in results]
    for request, result in zip(requests, results, strict=True):
        lora = server.lora_dirs.get(request["policy"])
        ours = torch.tensor(result["logprobs"])
        assert torch.allclose(ours, _reference_logprobs(result, request, lora), atol=1e-4), request["policy"]
    # And the wrong policy does not explain the output: adapters really differ.
    alpha = results[1]
    wrong = _reference_logprobs(alpha, requests[1], server.lora_dirs["beta@v1"])
    assert not torch.allclose(torch.tensor(alpha["logprobs"]), wrong, atol=1e-3)


def test_publishing_while_requests_flow_fails_nothing_and_the_new_version_is_served(
    server: Server, tmp_path: Path
) -> None:
    results: list[dict[str, Any]] = []
    errors: list[BaseException] = []

    def traffic() -> None:
        try:
            for _ in range(3):
                results.extend(server.generate(_requests(["alpha@v1", "base", "beta@v1"])))
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=traffic)
    thread.start()
    time.sleep(1.0)
    lora_v2 = make_lora_dir(tmp_path / "alpha2", seed=7)
    ref = server.store.publish("alpha", lora_v2)
    thread.join(timeout=600)
    assert errors == [] and len(results) == 9
    assert all(r["error"] is None and r["complete"] for r in results)
    request = _requests([ref.name])[0]
    [fresh] = server.generate([request])
    assert fresh["error"] is None and fresh["complete"]
    expected = _reference_logprobs(fresh, request, lora_v2)
    assert torch.allclose(torch.tensor(fresh["logprobs"]), expected, atol=1e-4)


@pytest.mark.parametrize(
    ("policy", "message"),
    [
        ("../alpha@v1", "InvalidAdapterName"),
        ("/etc/passwd", "InvalidAdapterName"),
        ("alpha/../../x@v1", "InvalidAdapterName"),
        ("Alpha@v1", "InvalidAdapterName"),
        ("alpha@v99", "UnknownAdapter"),
        ("gamma@v1", "UnknownAdapter"),
    ],
)
def test_bad_policy_names_fail_alone_with_a_clear_error(server: Server, policy: str, message: str) -> None:
    results = server.generate(_requests([policy, "beta@v1"]))
    assert results[0]["error"] is not None and message in results[0]["error"]
    assert results[1]["error"] is None and results[1]["complete"]


def test_corrupt_adapter_and_malformed_requests_fail_alone(server: Server, tmp_path: Path) -> None:
    ref = server.store.publish("gamma", make_lora_dir(tmp_path / "gamma", seed=3))
    weights = server.store.resolve(ref.name).path / "adapter_model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])  # truncated on disk after publishing
    good = _requests(["base"])[0]
    bad_legal = dict(good, legal={"power": "FRANCE", "kind": "movement"})
    results = server.generate(
        [_requests([ref.name])[0], bad_legal, dict(good, prompt=""), dict(good, temperature=-1), good]
    )
    assert "CorruptAdapter" in results[0]["error"] and "adapter_model.safetensors" in results[0]["error"]
    assert "malformed legal-orders payload" in results[1]["error"]
    assert "prompt" in results[2]["error"] and "temperature" in results[3]["error"]
    assert results[4]["error"] is None and results[4]["complete"]


def test_a_version_that_travels_through_the_object_store_is_served(server: Server, tmp_path: Path) -> None:
    """The learner's store is on another disk: the server's directory never sees the files."""
    from diprl.inference.registry import publish_everywhere, start_registry

    learner_store = AdapterStore(tmp_path / "learner-disk")
    lora = make_lora_dir(tmp_path / "remote", seed=11)
    ref = publish_everywhere(learner_store, "remote", lora, start_registry())
    assert ref.name not in server.store
    request = _requests([ref.name])[0]
    [result] = server.generate([request])
    assert result["error"] is None and result["complete"]
    assert torch.allclose(torch.tensor(result["logprobs"]), _reference_logprobs(result, request, lora), atol=1e-4)
    [missing] = server.generate(_requests(["remote@v2"]))
    assert "UnknownAdapter" in missing["error"]


def test_openai_compatible_completions_route(server: Server) -> None:
    def post(body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        req = urllib.request.Request(
            f"http://127.0.0.1:{server.port}/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=120) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())

    status, body = post({"model": "alpha@v1", "prompt": "A PAR", "max_tokens": 4})
    assert status == 200 and body["object"] == "text_completion" and body["usage"]["completion_tokens"] == 4
    status, body = post({"model": "nope@v3", "prompt": "A PAR", "max_tokens": 4})
    assert status == 404 and "UnknownAdapter" in body["error"]["message"]
    with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/v1/models", timeout=60) as response:
        models = {m["id"] for m in json.loads(response.read())["data"]}
    assert {"base", "alpha@v1", "beta@v1"} <= models


def test_adapters_beyond_the_lru_are_unloaded(server: Server, tmp_path: Path) -> None:
    ref = server.store.publish("delta", make_lora_dir(tmp_path / "delta", seed=5))
    before = server.handle.status.remote().result(timeout_s=60)
    assert all(r["error"] is None for r in server.generate(_requests(["alpha@v1", "beta@v1", "base"])))
    assert all(r["error"] is None for r in server.generate(_requests([ref.name])))
    status = server.handle.status.remote().result(timeout_s=60)
    # The server keeps at most 2 versions loaded (loaded_adapters=2): loading delta unloads one.
    assert status["loaded"][-1] == ref.name and len(status["loaded"]) == 2
    assert status["unloads"] > before["unloads"]


def test_a_killed_replica_is_restarted_and_serves_again(server: Server) -> None:
    import ray

    before = server.handle.status.remote().result(timeout_s=60)
    ray.kill(ray.get_actor(before["replica"], namespace="serve"), no_restart=True)
    deadline = time.time() + 300
    while True:
        try:
            results = server.generate(_requests(["base", "alpha@v1"]), timeout=120)
            if all(r["error"] is None and r["complete"] for r in results):
                break
        except Exception:
            if time.time() > deadline:
                raise
            time.sleep(2)
    after = server.handle.status.remote().result(timeout_s=60)
    assert after["actor_id"] != before["actor_id"]  # a new replica, not the old one
