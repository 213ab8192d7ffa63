"""Where rollouts get LLM completions: the PolicyServer deployment, or a uniform constrained sampler.

Both answer a batch of `GenerationRequest`s with `Generation`s, so an episode cannot tell them
apart. The uniform sampler walks `OrderConstraint` with a seeded RNG (a uniformly random legal
policy with exact behaviour logprobs); it lets tests and the bots-only benchmark run the whole
rollout path without starting an engine.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from typing import Any

from diprl.game.legal import PowerOrders
from diprl.messages import Generation, GenerationRequest
from diprl.policy.constraint import OrderConstraint
from diprl.policy.parser import legal_complete, parse_orders
from diprl.policy.vocab import TokenTable
from diprl.rollout.lockstep import PolicyClient

CLIENTS = ("serve", "uniform")
SERVER_MAX_BATCH = 4096
"""The PolicyServer's default `max_batch` (`ServerConfig`; rollout talks to the server, not its code)."""


def make_client(kind: str, serve_app: str = "policy", model: str = "tiny", seed: int = 0) -> PolicyClient:
    """The one factory of policy clients: "serve" (the PolicyServer app `serve_app`) or "uniform" (a
    uniformly random legal policy spelled in `model`'s tokenizer, for tests and dry runs)."""
    if kind == "serve":
        return ServeClient(app_name=serve_app)
    if kind == "uniform":
        from diprl.policy.models import load_preset, logits_width, preset_tokenizer_path
        from diprl.policy.tokenizer import load_tokenizer
        from diprl.policy.vocab import token_table

        preset = load_preset(model)
        tokenizer = load_tokenizer(preset_tokenizer_path(preset))
        return UniformConstrainedClient(token_table(tokenizer, logits_width(preset)), seed=seed, tokenizer=tokenizer)
    raise ValueError(f"unknown policy client {kind!r}: use one of {', '.join(CLIENTS)}")


class ServeClient:
    """Calls the PolicyServer through its deployment handle (what rollout workers use).

    A batch larger than the server's `max_batch` (a lockstep phase of many searched seats) goes out as
    several calls of at most `max_batch` requests, all in flight at once, answers kept in request order.
    """

    def __init__(
        self,
        app_name: str = "policy",
        deployment: str | None = None,
        timeout_s: float = 600.0,
        max_batch: int = SERVER_MAX_BATCH,
    ) -> None:
        if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
            raise ValueError(f"max_batch must be an integer >= 1, got {max_batch!r}")
        self.app_name = app_name
        self.deployment = deployment or app_name  # `serve_policy` names the application and its deployment alike
        self.timeout_s = timeout_s
        self.max_batch = max_batch
        self._handle: Any = None

    @property
    def handle(self) -> Any:
        """The deployment's handle, got at the first call: a training run creates its workers and evaluator
        while its PolicyServer is still deploying (`diprl.inference.deploy.deploying`)."""
        if self._handle is None:
            from ray import serve

            self._handle = serve.get_deployment_handle(self.deployment, app_name=self.app_name)
        return self._handle

    def generate(self, requests: Sequence[GenerationRequest]) -> list[Generation]:
        batch = list(requests)
        chunks = [batch[i : i + self.max_batch] for i in range(0, len(batch), self.max_batch)] or [batch]
        calls = [self.handle.generate.remote(chunk) for chunk in chunks]
        return [answer for call in calls for answer in call.result(timeout_s=self.timeout_s)]


class UniformConstrainedClient:
    """A uniformly random legal policy with exact logprobs; no model, no engine."""

    def __init__(self, table: TokenTable, seed: int = 0, tokenizer: Any = None) -> None:
        self.table = table
        self.rng = random.Random(seed)
        self.tokenizer = tokenizer  # to return prompt ids, as the server does; None skips it

    def generate(self, requests: Sequence[GenerationRequest]) -> list[Generation]:
        return [self._one(request) for request in requests]

    def _one(self, request: GenerationRequest) -> Generation:
        if request.legal is None:
            return Generation.failed(request.policy, "RequestError: the uniform sampler needs legal orders")
        legal = PowerOrders.from_dict(request.legal)
        constraint = OrderConstraint(legal, self.table)
        # A seeded request is drawn from its own stream (reproducible whatever the batch), as the server does.
        rng = self.rng if request.sample_seed is None else random.Random(request.sample_seed)
        ids: list[int] = []
        logprobs: list[float] = []
        while True:
            allowed = constraint.allowed_token_ids(ids)
            if constraint.done:
                break
            ids.append(int(rng.choice(allowed)))
            logprobs.append(-math.log(len(allowed)))
        text = "".join(self.table.texts[i] or "" for i in ids if i != self.table.eos_id)
        parsed = parse_orders(text, legal)
        prompt = request.prompt
        return Generation(
            policy=request.policy,
            prompt_ids=list(prompt) if not isinstance(prompt, str) else self._encode(prompt),
            token_ids=ids,
            logprobs=logprobs,
            text=text,
            finish_reason="stop",
            orders=list(parsed.orders),
            complete=legal_complete(parsed, legal),
            rejected=[[r.line, str(r.reason)] for r in parsed.rejected],
        )

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text)) if self.tokenizer is not None else []
