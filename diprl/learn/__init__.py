"""The learner: GRPO on LoRA with DeepSpeed, behaviour cloning, checkpoints and publishing.

Heavy modules (torch, DeepSpeed, PEFT) are imported by the submodules only; `from diprl.learn.config
import LearnerConfig` stays cheap for drivers and Hydra.
"""
