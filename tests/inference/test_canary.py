"""The canary file: strict parsing, comparison, and its place in a version (published, fingerprinted,
carried by packing and by the replica's private copy; versions without one keep being served)."""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import pytest

from diprl.game import DiplomacyGame
from diprl.inference.adapters import MANIFEST_FILE, AdapterStore, CorruptAdapter
from diprl.inference.adapters.private import PrivateCopies
from diprl.inference.canary import (
    CANARY_FILE,
    CANARY_UNITS,
    Canary,
    CanaryItem,
    CanaryMismatch,
    CanaryPrompt,
    CorruptCanary,
    canary_prompts,
    check_canary,
    compare_canary,
)

from .lora_fixtures import make_lora_dir


def make_canary(shift: float = 0.0) -> Canary:
    legal = DiplomacyGame().legal_orders("ITALY")
    return Canary(
        (
            CanaryItem(CanaryPrompt((5, 6, 7), legal), (11, 12, 2), (-0.5 + shift, -0.25, 0.0)),
            CanaryItem(CanaryPrompt((8,), legal), (13, 2), (-1.0, -2.0)),
        )
    )


@pytest.fixture(scope="module")
def lora(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_lora_dir(tmp_path_factory.mktemp("loras"), seed=1)


def test_a_canary_round_trips_through_its_bytes() -> None:
    canary = make_canary()
    assert Canary.from_bytes(canary.to_bytes(), "here") == canary
    request = canary.items[0].request("p@v1")
    assert request["temperature"] == 0.0 and request["prompt"] == [5, 6, 7] and request["legal"]["power"] == "ITALY"


def _doc() -> dict:
    return json.loads(make_canary().to_bytes())


@pytest.mark.parametrize(
    ("change", "why"),
    [
        (lambda d: d.update(format=2), "not a format-1 canary"),
        (lambda d: d.update(extra=1), "unknown fields"),
        (lambda d: d.update(items=[]), "1-64 items"),
        (lambda d: d["items"][0].update(logprobs=[-0.5, -0.25]), "one log-probability per token"),
        (lambda d: d["items"][0].update(logprobs=[-0.5, 0.25, 0.0]), "finite and <= 0"),
        (lambda d: d["items"][0].update(logprobs=[-0.5, True, 0.0]), "list of numbers"),
        (lambda d: d["items"][0].update(token_ids=[1, -1, 2]), "non-negative ints"),
        (lambda d: d["items"][0].update(prompt_ids=[]), "list of 1-"),
        (lambda d: d["items"][0]["legal"].update(n_required=9), "malformed legal-orders"),
        (lambda d: d["items"][0].pop("legal"), "exactly prompt_ids, legal"),
    ],
)
def test_a_corrupt_canary_is_a_clear_error(change, why: str) -> None:
    doc = _doc()
    change(doc)
    with pytest.raises(CorruptCanary, match=rf"p@v1: canary.json is invalid \(.*{why}"):
        Canary.from_bytes(json.dumps(doc).encode(), "p@v1")
    for raw in (b"", b"[1]", b"{" * 100_000, b"\xff", b"0" * (3 << 20)):
        with pytest.raises(CorruptCanary, match=r"canary\.json is invalid"):
            Canary.from_bytes(raw, "p@v1")


def test_comparison_needs_equal_tokens_and_logprobs_within_the_tolerance() -> None:
    canary = make_canary()
    tokens = [list(i.token_ids) for i in canary.items]
    same = compare_canary(canary, tokens, [[x + 1e-6 for x in i.logprobs] for i in canary.items])
    assert same.ok() and same.error == pytest.approx(1e-6, abs=1e-9)
    check_canary("p@v1", same)
    drifted = compare_canary(canary, tokens, [list(i.logprobs) for i in make_canary(shift=-0.01).items])
    assert not drifted.ok() and drifted.error == pytest.approx(0.01)
    with pytest.raises(CanaryMismatch, match=r"p@v1: .*differ .*refused"):
        check_canary("p@v1", drifted)
    other_tokens = compare_canary(canary, [[11, 14, 2], [13, 2]], [list(i.logprobs) for i in canary.items])
    assert not other_tokens.ok() and other_tokens.error == math.inf
    assert "canary 0: tokens differ from position 1" in other_tokens.detail
    shorter = compare_canary(canary, [[11, 12], [13, 2]], [[-0.5, -0.25], [-1.0, -2.0]])
    assert not shorter.ok() and "position 2" in shorter.detail
    assert not compare_canary(canary, tokens[:1], [[]]).ok()
    assert not compare_canary(canary, tokens, [[math.nan] * 3, [-1.0, -2.0]]).ok()


def test_a_canary_is_a_fingerprinted_file_of_its_version(tmp_path: Path, lora: Path) -> None:
    store = AdapterStore(tmp_path / "store")
    canary = make_canary().to_bytes()
    ref = store.publish("p", lora, canary=canary)
    version = store.resolve(str(ref))
    assert version.canary_file is not None and version.canary_file.sha256 == hashlib.sha256(canary).hexdigest()
    assert (version.path / CANARY_FILE).read_bytes() == canary
    # it travels into the private copy vLLM reads
    private = PrivateCopies(tmp_path / "private")
    assert (private.acquire(version) / CANARY_FILE).read_bytes() == canary
    assert store.resolve(str(store.publish("q", lora))).canary_file is None


def test_a_tampered_canary_is_refused_by_the_fingerprint(tmp_path: Path, lora: Path) -> None:
    store = AdapterStore(tmp_path)
    store.publish("p", lora, canary=make_canary().to_bytes())
    path = tmp_path / "p" / "v1" / CANARY_FILE
    forged = make_canary(shift=-0.1).to_bytes()
    path.chmod(0o644)
    path.write_bytes(forged)
    with pytest.raises(CorruptAdapter, match=r"canary\.json"):
        store.resolve("p@v1")
    manifest_path = tmp_path / "p" / "v1" / MANIFEST_FILE
    manifest_path.chmod(0o644)
    manifest = json.loads(manifest_path.read_text())
    manifest["files"][CANARY_FILE] = {"size": len(forged), "sha256": hashlib.sha256(forged).hexdigest()}
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(CorruptAdapter, match="do not match the fingerprint pinned"):
        store.resolve("p@v1")
    del manifest["files"][CANARY_FILE]  # dropping the canary from the manifest is caught by the pin too
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(CorruptAdapter, match="do not match the fingerprint pinned"):
        store.resolve("p@v1")


def test_a_corrupt_canary_is_refused_at_publish_and_claims_no_number(tmp_path: Path, lora: Path) -> None:
    store = AdapterStore(tmp_path)
    with pytest.raises(CorruptCanary, match=r"publishing p from .*canary\.json is invalid"):
        store.publish("p", lora, canary=b'{"format": 1, "items": []}')
    assert store.versions("p") == []
    assert str(store.publish("p", lora)) == "p@v1"


def test_the_canary_set_is_one_unit_of_a_few_powers_on_their_whole_opening_prompt() -> None:
    from diprl.policy.tokenizer import load_tokenizer

    from .lora_fixtures import tiny_base_path

    prompts = canary_prompts(load_tokenizer(tiny_base_path()))
    assert [(p.legal.power, p.legal.locs, p.legal.n_required) for p in prompts] == [
        (power, (loc,), 1) for power, loc in CANARY_UNITS
    ]
    assert all(len(p.prompt_ids) > 256 for p in prompts)  # longer than a prefix-cache block: a stale one is read
