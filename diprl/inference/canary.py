"""Canaries: a served version proven by what it generates, not only by its bytes.

SHA-256 manifests and pins prove that the files a replica loads are the files the learner published.
They cannot prove that the engine *serves* them: a reload that is skipped, a stale adapter published
under a new name, base weights served for an adapter, or vLLM reusing an old adapter's prefix-cache
blocks for a new one registered under the same name (vLLM #42125) all pass every byte check and show
up weeks later as a flat learning curve. So the learner greedy-decodes a small fixed canary set under
the order constraint with the weights it publishes, and stores the tokens and their log-probabilities
in the version (`canary.json`, one of its fingerprinted files); a replica, after loading the version,
sends the same requests through its normal generate path (prefix cache included) and refuses the
version when the tokens differ or a log-probability differs by more than `TOLERANCE`.

Why greedy generation and not vLLM's prompt log-probabilities: prompt log-probabilities with a LoRA
crash vLLM's CPU engine as soon as another request shares the batch (punica's `bgmv_shrink` einsum), and
they skip reading the prefix cache, so they could not see a stale cached block. A greedy request's
log-probabilities in our engine (`logprobs_mode="processed_logprobs"`) are the log-softmax of the logits
after the constraint mask at temperature 1 (vLLM's sampler sets a greedy row's temperature to 1), which
the learner computes the same way.

The canaries are the opening position of a few powers: each power's full prompt (several prefix-cache
blocks long, so a stale cached block would be read) and the legal orders of one of its units, so that a
completion is one order, the closing tag and EOS (about 8 tokens): the learner decodes the set in as
many forward passes, which keeps it cheap next to a training step. The file carries the prompt ids and
the legal orders it was made with, so a replica needs no game code and no tokenizer to check it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from diprl.game.legal import PowerOrders
from diprl.inference.adapters.files import CANARY_FILE
from diprl.inference.adapters.names import AdapterError

__all__ = [
    "CANARY_FILE",
    "CANARY_FORMAT",
    "CANARY_MAX_TOKENS",
    "CANARY_UNITS",
    "TOLERANCE",
    "Canary",
    "CanaryCheck",
    "CanaryItem",
    "CanaryMismatch",
    "CanaryPrompt",
    "CorruptCanary",
    "canary_prompts",
    "check_canary",
    "compare_canary",
]

CANARY_FORMAT = 1
CANARY_UNITS = (("AUSTRIA", "VIE"), ("FRANCE", "BRE"))
"""(power, unit location) of each canary at the opening: an army inland and a fleet on the coast. Two, not
more: each costs every replica a request beside the rollouts' (docs/inference.md, "Cost")."""
CANARY_MAX_TOKENS = 256
"""Decoding budget of one canary; an opening completion needs far less, so a canary is never truncated."""
TOLERANCE = 1e-4
"""Largest |learner - engine| log-probability of a canary token accepted as the same weights. Measured on
the tiny float32 model with rank-8 LoRAs (docs/inference.md, "Canaries"): the learner's canary and CPU
vLLM's differ by at most 2e-7; other weights change the greedy tokens themselves. 1e-4 is the bound the
learner/engine parity test holds on both vocabularies. bf16 GPU engines are not measured: a replica can
set its `ReplicaCanaries.tolerance` for them."""
_MAX_BYTES = 1 << 21
_MAX_ITEMS = 64
_MAX_TOKENS = 1 << 14


class CanaryMismatch(AdapterError):
    """The engine's canary tokens or log-probabilities are not the published weights': the version is refused."""


class CorruptCanary(AdapterError):
    """A canary file that is not one (malformed, oversized, inconsistent)."""


@dataclass(frozen=True)
class CanaryPrompt:
    """One canary request: prompt token ids and the legal orders that constrain its completion."""

    prompt_ids: tuple[int, ...]
    legal: PowerOrders


@dataclass(frozen=True)
class CanaryItem:
    """One canary as published: the request, the greedy completion and each completion token's
    log-probability (after the constraint mask, at temperature 1)."""

    prompt: CanaryPrompt
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.prompt.prompt_ids or not self.token_ids or len(self.token_ids) != len(self.logprobs):
            raise CorruptCanary("a canary item needs a prompt, a completion and one log-probability per token")
        if not all(math.isfinite(x) and x <= 0.0 for x in self.logprobs):
            raise CorruptCanary("canary log-probabilities must be finite and <= 0")

    def request(self, policy: str) -> dict[str, Any]:
        """The wire form of this canary for `policy`: greedy, constrained, room for the whole completion."""
        return {
            "policy": policy,
            "prompt": list(self.prompt.prompt_ids),
            "legal": self.prompt.legal.to_dict(),
            "temperature": 0.0,
            "max_tokens": max(CANARY_MAX_TOKENS, len(self.token_ids)),
        }


@dataclass(frozen=True)
class Canary:
    """The canary items of one version."""

    items: tuple[CanaryItem, ...]

    def __post_init__(self) -> None:
        if not 0 < len(self.items) <= _MAX_ITEMS:
            raise CorruptCanary(f"a canary holds 1-{_MAX_ITEMS} items, got {len(self.items)}")

    def same_completions(self, other: Canary) -> bool:
        """Whether `other` asks the same prompts and holds the same completions (log-probabilities aside)."""
        return [(i.prompt, i.token_ids) for i in self.items] == [(i.prompt, i.token_ids) for i in other.items]

    def to_bytes(self) -> bytes:
        doc = {
            "format": CANARY_FORMAT,
            "items": [
                {
                    "prompt_ids": list(i.prompt.prompt_ids),
                    "legal": i.prompt.legal.to_dict(),
                    "token_ids": list(i.token_ids),
                    "logprobs": list(i.logprobs),
                }
                for i in self.items
            ],
        }
        return json.dumps(doc, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, data: bytes, where: str) -> Canary:
        """The canary in `data`; `CorruptCanary` naming `where` for anything that is not one."""
        try:
            if not isinstance(data, bytes):
                raise TypeError(f"a canary is bytes, got {type(data).__name__}")
            if len(data) > _MAX_BYTES:
                raise ValueError(f"{len(data)} bytes is far more than a canary needs")
            doc = json.loads(data)
            if not isinstance(doc, dict) or doc.get("format") != CANARY_FORMAT:
                raise ValueError(f"not a format-{CANARY_FORMAT} canary")
            if set(doc) != {"format", "items"}:
                raise ValueError(f"unknown fields {sorted(set(doc) - {'format', 'items'})}")
            raw_items = doc["items"]
            if not isinstance(raw_items, list):
                raise TypeError("items must be a list")
            return cls(tuple(_item(raw) for raw in raw_items))
        except CorruptCanary as err:
            raise CorruptCanary(f"{where}: {CANARY_FILE} is invalid ({err})") from None
        except (ValueError, KeyError, TypeError, RecursionError) as err:
            raise CorruptCanary(f"{where}: {CANARY_FILE} is invalid ({type(err).__name__}: {err})") from None


def _item(raw: Any) -> CanaryItem:
    if not isinstance(raw, dict) or set(raw) != {"prompt_ids", "legal", "token_ids", "logprobs"}:
        raise ValueError("an item holds exactly prompt_ids, legal, token_ids and logprobs")
    logprobs = raw["logprobs"]
    if not isinstance(logprobs, list) or not all(
        isinstance(x, float | int) and not isinstance(x, bool) for x in logprobs
    ):
        raise ValueError("logprobs must be a list of numbers")
    if not isinstance(raw["legal"], Mapping):
        raise TypeError("legal must be a legal-orders mapping")
    legal = PowerOrders.from_dict(raw["legal"])
    prompt = CanaryPrompt(_ids(raw["prompt_ids"]), legal)
    return CanaryItem(prompt, _ids(raw["token_ids"]), tuple(float(x) for x in logprobs))


def _ids(value: Any) -> tuple[int, ...]:
    if not isinstance(value, list) or not 0 < len(value) <= _MAX_TOKENS:
        raise ValueError(f"token ids must be a list of 1-{_MAX_TOKENS} ids")
    if not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < 1 << 31 for i in value):
        raise ValueError("token ids must be non-negative ints")
    return tuple(value)


def canary_prompts(tokenizer: Any) -> list[CanaryPrompt]:
    """The fixed canary set for a tokenizer: for each of `CANARY_UNITS`, the power's opening prompt and
    the legal orders of that one unit."""
    from diprl.game import DiplomacyGame
    from diprl.policy.prompt import build_prompt

    game = DiplomacyGame()
    prompts = []
    for power, loc in CANARY_UNITS:
        legal = game.legal_orders(power).to_dict()
        one_unit = PowerOrders.from_dict({**legal, "n_required": 1, "by_loc": {loc: legal["by_loc"][loc]}})
        prompt_ids = tuple(int(i) for i in tokenizer.encode(build_prompt(game, power).text))
        prompts.append(CanaryPrompt(prompt_ids, one_unit))
    return prompts


@dataclass(frozen=True)
class CanaryCheck:
    """How the served canaries compare with the published ones."""

    tokens_equal: bool
    error: float
    """Largest |published - served| log-probability over the tokens both hold (inf when the tokens differ)."""
    detail: str

    def ok(self, tolerance: float = TOLERANCE) -> bool:
        return self.tokens_equal and self.error <= tolerance


def compare_canary(
    expected: Canary, tokens: Sequence[Sequence[int]], logprobs: Sequence[Sequence[float]]
) -> CanaryCheck:
    """Compare served greedy completions (`tokens`, `logprobs`, one row per item) with the published ones."""
    if len(tokens) != len(expected.items) or len(logprobs) != len(expected.items):
        return CanaryCheck(False, math.inf, f"{len(tokens)} completions for {len(expected.items)} canaries")
    worst, first_diff = 0.0, ""
    for k, (item, got_ids, got_lp) in enumerate(zip(expected.items, tokens, logprobs, strict=True)):
        want_ids = list(item.token_ids)
        if list(got_ids) != want_ids:
            at = next((j for j, (a, b) in enumerate(zip(want_ids, got_ids, strict=False)) if a != b), None)
            at = min(len(want_ids), len(got_ids)) if at is None else at
            first_diff = first_diff or f"canary {k}: tokens differ from position {at} of {len(want_ids)}"
        if len(got_lp) != len(got_ids):
            return CanaryCheck(
                False, math.inf, f"canary {k}: {len(got_lp)} log-probabilities for {len(got_ids)} tokens"
            )
        for j, (a, b) in enumerate(zip(item.logprobs, got_lp, strict=False)):
            if want_ids[j : j + 1] != list(got_ids[j : j + 1]):
                break  # past the first differing token the two completions are no longer comparable
            diff = abs(a - float(b))
            worst = max(worst, diff if math.isfinite(diff) else math.inf)
    if first_diff:
        return CanaryCheck(False, math.inf, first_diff)
    return CanaryCheck(True, worst, f"max |published - served| log-probability {worst:.3g}")


def check_canary(name: str, check: CanaryCheck, tolerance: float = TOLERANCE) -> None:
    """`CanaryMismatch` naming `name` unless `check` is within `tolerance`."""
    if not check.ok(tolerance):
        raise CanaryMismatch(
            f"{name}: the engine's canary completions differ from the published weights' ({check.detail}; "
            f"tolerance {tolerance:g}): it does not serve the version that was trained; refused"
        )


@dataclass
class ReplicaCanaries:
    """What one replica's canaries found: how many versions were checked and how many refused, the seconds
    the probes took, each checked version's error, and why each refused version is refused (the answer to
    every request for it, for the replica's life)."""

    tolerance: float = TOLERANCE
    checks: int = 0
    failures: int = 0
    seconds: float = 0.0
    errors: dict[str, float] = field(default_factory=dict)  # per version checked: its error (inf: tokens differ)
    refused: dict[str, str] = field(default_factory=dict)

    def judge(
        self, name: str, canary: Canary, tokens: Sequence[Sequence[int]], logprobs: Sequence[Sequence[float]]
    ) -> str:
        """Compare what the engine served for version `name` with its canary; refuse the version
        (`CanaryMismatch`) unless it matches within `tolerance`, else say how close it came."""
        check = compare_canary(canary, tokens, logprobs)
        self.checks += 1
        self.errors[name] = check.error
        try:
            check_canary(name, check, self.tolerance)
        except CanaryMismatch as exc:
            self.refuse(name, str(exc), check.error)
            raise
        return check.detail

    def refuse(self, name: str, why: str, error: float) -> None:
        self.failures += 1
        self.errors[name] = error
        self.refused[name] = why

    def stats(self) -> dict[str, Any]:
        """Canary metrics of this replica: checks, failures, probe seconds, each checked version's error."""
        return {
            "canary_checks": self.checks,
            "canary_failures": self.failures,
            "canary_seconds": self.seconds,
            "canary_errors": dict(self.errors),
            "canary_refused": sorted(self.refused),
        }
