"""PolicyEngine's adapter loading and the HTTP route, driven by a fake engine (no Ray, no vLLM run).

The fake answers like vLLM's `AsyncLLM` and can hold any adapter's load or any generation at a gate,
so each test asserts the order of events (what finished while what was still held), never times.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from diprl.inference.adapters import MANIFEST_FILE, WEIGHTS_FILE, AdapterStore
from diprl.inference.config import ServerConfig
from diprl.inference.http_route import CompletionsRoute
from diprl.inference.policy_engine import PolicyEngine

from .lora_fixtures import make_lora_dir, tiny_base_path

WAIT_S = 60.0  # only ever reached when the code under test is wrong (a hang), never on the normal path


@dataclass
class _Step:
    logprob: float


@dataclass
class _Completion:
    token_ids: list[int]
    logprobs: list[dict[int, _Step]]
    text: str = "done"
    finish_reason: str = "stop"


@dataclass
class _Output:
    prompt_token_ids: list[int]
    outputs: list[_Completion]


@dataclass
class FakeEngine:
    """`AsyncLLM` as PolicyEngine uses it: adds and removes LoRAs, generates one fixed token."""

    load_gates: dict[str, asyncio.Event] = field(default_factory=dict)
    generate_gates: dict[str, asyncio.Event] = field(default_factory=dict)  # keyed by the LoRA name or "base"
    loading: dict[str, asyncio.Event] = field(default_factory=dict)  # set when a load has started
    events: list[str] = field(default_factory=list)
    paths: dict[str, str] = field(default_factory=dict)  # LoRA name -> the path vLLM was given
    weights_read: dict[str, bytes] = field(default_factory=dict)
    model_config: Any = None
    errored: bool = False

    def started(self, name: str) -> asyncio.Event:
        return self.loading.setdefault(name, asyncio.Event())

    async def add_lora(self, lora: Any) -> bool:
        self.events.append(f"load {lora.lora_name}")
        self.started(lora.lora_name).set()
        gate = self.load_gates.get(lora.lora_name)
        if gate is not None:
            await gate.wait()
        self.paths[lora.lora_name] = lora.lora_path
        self.weights_read[lora.lora_name] = (Path(lora.lora_path) / WEIGHTS_FILE).read_bytes()
        self.events.append(f"loaded {lora.lora_name}")
        return True

    async def remove_lora(self, lora_id: int) -> bool:
        self.events.append(f"remove {lora_id}")
        return True

    async def generate(self, prompt: Any, params: Any, request_id: str, lora_request: Any = None) -> AsyncIterator[Any]:
        name = lora_request.lora_name if lora_request is not None else "base"
        gate = self.generate_gates.get(name)
        if gate is not None:
            await gate.wait()
        self.events.append(f"generated {name}")
        yield _Output(list(prompt["prompt_token_ids"]), [_Completion([7], [{7: _Step(-0.5)}])])

    async def abort(self, request_id: str) -> None:
        pass

    async def check_health(self) -> None:
        pass

    def shutdown(self) -> None:
        pass


class ThreadRecordingTokenizer:
    """The tiny tokenizer, noting which thread each `encode` ran on."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.encode_threads: list[int] = []

    def encode(self, text: str, *args: Any, **kwargs: Any) -> Any:
        self.encode_threads.append(threading.get_ident())
        return self.inner.encode(text, *args, **kwargs)

    def __len__(self) -> int:
        return len(self.inner)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@pytest.fixture(scope="module")
def tiny_tokenizer() -> Any:
    from diprl.policy.tokenizer import load_tokenizer

    return load_tokenizer(tiny_base_path())


@pytest.fixture(scope="module")
def lora_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("loras")
    return {"a": make_lora_dir(root, seed=1), "b": make_lora_dir(root, seed=2), "c": make_lora_dir(root, seed=3)}


@pytest.fixture
def store(tmp_path: Path, lora_dirs: dict[str, Path]) -> AdapterStore:
    store = AdapterStore(tmp_path / "adapters")
    for policy, source in lora_dirs.items():
        store.publish(policy, source)
    return store


@pytest.fixture
def make_engine(tmp_path: Path, store: AdapterStore, tiny_tokenizer: Any) -> Iterator[Any]:
    engines: list[PolicyEngine] = []

    def make(fake: FakeEngine, tokenizer: Any = None, **config: Any) -> PolicyEngine:
        server_config = ServerConfig(
            model=str(tiny_base_path()),
            adapter_root=str(store.root),
            **config,
        )
        engine = PolicyEngine(server_config, engine=fake, tokenizer=tokenizer or tiny_tokenizer)
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.shutdown()


def request(policy: str, prompt: str = "A PAR - BUR") -> dict[str, Any]:
    return {"policy": policy, "prompt": prompt, "max_tokens": 1}


def tamper(version_dir: Path, data: bytes) -> None:
    """Replace a published version's weights and rewrite its manifest to match them."""
    weights, manifest_path = version_dir / WEIGHTS_FILE, version_dir / MANIFEST_FILE
    for path in (weights, manifest_path):
        path.chmod(0o644)
    weights.write_bytes(data)
    manifest = json.loads(manifest_path.read_text())
    manifest["files"][WEIGHTS_FILE] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    manifest_path.write_text(json.dumps(manifest))


# ---- per-adapter loading ---------------------------------------------------------------------


def test_a_cold_load_does_not_hold_up_requests_for_an_adapter_already_loaded(make_engine: Any) -> None:
    fake = FakeEngine()
    engine = make_engine(fake)

    async def scenario() -> None:
        assert (await engine.generate_one(request("b@v1"))).error is None  # b is loaded
        fake.load_gates["a@v1"] = asyncio.Event()
        cold = asyncio.create_task(engine.generate_one(request("a@v1")))
        await asyncio.wait_for(fake.started("a@v1").wait(), WAIT_S)  # a's load is in progress, held
        warm = asyncio.create_task(engine.generate_one(request("b@v1")))
        done, _ = await asyncio.wait({cold, warm}, timeout=WAIT_S, return_when=asyncio.FIRST_COMPLETED)
        assert done == {warm} and warm.result().error is None  # b answered while a still loads
        assert not cold.done()
        fake.load_gates["a@v1"].set()
        assert (await asyncio.wait_for(cold, WAIT_S)).error is None

    asyncio.run(scenario())
    assert fake.events.index("generated b@v1", fake.events.index("load a@v1")) < fake.events.index("loaded a@v1")


def test_concurrent_first_requests_for_one_adapter_load_it_once(make_engine: Any) -> None:
    fake = FakeEngine(load_gates={"a@v1": asyncio.Event()})
    engine = make_engine(fake)

    async def scenario() -> list[dict[str, Any]]:
        tasks = [asyncio.create_task(engine.generate_one(request("a@v1"))) for _ in range(3)]
        await asyncio.wait_for(fake.started("a@v1").wait(), WAIT_S)
        fake.load_gates["a@v1"].set()
        return list(await asyncio.wait_for(asyncio.gather(*tasks), WAIT_S))

    results = asyncio.run(scenario())
    assert [r.error for r in results] == [None] * 3
    assert fake.events.count("load a@v1") == 1 and engine.adapters.loads == 1
    assert len(engine.adapters._loading) == 0  # no lock kept for a name once no one waits on it


# ---- pins and the private copy -----------------------------------------------------------------


def test_vllm_reads_a_private_copy_of_the_verified_bytes_never_the_store(
    make_engine: Any, store: AdapterStore, lora_dirs: dict[str, Path]
) -> None:
    fake = FakeEngine()
    engine = make_engine(fake)
    published = (lora_dirs["a"] / WEIGHTS_FILE).read_bytes()
    assert asyncio.run(engine.generate_one(request("a@v1"))).error is None
    given = Path(fake.paths["a@v1"])
    assert store.root not in given.parents and given.name == store.resolve("a@v1").fingerprint
    assert fake.weights_read["a@v1"] == published
    # The store's copy is changed after the load (manifest rewritten to match): what vLLM would
    # re-read after its own cache evicted the adapter is still the verified bytes.
    tamper(store.root / "a" / "v1", (lora_dirs["b"] / WEIGHTS_FILE).read_bytes())
    assert (given / WEIGHTS_FILE).read_bytes() == published


def test_a_tampered_adapter_is_refused_on_load_and_other_adapters_are_served(
    make_engine: Any, store: AdapterStore, lora_dirs: dict[str, Path]
) -> None:
    fake = FakeEngine()
    engine = make_engine(fake, loaded_adapters=1)

    async def scenario() -> list[dict[str, Any]]:
        assert (await engine.generate_one(request("a@v1"))).error is None
        assert (await engine.generate_one(request("b@v1"))).error is None  # a is unloaded (LRU of 1)
        tamper(store.root / "a" / "v1", (lora_dirs["c"] / WEIGHTS_FILE).read_bytes())
        return list(await engine.generate([request("a@v1"), request("b@v1"), request("c@v1"), request("base")]))

    results = asyncio.run(scenario())
    assert "CorruptAdapter" in results[0].error and "fingerprint pinned when it was published" in results[0].error
    assert [r.error for r in results[1:]] == [None, None, None]
    assert fake.events.count("load a@v1") == 1  # the tampered bytes never reached the engine


def test_a_zoo_entry_of_another_model_is_refused_by_name_and_the_rest_are_served(make_engine: Any) -> None:
    fake = FakeEngine()
    engine = make_engine(fake)

    async def scenario() -> list[Any]:
        return list(await engine.generate([request("zoo:best"), request("zoo:nope"), request("base")]))

    best, unknown, base = asyncio.run(scenario())
    assert "zoo:best plays on model 'tiny_pretrained'" in best.error and "this server runs" in best.error
    assert "unknown zoo entry 'zoo:nope'" in unknown.error
    assert base.error is None
    assert not [e for e in fake.events if e.startswith("load")]  # nothing was loaded for them


def test_a_zoo_adapter_on_the_served_model_is_verified_loaded_once_and_kept(
    make_engine: Any, lora_dirs: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from diprl.policy import zoo

    monkeypatch.setattr(zoo, "ZOO_ROOT", tmp_path / "zoo")
    zoo.add_entry("tuned", "tiny", "python -m diprl.train", "1 minute", "abc", {}, adapter=lora_dirs["a"])
    fake = FakeEngine()
    engine = make_engine(fake, loaded_adapters=1)

    async def scenario() -> list[Any]:
        first = list(await engine.generate([request("zoo:tuned"), request("zoo:tuned")]))
        await engine.generate([request("b@v1"), request("c@v1")])  # the LRU of one turns over twice
        return first + list(await engine.generate([request("zoo:tuned")]))

    results = asyncio.run(scenario())
    assert [r.error for r in results] == [None, None, None]
    assert fake.events.count("load zoo:tuned") == 1 and "generated zoo:tuned" in fake.events
    assert fake.paths["zoo:tuned"] == str(tmp_path / "zoo" / "tuned" / "adapter")
    (tmp_path / "zoo" / "tuned" / "adapter" / WEIGHTS_FILE).write_bytes(b"changed")
    fresh = make_engine(FakeEngine())
    [changed] = asyncio.run(fresh.generate([request("zoo:tuned")]))
    assert "does not match the SHA-256 in its manifest" in changed.error


def test_private_copies_go_with_their_adapter_and_with_the_engine(make_engine: Any, store: AdapterStore) -> None:
    fake = FakeEngine()
    engine = make_engine(fake, loaded_adapters=1)

    async def scenario() -> None:
        assert (await engine.generate_one(request("a@v1"))).error is None
        assert (await engine.generate_one(request("b@v1"))).error is None

    asyncio.run(scenario())
    assert engine.adapters.loaded() == ["b@v1"] and engine.adapters.unloads == 1
    assert not Path(fake.paths["a@v1"]).exists() and Path(fake.paths["b@v1"]).is_dir()
    root = engine.adapters.private.root
    engine.shutdown()
    assert not root.exists()


# ---- tokenisation and the HTTP route ---------------------------------------------------------


def test_prompts_are_tokenised_off_the_event_loop(make_engine: Any, tiny_tokenizer: Any) -> None:
    tokenizer = ThreadRecordingTokenizer(tiny_tokenizer)
    engine = make_engine(FakeEngine(), tokenizer=tokenizer)

    async def scenario() -> int:
        assert (await engine.generate_one(request("base", "A PAR - BUR " * 2000))).error is not None  # too long
        assert (await engine.generate_one(request("base"))).error is None
        return threading.get_ident()

    loop_thread = asyncio.run(scenario())
    assert len(tokenizer.encode_threads) == 2 and loop_thread not in tokenizer.encode_threads


def test_a_prompt_sent_by_every_fork_is_tokenised_once_and_answered_once(make_engine: Any, tiny_tokenizer: Any) -> None:
    """The forks of a decision send one prompt together: its ids come from the tokenizer once, and each
    request asks vLLM for its final output only (no output per generated token)."""
    from vllm.sampling_params import RequestOutputKind

    tokenizer = ThreadRecordingTokenizer(tiny_tokenizer)
    fake = FakeEngine()
    seen: list[Any] = []
    generate = fake.generate

    def recording(prompt: Any, params: Any, request_id: str, lora_request: Any = None) -> AsyncIterator[Any]:
        seen.append((list(prompt["prompt_token_ids"]), params.output_kind))
        return generate(prompt, params, request_id, lora_request)

    fake.generate = recording  # type: ignore[method-assign]
    engine = make_engine(fake, tokenizer=tokenizer)
    prompt = "A PAR - BUR ; F BRE - MAO"

    async def scenario() -> list[Any]:
        same = await engine.generate([request("base", prompt) for _ in range(4)])
        other = await engine.generate_one(request("base", prompt + " ; A MAR H"))
        return [*same, other]

    results = asyncio.run(scenario())
    assert [r.error for r in results] == [None] * 5
    assert len(tokenizer.encode_threads) == 2  # the shared prompt once, the other once
    ids = list(tiny_tokenizer.encode(prompt))
    assert [s[0] for s in seen[:4]] == [ids] * 4 and seen[4][0] == list(tiny_tokenizer.encode(prompt + " ; A MAR H"))
    assert {s[1] for s in seen} == {RequestOutputKind.FINAL_ONLY}


def test_the_prompt_cache_keeps_the_latest_prompts_only(
    make_engine: Any, tiny_tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import diprl.inference.policy_engine as policy_engine

    monkeypatch.setattr(policy_engine, "PROMPT_CACHE_SIZE", 2)
    tokenizer = ThreadRecordingTokenizer(tiny_tokenizer)
    engine = make_engine(FakeEngine(), tokenizer=tokenizer)
    for prompt in ["A PAR H", "A MAR H", "A PAR H", "A BUR H", "A MAR H", "A BUR H"]:
        assert engine._encode(prompt) == tuple(tiny_tokenizer.encode(prompt))
    # PAR, MAR, (PAR kept), BUR evicts MAR, MAR again evicts PAR, BUR kept: four tokenisations.
    assert len(tokenizer.encode_threads) == 4 and len(engine._prompt_ids) == 2


def http_app(engine: PolicyEngine, max_body_bytes: int = 4096, max_ongoing: int = 2) -> tuple[FastAPI, Any]:
    route = CompletionsRoute(engine.generate_one, max_body_bytes, max_ongoing)
    app = FastAPI()
    app.post("/v1/completions")(route.__call__)
    return app, route


def client(app: FastAPI) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


def test_a_body_above_the_limit_is_refused_with_413_before_it_is_parsed(make_engine: Any) -> None:
    fake = FakeEngine()
    app, _ = http_app(make_engine(fake), max_body_bytes=4096)

    async def chunks() -> AsyncIterator[bytes]:
        yield b'{"model": "base", "prompt": "'
        for _ in range(100):
            yield b"A PAR - BUR " * 10  # no Content-Length: counted as it arrives
        yield b'"}'

    async def scenario() -> list[httpx.Response]:
        async with client(app) as http:
            huge = json.dumps({"model": "base", "prompt": "A PAR - BUR " * 1000, "max_tokens": 2})
            return [
                await http.post("/v1/completions", content=huge, headers={"Content-Type": "application/json"}),
                await http.post("/v1/completions", content=chunks(), headers={"Content-Type": "application/json"}),
                await http.post("/v1/completions", json={"model": "base", "prompt": "A PAR", "max_tokens": 2}),
                await http.post("/v1/completions", json={"model": "base", "prompt": [True], "max_tokens": 2}),
                await http.post("/v1/completions", content=b"{not json", headers={"Content-Type": "application/json"}),
            ]

    declared, streamed, small, bad_type, not_json = asyncio.run(scenario())
    assert declared.status_code == 413 and "declares 12" in declared.json()["error"]["message"]
    assert streamed.status_code == 413 and "at most 4096" in streamed.json()["error"]["message"]
    assert fake.events == ["generated base"]  # only the small request reached the engine
    assert small.status_code == 200 and small.json()["usage"]["completion_tokens"] == 1
    assert bad_type.status_code == 422 and not_json.status_code == 400


def test_the_http_route_is_bounded_and_cannot_starve_the_handle_path(make_engine: Any) -> None:
    """Two HTTP completions held in the engine fill the route's share: a third is refused at once
    (429, not queued on the replica), and training's `generate` is served meanwhile."""
    fake = FakeEngine(generate_gates={"a@v1": asyncio.Event()})
    engine = make_engine(fake)
    app, route = http_app(engine, max_ongoing=2)
    body = {"model": "a@v1", "prompt": "A PAR", "max_tokens": 1}

    async def scenario() -> None:
        async with client(app) as http:
            held = [asyncio.create_task(http.post("/v1/completions", json=body)) for _ in range(2)]
            while route.ongoing < 2:
                await asyncio.sleep(0.01)
            refused = await asyncio.wait_for(http.post("/v1/completions", json=body), WAIT_S)
            assert refused.status_code == 429 and refused.headers["Retry-After"] == "1"
            assert "http_max_ongoing" in refused.json()["error"]["message"]
            training = await asyncio.wait_for(engine.generate([request("b@v1"), request("base")]), WAIT_S)
            assert [r.error for r in training] == [None, None]
            assert not any(task.done() for task in held)
            fake.generate_gates["a@v1"].set()
            assert [r.status_code for r in await asyncio.wait_for(asyncio.gather(*held), WAIT_S)] == [200, 200]
        assert route.ongoing == 0 and route.refused_busy == 1

    asyncio.run(scenario())
