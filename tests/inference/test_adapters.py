"""AdapterStore: validated names, atomic immutable publishing and verification."""

from __future__ import annotations

import errno
import hashlib
import hmac
import json
import os
import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from diprl.inference import adapters
from diprl.inference.adapters import (
    BASE,
    MANIFEST_FILE,
    WEIGHTS_FILE,
    AdapterError,
    AdapterStore,
    CorruptAdapter,
    IncompatibleAdapter,
    InvalidAdapterName,
    UnknownAdapter,
    base_model_key,
    check_compatible,
    model_ref,
)
from diprl.inference.adapters import store as store_module
from diprl.inference.adapters.manifest import version_from_manifest
from diprl.messages import BASE_REF, PolicyRef, UnknownPolicyRef
from diprl.policy.models import QWEN3_LINEAR_MODULES

from .lora_fixtures import load_tiny_base, make_lora_dir, make_lora_model, tiny_base_path


@pytest.fixture(scope="module")
def loras(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Saved adapters: two rank-8 ones with different weights and one of rank 16."""
    root = tmp_path_factory.mktemp("loras")
    return {
        "a": make_lora_dir(root, seed=1),
        "b": make_lora_dir(root, seed=2),
        "r16": make_lora_dir(root, seed=3, rank=16),
    }


def file_hashes(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


def writable(path: Path) -> Path:
    path.chmod(0o644)
    return path


# ---- names -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("main@v1", PolicyRef.adapter("main", 1)),
        ("p@v1", PolicyRef.adapter("p", 1)),
        ("hero_2-b@v10", PolicyRef.adapter("hero_2-b", 10)),
        ("x@v999999999", PolicyRef.adapter("x", 999_999_999)),
        ("a" * 48 + "@v3", PolicyRef.adapter("a" * 48, 3)),
        ("base", BASE_REF),
    ],
)
def test_valid_names_parse(name: str, expected: PolicyRef) -> None:
    assert model_ref(name) == expected and str(expected) == name


@pytest.mark.parametrize(
    "name",
    [
        "",
        "main",
        "../x@v1",
        "a/b@v1",
        "/etc/passwd",
        "..",
        "a\\b@v1",
        "p@v01",
        "p@v0",
        "P@v1",
        "p@V1",
        "p@v1 ",
        " p@v1",
        "p@v1\n",
        "p@1",
        "p@v",
        "p@v-1",
        "p@v1@v2",
        "p@v1/../../x",
        "1p@v1",
        "_p@v1",
        "p.q@v1",
        "a" * 49 + "@v1",
        "p@v1234567890",
        "pé@v1",
        "p@v١",  # Arabic-Indic digit one
        "base@v1",
        "BASE",
        "p@v1\x00",
    ],
)
def test_invalid_names_are_rejected_with_a_description_of_valid_ones(name: str) -> None:
    with pytest.raises(InvalidAdapterName, match="a valid name is 'base' or '<policy>@v<N>'"):
        model_ref(name)


def test_non_string_names_and_hand_built_refs_are_validated_too() -> None:
    with pytest.raises(InvalidAdapterName):
        model_ref(None)
    with pytest.raises(UnknownPolicyRef):
        PolicyRef.adapter("../etc", 1)
    with pytest.raises(UnknownPolicyRef):
        PolicyRef.adapter("p", 0)
    with pytest.raises(UnknownPolicyRef):
        PolicyRef.adapter("p", True)  # type: ignore[arg-type]
    assert issubclass(InvalidAdapterName, ValueError)


def test_publish_rejects_invalid_policy_names_before_touching_disk(tmp_path: Path, loras: dict[str, Path]) -> None:
    store = AdapterStore(tmp_path / "store")
    for policy in ["../x", "a/b", "base", "p@v1", "P", ""]:
        with pytest.raises(InvalidAdapterName):
            store.publish(policy, loras["a"])
    assert not (tmp_path / "store").exists()


# ---- publishing ------------------------------------------------------------------------------


def test_publish_twice_gives_v1_and_v2_in_distinct_immutable_dirs(tmp_path: Path, loras: dict[str, Path]) -> None:
    store = AdapterStore(tmp_path)
    r1 = store.publish("main", loras["a"], base_model=str(tiny_base_path()))
    v1 = store.resolve("main@v1")
    before = file_hashes(v1.path)
    r2 = store.publish("main", loras["b"])
    assert (str(r1), str(r2)) == ("main@v1", "main@v2")
    v2 = store.resolve(str(r2))
    assert v1.path != v2.path and v1.path.name == "v1" and v2.path.name == "v2"
    assert file_hashes(v1.path) == before  # publishing never touches older versions
    assert sorted(p.name for p in v1.path.iterdir()) == sorted([*adapters.ADAPTER_FILES, MANIFEST_FILE])
    assert (v1.path / WEIGHTS_FILE).read_bytes() == (loras["a"] / WEIGHTS_FILE).read_bytes()
    assert all(not os.access(p, os.W_OK) or os.geteuid() == 0 for p in v1.path.iterdir())
    assert v1.fingerprint != v2.fingerprint
    assert (v1.rank, v1.alpha, v1.base_model) == (8, 16.0, str(tiny_base_path()))
    assert v1.target_modules == tuple(sorted(QWEN3_LINEAR_MODULES))
    assert store.versions("main") == [r1, r2]
    assert store.latest("main") == r2
    assert store.latest("other") is None
    assert store.policies() == ["main"]
    assert "main@v2" in store and "main@v3" not in store and "../x" not in store
    index = json.loads((tmp_path / "index.json").read_text())
    assert index["policies"] == {"main": [1, 2]}


def test_best_alias_names_one_published_version_of_its_policy_and_refuses_anything_else(
    tmp_path: Path, loras: dict[str, Path]
) -> None:
    store = AdapterStore(tmp_path)
    store.publish("main", loras["a"], base_model=str(tiny_base_path()))
    store.publish("main", loras["b"])
    store.publish("other", loras["a"])
    assert store.alias("main", "best") is None and store.resolve_alias("main@v2") == "main@v2"
    with pytest.raises(UnknownAdapter, match="no version of 'main' is marked 'best'"):
        store.resolve_alias("main@best")
    store.set_alias("main", "best", "main@v1", step=10, score=4.5)
    assert store.resolve_alias("main@best") == "main@v1" and store.resolve_alias("bot:dumbbot") == "bot:dumbbot"
    store.set_alias("main", "best", "main@v2")  # replaced, not appended
    assert str(store.alias("main", "best")) == "main@v2" and store.versions("main") == [
        PolicyRef.adapter("main", 1),
        PolicyRef.adapter("main", 2),
    ]  # an alias is not a version
    for policy, alias, version in (
        ("main", "best", "other@v1"),
        ("main", "best", "main@v3"),
        ("main", "worst", "main@v1"),
    ):
        with pytest.raises(AdapterError):
            store.set_alias(policy, alias, version)
    assert str(store.alias("main", "best")) == "main@v2"  # a refused mark leaves the old one
    path = tmp_path / "main" / "best.json"
    for bad in (b"{", b"[]", json.dumps({"format": "x", "alias": "best", "version": "main@v1"}).encode(),
                json.dumps({"format": store_module.ALIAS_FORMAT, "alias": "best", "version": "other@v1"}).encode(),
                b" " * 5000):  # fmt: skip
        path.write_bytes(bad)
        with pytest.raises(CorruptAdapter, match="main@best"):
            store.resolve_alias("main@best")
    path.unlink()
    path.symlink_to(tmp_path / "other" / "best.json")
    with pytest.raises(CorruptAdapter, match="cannot read"):
        store.alias("main", "best")


def test_publish_from_a_peft_model_object(tmp_path: Path) -> None:
    store = AdapterStore(tmp_path)
    ref = store.publish("obj", make_lora_model(seed=5))
    version = store.resolve(str(ref))
    assert str(ref) == "obj@v1"
    assert version.base_model == str(tiny_base_path())
    assert [p.name for p in (tmp_path / "obj").iterdir()] == ["v1"]  # no save_pretrained leftovers


def test_a_crash_before_the_rename_leaves_no_version(
    tmp_path: Path, loras: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    store = AdapterStore(tmp_path)
    real_rename = os.rename

    def crash(src: Any, dst: Any) -> None:
        assert (Path(src) / MANIFEST_FILE).is_file()  # every file is written, only the claim is missing
        raise OSError(errno.EIO, "simulated crash")

    monkeypatch.setattr(os, "rename", crash)
    with pytest.raises(OSError, match="simulated crash"):
        store.publish("p", loras["a"])
    # A kill -9 would also skip the cleanup: keep the temp directory this time.
    monkeypatch.setattr(shutil, "rmtree", lambda *args, **kwargs: None)
    with pytest.raises(OSError, match="simulated crash"):
        store.publish("p", loras["a"])
    monkeypatch.setattr(os, "rename", real_rename)
    monkeypatch.undo()

    leftovers = list((tmp_path / "p").iterdir())
    assert len(leftovers) == 1 and leftovers[0].name.startswith(".tmp-")
    assert store.versions("p") == [] and store.policies() == []
    with pytest.raises(UnknownAdapter, match="none"):
        store.resolve("p@v1")
    assert str(store.publish("p", loras["a"])) == "p@v1"
    assert store.versions("p") == [PolicyRef.adapter("p", 1)]


def test_a_crash_after_the_rename_leaves_a_complete_version_and_a_stale_index(
    tmp_path: Path, loras: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    store = AdapterStore(tmp_path)
    store.publish("p", loras["a"])
    monkeypatch.setattr(AdapterStore, "refresh_index", lambda self: False)
    store.publish("p", loras["b"])
    monkeypatch.undo()
    assert json.loads((tmp_path / "index.json").read_text())["policies"] == {"p": [1]}
    assert [r.version for r in store.versions("p")] == [1, 2]  # the directory is the truth
    store.resolve("p@v2")
    assert store.refresh_index() is True
    assert json.loads((tmp_path / "index.json").read_text())["policies"] == {"p": [1, 2]}
    assert store.refresh_index() is False


def test_concurrent_publishers_get_distinct_consecutive_versions(tmp_path: Path, loras: dict[str, Path]) -> None:
    store = AdapterStore(tmp_path)
    start = threading.Barrier(8)
    results: list[PolicyRef] = []
    errors: list[BaseException] = []

    def publish(i: int) -> None:
        try:
            start.wait()
            results.append(AdapterStore(tmp_path).publish("race", loras["a" if i % 2 else "b"]))
        except BaseException as err:
            errors.append(err)

    threads = [threading.Thread(target=publish, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert sorted(r.version for r in results) == list(range(1, 9))
    for ref in results:
        assert store.resolve(str(ref)).ref == ref  # each manifest names its own directory
    assert json.loads((tmp_path / "index.json").read_text())["policies"] == {"race": list(range(1, 9))}
    assert [p.name for p in (tmp_path / "race").iterdir() if p.name.startswith(".tmp-")] == []


def test_losing_the_rename_race_retries_with_the_next_number(
    tmp_path: Path, loras: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    store = AdapterStore(tmp_path)
    store.publish("p", loras["a"])
    real = store_module.version_numbers
    scans = 0

    def numbers(policy_dir: Path) -> list[int]:
        nonlocal scans
        scans += 1
        if scans == 1:
            return []  # this scan misses v1, as if another publisher claimed it right after we looked
        return real(policy_dir)

    monkeypatch.setattr(store_module, "version_numbers", numbers)
    ref = store.publish("p", loras["b"])
    assert str(ref) == "p@v2" and scans >= 2
    monkeypatch.undo()
    assert store.resolve("p@v2").fingerprint != store.resolve("p@v1").fingerprint
    assert (store.resolve("p@v1").path / WEIGHTS_FILE).read_bytes() == (loras["a"] / WEIGHTS_FILE).read_bytes()


def test_stray_entries_neither_list_nor_exhaust_version_numbers(tmp_path: Path, loras: dict[str, Path]) -> None:
    store = AdapterStore(tmp_path)
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "v999999999").mkdir()  # found: one stray empty directory made every publish fail
    (tmp_path / "p" / "v2").mkdir()
    (tmp_path / "p" / "v2" / "junk").write_text("x")  # non-empty, no manifest: not a version, not overwritten
    (tmp_path / "p" / "v3").write_text("a stray file")
    assert str(store.publish("p", loras["a"])) == "p@v1"
    assert str(store.publish("p", loras["b"])) == "p@v4"  # v2 and v3 are taken by strays: skipped
    assert store.versions("p") == [PolicyRef.adapter("p", 1), PolicyRef.adapter("p", 4)]
    assert (tmp_path / "p" / "v2" / "junk").read_text() == "x"


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda d: (d / "adapter_config.json").unlink(), "adapter_config.json is missing"),
        (lambda d: (d / WEIGHTS_FILE).rename(d / "adapter_model.bin"), "safe_serialization=True"),
        (lambda d: (d / "adapter_config.json").write_text("{not json"), "not valid JSON"),
        (
            lambda d: (d / "adapter_config.json").write_text(
                json.dumps({k: v for k, v in json.loads((d / "adapter_config.json").read_text()).items() if k != "r"})
            ),
            "positive integer 'r'",
        ),
        (lambda d: os.truncate(d / WEIGHTS_FILE, 5000), "truncated"),
        (lambda d: (d / WEIGHTS_FILE).write_bytes(b"\xff" * 16), "header too large"),
        (lambda d: (d / "adapter_config.json").write_text("[" * 100_000 + "]" * 100_000), "RecursionError"),
    ],
)
def test_publish_rejects_broken_sources_and_creates_no_version(
    tmp_path: Path, loras: dict[str, Path], damage: Callable[[Path], Any], message: str
) -> None:
    source = _copy(loras["a"], tmp_path / "src")
    damage(source)
    store = AdapterStore(tmp_path / "store")
    with pytest.raises(CorruptAdapter, match=message):
        store.publish("p", source)
    assert store.versions("p") == []
    assert list((tmp_path / "store" / "p").iterdir()) == []


def test_publish_rejects_dora_and_a_rank_above_the_config(tmp_path: Path, loras: dict[str, Path]) -> None:
    store = AdapterStore(tmp_path / "store")
    dora = _copy(loras["a"], tmp_path / "dora")
    config = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(IncompatibleAdapter, match="DoRA"):
        store.publish("p", dora)
    lying = _copy(loras["r16"], tmp_path / "lying")
    (lying / "adapter_config.json").write_text(json.dumps({**config, "r": 8}))
    with pytest.raises(CorruptAdapter, match="weights have rank 16"):
        store.publish("p", lying)
    assert store.versions("p") == []


# ---- resolving -------------------------------------------------------------------------------


def test_resolve_unknown_names_lists_known_versions(tmp_path: Path, loras: dict[str, Path]) -> None:
    store = AdapterStore(tmp_path)
    store.publish("p", loras["a"])
    store.publish("p", loras["b"])
    with pytest.raises(UnknownAdapter, match=r"unknown adapter p@v7 .*versions of 'p': p@v1, p@v2"):
        store.resolve("p@v7")
    with pytest.raises(UnknownAdapter, match="versions of 'q': none"):
        store.resolve("q@v1")
    with pytest.raises(UnknownAdapter, match="base model"):
        store.resolve(BASE)
    with pytest.raises(InvalidAdapterName):
        store.resolve("../p@v1")
    (tmp_path / "p" / "v9").mkdir()  # a directory without a manifest is not a version
    with pytest.raises(UnknownAdapter):
        store.resolve("p@v9")
    assert AdapterStore(tmp_path / "missing").policies() == []


def test_truncated_weights_are_reported_naming_the_file_even_without_hashing(
    tmp_path: Path, loras: dict[str, Path]
) -> None:
    store = AdapterStore(tmp_path)
    version = store.resolve(str(store.publish("p", loras["a"])))
    weights = writable(version.path / WEIGHTS_FILE)
    os.truncate(weights, weights.stat().st_size - 10)
    with pytest.raises(CorruptAdapter, match=rf"p@v1: {weights}.*bytes, its manifest says"):
        store.resolve("p@v1")


def test_a_flipped_byte_is_caught_by_the_hash_check(tmp_path: Path, loras: dict[str, Path]) -> None:
    store = AdapterStore(tmp_path)
    store.publish("p", loras["a"])
    weights = writable(tmp_path / "p" / "v1" / WEIGHTS_FILE)
    data = bytearray(weights.read_bytes())
    data[-3] ^= 0x01
    weights.write_bytes(bytes(data))
    with pytest.raises(CorruptAdapter, match=rf"{WEIGHTS_FILE} does not match the sha256"):
        AdapterStore(tmp_path).resolve("p@v1")


def test_every_resolve_hashes_so_a_flip_with_the_mtime_restored_is_caught(
    tmp_path: Path, loras: dict[str, Path]
) -> None:
    """Found: a cache keyed on (path, inode, size, mtime) served a byte flipped with its mtime restored."""
    store = AdapterStore(tmp_path)
    store.publish("p", loras["a"])
    store.resolve("p@v1")  # verified once (and loaded, in a server)
    weights = writable(tmp_path / "p" / "v1" / WEIGHTS_FILE)
    st = weights.stat()
    data = bytearray(weights.read_bytes())
    data[-3] ^= 0x01
    weights.write_bytes(bytes(data))
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert weights.stat().st_mtime_ns == st.st_mtime_ns and weights.stat().st_ino == st.st_ino
    with pytest.raises(CorruptAdapter, match="does not match the sha256"):
        store.resolve("p@v1")


def test_symlinks_anywhere_in_the_store_are_refused(tmp_path: Path, loras: dict[str, Path]) -> None:
    outside = AdapterStore(tmp_path / "outside")
    outside.publish("p", loras["a"])
    store = AdapterStore(tmp_path / "store")
    store.publish("q", loras["b"])
    (tmp_path / "store" / "p").symlink_to(tmp_path / "outside" / "p")  # found: a linked policy was served
    with pytest.raises(UnknownAdapter, match="symlinks in the store are refused"):
        store.resolve("p@v1")
    assert "p@v1" not in store and store.policies() == ["q"]
    with pytest.raises(CorruptAdapter, match="symlink"):
        store.publish("p", loras["a"])
    (tmp_path / "store" / "q" / "v2").symlink_to(tmp_path / "outside" / "p" / "v1")
    with pytest.raises(UnknownAdapter, match="symlinks in the store are refused"):
        store.resolve("q@v2")
    assert store.versions("q") == [PolicyRef.adapter("q", 1)]
    v1 = tmp_path / "store" / "q" / "v1"
    v1.chmod(0o755)
    (v1 / WEIGHTS_FILE).unlink()
    (v1 / WEIGHTS_FILE).symlink_to(tmp_path / "outside" / "p" / "v1" / WEIGHTS_FILE)
    with pytest.raises(CorruptAdapter, match="symlink"):
        store.resolve("q@v1")


def test_a_copied_version_directory_is_detected(tmp_path: Path, loras: dict[str, Path]) -> None:
    store = AdapterStore(tmp_path)
    store.publish("p", loras["a"])
    shutil.copytree(tmp_path / "p" / "v1", tmp_path / "p" / "v5")
    with pytest.raises(CorruptAdapter, match="describes p@v1"):
        store.resolve("p@v5")
    writable(tmp_path / "p" / "v1" / MANIFEST_FILE).write_text("[]")
    with pytest.raises(CorruptAdapter, match=f"{MANIFEST_FILE} is invalid"):
        store.resolve("p@v1")


def rewrite_with_manifest_to_match(version_dir: Path, name: str, data: bytes) -> None:
    """Replace one file of a published version and rewrite its manifest so the two agree again."""
    writable(version_dir / name).write_bytes(data)
    manifest_path = writable(version_dir / MANIFEST_FILE)
    manifest = json.loads(manifest_path.read_text())
    manifest["files"][name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    manifest_path.write_text(json.dumps(manifest))


def test_a_version_changed_after_publishing_is_refused_even_with_its_manifest_rewritten(
    tmp_path: Path, loras: dict[str, Path]
) -> None:
    """The manifest sits beside the files: only the pin written at publish time catches this."""
    store = AdapterStore(tmp_path)
    store.publish("p", loras["a"])
    store.publish("q", loras["a"])
    other = (loras["b"] / WEIGHTS_FILE).read_bytes()  # a sound adapter, just not the published one
    rewrite_with_manifest_to_match(tmp_path / "p" / "v1", WEIGHTS_FILE, other)
    with pytest.raises(CorruptAdapter, match=r"p@v1: its files do not match the fingerprint pinned"):
        store.resolve("p@v1")
    assert store.resolve("q@v1").name == "q@v1"  # other versions are unaffected
    (tmp_path / ".pins" / "q@v1").unlink()
    with pytest.raises(CorruptAdapter, match=r"q@v1: no pin"):
        store.resolve("q@v1")
    (tmp_path / ".pins" / "q@v1").write_text("not a fingerprint")
    with pytest.raises(CorruptAdapter, match=r"q@v1: its pin .* is not a fingerprint"):
        store.resolve("q@v1")


def test_a_version_rewritten_with_its_manifest_and_its_pin_is_refused(
    tmp_path: Path, loras: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by review (M2): whoever can rewrite a version's files and manifest can rewrite its pin file too
    (all three live in the store). The pin is a MAC under a key kept outside the store, so a pin recomputed
    from the new files, or one made with another key, does not verify."""
    monkeypatch.setenv("DIPRL_CACHE_DIR", str(tmp_path / "cache"))  # where the store's pin key lives
    root = tmp_path / "store"
    store = AdapterStore(root)
    store.publish("p", loras["a"])
    other = (loras["b"] / WEIGHTS_FILE).read_bytes()
    version_dir = root / "p" / "v1"
    rewrite_with_manifest_to_match(version_dir, WEIGHTS_FILE, other)
    forged = version_from_manifest((version_dir / MANIFEST_FILE).read_bytes(), version_dir, "p@v1").fingerprint
    pin = root / ".pins" / "p@v1"
    writable(pin).write_text(forged + "\n")  # what a writer of the store computes from the new files
    with pytest.raises(CorruptAdapter, match="p@v1"):
        store.resolve("p@v1")
    other_key = hmac.new(b"not the store's key", f"p@v1\n{forged}".encode(), hashlib.sha256).hexdigest()
    pin.write_text(f"hmac-sha256:{other_key}\n")
    with pytest.raises(CorruptAdapter, match="p@v1: its files do not match the fingerprint pinned"):
        store.resolve("p@v1")
    assert not any(p.name.endswith(".key") for p in root.rglob("*"))  # the key is not in the store


def test_a_store_made_before_keyed_pins_keeps_serving_and_a_keyed_one_needs_the_key(
    tmp_path: Path, loras: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Runs that were pinned with plain fingerprints (before M2's fix) still resume; a keyed store read where
    the key is missing is refused with where the key should be."""
    monkeypatch.setenv("DIPRL_CACHE_DIR", str(tmp_path / "cache"))
    root = tmp_path / "store"
    store = AdapterStore(root)
    version = store.resolve(str(store.publish("p", loras["a"])))
    monkeypatch.setenv("DIPRL_CACHE_DIR", str(tmp_path / "another-machine"))
    with pytest.raises(CorruptAdapter, match="no pin key"):
        store.resolve("p@v1")
    old = tmp_path / "old-store"  # the layout an older publisher left: a plain fingerprint as the pin
    shutil.copytree(root, old)
    (old / ".pins" / "p@v1").write_text(version.fingerprint + "\n")
    old_store = AdapterStore(old)
    assert old_store.resolve("p@v1").fingerprint == version.fingerprint
    assert old_store.resolve(str(old_store.publish("p", loras["b"]))).name == "p@v2"
    assert (old / ".pins" / "p@v2").read_text().strip() != ""  # published as the old store's pins are: plain
    assert not (old / ".pins" / "p@v2").read_text().startswith("hmac-sha256:")


def test_a_publish_that_crashed_after_pinning_leaves_a_pin_the_next_publish_replaces(
    tmp_path: Path, loras: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    store = AdapterStore(tmp_path)

    def crash(src: Any, dst: Any) -> None:
        raise OSError(errno.EIO, "simulated crash")

    monkeypatch.setattr(os, "rename", crash)
    with pytest.raises(OSError, match="simulated crash"):
        store.publish("p", loras["a"])
    monkeypatch.undo()
    assert (tmp_path / ".pins" / "p@v1").is_file()  # pinned, then killed before the claim
    assert str(store.publish("p", loras["b"])) == "p@v1"
    assert (store.resolve("p@v1").path / WEIGHTS_FILE).read_bytes() == (loras["b"] / WEIGHTS_FILE).read_bytes()


# ---- compatibility ---------------------------------------------------------------------------


def test_incompatible_rank_base_and_modules(tmp_path: Path, loras: dict[str, Path]) -> None:
    store = AdapterStore(tmp_path)
    base = str(tiny_base_path())
    r16 = store.resolve(str(store.publish("big", loras["r16"])))
    r8 = store.resolve(str(store.publish("small", loras["a"])))
    assert r16.rank == 16
    with pytest.raises(IncompatibleAdapter, match="rank 16 exceeds the server's max LoRA rank 8"):
        check_compatible(r16, max_rank=8)
    check_compatible(r16, max_rank=16, base_model=base)
    store.check_compatible(r8, 8, base + "/", set(QWEN3_LINEAR_MODULES))
    with pytest.raises(IncompatibleAdapter, match="trained on base model"):
        check_compatible(r8, max_rank=8, base_model="Qwen/Qwen3-8B")
    with pytest.raises(IncompatibleAdapter, match=r"targets modules \['down_proj', 'gate_proj', 'up_proj'\]"):
        check_compatible(r8, max_rank=8, allowed_modules={"q_proj", "k_proj", "v_proj", "o_proj"})
    unknown_base = _copy(loras["a"], tmp_path / "nobase")
    config = json.loads((unknown_base / "adapter_config.json").read_text())
    (unknown_base / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": None}))
    anonymous = store.resolve(str(store.publish("anon", unknown_base)))
    with pytest.raises(IncompatibleAdapter, match="records no base model"):
        check_compatible(anonymous, max_rank=8, base_model=base)
    assert issubclass(IncompatibleAdapter, AdapterError)


def test_base_model_key_sees_one_model_under_different_paths() -> None:
    snapshot = "/home/u/.cache/huggingface/hub/models--Qwen--Qwen3-8B/snapshots/abc123"
    assert base_model_key(snapshot) == base_model_key("Qwen/Qwen3-8B") == "Qwen/Qwen3-8B"
    assert base_model_key("/a/.cache/models/tiny-qwen3-77e2bb8ffe60") == base_model_key("/b/tiny-qwen3-77e2bb8ffe60/")
    assert base_model_key("/a/model") != base_model_key("/b/model")
    # A body shipped in the zoo is one model in every checkout (an adapter trained in one serves in another).
    assert base_model_key("/home/a/zoo/bases/tiny_pretrained") == base_model_key("/ci/zoo/bases/tiny_pretrained/")
    assert base_model_key("/a/zoo/bases/tiny_pretrained") != base_model_key("/a/zoo/bases/tiny_dagger")


# ---- PEFT round trip -------------------------------------------------------------------------


def test_a_resolved_version_loads_into_peft_with_the_same_logits(tmp_path: Path) -> None:
    from peft import PeftModel

    in_memory = make_lora_model(seed=11)
    store = AdapterStore(tmp_path / "store")
    ref = store.publish("p", in_memory)
    version = store.resolve(str(ref))
    loaded = PeftModel.from_pretrained(load_tiny_base(), str(version.path)).eval()
    from diprl.policy.tokenizer import load_tokenizer

    ids = torch.tensor([load_tokenizer(tiny_base_path()).encode("<|im_start|>user\nHello, world!")])
    with torch.no_grad():
        expected = in_memory(input_ids=ids).logits
        got = loaded(input_ids=ids).logits
        base = load_tiny_base()(input_ids=ids).logits
    assert torch.equal(got, expected)
    assert not torch.allclose(got, base, atol=1e-4)  # the adapter really changes the model


# ---- publish against the base model (issue 12) --------------------------------------------


def _rewrite_weights(src: Path, dst: Path, change: Callable[[dict[str, torch.Tensor]], None]) -> Path:
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(str(dst / WEIGHTS_FILE))
    change(tensors)
    save_file(tensors, str(dst / WEIGHTS_FILE), metadata={"format": "pt"})
    return dst


def _first_key(tensors: dict[str, torch.Tensor], half: str) -> str:
    return next(k for k in sorted(tensors) if f".{half}." in k and "q_proj" in k)


def test_publish_checks_shapes_dtypes_and_modules_against_the_base_model(
    tmp_path: Path, loras: dict[str, Path]
) -> None:
    store = AdapterStore(tmp_path / "store")

    def wider(t: dict[str, torch.Tensor]) -> None:  # lora_A [8, 80] for a q_proj whose input is 64 wide
        key = _first_key(t, "lora_A")
        t[key] = torch.zeros(8, 80)

    def as_int(t: dict[str, torch.Tensor]) -> None:
        key = _first_key(t, "lora_B")
        t[key] = t[key].to(torch.int32)

    def foreign_module(t: dict[str, torch.Tensor]) -> None:
        key = _first_key(t, "lora_A")
        t[key.replace("q_proj", "qq_proj")] = t.pop(key)
        b = _first_key(t, "lora_B")
        t[b.replace("q_proj", "qq_proj")] = t.pop(b)

    def half_missing(t: dict[str, torch.Tensor]) -> None:
        del t[_first_key(t, "lora_B")]

    cases: list[tuple[Callable[[dict[str, torch.Tensor]], None], type[AdapterError], str]] = [
        (wider, IncompatibleAdapter, r"lora_A \[8, 80\].*base weight is"),
        (as_int, CorruptAdapter, "dtype I32"),
        (foreign_module, IncompatibleAdapter, "does not exist in base model"),
        (half_missing, CorruptAdapter, "but not both"),
    ]
    for i, (change, error, message) in enumerate(cases):
        bad = _rewrite_weights(loras["a"], tmp_path / f"bad{i}", change)
        with pytest.raises(error, match=message):
            store.publish("p", bad, base_model=str(tiny_base_path()))
    assert store.versions("p") == []


def test_publish_rejects_an_unknown_dtype_and_an_absurd_alpha(tmp_path: Path, loras: dict[str, Path]) -> None:
    store = AdapterStore(tmp_path / "store")
    source = _copy(loras["a"], tmp_path / "dtype")
    data = (source / WEIGHTS_FILE).read_bytes()
    header_len = int.from_bytes(data[:8], "little")
    header = data[8 : 8 + header_len].replace(b'"F32"', b'"Q9"', 1)
    (source / WEIGHTS_FILE).write_bytes(data[:8] + header + data[8 + header_len :])
    with pytest.raises(CorruptAdapter, match="unknown variant `Q9`"):
        store.publish("p", source)
    for alpha in (1e308, float("inf"), True, -1):
        huge = _copy(loras["a"], tmp_path / f"alpha-{alpha}")
        config = json.loads((huge / "adapter_config.json").read_text())
        (huge / "adapter_config.json").write_text(json.dumps({**config, "lora_alpha": alpha}))
        with pytest.raises(CorruptAdapter, match="finite 'lora_alpha'"):
            store.publish("p", huge)
    assert store.versions("p") == []


def test_a_server_refuses_an_adapter_of_another_base_model_or_shape(tmp_path: Path, loras: dict[str, Path]) -> None:
    """Found: the server passed base_model=None, so an adapter for another model was loaded."""
    store = AdapterStore(tmp_path / "store")
    base = str(tiny_base_path())
    foreign = _copy(loras["a"], tmp_path / "foreign")
    config = json.loads((foreign / "adapter_config.json").read_text())
    (foreign / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": "Qwen/Qwen3-8B"}))
    version = store.resolve(str(store.publish("f", foreign)))  # the learner's machine cannot check an 8B shape
    with pytest.raises(IncompatibleAdapter, match="trained on base model 'Qwen/Qwen3-8B'"):
        check_compatible(version, max_rank=8, base_model=base)
    check_compatible(store.resolve(str(store.publish("ok", loras["a"]))), max_rank=8, base_model=base)


# ---- non-finite weights and retention ---------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_publish_refuses_non_finite_weights_and_writes_nothing(
    tmp_path: Path, loras: dict[str, Path], dtype: torch.dtype, value: float
) -> None:
    """Found: a diverged adapter (NaN in one LoRA weight) was published and served."""

    def poison(t: dict[str, torch.Tensor]) -> None:
        for k in t:
            t[k] = t[k].to(dtype)
        weight = t[_first_key(t, "lora_B")]
        extremes = torch.finfo(dtype)
        weight[0, :3] = torch.tensor([extremes.max, -extremes.max, extremes.smallest_normal / 4])  # finite: allowed
        weight[3, 1] = value

    store = AdapterStore(tmp_path / "store")
    store.publish("p", loras["a"])
    bad = _rewrite_weights(loras["a"], tmp_path / "bad", poison)
    with pytest.raises(CorruptAdapter, match=r"q_proj.lora_B.weight.* 1 non-finite values"):
        store.publish("p", bad)
    assert [str(r) for r in store.versions("p")] == ["p@v1"]
    assert sorted(p.name for p in (tmp_path / "store" / "p").iterdir()) == ["v1"]  # no temp left behind
    assert json.loads((tmp_path / "store" / "index.json").read_text())["policies"] == {"p": [1]}
    store.publish("p", loras["b"])  # the next good one takes the next number
    assert store.latest("p") == PolicyRef.adapter("p", 2)


def test_prune_keeps_named_versions_and_the_newest_and_removes_the_rest(tmp_path: Path, loras: dict[str, Path]) -> None:
    store = AdapterStore(tmp_path / "store")
    for _ in range(6):
        store.publish("p", loras["a"])
    store.publish("q", loras["b"])
    reader = (tmp_path / "store" / "p" / "v1" / WEIGHTS_FILE).open("rb")  # a reader mid-copy of v1

    removed = store.prune("p", keep={"p@v2", "q@v1", "bot:random", "base", "p@v99", "not a ref"}, keep_last=2)

    assert [str(r) for r in removed] == ["p@v1", "p@v3", "p@v4"]
    assert [str(r) for r in store.versions("p")] == ["p@v2", "p@v5", "p@v6"]
    assert [str(r) for r in store.versions("q")] == ["q@v1"]
    assert sorted(p.name for p in (tmp_path / "store" / "p").iterdir()) == ["v2", "v5", "v6"]
    assert json.loads((tmp_path / "store" / "index.json").read_text())["policies"] == {"p": [2, 5, 6], "q": [1]}
    with pytest.raises(UnknownAdapter, match="versions of 'p': p@v2, p@v5, p@v6"):
        store.resolve("p@v3")
    assert reader.read() == (loras["a"] / WEIGHTS_FILE).read_bytes()  # an open file survives its removal
    reader.close()
    store.resolve("p@v2")
    assert store.publish("p", loras["b"]) == PolicyRef.adapter("p", 7)  # numbers are never reused
    assert store.prune("p", keep_last=3) == [PolicyRef.adapter("p", 2)]
    for bad_keep_last in (0, -1, True):
        with pytest.raises(ValueError, match="keep_last"):
            store.prune("p", keep_last=bad_keep_last)
    with pytest.raises(InvalidAdapterName):
        store.prune("../p")
    assert [str(r) for r in store.versions("p")] == ["p@v5", "p@v6", "p@v7"]


def _modes(root: Path) -> dict[str, int]:
    """Permission bits of `root` and everything under it, by relative path (links not followed)."""
    found = {".": root.lstat().st_mode & 0o777}
    for path in root.rglob("*"):
        found[path.relative_to(root).as_posix()] = path.lstat().st_mode & 0o777
    return found


def test_published_and_copied_adapters_are_readable_by_their_owner_only(tmp_path: Path, loras: dict[str, Path]) -> None:
    """Found by review (L6): published adapters (and a replica's private copies) were world-readable: anyone
    on the machine could copy a run's trained weights. Everything the store writes is its owner's alone:
    directories 0700, version files 0400 (pins, the index and lock files 0600), whatever the umask."""
    old_umask = os.umask(0o022)  # the usual umask: what left everything readable by all
    try:
        store = AdapterStore(tmp_path / "store")
        store.publish("p", loras["a"])
        store.publish("p", loras["b"])
        from diprl.inference.adapters.private import PrivateCopies

        copies = PrivateCopies(tmp_path / "private")
        private = copies.acquire(store.resolve("p@v1"))
    finally:
        os.umask(old_umask)
    for root in (store.root, copies.root):
        modes = _modes(root)
        assert {path: mode for path, mode in modes.items() if mode & 0o077} == {}, root
    version_files = [store.root / "p" / "v1" / name for name in (*adapters.ADAPTER_FILES, MANIFEST_FILE)]
    assert {(f.stat().st_mode & 0o777) for f in version_files} == {0o400}
    assert (store.root / "p" / "v1").stat().st_mode & 0o777 == 0o700
    # The owner still reads, verifies, serves and prunes them.
    assert store.resolve("p@v2").path.is_dir()
    assert (private / WEIGHTS_FILE).read_bytes() == (loras["a"] / WEIGHTS_FILE).read_bytes()
    copies.close()
    assert store.prune("p", keep_last=1) == [PolicyRef.adapter("p", 1)]
