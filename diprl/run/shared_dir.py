"""One run directory for the whole cluster, checked before anything trains.

Learners, PolicyServer replicas, the league and the evaluator write and read the run directory (adapters,
checkpoints, league state, evaluations) from whichever node Ray put them on. On several machines that only
works when the directory is the same absolute path on a filesystem every node mounts; otherwise adapters
stay on the node that published them and a replica elsewhere cannot load them, an hour in. So on a Ray
cluster of more than one node the run starts with a probe: the driver writes a nonce into the run
directory, a task pinned to each node reads it and writes one of its own, and the driver reads those back.
Any node that cannot is named in the error, with what to set. One node (a laptop, the embedded default):
nothing to check.
"""

from __future__ import annotations

import secrets
import shutil
from pathlib import Path
from typing import Any

from diprl.structured_config import ConfigError

PROBE_DIR = ".shared-dir-probe"
WHAT_TO_SET = (
    "set train.run_dir to one absolute path on a filesystem every node mounts at that same path (NFS or a "
    "parallel filesystem; in cluster/a100.yaml also add `-v <path>:<path>` to docker.run_options so the "
    "containers see it), e.g. train.run_dir=/mnt/shared/diprl/runs/pfsp-14b (docs/cluster.md, "
    '"One run directory for the whole cluster")'
)


def _probe(run_dir: str, nonce: str, node_id: str) -> str | None:
    """On one node: None when it reads the driver's nonce and wrote its own, else what went wrong."""
    probe = Path(run_dir) / PROBE_DIR
    try:
        seen = (probe / "driver").read_text()
    except OSError as exc:
        return f"cannot read the driver's probe file ({type(exc).__name__}: {exc.strerror or exc})"
    if seen != nonce:
        return "reads another file at the same path (a different filesystem)"
    try:
        (probe / node_id).write_text(nonce)
    except OSError as exc:
        return f"cannot write into it ({type(exc).__name__}: {exc.strerror or exc})"
    return None


def check_shared_run_dir(run_dir: Path, timeout_s: float = 120.0) -> int:
    """Refuse a run directory some node of the Ray cluster cannot read and write; the number of nodes checked.

    Raises ConfigError naming every node that failed and what to set. Needs a connected Ray.
    """
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    nodes: list[dict[str, Any]] = [n for n in ray.nodes() if n.get("Alive")]
    if len(nodes) <= 1:
        return len(nodes)
    if not run_dir.is_absolute():
        raise ConfigError(f"train.run_dir={run_dir} is relative on a cluster of {len(nodes)} nodes: {WHAT_TO_SET}")
    probe = run_dir / PROBE_DIR
    probe.mkdir(parents=True, exist_ok=True)
    nonce = secrets.token_hex(16)
    (probe / "driver").write_text(nonce)
    task = ray.remote(num_cpus=0, max_retries=0)(_probe)
    try:
        refs = [
            task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node["NodeID"], soft=False)).remote(
                str(run_dir), nonce, node["NodeID"]
            )
            for node in nodes
        ]
        answers = ray.get(refs, timeout=timeout_s)
        problems = []
        for node, answer in zip(nodes, answers, strict=True):
            where = f"node {node['NodeManagerAddress']} ({node['NodeID'][:8]})"
            if answer is not None:
                problems.append(f"{where} {answer}")
                continue
            written = probe / node["NodeID"]
            if not written.is_file() or written.read_text() != nonce:
                problems.append(f"{where} wrote its probe file where the driver does not see it")
    finally:
        shutil.rmtree(probe, ignore_errors=True)
    if problems:
        raise ConfigError(
            f"train.run_dir={run_dir} is not one directory for the whole cluster: "
            + "; ".join(problems)
            + f". Adapters, checkpoints and league state would stay on the node that wrote them: {WHAT_TO_SET}"
        )
    return len(nodes)
