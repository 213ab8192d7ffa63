"""PolicyServer on a real local Ray cluster with real Serve and real vLLM (CPU), tiny Qwen3."""

from __future__ import annotations

import json
import os
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
from diprl.messages import Generation
from diprl.policy.constraint import OrderConstraint
from diprl.policy.models import create_tiny_model, load_preset, logits_width, resolve_model_path
from diprl.policy.prompt import build_prompt
from diprl.policy.tokenizer import load_tokenizer
from diprl.policy.vocab import token_table
from diprl.ports import free_port
from diprl.raysession import connect
from tests.dense_logprobs import constrained_logprobs

from .lora_fixtures import make_lora_dir


class Server:
    def __init__(self, handle: Any, store: AdapterStore, port: int, lora_dirs: dict[str, Path]) -> None:
        self.handle, self.store, self.port, self.lora_dirs = handle, store, port, lora_dirs

    def generate(self, requests: list[dict[str, Any]], timeout: float = 300) -> list[dict[str, Any]]:
        return list(self.handle.generate.remote(requests).result(timeout_s=timeout))


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    import ray
    from ray import serve

    from diprl.inference.deploy import serve_policy

    root = tmp_path_factory.mktemp("server")
    store = AdapterStore(root / "adapters")
    lora_dirs = {
        f"{policy}@v1": make_lora_dir(root / policy, seed=seed) for policy, seed in (("alpha", 1), ("beta", 2))
    }
    for name, path in lora_dirs.items():
        assert str(store.publish(name.split("@")[0], path)) == name
    port = free_port()
    connect(address="local", num_cpus=4)
    config = ServerConfig(
        model="tiny",
        adapter_root=str(root / "adapters"),
        port=port,
        loaded_adapters=2,
        max_body_bytes=64 * 1024,
    )
    handle = serve_policy(config)
    yield Server(handle, store, port, lora_dirs)
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


def _reference_logprobs(result: Generation, request: dict[str, Any], lora_dir: Path | None) -> torch.Tensor:
    """The same completion scored by transformers (+ PEFT) under the same mask and temperature."""
    from peft import PeftModel

    from diprl.game.legal import PowerOrders

    preset = load_preset("tiny")
    path = resolve_model_path(preset)
    model: Any = create_tiny_model(preset.tiny)
    if lora_dir is not None:
        model = PeftModel.from_pretrained(model, str(lora_dir))
    model.eval()
    ids = torch.tensor([result.prompt_ids + result.token_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(result.prompt_ids) - 1 : -1]
    table = token_table(load_tokenizer(path), logits_width(preset))
    masks = OrderConstraint(PowerOrders.from_dict(request["legal"]), table).masks_for(result.token_ids)
    return constrained_logprobs(logits, masks, torch.tensor(result.token_ids), request["temperature"])


def test_base_and_two_adapters_in_one_batch_each_get_their_own_policy(server: Server) -> None:
    requests = _requests(["base", "alpha@v1", "beta@v1", "alpha@v1", "beta@v1", "base"])
    results = server.generate(requests)
    assert [r.error for r in results] == [None] * 6
    assert all(r.complete for r in results), [r.text for r in results]
    for request, result in zip(requests, results, strict=True):
        lora = server.lora_dirs.get(request["policy"])
        ours = torch.tensor(result.logprobs)
        assert torch.allclose(ours, _reference_logprobs(result, request, lora), atol=1e-4), request["policy"]
    # And the wrong policy does not explain the output: adapters really differ.
    alpha = results[1]
    wrong = _reference_logprobs(alpha, requests[1], server.lora_dirs["beta@v1"])
    assert not torch.allclose(torch.tensor(alpha.logprobs), wrong, atol=1e-3)


def test_publishing_while_requests_flow_fails_nothing_and_the_new_version_is_served(
    server: Server, tmp_path: Path
) -> None:
    results: list[Generation] = []
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
    assert all(r.error is None and r.complete for r in results)
    request = _requests([str(ref)])[0]
    [fresh] = server.generate([request])
    assert fresh.error is None and fresh.complete
    expected = _reference_logprobs(fresh, request, lora_v2)
    assert torch.allclose(torch.tensor(fresh.logprobs), expected, atol=1e-4)


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
    assert results[0].error is not None and message in results[0].error
    assert results[1].error is None and results[1].complete


def test_corrupt_adapter_and_malformed_requests_fail_alone(server: Server, tmp_path: Path) -> None:
    ref = server.store.publish("gamma", make_lora_dir(tmp_path / "gamma", seed=3))
    weights = server.store.resolve(str(ref)).path / "adapter_model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])  # truncated on disk after publishing
    good = _requests(["base"])[0]
    bad_legal = dict(good, legal={"power": "FRANCE", "kind": "movement"})
    results = server.generate(
        [_requests([str(ref)])[0], bad_legal, dict(good, prompt=""), dict(good, temperature=-1), good]
    )
    assert "CorruptAdapter" in results[0].error and "adapter_model.safetensors" in results[0].error
    assert "'legal' must have exactly the keys" in results[1].error
    assert "prompt" in results[2].error and "temperature" in results[3].error
    assert results[4].error is None and results[4].complete


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
    # Through Serve's proxy too (N3): a cross-site text/plain post and a rebound Host name are refused.
    body = json.dumps({"model": "base", "prompt": "A PAR", "max_tokens": 2}).encode()
    for headers, refused in (({"Content-Type": "text/plain"}, 415), ({"Host": "attacker.example"}, 403)):
        sent = {"Content-Type": "application/json", **headers}
        request = urllib.request.Request(f"http://127.0.0.1:{server.port}/v1/completions", data=body, headers=sent)
        with pytest.raises(urllib.error.HTTPError) as caught:
            urllib.request.urlopen(request, timeout=60)
        assert caught.value.code == refused, headers


def test_adapters_beyond_the_lru_are_unloaded(server: Server, tmp_path: Path) -> None:
    ref = server.store.publish("delta", make_lora_dir(tmp_path / "delta", seed=5))
    before = server.handle.status.remote().result(timeout_s=60)
    assert all(r.error is None for r in server.generate(_requests(["alpha@v1", "beta@v1", "base"])))
    assert all(r.error is None for r in server.generate(_requests([str(ref)])))
    status = server.handle.status.remote().result(timeout_s=60)
    # The server keeps at most 2 versions loaded (loaded_adapters=2): loading delta unloads one.
    assert status["loaded"][-1] == str(ref) and len(status["loaded"]) == 2
    assert status["unloads"] > before["unloads"]


def test_status_reports_a_healthy_replica(server: Server) -> None:
    status = server.handle.status.remote().result(timeout_s=60)
    assert status["dead"] is None and status["engine_pids"], status


# ---- issue 12: no request can hurt another ------------------------------------------------


def test_every_malformed_request_fails_alone_and_the_batch_gets_one_result_each(server: Server) -> None:
    good = _requests(["base"])[0]
    legal = good["legal"]
    # Thousands of tokens in any vocabulary (the compact one spells a whole order line in one id):
    # more than the 2048-token context
    long_prompt = "A PAR - BUR\n" * 3000
    bad: list[tuple[dict[str, Any], str]] = [
        (dict(good, prompt=long_prompt), "the context holds 2048"),
        (dict(good, prompt=[-1, 5]), "'prompt' token 0"),
        (dict(good, prompt=[10**10]), "'prompt' token 0"),
        (dict(good, prompt=[True]), "'prompt' token 0"),  # found: hung the engine's input thread
        (dict(good, prompt="A PAR \ud800"), "not valid unicode"),
        (dict(good, temperature=float("nan")), "'temperature'"),
        (dict(good, temperature=float("inf")), "'temperature'"),
        (dict(good, temperature=1e308), "'temperature'"),
        (dict(good, max_tokens=10**30), "'max_tokens'"),
        (dict(good, max_tokens=True), "'max_tokens'"),
        (dict(good, reasoning_max_tokens=-1), "'reasoning_max_tokens'"),
        # found: killed the engine for good (OrderConstraint raised inside vLLM's busy loop)
        (dict(good, legal={**legal, "kind": "none", "by_loc": {}, "n_required": 5}), "nothing to order"),
        (dict(good, legal={**legal, "by_loc": {**legal["by_loc"], "PAR": ["A MAR - SPA"]}}), "not PAR"),
        (dict(good, legal={**legal, "by_loc": {**legal["by_loc"], "PAR": ["A PAR H\n</orders>"]}}), "not a movement"),
        (dict(good, legal={**legal, "by_loc": {**legal["by_loc"], "PAR": [""]}}), "not a movement order"),
    ]
    twins = [dict(good, request_id="same"), dict(_requests(["alpha@v1"])[0], request_id="same")]
    batch = [good, *[b for b, _ in bad], *twins]
    results = server.generate(batch)
    assert len(results) == len(batch)
    assert results[0].error is None and results[0].complete
    for (_, message), result in zip(bad, results[1 : 1 + len(bad)], strict=True):
        assert result.error is not None and message in result.error, (message, result.error)
    for twin, result in zip(twins, results[-2:], strict=True):  # duplicate ids: each answered, its own policy
        assert result.error is None and result.complete and result.request_id == "same"
        assert result.policy == twin["policy"]
    status = server.handle.status.remote().result(timeout_s=60)
    assert status["dead"] is None


def test_generate_with_a_string_is_an_error_not_one_request_per_character(server: Server) -> None:
    with pytest.raises(Exception, match="generate takes a list of request dicts, got str"):
        server.handle.generate.remote("a string").result(timeout_s=60)
    assert server.generate([]) == []


def test_tampered_foreign_and_nested_adapters_are_refused_on_load(server: Server, tmp_path: Path) -> None:
    flip = server.store.publish("flip", make_lora_dir(tmp_path / "flip", seed=21))
    [first] = server.generate(_requests([str(flip)]))
    assert first.error is None
    # Load two others: the server keeps 2 loaded, so `flip` is unloaded and must be read again.
    assert all(r.error is None for r in server.generate(_requests(["alpha@v1", "beta@v1"])))
    weights = server.store.resolve(str(flip)).path / "adapter_model.safetensors"
    st = weights.stat()
    weights.chmod(0o644)
    data = bytearray(weights.read_bytes())
    data[-5] ^= 0x01
    weights.write_bytes(bytes(data))
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))  # found: served after an LRU reload

    foreign_dir = make_lora_dir(tmp_path / "foreign", seed=22)
    foreign = server.store.publish("foreign", foreign_dir, base_model="Qwen/Qwen3-8B")  # found: served
    nested = server.store.publish("nested", make_lora_dir(tmp_path / "nested", seed=23))
    manifest = server.store.root / "nested" / "v1" / "DIPRL_MANIFEST.json"
    manifest.chmod(0o644)
    manifest.write_text("[" * 50_000 + "]" * 50_000)  # found: RecursionError escaped the handler
    results = server.generate(_requests([str(flip), str(foreign), str(nested), "base"]))
    assert "CorruptAdapter" in results[0].error and "sha256" in results[0].error
    assert "IncompatibleAdapter" in results[1].error and "Qwen/Qwen3-8B" in results[1].error
    assert "CorruptAdapter" in results[2].error and "RecursionError" in results[2].error
    assert results[3].error is None and results[3].complete


def test_the_http_route_refuses_bools_and_bad_unicode(server: Server) -> None:
    def post(body: bytes) -> int:
        req = urllib.request.Request(
            f"http://127.0.0.1:{server.port}/v1/completions", data=body, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=120) as response:
                return int(response.status)
        except urllib.error.HTTPError as exc:
            return exc.code

    assert post(b'{"model": "base", "prompt": [true], "max_tokens": 2}') == 422
    assert post(b'{"model": "base", "prompt": "A \\ud800", "max_tokens": 2}') == 400
    assert post(b'{"model": "base", "prompt": "A PAR", "max_tokens": 2, "temperature": 1e308}') == 400
    assert post(b'{"model": "base", "prompt": "A PAR", "max_tokens": 2}') == 200
    huge = json.dumps({"model": "base", "prompt": "A PAR - BUR\n" * 10_000, "max_tokens": 2}).encode()
    assert post(huge) == 413  # refused before parsing (it was parsed and tokenised, then refused as too long)


def test_a_second_server_for_another_adapter_store_is_refused_and_the_first_keeps_serving(
    server: Server, tmp_path: Path
) -> None:
    """Another run on this cluster with the same application name: refused before anything is deployed
    (it used to repoint this server's replicas at its own store, then delete them)."""
    from diprl.inference.deploy import ServeConflict, serve_policy, stop_serving

    before = server.handle.status.remote().result(timeout_s=60)
    other = ServerConfig(
        model="tiny",
        adapter_root=str(tmp_path / "other-run"),
        port=server.port,
    )
    with pytest.raises(ServeConflict, match=r"'policy' already serves adapters from .*adapters"):
        serve_policy(other)
    stop_serving(other.name, adapter_root=other.adapter_root)  # the refused run's cleanup leaves it alone
    results = server.generate(_requests(["alpha@v1", "base"]))
    assert all(r.error is None and r.complete for r in results)
    after = server.handle.status.remote().result(timeout_s=60)
    assert after["actor_id"] == before["actor_id"]  # the same replica, never redeployed


FUZZ_COUNTS: dict[str, int] = {"malformed": 0, "good": 0, "good_failed": 0, "malformed_answered": 0}


def test_fuzz_malformed_requests_mixed_with_good_ones(server: Server) -> None:
    """A few hundred hypothesis-made malformed requests among good ones: every good one answered
    complete, every bad one answered with an error, the replica alive and the same one throughout."""
    from hypothesis import HealthCheck, given, settings

    from .fuzz_requests import malformed_requests

    before = server.handle.status.remote().result(timeout_s=60)
    goods = _requests(["base", "alpha@v1", "beta@v1", "base", "alpha@v1", "base"])

    @settings(
        max_examples=6,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
    )
    @given(malformed_requests(goods[0], count=50))
    def batch_of(bad: list[Any]) -> None:
        batch = [*bad[:25], *goods, *bad[25:]]
        results = server.generate(batch)
        assert len(results) == len(batch)
        answered_good = results[25 : 25 + len(goods)]
        FUZZ_COUNTS["good"] += len(goods)
        FUZZ_COUNTS["good_failed"] += sum(r.error is not None or not r.complete for r in answered_good)
        FUZZ_COUNTS["malformed"] += len(bad)
        FUZZ_COUNTS["malformed_answered"] += sum(r.error is not None for r in results[:25] + results[25 + len(goods) :])

    start = time.perf_counter()
    batch_of()
    seconds = time.perf_counter() - start
    after = server.handle.status.remote().result(timeout_s=60)
    assert after["actor_id"] == before["actor_id"] and after["dead"] is None
    assert FUZZ_COUNTS["good_failed"] == 0 and FUZZ_COUNTS["malformed_answered"] == FUZZ_COUNTS["malformed"]
    assert FUZZ_COUNTS["malformed"] >= 300
    print(
        f"fuzz: {FUZZ_COUNTS['malformed']} malformed + {FUZZ_COUNTS['good']} good requests in "
        f"{seconds:.1f} s: {FUZZ_COUNTS['good'] - FUZZ_COUNTS['good_failed']}/{FUZZ_COUNTS['good']} good answered, "
        f"{FUZZ_COUNTS['malformed_answered']}/{FUZZ_COUNTS['malformed']} malformed refused, same replica alive"
    )


def test_a_dead_engine_fails_in_flight_requests_and_its_replica_is_replaced(server: Server) -> None:
    """Kill the replica's vLLM engine core: requests get an error (none hangs), health checks fail,
    Serve starts a new replica, and it serves. (Runs last: it replaces the module's replica.)"""
    import signal

    before = server.handle.status.remote().result(timeout_s=60)
    in_flight = server.handle.generate.remote(_requests(["base", "alpha@v1"] * 4))
    time.sleep(1.0)
    for pid in before["engine_pids"]:
        os.kill(pid, signal.SIGKILL)
    try:
        results = in_flight.result(timeout_s=120)
        assert all(r.error is not None or r.complete for r in results)  # finished ones may have made it
    except Exception as exc:  # the replica may be torn down under the call: an error, not a hang
        assert "timed out" not in str(exc).lower(), exc
    deadline = time.time() + 300
    while True:
        try:
            results = server.generate(_requests(["base", "alpha@v1"]), timeout=120)
            if all(r.error is None and r.complete for r in results):
                break
            assert all(r.error and r.error.startswith(("EngineDead", "EngineError")) for r in results if r.error)
        except AssertionError:
            raise
        except Exception:
            pass
        if time.time() > deadline:
            raise AssertionError("no new replica served within 300 s of the engine's death")
        time.sleep(2)
    after = server.handle.status.remote().result(timeout_s=60)
    assert after["actor_id"] != before["actor_id"] and after["dead"] is None  # a new replica, not the old one
