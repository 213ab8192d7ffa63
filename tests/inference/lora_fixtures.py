"""Tiny LoRA adapters on the tiny Qwen3, for adapter-store and server tests.

PEFT initialises `lora_B` to zeros, so a fresh adapter computes exactly the base model; these
helpers fill every LoRA weight from a seeded generator instead, so different seeds give adapters
whose logits visibly differ from the base and from each other. The base is loaded from the tiny
model's directory, so `base_model_name_or_path` in the saved config is the path vLLM serves.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from diprl.policy.models import load_preset, resolve_model_path


def tiny_base_path() -> Path:
    """The built tiny Qwen3 directory (built on first use, offline)."""
    return Path(resolve_model_path(load_preset("tiny")))


def load_tiny_base() -> Any:
    """A fresh float32 tiny Qwen3 in eval mode (PEFT wraps models in place, so each adapter needs one)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_base_path(), dtype=torch.float32).eval()


def make_lora_model(seed: int, rank: int = 8, alpha: int | None = None) -> Any:
    """A PEFT LoRA model on the tiny base with every lora_A / lora_B weight ~ N(0, 0.02²) from `seed`."""
    from peft import LoraConfig, get_peft_model

    lora = load_preset("tiny").lora
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha if alpha is not None else 2 * rank,
        target_modules=list(lora.target_modules),
        lora_dropout=0.0,
    )
    model = get_peft_model(load_tiny_base(), config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if "lora_A" in name or "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.02)
    return model.eval()


def make_lora_dir(tmp_path: Path, seed: int, rank: int = 8) -> Path:
    """Save `make_lora_model(seed, rank)` with `save_pretrained` (safetensors) under `tmp_path`."""
    out = tmp_path / f"lora-seed{seed}-r{rank}"
    make_lora_model(seed, rank).save_pretrained(str(out), safe_serialization=True)
    return out
