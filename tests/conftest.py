"""Offline, loopback-only defaults for every test (the same values the Makefile exports)."""

from __future__ import annotations

import os

for _name, _value in {
    "HF_HUB_OFFLINE": "1",
    "WANDB_MODE": "offline",
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_AUTH_MODE": "disabled",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
}.items():
    os.environ.setdefault(_name, _value)
