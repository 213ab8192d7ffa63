"""Inference configs load typed, through Hydra too; a typo or a wrong type is a clear error."""

from __future__ import annotations

from pathlib import Path

import pytest

from diprl.inference.config import ServerConfig, load_server_config, register_configs
from diprl.structured_config import CONF_DIR


def test_local_and_cluster_configs_load() -> None:
    local = load_server_config("local")
    cluster = load_server_config("cluster")
    assert local.model == "tiny" and local.host == "127.0.0.1" and local.replica_gpus == 0
    assert cluster.model == "qwen3_8b" and cluster.replica_gpus == 1 and cluster.autoscaling is not None
    assert cluster.host == "127.0.0.1"  # the cluster route is reached through `ray dashboard` port-forwarding


def test_hydra_composes_the_inference_group() -> None:
    from hydra import compose, initialize_config_dir

    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="inference/local")
    assert cfg.inference.model == "tiny" and cfg.inference.port == 8000


@pytest.mark.parametrize(("line", "message"), [("modle: tiny", "modle"), ("port: lots", "port")])
def test_bad_inference_config_is_a_clear_error(tmp_path: Path, line: str, message: str) -> None:
    (tmp_path / "inference").mkdir()
    (tmp_path / "inference" / "bad.yaml").write_text(line + "\n")
    with pytest.raises(ValueError, match=message):
        load_server_config("bad", tmp_path)


@pytest.mark.parametrize(
    ("lines", "rank"),
    [
        ("model: small", 16),  # the preset's LoRA rank, above the default 8
        ("model: small\nmax_lora_rank: 32", 32),  # a wider setting stays: it serves other adapters too
        ("model: tiny", 8),
        ("model: /checkpoints/qwen3", 8),  # a checkpoint path names no preset: the setting as written
    ],
)
def test_a_standalone_server_holds_its_model_presets_lora_rank(tmp_path: Path, lines: str, rank: int) -> None:
    """`python -m diprl.evaluate server=<name>` serves a preset's adapters as a training run does: a config
    naming `model: small` without `max_lora_rank: 16` would otherwise refuse every `small` adapter."""
    (tmp_path / "inference").mkdir()
    (tmp_path / "inference" / "server.yaml").write_text(lines + "\n")
    assert load_server_config("server", tmp_path).max_lora_rank == rank


def test_unknown_inference_config_lists_the_known_ones() -> None:
    with pytest.raises(KeyError, match="local"):
        load_server_config("laptop")
    assert ServerConfig().host == "127.0.0.1"


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        ("port: 99999999", "port must be an integer in \\[0, 65535\\]"),
        ("replica_cpus: -3", "replica_cpus must be a finite number"),
        ("max_lora_rank: 0", "max_lora_rank must be one of"),
        ("num_replicas: 0", "num_replicas must be an integer"),
        ("engine_extra: {enable_lora: false}", "engine_extra may not set \\['enable_lora'\\]"),
        ("host: 0.0.0.0", "needs allow_public_host: true"),
        ("max_loras: 16\nmax_cpu_loras: 8", "max_cpu_loras \\(8\\) must be >= max_loras \\(16\\)"),
        ("loaded_adapters: 64", "loaded_adapters \\(64\\) must be <= max_cpu_loras"),
        ("request_timeout_s: .nan", "request_timeout_s must be a finite number"),
        ("log_level: LOUD", "log_level must be one of"),
        ("autoscaling: {min_replicas: 3, max_replicas: 1}", "autoscaling needs"),
        ("max_ongoing_requests: 4\nhttp_max_ongoing: 4", "must leave room for training's generate calls"),
        ("max_body_bytes: 10", "max_body_bytes must be an integer in \\[1024"),
    ],
)
def test_out_of_range_and_inconsistent_settings_are_refused(tmp_path: Path, lines: str, message: str) -> None:
    """Issue 12 found every one of these accepted by the loader."""
    (tmp_path / "inference").mkdir()
    (tmp_path / "inference" / "bad.yaml").write_text(lines + "\n")
    with pytest.raises(ValueError, match=message):
        load_server_config("bad", tmp_path)


def test_an_empty_config_file_is_an_error_not_the_defaults(tmp_path: Path) -> None:
    (tmp_path / "inference").mkdir()
    (tmp_path / "inference" / "empty.yaml").write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        load_server_config("empty", tmp_path)


def test_a_public_host_needs_the_flag_and_warns(caplog: pytest.LogCaptureFixture) -> None:
    with pytest.raises(ValueError, match="allow_public_host"):
        ServerConfig(host="192.168.1.5")
    with caplog.at_level("WARNING"):
        config = ServerConfig(host="0.0.0.0", allow_public_host=True)
    assert config.host == "0.0.0.0" and "unauthenticated" in caplog.text
    assert ServerConfig(host="::1").host == "::1" and ServerConfig(host="localhost").host == "localhost"
    with pytest.raises(ValueError, match="must be an integer"):
        ServerConfig(max_num_seqs=True)  # type: ignore[arg-type]


def test_no_inference_config_fixes_where_adapters_live(tmp_path: Path) -> None:
    """One source: a training run serves `<run_dir>/adapters` and `python -m diprl.evaluate` the store its
    `adapters` names; a path fixed in a server config (cluster.yaml named one under /home/ubuntu) only misled."""
    from diprl.run.actors import server_config
    from diprl.run.config import compose_config

    for path in sorted((CONF_DIR / "inference").glob("*.yaml")):
        assert load_server_config(path.stem).adapter_root == ServerConfig().adapter_root, path.name
    config, _ = compose_config(["+experiment=pfsp_cluster"])
    assert server_config(config, tmp_path / "run").adapter_root == str((tmp_path / "run" / "adapters").resolve())
