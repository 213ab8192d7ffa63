"""Deploying the PolicyServer on the running Ray cluster, and taking it down again.

`serve_policy` starts (or updates) the deployment and returns its handle; `serving` holds one for the
length of a `with` block, `deploying` too while the replicas start on a thread of their own, and
`stop_serving` deletes it. Two checks come before anything is deployed: an application of the same
name that serves another run's adapter store is refused (`ServeConflict`), never repointed or deleted,
and an HTTP port another process holds fails at once instead of Serve reporting ready while requests
reach the other server. `replica_options` places each replica (CPUs, GPUs, tensor-parallel bundles).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
from collections.abc import Iterator, Mapping
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from ray import serve

from diprl.inference.adapters.pins import PinKey
from diprl.inference.config import ServerConfig, is_loopback
from diprl.inference.engine import ENGINE_ENV
from diprl.inference.policy_engine import HEALTH_CHECK_TIMEOUT_S, resolve_model
from diprl.inference.server import PolicyServer
from diprl.ports import free_port, port_in_use

log = logging.getLogger(__name__)

__all__ = [
    "IDENTITY_TIMEOUT_S",
    "ServeConflict",
    "deploying",
    "replica_options",
    "serve_policy",
    "serving",
    "stop_serving",
]


def _serve_running() -> bool:
    """Whether this Ray cluster already runs Serve (then its proxy holds the port, legitimately)."""
    import ray

    try:
        ray.get_actor("SERVE_CONTROLLER_ACTOR", namespace="serve")
    except ValueError:
        return False
    return True


class ServeConflict(RuntimeError):
    """A Serve application of this name already serves another run's adapters: deploying would take it over."""


IDENTITY_TIMEOUT_S = 60.0


def _served_adapter_root(app: str) -> str | None:
    """The adapter root the running application `app` serves; None when no application has that name.

    Raises `ServeConflict` when one exists but cannot say (not a PolicyServer, or no replica answers):
    it may belong to another run, so it is not ours to replace or delete.
    """
    if not _serve_running():
        return None
    overview = serve.status().applications.get(app)
    if overview is None:
        return None
    try:
        served: dict[str, Any] = serve.get_app_handle(app).identity.remote().result(timeout_s=IDENTITY_TIMEOUT_S)
        return str(served["adapter_root"])
    except Exception as exc:
        reason = f"{type(exc).__name__}: {exc}"[:300]
        raise ServeConflict(
            f"a Serve application named {app!r} already exists ({overview.status}) and did not say which adapter "
            f"store it serves ({reason}); it may be another run's. Give this server another name "
            f"(inference.name; training names its own per run), or delete it with `serve.delete({app!r})` "
            "if it is yours"
        ) from exc


def stop_serving(app: str, adapter_root: str | Path | None = None) -> None:
    """Delete the Serve application `app` (a PolicyServer) and wait for its replicas to stop.

    With `adapter_root`, only if `app` serves that store: a run never deletes another run's server
    (one whose `serve_policy` was refused, say, still runs its cleanup). An application that cannot
    say which store it serves is left running, with a warning.

    Not `serve.shutdown()`: that kills the Serve controller, which fails every call still waiting on
    it (its own `graceful_shutdown`, the long polls of every handle), and Ray prints each failure as a
    "(raylet) Task ServeController... failed" line in a healthy run. The controller goes with
    `ray.shutdown()` on a local cluster; on a shared one, other Serve applications stay up.
    """
    from ray.serve.exceptions import RayServeException

    if adapter_root is not None:
        try:
            served = _served_adapter_root(app)
        except ServeConflict as exc:
            log.warning("left the Serve application %r running: %s", app, exc)
            return
        if served is None:
            return
        if served != str(Path(adapter_root).resolve()):
            log.warning("left the Serve application %r running: it serves %s, not %s", app, served, adapter_root)
            return
    with contextlib.suppress(RayServeException):  # Serve never started (a run failed early): nothing to stop
        serve.delete(app)


@contextlib.contextmanager
def serving(
    config: ServerConfig, resources: Mapping[str, float] | None = None, pin_key: PinKey | None = None
) -> Iterator[Any]:
    """The PolicyServer of `config` (its deployment handle) for the length of a `with` block, on the running
    Ray; deleted after it, however the block ends, and only if it still serves `config`'s adapters.
    `resources`: custom resources every replica asks for (see `replica_options`); `pin_key` as for
    `serve_policy`."""
    handle = serve_policy(config, resources, pin_key)
    try:
        yield handle
    finally:
        stop_serving(config.name, adapter_root=config.adapter_root)


@contextlib.contextmanager
def deploying(
    config: ServerConfig, resources: Mapping[str, float] | None = None, pin_key: PinKey | None = None
) -> Iterator[concurrent.futures.Future[Any]]:
    """`serving`, with the deployment on a thread of its own: the block runs while the replicas start, and
    `.result()` on the future it yields waits for the deployment handle (raising what deploying raised).
    A training run creates its other actors meanwhile: their start (imports, the learner's engine) and the
    replicas' (vLLM's) overlap instead of following one another. After the block, once the deployment
    call has returned, the server is deleted as `serving` deletes it; a deployment that raised is left
    as `serving` leaves it (nothing of this server's to delete, or another run's)."""
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="deploy-policy-server") as pool:
        deployment = pool.submit(serve_policy, config, resources, pin_key)
        try:
            yield deployment
        finally:
            if deployment.exception() is None:  # waits for the deployment call to return
                stop_serving(config.name, adapter_root=config.adapter_root)


def replica_options(config: ServerConfig, resources: Mapping[str, float] | None = None) -> dict[str, Any]:
    """Ray Serve options that place one replica: its CPUs, GPUs and, with tensor parallelism, its bundles.

    With `tensor_parallel_size` 1 the replica actor holds its GPU (or fraction) itself. Above 1 vLLM's Ray
    executor starts one worker per shard and puts each in a GPU bundle of the placement group the replica
    runs in, so every replica gets its own group: the first bundle holds the replica actor's CPUs and the
    first shard's GPU, the others one GPU each, STRICT_PACK so the shards share a node (their all-reduce
    runs every layer and wants NVLink, not the network). The replica actor then asks for no GPU itself.

    `resources` (custom resources, a run's `placement.inference`) go to the replica actor and, with
    tensor parallelism, to the first bundle, which must hold what the actor asks for: STRICT_PACK puts the
    other shards on the same node, one that declares them.
    """
    env = {**ENGINE_ENV, "VLLM_LOGGING_LEVEL": config.log_level, "VLLM_CONFIGURE_LOGGING": "1"}
    tp = config.tensor_parallel_size
    custom = dict(resources or {})
    actor: dict[str, Any] = {
        "num_cpus": config.replica_cpus,
        "num_gpus": config.replica_gpus if tp == 1 else 0,
        "runtime_env": {"env_vars": env},
    }
    if custom:
        actor["resources"] = custom
    options: dict[str, Any] = {"ray_actor_options": actor}
    if tp > 1:
        first = {"CPU": config.replica_cpus, "GPU": 1.0, **custom}
        options["placement_group_bundles"] = [first] + [{"GPU": 1.0}] * (tp - 1)
        options["placement_group_strategy"] = "STRICT_PACK"
    return options


def serve_policy(
    config: ServerConfig, resources: Mapping[str, float] | None = None, pin_key: PinKey | None = None
) -> Any:
    """Start (or update) the PolicyServer on the running Ray cluster and return its deployment handle.

    `resources`: custom resources every replica asks for, to run only on the nodes that declare them
    (see `replica_options`). `pin_key`: a training run's adapter pin key, handed to every replica (an
    argument of the deployment, never part of `config`), which installs it before opening the store; None:
    each replica reads its node's key file (`diprl.inference.adapters.pins`).

    Fails fast with `OSError(EADDRINUSE)` when another process (another cluster's PolicyServer, say)
    already holds the HTTP port: Serve would otherwise report ready while requests reach the other
    server. `port: 0` picks a free port and logs it (the returned config's port, `handle` users need
    no port). Library logging inside the replicas follows `config.log_level` (WARNING by default).

    Fails fast with `ServeConflict`, before anything is deployed, when an application of the same
    name already serves another adapter root (another run on this cluster): updating it would repoint
    that run's replicas at this store. The same root is an update (a resumed run, a new setting).
    """
    import errno

    model_path, dtype = resolve_model(config)  # looked up once, here (the entry point built it), not per replica
    config = replace(
        config,
        model=model_path,
        dtype=dtype,
        adapter_root=str(Path(config.adapter_root).resolve()),
    )
    served = _served_adapter_root(config.name)
    if served is not None and served != config.adapter_root:
        raise ServeConflict(
            f"the Serve application {config.name!r} already serves adapters from {served}; this server's are in "
            f"{config.adapter_root}. Deploying would repoint that server (another run's?) at this store: give this "
            "one another name (inference.name; training names its own per run) or stop the other first"
        )
    if not _serve_running():
        if config.port == 0:
            config = replace(config, port=free_port(config.host))
            log.warning("PolicyServer HTTP route: picked free port %d on %s", config.port, config.host)
        elif port_in_use(config.host, config.port):
            raise OSError(
                errno.EADDRINUSE,
                f"PolicyServer cannot listen on {config.host}:{config.port}: the port is already in use (another "
                "PolicyServer or Ray Serve instance?). Stop it, set inference.port to a free port, or port: 0 to "
                "pick one",
            )
    logging_config = {"log_level": config.log_level, "enable_access_log": config.log_level in ("DEBUG", "INFO")}
    # A loopback route is reached only on its own node, and one proxy per node of a multi-node cluster on one
    # host (tests, `ray.cluster_utils`) would collide on the port: one proxy, on the head, where the driver is.
    proxies = "HeadOnly" if is_loopback(config.host) else "EveryNode"
    serve.start(
        proxy_location=proxies,
        http_options={"host": config.host, "port": config.port},
        logging_config=logging_config,
    )
    scaling: dict[str, Any] = (
        {"autoscaling_config": config.autoscaling, "num_replicas": "auto"}
        if config.autoscaling
        else {"num_replicas": config.num_replicas}
    )
    deployment = PolicyServer.options(  # type: ignore[attr-defined]
        name=config.name,
        max_ongoing_requests=config.max_ongoing_requests,
        health_check_period_s=5.0,
        health_check_timeout_s=HEALTH_CHECK_TIMEOUT_S + 10.0,
        logging_config=logging_config,
        **replica_options(config, resources),
        **scaling,
    )
    return serve.run(
        deployment.bind(asdict(config), pin_key),
        name=config.name,
        route_prefix=config.route_prefix,
        logging_config=logging_config,
    )
