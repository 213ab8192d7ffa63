"""The CPU LoRA benchmark's reading of its children (each child starts a vLLM engine: the benchmark is run by
hand, docs/benchmarks.md; the ops themselves are tested in tests/inference/test_cpu_lora.py)."""

from __future__ import annotations

import pytest

from diprl.bench import cpu_lora


def test_a_childs_last_result_line_is_read_and_none_is_an_error() -> None:
    out = "one_adapter_tokens_per_s=1.0 mixed_tokens_per_s=2.0 base_drift=3\n"
    out += "one_adapter_tokens_per_s=510.5 mixed_tokens_per_s=480.25 base_drift=2.38e-07\n"
    assert cpu_lora.child_result(out) == (510.5, 480.25, 2.38e-07)
    with pytest.raises(RuntimeError, match="no result line"):
        cpu_lora.child_result("Traceback (most recent call last):\n  ...\nRuntimeError: engine died")
