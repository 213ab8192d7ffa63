"""LoRA on vLLM's CPU engine (`diprl.inference.cpu_lora`): each row gets its own slot's adapter, a base row
(index -1) none, and the ops are what vLLM's engine core runs. The engine-level check (a base request
batched with an adapter's, one LoRA slot) is in tests/learn/test_vllm_parity.py."""

from __future__ import annotations

from importlib.metadata import entry_points

import pytest
import torch

from diprl.inference import cpu_lora
from diprl.inference.cpu_lora import NO_LORA, SWITCH, bgmv_expand, bgmv_expand_slice, bgmv_shrink, lora_rows

SLOTS, RANK, WIDTH = 3, 4, 6


def reference(x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """Row by row: x[i] @ weights[indices[i]]^T, and nothing for a row without LoRA."""
    weights = weights.squeeze(1) if weights.dim() == 4 else weights
    rows = [x[i] @ weights[s].t() if s != NO_LORA else torch.zeros(weights.shape[1]) for i, s in enumerate(indices)]
    return torch.stack(rows)


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(0)


@pytest.mark.parametrize(
    "indices",
    [[0, 0, 0, 0], [2, 2, 2], [NO_LORA] * 3, [0, NO_LORA, 2, 1, NO_LORA, 0], [NO_LORA, 1], [2, NO_LORA, NO_LORA]],
)
def test_each_row_gets_its_slots_adapter_and_a_base_row_none(gen: torch.Generator, indices: list[int]) -> None:
    x = torch.randn(len(indices), WIDTH, generator=gen)
    weights = torch.randn(SLOTS, 1, RANK, WIDTH, generator=gen)  # vLLM's stacked layout: slots, 1, out, in
    index = torch.tensor(indices)
    got = lora_rows(x, weights, index, torch.float32)
    torch.testing.assert_close(got, reference(x, weights, index), rtol=1e-6, atol=1e-6)
    assert not got[index == NO_LORA].any()  # vLLM's own ops gave these rows the last slot (weights[-1])


def test_indices_longer_than_the_batch_and_an_empty_batch(gen: torch.Generator) -> None:
    weights = torch.randn(SLOTS, RANK, WIDTH, generator=gen)
    x = torch.randn(2, WIDTH, generator=gen)
    buffer = torch.tensor([1, NO_LORA, 0, 0, 2])  # vLLM's index buffers are sized for the largest batch
    torch.testing.assert_close(lora_rows(x, weights, buffer, torch.float32), reference(x, weights, buffer[:2]))
    assert lora_rows(x[:0], weights, buffer, torch.float32).shape == (0, RANK)


def test_shrink_and_expand_keep_vllms_semantics(gen: torch.Generator) -> None:
    indices = torch.tensor([1, NO_LORA, 0, 1])
    x = torch.randn(4, WIDTH, generator=gen)
    a = torch.randn(SLOTS, 1, RANK, WIDTH, generator=gen)
    b = torch.randn(SLOTS, 1, WIDTH, RANK, generator=gen)

    shrunk = torch.full((4, RANK), 7.0)  # overwritten, scaled
    bgmv_shrink(x, a, shrunk, indices, scaling=0.5)
    torch.testing.assert_close(shrunk, 0.5 * reference(x, a, indices))

    start = torch.randn(4, WIDTH, generator=gen)
    added = start.clone()
    bgmv_expand(shrunk, b, added, indices, add_inputs=True)
    torch.testing.assert_close(added, start + reference(shrunk, b, indices))
    assigned = start.clone()
    bgmv_expand(shrunk, b, assigned, indices, add_inputs=False)
    torch.testing.assert_close(assigned, reference(shrunk, b, indices))

    wide = torch.randn(4, 3 * WIDTH, generator=gen)  # a fused projection: this LoRA writes its slice alone
    sliced = wide.clone()
    bgmv_expand_slice(shrunk, b, sliced, indices, WIDTH, WIDTH, add_inputs=True)
    expected = wide.clone()
    expected[:, WIDTH : 2 * WIDTH] += reference(shrunk, b, indices)
    torch.testing.assert_close(sliced, expected)


def test_the_plugin_is_registered_with_vllm_and_installs_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.lora.ops.torch_ops import lora_ops
    from vllm.lora.punica_wrapper import punica_cpu

    plugins = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    assert plugins.get("diprl_cpu_lora") == "diprl.inference.cpu_lora:register"  # `make install` registers it

    for module in (lora_ops, punica_cpu):  # whatever an engine of this process installed, put back at the end
        for name in cpu_lora.OPS:
            monkeypatch.setattr(module, name, lambda *a, **k: None)
    monkeypatch.setenv(SWITCH, "vllm")
    cpu_lora.register()
    assert punica_cpu.bgmv_shrink is not bgmv_shrink  # kept vLLM's, as asked
    monkeypatch.setenv(SWITCH, "fast")
    with pytest.raises(ValueError, match=SWITCH):
        cpu_lora.register()
    monkeypatch.delenv(SWITCH)
    cpu_lora.register()
    for module in (lora_ops, punica_cpu):
        assert [getattr(module, name) for name in cpu_lora.OPS] == list(cpu_lora.OPS.values())
