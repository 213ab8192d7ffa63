"""The learner as a Ray actor: `learner_actor` makes `learner-<policy>`, one process or a group of ranks;
`learner_host_actor` makes one process for several policies on one base (`diprl.learn.host`).

The algorithm lives in `diprl.learn.learner.Learner` (a plain class, tested without Ray); this module
only says how Ray runs it: named, restarted forever, tasks retried, on a GPU or a CPU.
"""

from __future__ import annotations

from typing import Any

from diprl.learn.config import LearnerConfig
from diprl.learn.host import LearnerHost
from diprl.learn.learner import Learner
from diprl.learn.site import LearnerSite


def learner_actor(
    config: LearnerConfig,
    site: LearnerSite,
    name: str | None = None,
    namespace: str | None = None,
    queue: str | None = None,
    resources: dict[str, float] | None = None,
) -> Any:
    """The Ray actor form: named `learner-<policy>` (get-if-exists), restarted forever, tasks retried.

    A restarted actor runs `__init__` again and so resumes from its newest good checkpoint; a retried
    `train_next` then trains the batch it was training again (kept on disk, see `diprl.learn.intake`),
    so a killed learner loses none. `queue` names the policy's queue actor it pulls its batches from. It asks for one
    GPU when `config.use_gpu`, else one CPU with DeepSpeed on its CPU accelerator. The GPU is a whole one:
    Ray never hands a fraction of it to a PolicyServer replica (`python -m diprl.plan` counts the same way).
    `resources` (custom resources, `placement.learner`) keep it on the nodes that declare them, restarts too.
    With `config.ranks` > 1 it is a `diprl.learn.group.LearnerGroup` of that many ranks with the same API.
    `site.pin_key`: the run's adapter pin key, installed in every process that publishes or reads versions
    (its node then needs no key file); None: each reads its node's (`diprl.inference.adapters.pins`).
    """
    import ray

    if config.ranks > 1:
        from diprl.learn.group import group_actor

        name = name or f"learner-{config.policy}"
        return group_actor(config, site, name, namespace, queue, resources)
    remote_cls: Any = ray.remote(Learner)
    options = _actor_options(config, name or f"learner-{config.policy}", namespace, resources)
    return remote_cls.options(**options).remote(config, site, queue)


def learner_host_actor(
    configs: list[LearnerConfig],
    site: LearnerSite,
    namespace: str | None = None,
    queues: dict[str, str] | None = None,
    resources: dict[str, float] | None = None,
) -> Any:
    """A `LearnerHost` actor for `configs`' policies, named `learners-<policy>+<policy>...`; restarted forever,
    each adapter resuming on its own. `site` as for `learner_actor`.

    Placed like a learner (one GPU or one CPU for all of them, their steps one after another), except with
    `learner.host_parallel` on CPU: then it holds a CPU per policy, the cores the policies' own learners would
    hold, and steps them at once, a threaded actor (a thread per policy, and one for the driver's other
    calls) of one torch thread per step."""
    import ray

    name = "learners-" + "+".join(c.policy for c in configs)
    remote_cls: Any = ray.remote(LearnerHost)
    options = _actor_options(configs[0], name, namespace, resources)
    if configs[0].host_parallel:
        options["num_cpus"] = len(configs)
        options["max_concurrency"] = len(configs) + 1
        options["runtime_env"]["env_vars"]["OMP_NUM_THREADS"] = "1"
    return remote_cls.options(**options).remote(configs, site, queues)


class HostedLearner:
    """One policy's handle on a host actor, called as a learner actor is: `handle.train_next.remote(2.0)` is
    `host.train_next.remote(policy, 2.0)`. What the driver holds for each policy a host trains."""

    def __init__(self, host: Any, policy: str) -> None:
        self.host = host
        self.policy = policy

    def __getattr__(self, method: str) -> _PolicyMethod:
        if method.startswith("_"):
            raise AttributeError(method)
        return _PolicyMethod(getattr(self.host, method), self.policy)


class _PolicyMethod:
    def __init__(self, method: Any, policy: str) -> None:
        self.method = method
        self.policy = policy

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        return self.method.remote(self.policy, *args, **kwargs)


def _actor_options(
    config: LearnerConfig, name: str, namespace: str | None, resources: dict[str, float] | None
) -> dict[str, Any]:
    env = {"DS_BUILD_OPS": "0"} if config.use_gpu else {"DS_ACCELERATOR": "cpu", "DS_BUILD_OPS": "0"}
    options: dict[str, Any] = {
        "name": name,
        "get_if_exists": True,
        "max_restarts": -1,
        "max_task_retries": -1,
        "num_cpus": 1,
        "num_gpus": 1 if config.use_gpu else 0,
        "runtime_env": {"env_vars": env},
    }
    if namespace is not None:
        options["namespace"] = namespace
    if resources:
        options["resources"] = dict(resources)
    return options
