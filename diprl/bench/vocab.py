"""What the vocabulary costs at inference: the same body with Qwen's 151,936 ids and with the compact
BPE, measured side by side in one run (part of `python -m diprl.bench inference`).

Every model gets the same constrained order requests (mid-game states, temperature 1) through the
bare async engine, sent in batches of 4, 16 and 64. Two rates per cell: tokens per second (what the
sampler and model cost) and completions per second (one completion is one power's orders for one
phase: the experience a rollout collects, which is the figure that matters, since the compact
vocabulary also spells an order in fewer tokens).
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from diprl.messages import Generation, GenerationRequest
from diprl.policy.models import TinyModelSpec, TokenizerKind
from diprl.policy.tokenizer import QWEN3_PADDED_VOCAB

BATCHES = (4, 16, 64)


@dataclass(frozen=True)
class Candidate:
    """A model body and vocabulary to measure; `label` names it in the table."""

    label: str
    spec: TinyModelSpec


@dataclass(frozen=True)
class Rate:
    tokens_per_s: float
    completions_per_s: float


def tiny_pair() -> list[Candidate]:
    """The `tiny` body with Qwen's vocabulary and with the compact one (the issue's comparison)."""
    body = TinyModelSpec()
    return [
        Candidate(
            f"tiny body, Qwen vocab {QWEN3_PADDED_VOCAB}",
            TinyModelSpec(vocab_size=QWEN3_PADDED_VOCAB, tokenizer=TokenizerKind.qwen3),
        ),
        Candidate(f"tiny body, compact vocab {body.vocab_size}", body),
    ]


def body_candidates() -> list[Candidate]:
    """Bodies for the `small` preset, all on the compact vocabulary; the first row of the table
    (tiny with Qwen's vocabulary, today's training default) is what they are compared with."""

    def spec(width: int, layers: int, vocab: int) -> TinyModelSpec:
        heads = width // 32
        return TinyModelSpec(
            hidden_size=width,
            intermediate_size=3 * width,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=max(1, heads // 2),
            vocab_size=vocab,
        )

    return [
        Candidate("w128 L4, compact 4096", spec(128, 4, 4096)),
        Candidate("w256 L4, compact 4096", spec(256, 4, 4096)),
        Candidate("w256 L4, compact 2048", spec(256, 4, 2048)),
        Candidate("w256 L8, compact 4096", spec(256, 8, 4096)),
        Candidate("w384 L6, compact 4096", spec(384, 6, 4096)),
    ]


def parameters(spec: TinyModelSpec) -> tuple[int, int]:
    """(total parameters, embedding parameters) of a tiny model of `spec` (tied LM head)."""
    from diprl.policy.models import create_tiny_model

    model = create_tiny_model(spec)
    return sum(p.numel() for p in model.parameters()), spec.vocab_size * spec.hidden_size


def tokens_of(results: Sequence[Generation]) -> int:
    """Generated tokens of a batch's results; any failed request fails the benchmark."""
    failed = [r.error for r in results if r.error]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed, first: {failed[0]}")
    return sum(len(r.token_ids) for r in results)


def _measure(path: Path, dtype: str, requests: list[GenerationRequest], batches: Sequence[int]) -> dict[int, Rate]:
    from diprl.inference.config import ServerConfig
    from diprl.inference.policy_engine import PolicyEngine

    root = Path(tempfile.mkdtemp(prefix="diprl-bench-vocab-"))
    config = ServerConfig(
        model=str(path),
        dtype=dtype,
        max_num_seqs=max(batches),
        adapter_root=str(root / "adapters"),
    )

    async def run() -> dict[int, Rate]:
        engine = PolicyEngine(config)
        try:
            await engine.generate(requests[: min(batches)])  # warm-up
            rates: dict[int, Rate] = {}
            for batch in batches:
                tokens = 0
                start = time.perf_counter()
                for i in range(0, len(requests), batch):
                    tokens += tokens_of(await engine.generate(requests[i : i + batch]))
                seconds = time.perf_counter() - start
                rates[batch] = Rate(tokens / seconds, len(requests) / seconds)
            return rates
        finally:
            engine.shutdown()

    return asyncio.run(run())


def compare(
    candidates: Sequence[Candidate],
    requests: list[GenerationRequest],
    batches: Sequence[int] = BATCHES,
    on_row: Callable[[Candidate, dict[int, Rate]], None] | None = None,
) -> dict[str, dict[int, Rate]]:
    """Rates of every candidate at every batch size, each model in turn in this process;
    `on_row` sees each model's rates as soon as they are measured (a long run shows progress)."""
    from diprl.policy.models import build_tiny_model

    rates: dict[str, dict[int, Rate]] = {}
    for c in candidates:
        rates[c.label] = _measure(build_tiny_model(c.spec), "float32", requests, batches)
        if on_row is not None:
            on_row(c, rates[c.label])
    return rates


def row_text(candidate: Candidate, rates: dict[int, Rate], batches: Sequence[int] = BATCHES) -> str:
    """One model's rates on one line, for progress output."""
    cells = ", ".join(
        f"b{b}: {rates[b].tokens_per_s:.0f} tok/s {rates[b].completions_per_s:.2f} compl/s" for b in batches
    )
    return f"{candidate.label}: {cells}"


def report(candidates: Sequence[Candidate], rates: dict[str, dict[int, Rate]], batches: Sequence[int] = BATCHES) -> str:
    """The table: parameters, tokens/s and completions/s per batch, and each row's ratio to the first."""
    first = rates[candidates[0].label]
    head = f"{'model':<30}{'params':>8}{'embed':>7}" + "".join(f"{f'tok/s b{b}':>12}" for b in batches)
    head += "".join(f"{f'compl/s b{b}':>13}" for b in batches)
    lines = [head]
    ratio_lines = [f"{'ratio to first row':<30}{'':>15}" + "".join(f"{f'b{b}':>12}" for b in batches)]
    for c in candidates:
        total, embed = parameters(c.spec)
        row = rates[c.label]
        line = f"{c.label:<30}{total / 1e6:>7.2f}M{100 * embed / total:>6.0f}%"
        line += "".join(f"{row[b].tokens_per_s:>12.0f}" for b in batches)
        line += "".join(f"{row[b].completions_per_s:>13.2f}" for b in batches)
        lines.append(line)
        ratios = ""
        for b in batches:
            pair = f"{row[b].tokens_per_s / first[b].tokens_per_s:.2f}/"
            pair += f"{row[b].completions_per_s / first[b].completions_per_s:.2f}"
            ratios += f"{pair:>12}"
        ratio_lines.append(f"{c.label:<30}{'tok/compl':>15}{ratios}")
    return "\n".join([*lines, "", *ratio_lines])
