"""Where rollouts get LLM completions: the PolicyServer deployment, or a uniform constrained sampler.

Both answer a batch of requests in the PolicyServer's plain-dict schema, so an episode cannot tell
them apart. The uniform sampler walks `OrderConstraint` with a seeded RNG (a uniformly random legal
policy with exact behaviour logprobs); it lets tests and the bots-only benchmark run the whole
rollout path without starting an engine.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from typing import Any, Protocol

from diprl.game.legal import PowerOrders
from diprl.policy.constraint import OrderConstraint
from diprl.policy.parser import legal_complete, parse_orders
from diprl.policy.vocab import TokenTable


class PolicyClient(Protocol):
    def generate(self, requests: Sequence[dict[str, Any]]) -> list[dict[str, Any]]: ...


class ServeClient:
    """Calls the PolicyServer through its deployment handle (what rollout workers use)."""

    def __init__(self, app_name: str = "policy", deployment: str | None = None, timeout_s: float = 600.0) -> None:
        from ray import serve

        # `serve_policy` names the application and its one deployment alike.
        self.handle = serve.get_deployment_handle(deployment or app_name, app_name=app_name)
        self.timeout_s = timeout_s

    def generate(self, requests: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
        return list(self.handle.generate.remote(list(requests)).result(timeout_s=self.timeout_s))


class UniformConstrainedClient:
    """A uniformly random legal policy with exact logprobs; no model, no engine."""

    def __init__(self, table: TokenTable, seed: int = 0, tokenizer: Any = None) -> None:
        self.table = table
        self.rng = random.Random(seed)
        self.tokenizer = tokenizer  # to return prompt ids, as the server does; None skips it

    def generate(self, requests: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
        return [self._one(request) for request in requests]

    def _one(self, request: dict[str, Any]) -> dict[str, Any]:
        legal = PowerOrders.from_dict(request["legal"])
        constraint = OrderConstraint(legal, self.table)
        ids: list[int] = []
        logprobs: list[float] = []
        while True:
            allowed = constraint.allowed_token_ids(ids)
            if constraint.done:
                break
            ids.append(int(self.rng.choice(allowed)))
            logprobs.append(-math.log(len(allowed)))
        text = "".join(self.table.texts[i] or "" for i in ids if i != self.table.eos_id)
        parsed = parse_orders(text, legal)
        prompt = request["prompt"]
        return {
            "policy": request.get("policy", "base"),
            "error": None,
            "prompt_ids": list(prompt) if isinstance(prompt, list) else self._encode(prompt),
            "token_ids": ids,
            "logprobs": logprobs,
            "text": text,
            "finish_reason": "stop",
            "orders": parsed.orders,
            "complete": legal_complete(parsed, legal),
            "rejected": [[r.line, str(r.reason)] for r in parsed.rejected],
        }

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text)) if self.tokenizer is not None else []
