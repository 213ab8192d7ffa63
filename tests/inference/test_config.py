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


def test_unknown_inference_config_lists_the_known_ones() -> None:
    with pytest.raises(KeyError, match="local"):
        load_server_config("laptop")
    assert ServerConfig().host == "127.0.0.1"
