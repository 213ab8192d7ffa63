"""Typed configuration of the learner (Hydra group `learner`, `conf/learner/default.yaml`).

Every knob of the GRPO step, its DeepSpeed engine and its publishing/checkpoint cadence is one typed
field with the reason for its default beside it; `LearnerConfig.__post_init__` rejects values out of
range with a message naming the field, so a bad YAML or override fails before a model is built.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class LearnerConfig:
    """One trained policy's learner.

    Batching: a step takes the records of the groups it is given (the driver pulls `groups_per_step`
    groups from the queue), drops stale ones, and packs the rest into micro-batches of at most
    `micro_batch_tokens` forwarded tokens (with `prefix_sharing`, each shared prefix counts once;
    without, padded rows of prompt + completion), at least `grad_accum` of them; gradients accumulate
    over all of them and the optimiser steps once.
    """

    policy: str = "main"  # trained policy name: versions are published as "<policy>@v<N>"
    model: str = "tiny"  # model preset (conf/model/<name>.yaml); LoRA shape comes from the preset
    init_adapter: str | None = None  # warm start: "<policy>@v<N>" in the adapter store, or a PEFT directory
    lr: float = 1e-4
    # > 0: the lr falls linearly from `lr` to 0 over this many optimiser steps, then stays at 0 (imitation
    # sets its run's length: a constant lr's last steps leave the adapter where the noise of one batch put
    # it). 0 keeps it constant, as an RL run of unknown length does.
    lr_decay_steps: int = 0
    weight_decay: float = 0.0  # LoRA weights start at B = 0; decay would pull them back to the base
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    groups_per_step: int = 8  # what the train driver pulls from the queue per train_step
    micro_batch_tokens: int = 8192  # tokens forwarded per forward/backward: the memory knob
    grad_accum: int = 1  # minimum micro-batches per optimiser step (records balanced over them by tokens)
    # GRPO only: optimiser updates per step on the same batch (PPO's epochs), each against the same old
    # logprobs, so the clip bounds how far the step moves the policy. One version is published per step.
    # Worth raising where rollouts, not the learner, set the pace (a CPU run: the learner idles 90% of a step).
    epochs: int = 1
    clip_low: float = 0.2  # PPO ratio floor 1 - clip_low (for negative advantages)
    clip_high: float = 0.28  # PPO ratio ceiling 1 + clip_high (clip-higher: room for rare good tokens to rise)
    tis_cap: float = 2.0  # truncated importance weight cap on trainer-vs-engine drift
    entropy_coef: float = 0.0
    kl_coef: float = 0.0  # k2 KL penalty to the reference weights (below); 0 skips the reference forward pass
    # The KL reference: an EMA of the LoRA weights with this decay, which follows the policy's drift. 1.0 keeps
    # the weights the learner started from (`init_adapter`'s, or a reset's fresh LoRA): RL anchored to a warm start.
    ema_decay: float = 0.99
    max_grad_norm: float = 1.0  # 0 disables clipping
    max_policy_lag: int = 4  # groups from versions more than this behind the current one are dropped
    publish_every: int = 1  # optimiser steps between published versions
    # Published versions between two that carry a canary (`diprl.learn.canary`: the learner's greedy decode
    # of the canary set, which a replica must reproduce to serve the version); the first publish of a process
    # always carries one. Versions in between are checked by their bytes only. 16 keeps the learner's canary and
    # the replicas' probes under 2% of a run on the tiny CPU model (`python -m diprl.bench canary`,
    # docs/inference.md); 1 proves every one.
    canary_every: int = 16
    checkpoint_every: int = 10  # optimiser steps between checkpoints (0: only on request)
    keep_checkpoints: int = 3
    # Adapter versions of this policy kept in the store beyond those the league holds and those still
    # trainable (max_policy_lag): older ones are deleted after each publish (a 14B LoRA version is
    # 0.13-0.26 GB and one is published every step). 0 keeps every version.
    keep_versions: int = 8
    # ZeRO stage of the learner's DeepSpeed engine: 2 splits the LoRA optimiser state and gradients over
    # the ranks; 3 also partitions the frozen base weights (loaded partitioned), for a model one GPU
    # cannot hold. 0/1 for comparisons.
    zero_stage: int = 2
    # At ZeRO-3, parameters with at most this many elements stay whole on every rank instead of being
    # gathered for each use (DeepSpeed's default): norms and the LoRA matrices; 0 partitions everything.
    zero3_persistence_threshold: int = 100_000
    # Data-parallel learner ranks of this policy (one GPU, or one CPU, each) in one torch.distributed group
    # under DeepSpeed ZeRO: a step's batch is split across them by tokens, rank 0 publishes and checkpoints
    # (`diprl.learn.group`). A run resumes only with the number of ranks that wrote its checkpoints.
    ranks: int = 1
    # Trained policies (league roles) per learner process, each a LoRA adapter of its own on one base model
    # loaded once (`diprl.learn.host`): 1 keeps one learner actor per policy. Needs ranks 1 and ZeRO <= 2.
    adapters_per_actor: int = 1
    # A CPU host (adapters_per_actor > 1) steps its policies at once, a thread and a CPU each (the cores
    # their own learners would hold); false: one after another on one CPU. A GPU host is serial (refused here).
    host_parallel: bool = False
    bf16: bool = False  # GPU path; the tiny CPU model is float32 so its logprobs match vLLM's to ~1e-6
    gradient_checkpointing: bool = False
    use_gpu: bool = False  # the Ray actor asks for one GPU and DeepSpeed uses CUDA + NCCL
    logprob_chunk_tokens: int = 512  # completion positions whose full-vocabulary logits exist at once
    # Forward each prefix that a micro-batch's sequences share once (a prefix tree packed into one
    # sequence): the G forks of a group share their prompt, the powers of a phase the rules and the
    # board. False: one padded row per record (the same numbers, several times the tokens).
    prefix_sharing: bool = True
    # A shared stretch shorter than this is repeated in each sequence instead: it would save little
    # and cost an attention block of its own.
    prefix_min_tokens: int = 16
    seed: int = 0

    def __post_init__(self) -> None:
        problems: list[str] = []

        def need(ok: bool, message: str) -> None:
            if not ok:
                problems.append(message)

        need(bool(self.policy), "policy must be a non-empty name")
        need(self.lr > 0, f"lr must be positive, got {self.lr}")
        need(self.lr_decay_steps >= 0, f"lr_decay_steps must be >= 0 (0: constant), got {self.lr_decay_steps}")
        need(self.weight_decay >= 0, f"weight_decay must be >= 0, got {self.weight_decay}")
        need(0 <= self.adam_beta1 < 1, f"adam_beta1 must be in [0, 1), got {self.adam_beta1}")
        need(0 <= self.adam_beta2 < 1, f"adam_beta2 must be in [0, 1), got {self.adam_beta2}")
        need(self.adam_eps > 0, f"adam_eps must be positive, got {self.adam_eps}")
        need(self.groups_per_step >= 1, f"groups_per_step must be >= 1, got {self.groups_per_step}")
        need(self.micro_batch_tokens >= 16, f"micro_batch_tokens must be >= 16, got {self.micro_batch_tokens}")
        need(self.grad_accum >= 1, f"grad_accum must be >= 1, got {self.grad_accum}")
        need(self.epochs >= 1, f"epochs must be >= 1, got {self.epochs}")
        need(0 <= self.clip_low < 1, f"clip_low must be in [0, 1), got {self.clip_low}")
        need(self.clip_high >= 0, f"clip_high must be >= 0, got {self.clip_high}")
        need(self.tis_cap >= 1, f"tis_cap must be >= 1 (1 would down-weight every drifted token), got {self.tis_cap}")
        need(self.entropy_coef >= 0, f"entropy_coef must be >= 0, got {self.entropy_coef}")
        need(self.kl_coef >= 0, f"kl_coef must be >= 0, got {self.kl_coef}")
        need(0 <= self.ema_decay <= 1, f"ema_decay must be in [0, 1], got {self.ema_decay}")
        need(self.max_grad_norm >= 0, f"max_grad_norm must be >= 0, got {self.max_grad_norm}")
        need(self.max_policy_lag >= 0, f"max_policy_lag must be >= 0, got {self.max_policy_lag}")
        need(self.publish_every >= 1, f"publish_every must be >= 1, got {self.publish_every}")
        need(self.canary_every >= 1, f"canary_every must be >= 1, got {self.canary_every}")
        need(self.checkpoint_every >= 0, f"checkpoint_every must be >= 0, got {self.checkpoint_every}")
        need(self.keep_checkpoints >= 1, f"keep_checkpoints must be >= 1, got {self.keep_checkpoints}")
        need(self.keep_versions >= 0, f"keep_versions must be >= 0 (0 keeps every version), got {self.keep_versions}")
        need(self.zero_stage in (0, 1, 2, 3), f"zero_stage must be 0, 1, 2 or 3, got {self.zero_stage}")
        need(
            self.zero3_persistence_threshold >= 0,
            f"zero3_persistence_threshold must be >= 0, got {self.zero3_persistence_threshold}",
        )
        need(
            self.ranks >= 1,
            f"ranks must be >= 1 (data-parallel learner ranks of this policy, one GPU or CPU each), got {self.ranks}",
        )
        need(
            self.adapters_per_actor >= 1,
            f"adapters_per_actor must be >= 1 (trained policies per learner process), got {self.adapters_per_actor}",
        )
        need(
            not (self.host_parallel and self.use_gpu),
            "host_parallel steps a host's policies on CPU threads; a GPU host is serial (set host_parallel=false)",
        )
        unshareable = shared_base_refusal(self)
        need(self.adapters_per_actor == 1 or unshareable is None, f"adapters_per_actor > 1 {unshareable}")
        need(self.prefix_min_tokens >= 1, f"prefix_min_tokens must be >= 1, got {self.prefix_min_tokens}")
        need(self.logprob_chunk_tokens >= 1, f"logprob_chunk_tokens must be >= 1, got {self.logprob_chunk_tokens}")
        if problems:
            raise ValueError("invalid learner config: " + "; ".join(problems))


def shared_base_refusal(config: LearnerConfig) -> str | None:
    """Why adapters cannot share one base model under `config`, or None when they can.

    Adapters share a base as one whole model in one process (`diprl.learn.host`): a group of ranks is
    several processes, and ZeRO-3 partitions the base weights over them, so neither holds it whole. The
    config, the learner host and the model builder each refuse a shared base with this one reason.
    """
    if config.ranks == 1 and config.zero_stage != 3:
        return None
    return (
        "shares one whole base in one process: it needs ranks 1 and zero_stage <= 2, "
        f"got ranks={config.ranks} zero_stage={config.zero_stage}"
    )


def scheduled_lr(config: LearnerConfig, step: int) -> float:
    """The lr of optimiser step `step + 1` (steps already taken: `step`): `lr`, or its linear decay."""
    if config.lr_decay_steps <= 0:
        return config.lr
    return config.lr * max(0.0, 1.0 - step / config.lr_decay_steps)


def register_configs() -> None:
    """Register the `base_learner` schema (group `learner`) that the YAML files extend."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(group="learner", name="base_learner", node=LearnerConfig)
