"""Torch's CPU thread count, set so that it holds in a process that has run a vLLM engine.

vLLM's CPU worker, once it has bound its threads to cores, replaces `torch.set_num_threads` for the whole
process with a function that only logs a warning. Where an engine runs in-process (the tests, the benches,
a local evaluator), every later call then keeps the engine's count without a word: a learner meant to step
on one thread runs on several, and CPU reductions that agree to the bit on one thread no longer do. These
helpers call torch's own setter, which the replacement does not reach, and check that the count took.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


def set_torch_threads(count: int) -> None:
    """Torch's intra-op threads in this process, from now on."""
    import torch

    if count < 1:
        raise ValueError(f"torch needs at least one thread, not {count}")
    torch._C.set_num_threads(count)  # torch's own: vLLM's CPU worker swaps out `torch.set_num_threads`
    if torch.get_num_threads() != count:
        raise RuntimeError(f"torch runs on {torch.get_num_threads()} threads after being set to {count}")


@contextmanager
def torch_threads(count: int | None = None) -> Iterator[None]:
    """Torch's intra-op threads inside the block (None: as they are, or as something inside sets them, a vLLM
    engine for one); the count before it comes back after, whatever happens."""
    import torch

    before = torch.get_num_threads()
    if count is not None:
        set_torch_threads(count)
    try:
        yield
    finally:
        set_torch_threads(before)
