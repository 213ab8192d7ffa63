"""The model zoo: `zoo:<name>` parses, every shipped file matches its manifest, and a mismatch is refused."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from diprl.messages import PolicyRef, RefKind, UnknownPolicyRef
from diprl.policy import zoo
from diprl.policy.models import CONF_DIR
from diprl.policy.zoo import (
    ZooError,
    add_entry,
    known_entries,
    load_entry,
    warm_start_dir,
)

MAX_ZOO_BYTES = 10 * 1024 * 1024
"""The whole zoo stays under 10 MB: it lives in git, and every clone carries it."""


def test_zoo_refs_parse_and_print_back() -> None:
    ref = PolicyRef.parse("zoo:best")
    assert (ref.kind, ref.name, ref.is_zoo, ref.is_llm, ref.is_adapter, str(ref)) == (
        RefKind.ZOO, "best", True, True, False, "zoo:best"
    )  # fmt: skip
    for bad in ("zoo:", "zoo:../x", "zoo:Best", "zoo:a/b"):
        with pytest.raises(UnknownPolicyRef, match="malformed zoo reference"):
            PolicyRef.parse(bad)


def test_every_shipped_entry_matches_its_manifest_and_the_zoo_stays_small() -> None:
    names = [n for n in known_entries() if (zoo.ZOO_ROOT / n / zoo.MANIFEST).is_file()]
    assert names, "the repository ships at least one zoo entry"
    for name in names:
        entry = load_entry(f"zoo:{name}")
        assert entry.recipe.startswith("python -m diprl.") and entry.commit and entry.budget
        assert entry.files
    best = load_entry("zoo:best")
    assert best.name in names and best.figures
    assert sum(p.stat().st_size for p in zoo.ZOO_ROOT.rglob("*") if p.is_file()) < MAX_ZOO_BYTES


@pytest.fixture
def tmp_zoo(tmp_path: Path) -> tuple[Path, Path]:
    """A zoo holding a copy of the shipped pretrained base, and a conf/ whose preset names it."""
    root, conf = tmp_path / "zoo", tmp_path / "conf"
    shutil.copytree(CONF_DIR, conf)
    base = root / "bases" / "body"
    shutil.copytree(zoo.ZOO_ROOT / "bases" / "tiny_pretrained", base)
    preset = conf / "model" / "tiny_pretrained.yaml"
    preset.write_text(preset.read_text().replace("path: zoo/bases/tiny_pretrained", f"path: {base}"))
    return root, conf


def test_a_changed_byte_a_missing_file_or_an_escape_is_refused(tmp_zoo: tuple[Path, Path]) -> None:
    root, conf = tmp_zoo
    entry = add_entry("plain", "tiny_pretrained", "python -m diprl.imitation.pretrain", "1 minute", "abc123",
                      {"x": 1}, best=True, root=root, conf_dir=conf)  # fmt: skip
    assert entry.adapter_dir is None and "bases/body/model.safetensors" in entry.files
    assert load_entry("zoo:best", root, conf).name == "plain"
    assert known_entries(root) == ["best", "plain"]
    assert warm_start_dir("zoo:plain", "tiny_pretrained", root) is None  # a fresh LoRA on the entry's base
    with pytest.raises(ZooError, match="set model=tiny_pretrained"):
        warm_start_dir("zoo:plain", "tiny", root)

    weights = root / "bases" / "body" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    with pytest.raises(ZooError, match=r"model\.safetensors does not match the SHA-256"):
        load_entry("zoo:plain", root, conf)
    weights.unlink()
    with pytest.raises(ZooError, match="missing or not a regular file"):
        load_entry("zoo:plain", root, conf)

    manifest = root / "plain" / zoo.MANIFEST
    raw = json.loads(manifest.read_text())
    raw["files"] = {"../../etc/passwd": "0" * 64}
    manifest.write_text(json.dumps(raw))
    with pytest.raises(ZooError, match="not a path inside the zoo"):
        load_entry("zoo:plain", root, conf)
    with pytest.raises(ZooError, match=r"unknown zoo entry 'zoo:nope' \(known: best, plain"):
        load_entry("zoo:nope", root, conf)


def test_an_adapter_entry_lists_every_adapter_file(tmp_zoo: tuple[Path, Path], tmp_path: Path) -> None:
    root, conf = tmp_zoo
    adapter = tmp_path / "lora"
    adapter.mkdir()
    (adapter / "adapter_model.safetensors").write_bytes(b"weights")
    (adapter / "adapter_config.json").write_text("{}")
    entry = add_entry("tuned", "tiny_pretrained", "python -m diprl.train", "30 minutes", "abc123", {},
                      adapter=adapter, root=root, conf_dir=conf)  # fmt: skip
    assert entry.adapter_dir == root / "tuned" / "adapter"
    assert warm_start_dir("zoo:tuned", "tiny_pretrained", root) == entry.adapter_dir
    (entry.adapter_dir / "extra.bin").write_bytes(b"x")  # PEFT could load what the manifest never saw
    with pytest.raises(ZooError, match="adapter files not in its manifest"):
        load_entry("zoo:tuned", root, conf)


def test_a_renamed_entry_is_refused(tmp_zoo: tuple[Path, Path]) -> None:
    root, conf = tmp_zoo
    add_entry("one", "tiny_pretrained", "python -m diprl.imitation.pretrain", "1 minute", "abc", {}, root=root,
              conf_dir=conf)  # fmt: skip
    (root / "one").rename(root / "two")
    with pytest.raises(ZooError, match="copied or renamed"):
        load_entry("zoo:two", root, conf)


def test_the_add_command_writes_a_verified_entry_and_refuses_bad_input_writing_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    adapter = tmp_path / "lora"
    adapter.mkdir()
    (adapter / "adapter_model.safetensors").write_bytes(b"weights")
    (adapter / "adapter_config.json").write_text("{}")
    figures = tmp_path / "figures.json"
    figures.write_text(json.dumps({"policy_vs_dumbbot": 4.5}))
    root = tmp_path / "zoo"
    rest = ["--recipe", "python -m diprl.train", "--budget", "1 minute", "--commit", "abc", "--root", str(root)]
    tiny = ["--model", "tiny", *rest]
    assert zoo.main(["add", "tuned", "--adapter", str(adapter), "--figures", str(figures), "--best", *tiny]) == 0
    assert "zoo:tuned: 2 files fingerprinted" in capsys.readouterr().out
    entry = load_entry("zoo:best", root)
    assert (entry.name, entry.model, entry.commit) == ("tuned", "tiny", "abc")
    assert entry.figures == {"policy_vs_dumbbot": 4.5}
    assert sorted(entry.files) == ["tuned/adapter/adapter_config.json", "tuned/adapter/adapter_model.safetensors"]

    not_an_object = tmp_path / "list.json"
    not_an_object.write_text("[4.5]")
    empty = tmp_path / "empty"
    empty.mkdir()
    refused = [
        (["Bad/Name", "--adapter", str(adapter), *tiny], "malformed zoo reference"),
        (["x", "--adapter", str(adapter), "--model", "nope", *rest], "unknown model preset 'nope'"),
        (["x", "--adapter", str(tmp_path / "missing"), *tiny], "not a PEFT adapter directory"),
        (["x", "--adapter", str(empty), *tiny], "no adapter_config.json, adapter_model.safetensors"),
        (["x", *tiny], "'tiny' ships no base"),
        (["x", "--model", "tiny_pretrained", *rest], "is not in the zoo"),
        (["x", "--adapter", str(adapter), "--figures", str(not_an_object), *tiny], "must be a JSON object, got list"),
    ]
    for argv, message in refused:
        with pytest.raises(SystemExit) as exited:
            zoo.main(["add", *argv])
        assert exited.value.code == 2 and message in capsys.readouterr().err, argv
    assert sorted(p.name for p in root.iterdir()) == ["tuned", "zoo.json"]  # a refused call wrote nothing
