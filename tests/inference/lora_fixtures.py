"""Tiny LoRA adapters on the tiny Qwen3, and the PolicyServer's engine run in-process to serve them, for
adapter-store, server and parity tests.

PEFT initialises `lora_B` to zeros, so a fresh adapter computes exactly the base model; these
helpers fill every LoRA weight from a seeded generator instead, so different seeds give adapters
whose logits visibly differ from the base and from each other. The base is loaded from the tiny
model's directory, so `base_model_name_or_path` in the saved config is the path vLLM serves.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from diprl.inference.config import ServerConfig
from diprl.messages import Generation, GenerationRequest
from diprl.policy.models import load_preset, random_lora_model, resolve_model_path, save_random_lora
from diprl.torch_threads import torch_threads


def tiny_base_path() -> Path:
    """The built tiny Qwen3 directory (built on first use, offline)."""
    return Path(resolve_model_path(load_preset("tiny")))


def load_tiny_base() -> Any:
    """A fresh float32 tiny Qwen3 in eval mode (PEFT wraps models in place, so each adapter needs one)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_base_path(), dtype=torch.float32).eval()


def make_lora_model(seed: int, rank: int = 8, alpha: int | None = None) -> Any:
    """A PEFT LoRA model on the tiny base with every lora_A / lora_B weight ~ N(0, 0.02²) from `seed`."""
    return random_lora_model(seed, rank, alpha)


def make_lora_dir(tmp_path: Path, seed: int, rank: int = 8) -> Path:
    """Save `make_lora_model(seed, rank)` with `save_pretrained` (safetensors) under `tmp_path`."""
    return save_random_lora(tmp_path / f"lora-seed{seed}-r{rank}", seed, rank)


def serve_in_process(config: ServerConfig, requests: Sequence[GenerationRequest | dict[str, Any]]) -> list[Generation]:
    """What the PolicyServer deployment's engine (`PolicyEngine`, the code each replica runs) answers to
    `requests`, started in this process and shut down afterwards: the served side of a parity test, without
    Ray Serve. torch's thread count is put back afterwards, because vLLM pins it to one thread in-process."""
    return run_engine(config, lambda engine: engine.generate(list(requests)))


def run_engine(config: ServerConfig, work: Any, engine_class: Any = None) -> Any:
    """`await work(engine)` on a `PolicyEngine` (or `engine_class`) started in this process and shut down
    afterwards, torch's thread count put back (vLLM pins it to one thread in-process)."""
    from diprl.inference.policy_engine import PolicyEngine

    async def serve() -> Any:
        engine = (engine_class or PolicyEngine)(config)
        try:
            return await work(engine)
        finally:
            engine.shutdown()

    with torch_threads():  # the engine in this process sets its own count
        return asyncio.run(serve())
