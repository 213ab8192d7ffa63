"""The cluster file must pass Ray's own schema, or `ray up` fails on the first try on a cluster."""

from __future__ import annotations

from pathlib import Path

import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

ROOT = Path(__file__).resolve().parents[1]


def test_a100_cluster_config_matches_ray_schema() -> None:
    config = yaml.safe_load((ROOT / "cluster" / "a100.yaml").read_text())
    validate_config(prepare_config(config))  # prepare_config fills defaults as `ray up` does
    gpu_types = [t for t in config["available_node_types"].values() if t["resources"].get("GPU", 0) > 0]
    assert gpu_types, "no GPU node type: inference and the learner could not be scheduled"
    assert any("requirements/gpu.txt" in cmd for cmd in config["setup_commands"])


def test_gpu_image_pins_the_v1_model_runner() -> None:
    """FACTS.md: GPU vLLM builds default to Model Runner V2, whose logits-processor interface differs."""
    assert "VLLM_USE_V2_MODEL_RUNNER=0" in (ROOT / "docker" / "Dockerfile").read_text()


def test_gpu_image_runs_the_training_entry() -> None:
    text = (ROOT / "docker" / "Dockerfile").read_text()
    assert '"diprl.train"' in text and '"diprl.arena"' not in text
